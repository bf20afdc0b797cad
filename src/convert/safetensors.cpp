#include "convert/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "util/mapped_file.h"

namespace dsv4::convert {
namespace {

using nlohmann::json;

// The safetensors library refuses headers above 100 MB; so do we (a corrupt length field
// must not make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DtypeInfo {
  StDtype dtype;
  std::string_view name;
  uint32_t size;
};
constexpr std::array<DtypeInfo, 16> kDtypes = {{
    {StDtype::BOOL, "BOOL", 1},       {StDtype::U8, "U8", 1},
    {StDtype::I8, "I8", 1},           {StDtype::U16, "U16", 2},
    {StDtype::I16, "I16", 2},         {StDtype::U32, "U32", 4},
    {StDtype::I32, "I32", 4},         {StDtype::U64, "U64", 8},
    {StDtype::I64, "I64", 8},         {StDtype::F16, "F16", 2},
    {StDtype::BF16, "BF16", 2},       {StDtype::F32, "F32", 4},
    {StDtype::F64, "F64", 8},         {StDtype::F8_E4M3, "F8_E4M3", 1},
    {StDtype::F8_E5M2, "F8_E5M2", 1}, {StDtype::F8_E8M0, "F8_E8M0", 1},
}};

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

Result<uint64_t> json_uint(const json& v, const std::string& what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return Status::errorf("{}: expected a non-negative integer, found {}", what, v.dump());
}

Result<std::string> read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("{}: cannot open: {}", path.string(), std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::errorf("{}: read error", path.string());
  return ss.str();
}

}  // namespace

std::string_view st_dtype_name(StDtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}

std::optional<StDtype> st_dtype_from_name(std::string_view name) {
  for (const auto& d : kDtypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

uint32_t st_dtype_size(StDtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d.size;
  return 0;
}

uint64_t StTensor::n_elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

std::string StTensor::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---- SafetensorsFile -------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::filesystem::path path;
  std::optional<MappedFile> map;  // set by open() / open_bytes()
  bool file_backed = false;       // madvise(DONTNEED) is only safe on a file mapping
  std::vector<StTensor> tensors;
  std::map<std::string, size_t, std::less<>> by_name;
  std::map<std::string, std::string> metadata;
};

SafetensorsFile::SafetensorsFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

const std::filesystem::path& SafetensorsFile::path() const { return impl_->path; }
uint64_t SafetensorsFile::file_bytes() const { return impl_->map->size(); }
const std::vector<StTensor>& SafetensorsFile::tensors() const { return impl_->tensors; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }

const StTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = impl_->by_name.find(name);
  return it == impl_->by_name.end() ? nullptr : &impl_->tensors[it->second];
}

void SafetensorsFile::release(std::span<const uint8_t> bytes) const {
  const uint8_t* base = impl_->map->data();
  if (!impl_->file_backed || !base || bytes.empty()) return;
  // Whole pages only; the neighbours of a partial page are simply read again if needed
  // (the mapping is read-only and file-backed, so dropping pages never loses data).
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes.data() + bytes.size());
  const uintptr_t map_begin = reinterpret_cast<uintptr_t>(base);
  if (begin < map_begin || end > map_begin + impl_->map->size()) return;
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

Result<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path,
                                               uint32_t file_index) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  DSV4_ASSIGN_OR_RETURN(MappedFile map, MappedFile::open(path.string()));
  impl->map = std::move(map);
  impl->file_backed = true;
  return parse(std::move(impl), file_index);
}

Result<SafetensorsFile> SafetensorsFile::open_bytes(std::string name, std::span<const uint8_t> bytes,
                                                     uint32_t file_index) {
  auto impl = std::make_unique<Impl>();
  impl->path = name;
  impl->map = MappedFile::from_bytes(std::move(name), bytes);
  return parse(std::move(impl), file_index);
}

Result<SafetensorsFile> SafetensorsFile::parse(std::unique_ptr<Impl> impl, uint32_t file_index) {
  const std::string file = impl->path.string();
  const uint8_t* base = impl->map->data();
  const uint64_t size = impl->map->size();

  if (size < 8)
    return Status::errorf("{}: truncated: {} bytes, a safetensors file starts with an 8-byte header length",
                          file, size);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | base[i];
  if (header_len > kMaxHeaderBytes)
    return Status::errorf("{}: header length {} exceeds the limit of {} bytes", file, header_len,
                          kMaxHeaderBytes);
  if (header_len > size - 8)
    return Status::errorf("{}: truncated: header length {} but only {} bytes follow the length field",
                          file, header_len, size - 8);
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;

  json header;
  try {
    header = json::parse(base + 8, base + data_start);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    return Status::errorf("{}: header is not valid JSON: {}", file, e.what());
  }
  if (!header.is_object()) return Status::errorf("{}: header is not a JSON object", file);

  for (const auto& [name, entry] : header.items()) {
    const std::string where = fmt::format("{}: tensor {}", file, name);
    if (name == "__metadata__") {
      if (!entry.is_object()) return Status::errorf("{}: __metadata__ is not an object", file);
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return Status::errorf("{}: __metadata__.{} is not a string", file, k);
        impl->metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) return Status::errorf("{}: entry is not an object", where);
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(key)) return Status::errorf("{}: missing \"{}\"", where, key);
    const json& jd = entry["dtype"];
    if (!jd.is_string()) return Status::errorf("{}: dtype is not a string", where);
    const auto dtype = st_dtype_from_name(jd.get<std::string>());
    if (!dtype) return Status::errorf("{}: unknown dtype \"{}\"", where, jd.get<std::string>());

    StTensor t;
    t.name = name;
    t.dtype = *dtype;
    t.file_index = file_index;
    const json& js = entry["shape"];
    if (!js.is_array()) return Status::errorf("{}: shape is not an array", where);
    uint64_t n_elements = 1;
    for (const json& d : js) {
      DSV4_ASSIGN_OR_RETURN(uint64_t dim, json_uint(d, where + ": shape"));
      if (mul_overflows(n_elements, dim, &n_elements))
        return Status::errorf("{}: shape {} overflows", where, js.dump());
      t.shape.push_back(dim);
    }
    const json& jo = entry["data_offsets"];
    if (!jo.is_array() || jo.size() != 2)
      return Status::errorf("{}: data_offsets must be [begin, end], found {}", where, jo.dump());
    DSV4_ASSIGN_OR_RETURN(uint64_t begin, json_uint(jo[0], where + ": data_offsets"));
    DSV4_ASSIGN_OR_RETURN(uint64_t end, json_uint(jo[1], where + ": data_offsets"));
    if (begin > end)
      return Status::errorf("{}: data_offsets [{}, {}] run backwards", where, begin, end);
    if (end > data_size)
      return Status::errorf("{}: data_offsets [{}, {}] end beyond the data section of {} bytes "
                            "(file truncated?)", where, begin, end, data_size);
    uint64_t expected = 0;
    if (mul_overflows(n_elements, st_dtype_size(t.dtype), &expected) || expected != end - begin)
      return Status::errorf("{}: {} {} needs {} bytes, data_offsets [{}, {}] hold {}", where,
                            st_dtype_name(t.dtype), t.shape_string(), expected, begin, end, end - begin);
    t.nbytes = end - begin;
    t.data = base + data_start + begin;
    impl->tensors.push_back(std::move(t));
  }

  std::sort(impl->tensors.begin(), impl->tensors.end(),
            [](const StTensor& a, const StTensor& b) { return a.data < b.data; });
  for (size_t i = 1; i < impl->tensors.size(); ++i) {
    const StTensor& prev = impl->tensors[i - 1];
    const StTensor& cur = impl->tensors[i];
    if (prev.data + prev.nbytes > cur.data)
      return Status::errorf("{}: tensors {} and {} overlap", file, prev.name, cur.name);
  }
  for (size_t i = 0; i < impl->tensors.size(); ++i) impl->by_name[impl->tensors[i].name] = i;
  return SafetensorsFile(std::move(impl));
}

// ---- Checkpoint ------------------------------------------------------------------------

struct Checkpoint::Impl {
  std::filesystem::path dir;
  std::vector<SafetensorsFile> files;
  std::map<std::string, const StTensor*, std::less<>> tensors;
};

Checkpoint::Checkpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

const std::filesystem::path& Checkpoint::dir() const { return impl_->dir; }
const std::vector<SafetensorsFile>& Checkpoint::files() const { return impl_->files; }
const std::map<std::string, const StTensor*, std::less<>>& Checkpoint::tensors() const {
  return impl_->tensors;
}

uint64_t Checkpoint::data_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, t] : impl_->tensors) n += t->nbytes;
  return n;
}

const StTensor* Checkpoint::find(std::string_view name) const {
  auto it = impl_->tensors.find(name);
  return it == impl_->tensors.end() ? nullptr : it->second;
}

void Checkpoint::release(const StTensor& tensor) const {
  impl_->files.at(tensor.file_index).release(tensor.bytes());
}

Result<Checkpoint> Checkpoint::open(const std::filesystem::path& dir) {
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  if (!std::filesystem::is_directory(dir))
    return Status::errorf("{}: not a directory (expected a checkpoint folder)", dir.string());

  const auto index_path = dir / "model.safetensors.index.json";
  // shard file name -> the names the index assigns to it
  std::map<std::string, std::vector<std::string>> shards;
  if (std::filesystem::exists(index_path)) {
    const std::string where = index_path.string();
    DSV4_ASSIGN_OR_RETURN(std::string text, read_text_file(index_path));
    json index;
    try {
      index = json::parse(text);
    } catch (const json::exception& e) {
      return Status::errorf("{}: not valid JSON: {}", where, e.what());
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      return Status::errorf("{}: no \"weight_map\" object", where);
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (!shard.is_string())
        return Status::errorf("{}: weight_map.{} is not a file name", where, name);
      const std::string file = shard.get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        return Status::errorf("{}: weight_map.{} = \"{}\" is not a file name in the folder", where,
                              name, file);
      shards[file].push_back(name);
    }
    if (shards.empty()) return Status::errorf("{}: weight_map is empty", where);
  } else if (std::filesystem::exists(dir / "model.safetensors")) {
    shards["model.safetensors"] = {};
  } else {
    return Status::errorf("{}: neither model.safetensors.index.json nor model.safetensors found",
                          dir.string());
  }

  for (const auto& [file, names] : shards) {
    const auto path = dir / file;
    if (!std::filesystem::exists(path))
      return Status::errorf("{}: missing shard (model.safetensors.index.json places {} tensors "
                            "there, e.g. {})", path.string(), names.size(), names.front());
    DSV4_ASSIGN_OR_RETURN(SafetensorsFile f,
                          SafetensorsFile::open(path, static_cast<uint32_t>(impl->files.size())));
    for (const std::string& name : names)
      if (!f.find(name))
        return Status::errorf("{}: tensor {} is missing (model.safetensors.index.json places it "
                              "in this shard)", path.string(), name);
    impl->files.push_back(std::move(f));
  }
  for (uint32_t i = 0; i < impl->files.size(); ++i) {
    for (const StTensor& t : impl->files[i].tensors()) {
      auto [it, inserted] = impl->tensors.emplace(t.name, &t);
      if (!inserted)
        return Status::errorf("{}: tensor {} also appears in {}", impl->files[i].path().string(),
                              t.name, impl->files[it->second->file_index].path().string());
    }
  }
  return Checkpoint(std::move(impl));
}

}  // namespace dsv4::convert
