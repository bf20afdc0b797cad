// Errors as values. A Status is either ok or carries a code and one human-readable
// message that names what was wrong (file, field, value, limit); Result<T> is a T or such a
// Status. Modules return these instead of throwing across their boundaries (LevelDB style).
// The code lets a caller act on the kind of failure without parsing text (the server maps
// it to an HTTP status: invalid argument 400, out of range 400, resource exhausted 429/503,
// I/O and internal 500).
#pragma once

// fmt 9's headers do not compile under nvcc in C++20 mode, so CUDA translation units get
// errorf from a small formatter below that substitutes each "{}" with operator<<.
#ifndef __CUDACC__
#include <fmt/format.h>
#endif
#include <sstream>

#include <cassert>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace dsv4 {

enum class StatusCode : uint8_t {
  kOk,
  kInvalidArgument,    // the input is wrong (a file, a request, a parameter): fix the input
  kOutOfRange,         // a valid kind of input past a limit (context length, token id, size)
  kResourceExhausted,  // memory or a budget is full now; the same input may fit later
  kIo,                 // the operating system failed a read, write, map or open
  kInternal,           // a bug or a device failure: nothing the caller did
  kCancelled,          // stopped on request (Ctrl-C, a client that went away)
};
std::string_view status_code_name(StatusCode code);  // "invalid argument", ...

// "{}"-only formatting through operator<< (what CUDA translation units use for errorf).
namespace detail {
inline void format_into(std::ostringstream& os, std::string_view f) { os << f; }
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, std::string_view f, const T& value, const Rest&... rest) {
  const size_t at = f.find("{}");
  if (at == std::string_view::npos) { os << f; return; }
  os << f.substr(0, at) << value;
  format_into(os, f.substr(at + 2), rest...);
}
template <typename... Args>
std::string stream_format(std::string_view f, const Args&... args) {
  std::ostringstream os;
  format_into(os, f, args...);
  return os.str();
}
}  // namespace detail

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  static Status ok() { return Status(); }
  // Without a code, an error is an invalid argument: most errors here report bad input.
  static Status error(std::string message) { return error(StatusCode::kInvalidArgument, std::move(message)); }
  static Status error(StatusCode code, std::string message) {
    assert(code != StatusCode::kOk);
    return Status(code, std::move(message));
  }
#ifndef __CUDACC__
  template <typename... Args>
  static Status errorf(fmt::format_string<Args...> f, Args&&... args) {
    return error(fmt::format(f, std::forward<Args>(args)...));
  }
  template <typename... Args>
  static Status errorf(StatusCode code, fmt::format_string<Args...> f, Args&&... args) {
    return error(code, fmt::format(f, std::forward<Args>(args)...));
  }
#else
  template <typename... Args>
  static Status errorf(std::string_view f, const Args&... args) {
    return errorf(StatusCode::kInvalidArgument, f, args...);
  }
  template <typename... Args>
  static Status errorf(StatusCode code, std::string_view f, const Args&... args) {
    return error(code, detail::stream_format(f, args...));
  }
#endif

  bool is_ok() const { return !message_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const {
    static const std::string kOk = "ok";
    return message_ ? *message_ : kOk;
  }
  // Adds context in front: "file.gguf: " + "tensor x: shape ..." (the code is kept).
  Status with_context(const std::string& context) const {
    if (is_ok()) return *this;
    return Status(code_, context + ": " + *message_);
  }

 private:
  Status(StatusCode code, std::string m) : code_(code), message_(std::move(m)) {}
  StatusCode code_ = StatusCode::kOk;
  std::optional<std::string> message_;
};

inline std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kOutOfRange: return "out of range";
    case StatusCode::kResourceExhausted: return "resource exhausted";
    case StatusCode::kIo: return "i/o error";
    case StatusCode::kInternal: return "internal error";
    case StatusCode::kCancelled: return "cancelled";
  }
  return "unknown";
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}                       // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).is_ok()); }  // NOLINT

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  Status status() const { return is_ok() ? Status::ok() : std::get<Status>(v_); }

  T& value() & { assert(is_ok()); return std::get<T>(v_); }
  const T& value() const& { assert(is_ok()); return std::get<T>(v_); }
  T&& value() && { assert(is_ok()); return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace dsv4

#define DSV4_CONCAT_INNER(a, b) a##b
#define DSV4_CONCAT(a, b) DSV4_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if `expr` (a Status) is an error.
#define DSV4_TRY(expr)                                      \
  do {                                                      \
    ::dsv4::Status dsv4_try_status_ = (expr);               \
    if (!dsv4_try_status_.is_ok()) return dsv4_try_status_; \
  } while (0)

// `DSV4_ASSIGN_OR_RETURN(auto x, f());` declares x from a Result<T>, or returns its error.
#define DSV4_ASSIGN_OR_RETURN(lhs, expr) \
  DSV4_ASSIGN_OR_RETURN_IMPL(DSV4_CONCAT(dsv4_result_, __LINE__), lhs, expr)
#define DSV4_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.is_ok()) return tmp.status();           \
  lhs = std::move(tmp).value()
