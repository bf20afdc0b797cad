#include "gguf/gguf_file.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "gguf/gguf_split.h"
#include "util/mapped_file.h"

namespace dsv4::gguf {

namespace {

constexpr size_t kReadChunk = size_t{1} << 20;
// Containers sized by a header count reserve at most this many entries up front.
constexpr uint64_t kReserveCap = 4096;

// Smallest encoding of one element of each value type (a string's 8-byte length, an
// array's 4-byte type and 8-byte count), used to bound counts by the bytes remaining.
uint64_t min_encoded_size(ValueType t) {
  switch (t) {
    case ValueType::UINT8:
    case ValueType::INT8:
    case ValueType::BOOL: return 1;
    case ValueType::UINT16:
    case ValueType::INT16: return 2;
    case ValueType::UINT32:
    case ValueType::INT32:
    case ValueType::FLOAT32: return 4;
    case ValueType::UINT64:
    case ValueType::INT64:
    case ValueType::FLOAT64:
    case ValueType::STRING: return 8;
    case ValueType::ARRAY: return 12;
  }
  return 1;
}

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::FLOAT64); }

// What the headers read by one open() may still use: the limits of gguf_file.h, shared by
// all parts of a split set (whose later parts normally hold only the split keys), so a set
// of many parts cannot multiply them.
struct HeaderBudget {
  uint64_t header_bytes = kMaxHeaderBytes;
  uint64_t values = kMaxMetadataValues;
};

// Sequential reader of a header. With the file mapped it reads from the mapping; otherwise
// it pulls bounded chunks with pread so the tensor data is never touched. Errors carry
// the field being read and the offset; the caller adds the file name.
class HeaderCursor {
 public:
  HeaderCursor(const MappedFile& file, bool direct, uint64_t max_bytes)
      : file_(file), direct_(direct && file.data() != nullptr), max_bytes_(max_bytes),
        limit_(std::min(file.size(), max_bytes)) {}

  uint64_t offset() const { return pos_; }
  uint64_t remaining() const { return limit_ - pos_; }

  Status read(void* out, uint64_t n, std::string_view what) {
    if (n > remaining()) return truncated(n, what);
    if (direct_) {
      if (n) std::memcpy(out, file_.data() + pos_, n);
      pos_ += n;
      return Status::ok();
    }
    auto* dst = static_cast<uint8_t*>(out);
    while (n > 0) {
      if (pos_ < buf_start_ || pos_ >= buf_start_ + buf_.size()) {
        buf_.resize(static_cast<size_t>(std::min<uint64_t>(kReadChunk, file_.size() - pos_)));
        DSV4_TRY(file_.read_at(pos_, buf_.data(), buf_.size()));
        buf_start_ = pos_;
      }
      const uint64_t at = pos_ - buf_start_;
      const uint64_t take = std::min<uint64_t>(n, buf_.size() - at);
      std::memcpy(dst, buf_.data() + at, take);
      pos_ += take;
      dst += take;
      n -= take;
    }
    return Status::ok();
  }

  template <typename T>
  Status read_pod(T& out, std::string_view what) {
    return read(&out, sizeof(T), what);
  }

  Status read_string(std::string& out, std::string_view what) {
    uint64_t len = 0;
    if (remaining() < sizeof(len)) return truncated(sizeof(len), fmt::format("{} (string length)", what));
    DSV4_TRY(read_pod(len, what));
    if (len > kMaxStringBytes)
      return Status::errorf("{}: string length {} at offset {} exceeds the limit of {} bytes", what, len,
                            pos_ - 8, kMaxStringBytes);
    if (len > remaining())
      return Status::errorf("{}: string length {} at offset {} exceeds the {} bytes left{}", what, len,
                            pos_ - 8, remaining(), limit_note());
    out.resize(static_cast<size_t>(len));
    return read(out.data(), len, what);
  }

  // Says why the bytes ran out: the end of the file or the header size limit.
  std::string limit_note() const {
    if (limit_ == file_.size()) return " in the file";
    if (max_bytes_ == kMaxHeaderBytes) return fmt::format(" (headers are limited to {} bytes)", kMaxHeaderBytes);
    return fmt::format(" (headers are limited to {} bytes, all parts of a split set together; {} were left for "
                       "this part)",
                       kMaxHeaderBytes, max_bytes_);
  }

 private:
  Status truncated(uint64_t n, std::string_view what) const {
    return Status::errorf("{}: truncated: needs {} bytes at offset {} but only {} are left{}", what, n, pos_,
                          remaining(), limit_note());
  }

  const MappedFile& file_;
  const bool direct_;
  const uint64_t max_bytes_;
  const uint64_t limit_;
  uint64_t pos_ = 0;
  std::vector<uint8_t> buf_;
  uint64_t buf_start_ = 0;
};

struct ParsedPart {
  uint32_t version = 0;
  uint64_t alignment = kDefaultAlignment;
  std::vector<std::pair<std::string, Value>> metadata;
  std::vector<TensorInfo> tensors;
  uint64_t data_start = 0;
};

class HeaderParser {
 public:
  HeaderParser(const MappedFile& file, bool map_data, HeaderBudget& budget)
      : file_(file), cur_(file, map_data, budget.header_bytes), map_data_(map_data), budget_(budget),
        values_at_start_(budget.values) {}

  // Uses up the budget by what this header holds.
  Result<ParsedPart> parse() {
    ParsedPart part;
    DSV4_TRY(parse_preamble(part));
    DSV4_TRY(parse_metadata(part));
    DSV4_TRY(parse_alignment(part));
    DSV4_TRY(parse_tensor_infos(part));
    DSV4_TRY(place_tensors(part));
    budget_.header_bytes -= cur_.offset();
    return part;
  }

 private:
  Status parse_preamble(ParsedPart& part) {
    uint32_t magic = 0;
    DSV4_TRY(cur_.read_pod(magic, "magic"));
    if (magic != kMagic)
      return Status::errorf("magic: bad magic 0x{:08x} (expected 0x{:08x}, \"GGUF\"): not a GGUF file", magic,
                            kMagic);
    DSV4_TRY(cur_.read_pod(part.version, "version"));
    if (part.version != 2 && part.version != 3) {
      if ((part.version & 0xffff) == 0 && part.version != 0)
        return Status::errorf("version: 0x{:08x} looks byte-swapped: big-endian GGUF files are not supported",
                              part.version);
      return Status::errorf("version: unsupported GGUF version {} (supported: 2 and 3)", part.version);
    }
    DSV4_TRY(cur_.read_pod(tensor_count_, "tensor_count"));
    DSV4_TRY(cur_.read_pod(kv_count_, "kv_count"));
    // A key-value pair takes at least 13 bytes (key length, type, one-byte value), a tensor
    // info at least 24 (name length, n_dims, type, offset).
    if (kv_count_ > cur_.remaining() / 13)
      return Status::errorf("kv_count: {} key-value pairs cannot fit in the {} bytes left{}", kv_count_,
                            cur_.remaining(), cur_.limit_note());
    if (tensor_count_ > kMaxTensors)
      return Status::errorf("tensor_count: {} exceeds the limit of {} tensors", tensor_count_, kMaxTensors);
    if (tensor_count_ > (cur_.remaining() - kv_count_ * 13) / 24)
      return Status::errorf("tensor_count: {} tensor infos cannot fit in the {} bytes left{}", tensor_count_,
                            cur_.remaining(), cur_.limit_note());
    // Each pair holds one value: pairs and array elements share one budget.
    if (kv_count_ > budget_.values)
      return Status::errorf("kv_count: {} exceeds the limit of {} metadata values in all{}", kv_count_,
                            kMaxMetadataValues, values_note());
    budget_.values -= kv_count_;
    return Status::ok();
  }

  Status parse_metadata(ParsedPart& part) {
    std::map<std::string, uint64_t, std::less<>> seen;
    // Reserved up to a small cap and grown as pairs parse, so memory follows the bytes present.
    part.metadata.reserve(static_cast<size_t>(std::min<uint64_t>(kv_count_, kReserveCap)));
    for (uint64_t i = 0; i < kv_count_; ++i) {
      std::string key;
      DSV4_TRY(cur_.read_string(key, fmt::format("metadata key #{}", i)));
      if (key.empty()) return Status::errorf("metadata key #{}: empty key at offset {}", i, cur_.offset() - 8);
      const std::string what = fmt::format("metadata key '{}' (#{})", key, i);
      if (auto it = seen.find(key); it != seen.end())
        return Status::errorf("{}: duplicate key (first defined as #{})", what, it->second);
      seen.emplace(key, i);
      uint32_t type = 0;
      DSV4_TRY(cur_.read_pod(type, what + " type"));
      if (!valid_value_type(type))
        return Status::errorf("{}: unknown value type {} at offset {}", what, type, cur_.offset() - 4);
      Value value;
      DSV4_TRY(parse_value(static_cast<ValueType>(type), 0, what, value));
      part.metadata.emplace_back(std::move(key), std::move(value));
    }
    return Status::ok();
  }

  template <typename T>
  Status read_scalar(T& out, std::string_view what) {
    return cur_.read_pod(out, what);
  }

  Status parse_value(ValueType type, int depth, const std::string& what, Value& out) {
    switch (type) {
      case ValueType::UINT8: { uint8_t x; DSV4_TRY(read_scalar(x, what)); out = Value::u8(x); break; }
      case ValueType::INT8: { int8_t x; DSV4_TRY(read_scalar(x, what)); out = Value::i8(x); break; }
      case ValueType::UINT16: { uint16_t x; DSV4_TRY(read_scalar(x, what)); out = Value::u16(x); break; }
      case ValueType::INT16: { int16_t x; DSV4_TRY(read_scalar(x, what)); out = Value::i16(x); break; }
      case ValueType::UINT32: { uint32_t x; DSV4_TRY(read_scalar(x, what)); out = Value::u32(x); break; }
      case ValueType::INT32: { int32_t x; DSV4_TRY(read_scalar(x, what)); out = Value::i32(x); break; }
      case ValueType::UINT64: { uint64_t x; DSV4_TRY(read_scalar(x, what)); out = Value::u64(x); break; }
      case ValueType::INT64: { int64_t x; DSV4_TRY(read_scalar(x, what)); out = Value::i64(x); break; }
      case ValueType::FLOAT32: { float x; DSV4_TRY(read_scalar(x, what)); out = Value::f32(x); break; }
      case ValueType::FLOAT64: { double x; DSV4_TRY(read_scalar(x, what)); out = Value::f64(x); break; }
      case ValueType::BOOL: {
        uint8_t x;
        DSV4_TRY(read_scalar(x, what));
        if (x > 1)
          return Status::errorf("{}: invalid bool byte {} at offset {} (expected 0 or 1)", what, x,
                                cur_.offset() - 1);
        out = Value::boolean(x != 0);
        break;
      }
      case ValueType::STRING: {
        std::string s;
        DSV4_TRY(cur_.read_string(s, what));
        out = Value::string(std::move(s));
        break;
      }
      case ValueType::ARRAY: return parse_array(depth, what, out);
    }
    return Status::ok();
  }

  Status parse_array(int depth, const std::string& what, Value& out) {
    if (depth >= kMaxArrayNesting)
      return Status::errorf("{}: arrays nested more than {} deep", what, kMaxArrayNesting);
    uint32_t elem_type = 0;
    DSV4_TRY(cur_.read_pod(elem_type, what + " (array element type)"));
    if (!valid_value_type(elem_type))
      return Status::errorf("{}: unknown array element type {} at offset {}", what, elem_type, cur_.offset() - 4);
    uint64_t count = 0;
    DSV4_TRY(cur_.read_pod(count, what + " (array length)"));
    const ValueType et = static_cast<ValueType>(elem_type);
    if (count > cur_.remaining() / min_encoded_size(et))
      return Status::errorf("{}: array of {} {} elements at offset {} cannot fit in the {} bytes left{}", what,
                            count, value_type_name(et), cur_.offset() - 8, cur_.remaining(), cur_.limit_note());
    if (count > budget_.values)
      return Status::errorf("{}: array of {} elements exceeds the limit of {} metadata values in all{}", what, count,
                            kMaxMetadataValues, values_note());
    budget_.values -= count;
    // Grown as elements parse, so memory follows the bytes actually present.
    Value::Array items;
    items.reserve(static_cast<size_t>(std::min<uint64_t>(count, kReserveCap)));
    for (uint64_t i = 0; i < count; ++i) {
      Value& item = items.emplace_back();
      Status s = parse_value(et, depth + 1, what, item);
      // The element's index goes into the message only on error: vocabularies have 100k+ items.
      if (!s) {
        const std::string& m = s.message();
        return m.rfind(what, 0) == 0 ? Status::errorf("{}[{}]{}", what, i, m.substr(what.size())) : s;
      }
    }
    out = Value::array(et, std::move(items));
    return Status::ok();
  }

  Status parse_alignment(ParsedPart& part) {
    for (const auto& [key, value] : part.metadata) {
      if (key != "general.alignment") continue;
      if (value.type() != ValueType::UINT32)
        return Status::errorf("metadata key 'general.alignment': type {}, expected u32",
                              value_type_name(value.type()));
      const uint64_t a = value.as_u64();
      if (const std::string problem = alignment_problem(a); !problem.empty())
        return Status::errorf("metadata key 'general.alignment': {}", problem);
      part.alignment = a;
    }
    return Status::ok();
  }

  Status parse_tensor_infos(ParsedPart& part) {
    std::map<std::string, uint64_t, std::less<>> seen;
    part.tensors.reserve(static_cast<size_t>(std::min<uint64_t>(tensor_count_, kReserveCap)));
    for (uint64_t i = 0; i < tensor_count_; ++i) {
      TensorInfo t;
      DSV4_TRY(cur_.read_string(t.name, fmt::format("tensor info #{} name", i)));
      if (t.name.empty()) return Status::errorf("tensor info #{}: empty name at offset {}", i, cur_.offset() - 8);
      const std::string what = fmt::format("tensor '{}' (#{})", t.name, i);
      if (auto it = seen.find(t.name); it != seen.end())
        return Status::errorf("{}: duplicate tensor name (first defined as #{})", what, it->second);
      seen.emplace(t.name, i);

      uint32_t n_dims = 0;
      DSV4_TRY(cur_.read_pod(n_dims, what + " n_dims"));
      if (n_dims > kMaxDims)
        return Status::errorf("{}: n_dims {} exceeds the maximum of {}", what, n_dims, kMaxDims);
      t.ne.resize(n_dims);
      uint64_t elements = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        DSV4_TRY(cur_.read_pod(t.ne[d], fmt::format("{} ne[{}]", what, d)));
        if (t.ne[d] == 0) return Status::errorf("{}: dimension ne[{}] is 0", what, d);
        if (t.ne[d] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / elements)
          return Status::errorf("{}: element count overflows at dimension ne[{}] = {}", what, d, t.ne[d]);
        elements *= t.ne[d];
      }
      uint32_t type_id = 0;
      DSV4_TRY(cur_.read_pod(type_id, what + " type"));
      const auto traits = ggml_type_traits(type_id);
      if (!traits) return Status::errorf("{}: unknown tensor type id {}", what, type_id);
      t.type = traits->type;
      const uint64_t row = t.ne.empty() ? 1 : t.ne[0];
      const auto row_bytes = ggml_row_bytes(t.type, row);
      if (!row_bytes)
        return Status::errorf("{}: row length ne[0] = {} is not a multiple of the {} block size {}", what, row,
                              traits->name, traits->block_elems);
      const uint64_t rows = elements / row;
      if (*row_bytes != 0 && rows > std::numeric_limits<uint64_t>::max() / *row_bytes)
        return Status::errorf("{}: byte size overflows ({} rows of {} bytes)", what, rows, *row_bytes);
      t.nbytes = *row_bytes * rows;
      DSV4_TRY(cur_.read_pod(t.offset, what + " offset"));
      if (t.offset % part.alignment != 0)
        return Status::errorf("{}: data offset {} is not a multiple of the alignment {}", what, t.offset,
                              part.alignment);
      part.tensors.push_back(std::move(t));
    }
    return Status::ok();
  }

  Status place_tensors(ParsedPart& part) {
    const uint64_t header_end = cur_.offset();
    const uint64_t pad = (part.alignment - header_end % part.alignment) % part.alignment;
    part.data_start = header_end + pad;
    if (part.tensors.empty()) return Status::ok();
    if (part.data_start > file_.size())
      return Status::errorf("data section: starts at offset {} (header end {} aligned to {}) past the end of "
                            "the file ({} bytes)",
                            part.data_start, header_end, part.alignment, file_.size());
    const uint64_t data_size = file_.size() - part.data_start;
    for (size_t i = 0; i < part.tensors.size(); ++i) {
      TensorInfo& t = part.tensors[i];
      if (t.offset > data_size || t.nbytes > data_size - t.offset)
        return Status::errorf("tensor '{}' (#{}): data at offset {} of {} bytes runs past the end of the data "
                              "section ({} bytes from file offset {})",
                              t.name, i, t.offset, t.nbytes, data_size, part.data_start);
      t.file_offset = part.data_start + t.offset;
      if (map_data_) t.data = file_.data() + t.file_offset;
    }
    std::vector<size_t> order(part.tensors.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return part.tensors[a].offset < part.tensors[b].offset; });
    for (size_t i = 1; i < order.size(); ++i) {
      const TensorInfo& prev = part.tensors[order[i - 1]];
      const TensorInfo& next = part.tensors[order[i]];
      if (prev.offset + prev.nbytes > next.offset)
        return Status::errorf("tensor '{}': data [{}, {}) overlaps tensor '{}' at offset {}", next.name,
                              next.offset, next.offset + next.nbytes, prev.name, prev.offset);
    }
    return Status::ok();
  }

  std::string values_note() const {
    if (values_at_start_ == kMaxMetadataValues) return {};
    return fmt::format(" (all parts of a split set together; {} were left for this part)", values_at_start_);
  }

  const MappedFile& file_;
  HeaderCursor cur_;
  const bool map_data_;
  HeaderBudget& budget_;
  const uint64_t values_at_start_;
  uint64_t tensor_count_ = 0;
  uint64_t kv_count_ = 0;
};

bool is_signed_type(ValueType t) {
  return t == ValueType::INT8 || t == ValueType::INT16 || t == ValueType::INT32 || t == ValueType::INT64;
}

bool is_integer_type(ValueType t) {
  return is_signed_type(t) || t == ValueType::UINT8 || t == ValueType::UINT16 || t == ValueType::UINT32 ||
         t == ValueType::UINT64;
}

const Value* find_in(const std::vector<std::pair<std::string, Value>>& metadata, std::string_view key) {
  for (const auto& [k, v] : metadata)
    if (k == key) return &v;
  return nullptr;
}

// Reads an optional integer split.* key; nullopt when absent.
Result<std::optional<uint64_t>> split_key(const std::vector<std::pair<std::string, Value>>& metadata,
                                         std::string_view key, const std::string& path) {
  const Value* v = find_in(metadata, key);
  if (!v) return std::optional<uint64_t>{};
  if (!v->is_integer())
    return Status::errorf("{}: metadata key '{}': type {}, expected an integer", path, key,
                          value_type_name(v->type()));
  if (is_signed_type(v->type())) {
    if (v->as_i64() < 0) return Status::errorf("{}: metadata key '{}': negative value {}", path, key, v->as_i64());
    return std::optional<uint64_t>{static_cast<uint64_t>(v->as_i64())};
  }
  return std::optional<uint64_t>{v->as_u64()};
}


}  // namespace

std::string alignment_problem(uint64_t a) {
  if (a == 0 || (a & (a - 1)) != 0) return fmt::format("{} is not a power of two", a);
  if (a > kMaxAlignment)
    return fmt::format("{} exceeds the limit of {} (a 64 KiB page; real files use 32)", a, kMaxAlignment);
  return {};
}

uint64_t TensorInfo::n_elements() const {
  uint64_t n = 1;
  for (uint64_t d : ne) n *= d;
  return n;
}

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (size_t i = ne.size(); i-- > 0;) {
    s += std::to_string(ne[i]);
    if (i) s += ", ";
  }
  return s + "]";
}

struct GgufFile::Impl {
  std::string path;
  std::vector<std::string> part_paths;
  std::vector<MappedFile> files;
  uint32_t version = kVersion;
  uint64_t alignment = kDefaultAlignment;
  uint64_t file_bytes = 0;
  std::vector<std::pair<std::string, Value>> metadata;
  std::map<std::string, size_t, std::less<>> key_index;
  std::vector<TensorInfo> tensors;
  std::map<std::string, size_t, std::less<>> tensor_index;

  Status key_error(std::string_view key, std::string_view problem) const {
    return Status::errorf("{}: metadata key '{}': {}", path, key, problem);
  }
  Result<const Value*> require(std::string_view key) const {
    auto it = key_index.find(key);
    if (it == key_index.end()) return key_error(key, "missing");
    return &metadata[it->second].second;
  }
};

namespace {

Result<ParsedPart> parse_part(const MappedFile& file, bool map_data, HeaderBudget& budget) {
  auto parsed = HeaderParser(file, map_data, budget).parse();
  if (!parsed) return parsed.status().with_context(file.path());
  return parsed;
}

struct LoadedPart {
  MappedFile file;
  ParsedPart parsed;
};

// Finds and checks every part of the split set `first` belongs to (llama.cpp gguf-split:
// "<prefix>-%05d-of-%05d.gguf", split.no counting from 0, metadata in part 0 only).
Result<std::vector<LoadedPart>> load_split_set(LoadedPart given, uint64_t count, const OpenOptions& opts,
                                              HeaderBudget& budget) {
  const std::string path = given.file.path();  // a copy: `given` moves into the set below
  DSV4_ASSIGN_OR_RETURN(auto no, split_key(given.parsed.metadata, kSplitNoKey, path));
  if (!no) return Status::errorf("{}: metadata key '{}' is missing (split.count is {})", path, kSplitNoKey, count);
  if (count > kMaxSplitCount)
    return Status::errorf("{}: metadata key '{}': {} parts exceeds the limit of {}", path, kSplitCountKey, count,
                          kMaxSplitCount);
  if (*no >= count)
    return Status::errorf("{}: metadata key '{}': {} is not below split.count {}", path, kSplitNoKey, *no, count);
  const std::string suffix = split_suffix(static_cast<uint32_t>(*no), static_cast<uint32_t>(count));
  if (path.size() < suffix.size() || path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0)
    return Status::errorf("{}: file name does not end in '{}' as split.no {} and split.count {} require", path,
                          suffix, *no, count);
  const std::string prefix = path.substr(0, path.size() - suffix.size());

  // Not reserved: split.count is a header value, and the parts are only known to exist
  // once each opens (the first missing one ends the loop with an error).
  std::vector<LoadedPart> parts;
  for (uint64_t i = 0; i < count; ++i) {
    if (i == *no) {
      parts.push_back(std::move(given));
      continue;
    }
    const std::string part_path = split_path(prefix, static_cast<uint32_t>(i), static_cast<uint32_t>(count));
    auto file = MappedFile::open(part_path, opts.map_data);
    if (!file)
      return Status::errorf("{}: split part {} of {} is missing or unreadable: {}", path, i + 1, count,
                            file.status().message());
    DSV4_ASSIGN_OR_RETURN(auto parsed, parse_part(*file, opts.map_data, budget));
    parts.push_back(LoadedPart{std::move(file).value(), std::move(parsed)});
  }

  DSV4_ASSIGN_OR_RETURN(auto total, split_key(parts[0].parsed.metadata, kSplitTensorsCountKey, parts[0].file.path()));
  for (uint64_t i = 0; i < count; ++i) {
    const auto& md = parts[i].parsed.metadata;
    const std::string& p = parts[i].file.path();
    DSV4_ASSIGN_OR_RETURN(auto part_no, split_key(md, kSplitNoKey, p));
    DSV4_ASSIGN_OR_RETURN(auto part_count, split_key(md, kSplitCountKey, p));
    DSV4_ASSIGN_OR_RETURN(auto part_total, split_key(md, kSplitTensorsCountKey, p));
    if (part_no != i)
      return Status::errorf("{}: metadata key '{}' is {}, expected {} (part {} of the set)", p, kSplitNoKey,
                            part_no ? std::to_string(*part_no) : "missing", i, i + 1);
    if (part_count != count)
      return Status::errorf("{}: metadata key '{}' is {}, but {} says {}: the parts disagree", p, kSplitCountKey,
                            part_count ? std::to_string(*part_count) : "missing", path, count);
    if (part_total != total)
      return Status::errorf("{}: metadata key '{}' is {}, but the first part says {}: the parts disagree", p,
                            kSplitTensorsCountKey, part_total ? std::to_string(*part_total) : "missing",
                            total ? std::to_string(*total) : "missing");
    if (parts[i].parsed.version != parts[0].parsed.version)
      return Status::errorf("{}: GGUF version {} differs from the first part's {}", p, parts[i].parsed.version,
                            parts[0].parsed.version);
  }
  uint64_t n_tensors = 0;
  for (const auto& part : parts) n_tensors += part.parsed.tensors.size();
  if (total && *total != n_tensors)
    return Status::errorf("{}: metadata key '{}' is {}, but the {} parts hold {} tensors", parts[0].file.path(),
                          kSplitTensorsCountKey, *total, count, n_tensors);
  return parts;
}

}  // namespace

GgufFile::GgufFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

Result<GgufFile> GgufFile::open(const std::string& path, OpenOptions opts) {
  DSV4_ASSIGN_OR_RETURN(auto file, MappedFile::open(path, opts.map_data));
  return open_parts(std::move(file), opts);
}

Result<GgufFile> GgufFile::open_bytes(std::string name, std::span<const uint8_t> bytes, OpenOptions opts) {
  OpenOptions single = opts;
  single.load_split_parts = false;
  return open_parts(MappedFile::from_bytes(std::move(name), bytes), single);
}

Result<GgufFile> GgufFile::open_parts(MappedFile file, OpenOptions opts) {
  HeaderBudget budget;
  DSV4_ASSIGN_OR_RETURN(auto parsed, parse_part(file, opts.map_data, budget));
  DSV4_ASSIGN_OR_RETURN(auto count, split_key(parsed.metadata, kSplitCountKey, file.path()));
  std::vector<LoadedPart> parts;
  const std::string path = file.path();
  if (opts.load_split_parts && count && *count > 1) {
    DSV4_ASSIGN_OR_RETURN(parts, load_split_set(LoadedPart{std::move(file), std::move(parsed)}, *count, opts, budget));
  } else {
    parts.push_back(LoadedPart{std::move(file), std::move(parsed)});
  }

  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->version = parts[0].parsed.version;
  impl->alignment = parts[0].parsed.alignment;
  impl->metadata = std::move(parts[0].parsed.metadata);
  for (size_t i = 0; i < impl->metadata.size(); ++i) impl->key_index.emplace(impl->metadata[i].first, i);
  for (size_t p = 0; p < parts.size(); ++p) {
    impl->part_paths.push_back(parts[p].file.path());
    impl->file_bytes += parts[p].file.size();
    for (auto& t : parts[p].parsed.tensors) {
      t.part = static_cast<uint32_t>(p);
      const auto [it, inserted] = impl->tensor_index.emplace(t.name, impl->tensors.size());
      if (!inserted)
        return Status::errorf("{}: tensor '{}' is also defined in {}: duplicate tensor name across split parts",
                              parts[p].file.path(), t.name, impl->part_paths[impl->tensors[it->second].part]);
      impl->tensors.push_back(std::move(t));
    }
    impl->files.push_back(std::move(parts[p].file));
  }
  return GgufFile(std::move(impl));
}

const std::string& GgufFile::path() const { return impl_->path; }
const std::vector<std::string>& GgufFile::part_paths() const { return impl_->part_paths; }
uint32_t GgufFile::version() const { return impl_->version; }
uint64_t GgufFile::alignment() const { return impl_->alignment; }
uint64_t GgufFile::file_bytes() const { return impl_->file_bytes; }
const std::vector<std::pair<std::string, Value>>& GgufFile::metadata() const { return impl_->metadata; }

const Value* GgufFile::find(std::string_view key) const {
  auto it = impl_->key_index.find(key);
  return it == impl_->key_index.end() ? nullptr : &impl_->metadata[it->second].second;
}

const std::vector<TensorInfo>& GgufFile::tensors() const { return impl_->tensors; }

const TensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

namespace {

std::string type_description(const Value& v) {
  if (!v.is_array()) return std::string(value_type_name(v.type()));
  return fmt::format("array of {}", value_type_name(v.elem_type()));
}

// The value of an integer Value as unsigned, or nullopt when negative.
std::optional<uint64_t> as_unsigned(const Value& v) {
  if (is_signed_type(v.type())) {
    if (v.as_i64() < 0) return std::nullopt;
    return static_cast<uint64_t>(v.as_i64());
  }
  return v.as_u64();
}

std::string integer_string(const Value& v) {
  return is_signed_type(v.type()) ? std::to_string(v.as_i64()) : std::to_string(v.as_u64());
}

}  // namespace

Result<std::string> GgufFile::get_string(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  if (!v->is_string()) return impl_->key_error(key, fmt::format("type {}, expected string", type_description(*v)));
  return v->as_string();
}

Result<uint64_t> GgufFile::get_uint(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  if (!v->is_integer())
    return impl_->key_error(key, fmt::format("type {}, expected an unsigned integer", type_description(*v)));
  auto u = as_unsigned(*v);
  if (!u) return impl_->key_error(key, fmt::format("value {} is negative, expected an unsigned integer", v->as_i64()));
  return *u;
}

Result<int64_t> GgufFile::get_int(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  if (!v->is_integer())
    return impl_->key_error(key, fmt::format("type {}, expected an integer", type_description(*v)));
  if (is_signed_type(v->type())) return v->as_i64();
  if (v->as_u64() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return impl_->key_error(key, fmt::format("value {} does not fit a signed 64-bit integer", v->as_u64()));
  return static_cast<int64_t>(v->as_u64());
}

Result<double> GgufFile::get_float(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  if (v->is_float()) return v->as_f64();
  if (v->is_integer())
    return is_signed_type(v->type()) ? static_cast<double>(v->as_i64()) : static_cast<double>(v->as_u64());
  return impl_->key_error(key, fmt::format("type {}, expected a number", type_description(*v)));
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  if (!v->is_bool()) return impl_->key_error(key, fmt::format("type {}, expected bool", type_description(*v)));
  return v->as_bool();
}

Result<std::vector<uint64_t>> GgufFile::get_uint_array(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  if (!v->is_array() || !is_integer_type(v->elem_type()))
    return impl_->key_error(key, fmt::format("type {}, expected an array of integers", type_description(*v)));
  std::vector<uint64_t> out;
  out.reserve(v->as_array().size());
  for (size_t i = 0; i < v->as_array().size(); ++i) {
    const Value& item = v->as_array()[i];
    auto u = as_unsigned(item);
    if (!u) return impl_->key_error(key, fmt::format("element [{}] = {} is negative", i, integer_string(item)));
    out.push_back(*u);
  }
  return out;
}

Result<std::vector<double>> GgufFile::get_float_array(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  const bool numeric = v->is_array() && (is_integer_type(v->elem_type()) || v->elem_type() == ValueType::FLOAT32 ||
                                         v->elem_type() == ValueType::FLOAT64);
  if (!numeric)
    return impl_->key_error(key, fmt::format("type {}, expected an array of numbers", type_description(*v)));
  std::vector<double> out;
  out.reserve(v->as_array().size());
  for (const Value& item : v->as_array()) {
    if (item.is_float()) out.push_back(item.as_f64());
    else if (is_signed_type(item.type())) out.push_back(static_cast<double>(item.as_i64()));
    else out.push_back(static_cast<double>(item.as_u64()));
  }
  return out;
}

Result<std::vector<std::string>> GgufFile::get_string_array(std::string_view key) const {
  DSV4_ASSIGN_OR_RETURN(const Value* v, impl_->require(key));
  if (!v->is_array() || v->elem_type() != ValueType::STRING)
    return impl_->key_error(key, fmt::format("type {}, expected an array of strings", type_description(*v)));
  std::vector<std::string> out;
  out.reserve(v->as_array().size());
  for (const Value& item : v->as_array()) out.push_back(item.as_string());
  return out;
}

}  // namespace dsv4::gguf
