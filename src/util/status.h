// Errors as values. A Status is either ok or carries one human-readable message that
// names what was wrong (file, field, value, limit); Result<T> is a T or such a Status.
// Modules return these instead of throwing across their boundaries (LevelDB style).
#pragma once

// fmt 9's headers do not compile under nvcc in C++20 mode, so CUDA translation units
// see Status without errorf (build messages there with std::string).
#ifndef __CUDACC__
#include <fmt/format.h>
#endif

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace dsv4 {

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  static Status ok() { return Status(); }
  static Status error(std::string message) { return Status(std::move(message)); }
#ifndef __CUDACC__
  template <typename... Args>
  static Status errorf(fmt::format_string<Args...> f, Args&&... args) {
    return Status(fmt::format(f, std::forward<Args>(args)...));
  }
#endif

  bool is_ok() const { return !message_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  const std::string& message() const {
    static const std::string kOk = "ok";
    return message_ ? *message_ : kOk;
  }
  // Adds context in front: "file.gguf: " + "tensor x: shape ...".
  Status with_context(const std::string& context) const {
    if (is_ok()) return *this;
    return Status(context + ": " + *message_);
  }

 private:
  explicit Status(std::string m) : message_(std::move(m)) {}
  std::optional<std::string> message_;
};

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
