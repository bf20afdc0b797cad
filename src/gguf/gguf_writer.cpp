#include "gguf/gguf_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>

#include "gguf/gguf_file.h"
#include "gguf/gguf_split.h"
#include "util/thread_pool.h"

namespace dsv4::gguf {

namespace {

constexpr size_t kWriteBufferBytes = size_t{4} << 20;

struct DeclaredTensor {
  std::string name;
  GgmlType type;
  std::vector<uint64_t> ne;
  uint64_t nbytes = 0;
  uint32_t part = 0;
  uint64_t offset = 0;  // within its part's data section
};

struct PartPlan {
  std::vector<size_t> tensors;  // indices into the declared tensors, in order
  std::string final_path;
  std::string temp_path;
};

uint64_t padding(uint64_t n, uint64_t alignment) { return (alignment - n % alignment) % alignment; }

// Little-endian serialisation of a header into memory (headers are small; tensor data is
// streamed separately).
class ByteSink {
 public:
  template <typename T>
  void pod(T x) {
    const auto* p = reinterpret_cast<const char*>(&x);
    bytes_.append(p, sizeof(T));
  }
  void string(std::string_view s) {
    pod<uint64_t>(s.size());
    bytes_.append(s);
  }
  void value_payload(const Value& v) {
    switch (v.type()) {
      case ValueType::UINT8: pod(static_cast<uint8_t>(v.as_u64())); break;
      case ValueType::INT8: pod(static_cast<int8_t>(v.as_i64())); break;
      case ValueType::UINT16: pod(static_cast<uint16_t>(v.as_u64())); break;
      case ValueType::INT16: pod(static_cast<int16_t>(v.as_i64())); break;
      case ValueType::UINT32: pod(static_cast<uint32_t>(v.as_u64())); break;
      case ValueType::INT32: pod(static_cast<int32_t>(v.as_i64())); break;
      case ValueType::UINT64: pod(v.as_u64()); break;
      case ValueType::INT64: pod(v.as_i64()); break;
      case ValueType::FLOAT32: pod(static_cast<float>(v.as_f64())); break;
      case ValueType::FLOAT64: pod(v.as_f64()); break;
      case ValueType::BOOL: pod(static_cast<uint8_t>(v.as_bool() ? 1 : 0)); break;
      case ValueType::STRING: string(v.as_string()); break;
      case ValueType::ARRAY:
        pod(static_cast<uint32_t>(v.elem_type()));
        pod<uint64_t>(v.as_array().size());
        for (const Value& item : v.as_array()) value_payload(item);
        break;
    }
  }
  void key_value(std::string_view key, const Value& v) {
    string(key);
    pod(static_cast<uint32_t>(v.type()));
    value_payload(v);
  }
  void zeros(uint64_t n) { bytes_.append(static_cast<size_t>(n), '\0'); }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

// Arrays must hold exactly their declared element type, recursively: the file format
// stores the type once per array. Strings, nesting and the number of values stay within
// the reader's limits (gguf_file.h), so every file written can be read back; `values`
// counts key-value pairs and array elements of all keys, as the reader does.
Status check_value(const std::string& key, const Value& v, int depth, uint64_t& values) {
  if (v.is_string() && v.as_string().size() > kMaxStringBytes)
    return Status::errorf("metadata key '{}': string of {} bytes exceeds the limit of {} bytes", key,
                          v.as_string().size(), kMaxStringBytes);
  if (!v.is_array()) return Status::ok();
  if (depth >= kMaxArrayNesting)
    return Status::errorf("metadata key '{}': arrays nested more than {} deep", key, kMaxArrayNesting);
  values += v.as_array().size();
  if (values > kMaxMetadataValues)
    return Status::errorf("metadata key '{}': array of {} elements takes the metadata past the limit of {} values "
                          "in all",
                          key, v.as_array().size(), kMaxMetadataValues);
  for (size_t i = 0; i < v.as_array().size(); ++i) {
    const Value& item = v.as_array()[i];
    if (item.type() != v.elem_type())
      return Status::errorf("metadata key '{}': element [{}] has type {} in an array of {}", key, i,
                            value_type_name(item.type()), value_type_name(v.elem_type()));
    DSV4_TRY(check_value(key, item, depth + 1, values));
  }
  return Status::ok();
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

struct GgufWriter::Impl {
  enum class State { kDeclaring, kWriting, kFinished, kFailed };

  std::string path;
  WriterOptions opts;
  std::vector<std::pair<std::string, Value>> metadata;
  std::vector<DeclaredTensor> tensors;
  std::map<std::string, size_t, std::less<>> tensor_index;

  State state = State::kDeclaring;
  Status failure;
  std::vector<PartPlan> parts;
  std::vector<std::string> output_paths;
  std::vector<std::string> temps_created;
  std::FILE* out = nullptr;
  std::unique_ptr<char[]> out_buffer;  // stdio buffer of the open part, reused across parts
  size_t current_part = 0;
  size_t next_tensor = 0;       // the tensor whose bytes are due
  uint64_t written_in_tensor = 0;

  Status fail(Status s) {
    state = State::kFailed;
    failure = s;
    close_output();
    return s;
  }

  void close_output() {
    if (out) std::fclose(out);
    out = nullptr;
  }

  void remove_temps() {
    close_output();
    for (const auto& t : temps_created) std::remove(t.c_str());
    temps_created.clear();
  }

  Status write_raw(const void* data, size_t n) {
    if (n && std::fwrite(data, 1, n, out) != n)
      return Status::errorf("{}: write failed: {}", parts[current_part].temp_path, errno_text());
    return Status::ok();
  }

  Status write_zeros(uint64_t n) {
    static constexpr char kZeros[256] = {};
    while (n > 0) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, sizeof(kZeros)));
      DSV4_TRY(write_raw(kZeros, take));
      n -= take;
    }
    return Status::ok();
  }

  Result<std::string> header_bytes(size_t p) const {
    const bool split = parts.size() > 1;
    ByteSink sink;
    std::vector<std::pair<std::string_view, Value>> kvs;
    if (p == 0) {
      for (const auto& [k, v] : metadata) kvs.emplace_back(k, v);
    } else if (opts.alignment != kDefaultAlignment) {
      kvs.emplace_back("general.alignment", Value::u32(static_cast<uint32_t>(opts.alignment)));
    }
    if (split) {
      kvs.emplace_back(kSplitNoKey, Value::u16(static_cast<uint16_t>(p)));
      kvs.emplace_back(kSplitCountKey, Value::u16(static_cast<uint16_t>(parts.size())));
      kvs.emplace_back(kSplitTensorsCountKey, Value::i32(static_cast<int32_t>(tensors.size())));
    }
    sink.pod(kMagic);
    sink.pod(kVersion);
    sink.pod<uint64_t>(parts[p].tensors.size());
    sink.pod<uint64_t>(kvs.size());
    for (const auto& [k, v] : kvs) sink.key_value(k, v);
    for (size_t i : parts[p].tensors) {
      const DeclaredTensor& t = tensors[i];
      sink.string(t.name);
      sink.pod(static_cast<uint32_t>(t.ne.size()));
      for (uint64_t d : t.ne) sink.pod(d);
      sink.pod(static_cast<uint32_t>(t.type));
      sink.pod(t.offset);
    }
    if (sink.bytes().size() > kMaxHeaderBytes)
      return Status::errorf("{}: header of {} bytes exceeds the limit of {} bytes", parts[p].final_path,
                            sink.bytes().size(), kMaxHeaderBytes);
    // Below the alignment, which begin() bounded by kMaxAlignment.
    sink.zeros(padding(sink.bytes().size(), opts.alignment));
    return sink.bytes();
  }

  Status open_part(size_t p) {
    current_part = p;
    const std::string& temp = parts[p].temp_path;
    out = std::fopen(temp.c_str(), "wb");
    if (!out) return Status::errorf("{}: cannot create: {}", temp, errno_text());
    temps_created.push_back(temp);
    if (!out_buffer) out_buffer = std::make_unique_for_overwrite<char[]>(kWriteBufferBytes);
    std::setvbuf(out, out_buffer.get(), _IOFBF, kWriteBufferBytes);
    DSV4_ASSIGN_OR_RETURN(const std::string header, header_bytes(p));
    return write_raw(header.data(), header.size());
  }

  Status close_part() {
    const std::string& temp = parts[current_part].temp_path;
    const bool flushed = std::fflush(out) == 0;
    const bool closed = std::fclose(out) == 0;
    out = nullptr;
    if (!flushed || !closed) return Status::errorf("{}: write failed: {}", temp, errno_text());
    return Status::ok();
  }

  // Moves on once the due tensor is complete: pads it, and closes its part and opens the
  // next when the part is done.
  Status advance_if_complete() {
    while (next_tensor < tensors.size() && written_in_tensor == tensors[next_tensor].nbytes) {
      const DeclaredTensor& t = tensors[next_tensor];
      DSV4_TRY(write_zeros(padding(t.nbytes, opts.alignment)));
      ++next_tensor;
      written_in_tensor = 0;
      if (next_tensor < tensors.size() && tensors[next_tensor].part != current_part) {
        DSV4_TRY(close_part());
        DSV4_TRY(open_part(tensors[next_tensor].part));
      }
    }
    return Status::ok();
  }

  Status plan_parts() {
    const bool by_tensors = opts.split_max_tensors > 0;
    const bool by_bytes = opts.split_max_bytes > 0;
    parts.assign(1, PartPlan{});
    uint64_t part_bytes = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const uint64_t padded = tensors[i].nbytes + padding(tensors[i].nbytes, opts.alignment);
      PartPlan& cur = parts.back();
      const bool full = !cur.tensors.empty() &&
                        ((by_tensors && cur.tensors.size() >= opts.split_max_tensors) ||
                         (by_bytes && part_bytes + padded > opts.split_max_bytes));
      if (full) {
        parts.emplace_back();
        part_bytes = 0;
      }
      tensors[i].part = static_cast<uint32_t>(parts.size() - 1);
      tensors[i].offset = part_bytes;
      part_bytes += padded;
      parts.back().tensors.push_back(i);
    }
    if (parts.size() > kMaxSplitCount)
      return Status::errorf("{}: {} split parts exceed the limit of {}", path, parts.size(), kMaxSplitCount);
    if (parts.size() > 1 && tensors.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
      return Status::errorf("{}: {} tensors do not fit split.tensors.count (i32)", path, tensors.size());
    if (parts.size() == 1) {
      parts[0].final_path = path;
    } else {
      std::string prefix = path;
      if (prefix.size() > 5 && prefix.compare(prefix.size() - 5, 5, ".gguf") == 0)
        prefix.resize(prefix.size() - 5);
      for (size_t p = 0; p < parts.size(); ++p)
        parts[p].final_path =
            split_path(prefix, static_cast<uint32_t>(p), static_cast<uint32_t>(parts.size()));
    }
    for (auto& part : parts) part.temp_path = part.final_path + ".tmp";
    return Status::ok();
  }

  Status check_metadata() {
    if (metadata.size() > kMaxMetadataValues)
      return Status::errorf("{}: {} metadata keys exceed the limit of {} values in all", path, metadata.size(),
                            kMaxMetadataValues);
    uint64_t values = metadata.size();
    for (const auto& [key, value] : metadata) {
      if (key.empty()) return Status::errorf("{}: metadata key is empty", path);
      if (key.size() > kMaxStringBytes)
        return Status::errorf("{}: metadata key of {} bytes exceeds the limit of {} bytes", path, key.size(),
                              kMaxStringBytes);
      if (key == kSplitNoKey || key == kSplitCountKey || key == kSplitTensorsCountKey)
        return Status::errorf("{}: metadata key '{}' is written by the writer itself (use split_max_*)", path, key);
      DSV4_TRY(check_value(key, value, 0, values).with_context(path));
    }
    return Status::ok();
  }
};

GgufWriter::GgufWriter(std::string path, WriterOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(path);
  impl_->opts = opts;
}

GgufWriter::~GgufWriter() {
  if (impl_->state != Impl::State::kFinished) impl_->remove_temps();
}

void GgufWriter::set(std::string key, Value value) {
  for (auto& [k, v] : impl_->metadata) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  impl_->metadata.emplace_back(std::move(key), std::move(value));
}

Status GgufWriter::add_tensor(std::string name, GgmlType type, std::vector<uint64_t> ne) {
  Impl& w = *impl_;
  if (w.state != Impl::State::kDeclaring)
    return Status::errorf("{}: tensor '{}': add_tensor after begin()", w.path, name);
  const std::string what = fmt::format("{}: tensor '{}'", w.path, name);
  if (name.empty()) return Status::errorf("{}: tensor name is empty", w.path);
  if (name.size() > kMaxStringBytes)
    return Status::errorf("{}: tensor name of {} bytes exceeds the limit of {} bytes", w.path, name.size(),
                          kMaxStringBytes);
  if (w.tensor_index.count(name)) return Status::errorf("{}: declared twice", what);
  if (w.tensors.size() >= kMaxTensors)
    return Status::errorf("{}: more than {} tensors (the limit)", what, kMaxTensors);
  if (!ggml_type_traits(static_cast<uint32_t>(type)))
    return Status::errorf("{}: unknown type id {}", what, static_cast<uint32_t>(type));
  if (ne.size() > kMaxDims) return Status::errorf("{}: {} dimensions, at most {} allowed", what, ne.size(), kMaxDims);
  uint64_t elements = 1;
  for (size_t d = 0; d < ne.size(); ++d) {
    if (ne[d] == 0) return Status::errorf("{}: dimension ne[{}] is 0", what, d);
    if (ne[d] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / elements)
      return Status::errorf("{}: element count overflows at ne[{}] = {}", what, d, ne[d]);
    elements *= ne[d];
  }
  const uint64_t row = ne.empty() ? 1 : ne[0];
  const auto row_bytes = ggml_row_bytes(type, row);
  if (!row_bytes)
    return Status::errorf("{}: row length {} is not a multiple of the {} block size {}", what, row,
                          ggml_type_name(type), ggml_traits(type).block_elems);
  const uint64_t rows = elements / row;
  if (rows > std::numeric_limits<uint64_t>::max() / 2 / std::max<uint64_t>(*row_bytes, 1))
    return Status::errorf("{}: byte size overflows", what);
  w.tensor_index.emplace(name, w.tensors.size());
  w.tensors.push_back(DeclaredTensor{std::move(name), type, std::move(ne), *row_bytes * rows, 0, 0});
  return Status::ok();
}

Status GgufWriter::begin() {
  Impl& w = *impl_;
  if (w.state == Impl::State::kFailed) return w.failure;
  if (w.state != Impl::State::kDeclaring) return Status::errorf("{}: begin() called twice", w.path);
  const uint64_t a = w.opts.alignment;
  if (const std::string problem = alignment_problem(a); !problem.empty())
    return w.fail(Status::errorf("{}: metadata key 'general.alignment' (the writer's alignment): {}", w.path, problem));
  // general.alignment is the writer's to state: it must match the layout actually written.
  std::erase_if(w.metadata, [](const auto& kv) { return kv.first == "general.alignment"; });
  if (a != kDefaultAlignment) w.metadata.emplace_back("general.alignment", Value::u32(static_cast<uint32_t>(a)));
  if (Status s = w.check_metadata(); !s) return w.fail(s);
  if (Status s = w.plan_parts(); !s) return w.fail(s);
  for (const auto& part : w.parts) {
    std::error_code ec;
    if (!w.opts.overwrite && std::filesystem::exists(part.final_path, ec))
      return w.fail(Status::errorf("{}: output file exists (overwrite not allowed)", part.final_path));
  }
  w.state = Impl::State::kWriting;
  if (Status s = w.open_part(0); !s) return w.fail(s);
  if (Status s = w.advance_if_complete(); !s) return w.fail(s);
  return Status::ok();
}

Status GgufWriter::write_tensor_data(std::span<const uint8_t> bytes) {
  Impl& w = *impl_;
  if (w.state == Impl::State::kFailed) return w.failure;
  if (w.state != Impl::State::kWriting)
    return Status::errorf("{}: write_tensor_data outside begin()..finish()", w.path);
  if (w.next_tensor >= w.tensors.size())
    return w.fail(Status::errorf("{}: {} bytes given after all {} declared tensors are complete", w.path,
                                 bytes.size(), w.tensors.size()));
  const DeclaredTensor& t = w.tensors[w.next_tensor];
  const uint64_t left = t.nbytes - w.written_in_tensor;
  if (bytes.size() > left)
    return w.fail(Status::errorf("{}: tensor '{}': {} bytes given but only {} of its {} bytes remain", w.path,
                                 t.name, bytes.size(), left, t.nbytes));
  if (Status s = w.write_raw(bytes.data(), bytes.size()); !s) return w.fail(s);
  w.written_in_tensor += bytes.size();
  if (Status s = w.advance_if_complete(); !s) return w.fail(s);
  return Status::ok();
}

Status GgufWriter::write_tensor_data_parallel(uint64_t bytes, uint64_t piece_bytes,
                                              const std::function<void(uint64_t, std::span<uint8_t>)>& produce,
                                              ThreadPool& pool) {
  Impl& w = *impl_;
  if (w.state == Impl::State::kFailed) return w.failure;
  if (w.state != Impl::State::kWriting)
    return Status::errorf("{}: write_tensor_data_parallel outside begin()..finish()", w.path);
  if (w.next_tensor >= w.tensors.size())
    return w.fail(Status::errorf("{}: {} bytes given after all {} declared tensors are complete", w.path, bytes,
                                 w.tensors.size()));
  const DeclaredTensor& t = w.tensors[w.next_tensor];
  const uint64_t left = t.nbytes - w.written_in_tensor;
  if (bytes > left)
    return w.fail(Status::errorf("{}: tensor '{}': {} bytes given but only {} of its {} bytes remain", w.path, t.name,
                                 bytes, left, t.nbytes));
  if (piece_bytes == 0) return w.fail(Status::errorf("{}: tensor '{}': pieces of 0 bytes", w.path, t.name));
  const std::string& temp = w.parts[w.current_part].temp_path;
  if (std::fflush(w.out) != 0) return w.fail(Status::errorf("{}: write failed: {}", temp, errno_text()));
  const int fd = fileno(w.out);
  const off_t base = ftello(w.out);
  if (base < 0) return w.fail(Status::errorf("{}: cannot read the file position: {}", temp, errno_text()));

  const int64_t n_pieces = static_cast<int64_t>((bytes + piece_bytes - 1) / piece_bytes);
  std::vector<std::vector<uint8_t>> buffers(pool.size());
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status error;
  pool.parallel_for(n_pieces, [&](int64_t begin, int64_t end, int thread) {
    std::vector<uint8_t>& buffer = buffers[thread];
    for (int64_t p = begin; p < end && !failed.load(std::memory_order_relaxed); ++p) {
      const uint64_t offset = static_cast<uint64_t>(p) * piece_bytes;
      const size_t size = static_cast<size_t>(std::min(piece_bytes, bytes - offset));
      buffer.resize(size);
      produce(offset, std::span<uint8_t>(buffer.data(), size));
      for (size_t done = 0; done < size;) {
        const ssize_t n = ::pwrite(fd, buffer.data() + done, size - done, base + static_cast<off_t>(offset + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          std::lock_guard<std::mutex> lock(mu);
          if (!failed.exchange(true)) error = Status::errorf("{}: write failed: {}", temp, n < 0 ? errno_text() : "no progress");
          break;
        }
        done += static_cast<size_t>(n);
      }
    }
  });
  if (failed.load()) return w.fail(error);
  if (fseeko(w.out, base + static_cast<off_t>(bytes), SEEK_SET) != 0)
    return w.fail(Status::errorf("{}: cannot seek: {}", temp, errno_text()));
  w.written_in_tensor += bytes;
  if (Status s = w.advance_if_complete(); !s) return w.fail(s);
  return Status::ok();
}

Status GgufWriter::finish() {
  Impl& w = *impl_;
  if (w.state == Impl::State::kFailed) return w.failure;
  if (w.state == Impl::State::kDeclaring) return Status::errorf("{}: finish() before begin()", w.path);
  if (w.state == Impl::State::kFinished) return Status::ok();
  if (w.next_tensor < w.tensors.size()) {
    const DeclaredTensor& t = w.tensors[w.next_tensor];
    return w.fail(Status::errorf("{}: tensor '{}': only {} of its {} bytes were written ({} of {} tensors complete)",
                                 w.path, t.name, w.written_in_tensor, t.nbytes, w.next_tensor, w.tensors.size()));
  }
  if (Status s = w.close_part(); !s) return w.fail(s);
  for (const auto& part : w.parts) {
    std::error_code ec;
    if (!w.opts.overwrite && std::filesystem::exists(part.final_path, ec))
      return w.fail(Status::errorf("{}: output file appeared while writing (overwrite not allowed)", part.final_path));
  }
  for (const auto& part : w.parts) {
    if (std::rename(part.temp_path.c_str(), part.final_path.c_str()) != 0)
      return w.fail(Status::errorf("{}: cannot rename to {}: {}", part.temp_path, part.final_path, errno_text()));
    w.output_paths.push_back(part.final_path);
  }
  w.temps_created.clear();
  w.state = Impl::State::kFinished;
  return Status::ok();
}

const std::vector<std::string>& GgufWriter::output_paths() const { return impl_->output_paths; }

}  // namespace dsv4::gguf
