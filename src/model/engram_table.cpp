#include "model/engram_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "gguf/gguf_file.h"
#include "gguf/quant.h"
#include "model/tensor_catalog.h"
#include "util/float_formats.h"

namespace dsv4 {

std::string engram_row_encoding(uint64_t dim) { return fmt::format("e4m3_e8m0_32_row{}", engram_row_bytes(dim)); }

void encode_engram_fp8_row(const uint8_t* codes, const uint8_t* scales, uint32_t dim, uint8_t* row) {
  std::memcpy(row, codes, dim);
  std::memcpy(row + dim, scales, dim / 32);
}

void decode_engram_fp8_row(const uint8_t* row, uint32_t dim, float* out) {
  const uint8_t* scales = row + dim;
  for (uint32_t c = 0; c < dim; ++c)
    out[c] = bf16_to_f32(f32_to_bf16(e4m3_to_f32(row[c]) * e8m0_to_f32(scales[c / 32])));
}

Result<EngramTable> EngramTable::open(const gguf::GgufFile& file, const gguf::TensorInfo& info, uint32_t dim,
                                      Access access) {
  EngramTable t;
  t.name_ = fmt::format("{}: tensor {}", file.path(), info.name);
  t.type_ = info.type;
  t.dim_ = dim;
  t.access_ = access;
  if (info.ne.size() < 2 || dim == 0 || dim % 32 != 0)
    return Status::errorf("{}: shape {} for rows of {} values", t.name_, info.shape_string(), dim);
  const uint64_t want = info.type == GgmlType::I8 ? engram_row_bytes(dim) : dim;
  if (info.ne[0] != want)
    return Status::errorf("{}: rows of {} {} elements, expected {} for {} values per row", t.name_, info.ne[0],
                          ggml_type_name(info.type), want, dim);
  if (info.type != GgmlType::I8 && !type_allowed(TypeClass::Matrix, info.type))
    return Status::errorf("{}: type {} cannot hold an Engram table", t.name_, ggml_type_name(info.type));
  const auto row_bytes = ggml_row_bytes(info.type, info.ne[0]);
  if (!row_bytes) return Status::errorf("{}: row length {} does not fit type {}", t.name_, info.ne[0], ggml_type_name(info.type));
  t.row_bytes_ = *row_bytes;
  t.rows_ = info.n_rows();
  if (t.rows_ * t.row_bytes_ != info.nbytes)
    return Status::errorf("{}: {} bytes for {} rows of {}", t.name_, info.nbytes, t.rows_, t.row_bytes_);
  if (access == Access::Mapped) {
    if (!info.data) return Status::errorf("{}: the file is not mapped (open it with map_data, or use pread)", t.name_);
    t.data_ = info.data;
  } else {
    const std::string& part = file.part_paths().at(info.part);
    t.fd_ = ::open(part.c_str(), O_RDONLY | O_CLOEXEC);
    if (t.fd_ < 0) return Status::errorf("{}: cannot open {}: {}", t.name_, part, std::strerror(errno));
    t.offset_ = info.file_offset;
  }
  return t;
}

EngramTable::EngramTable(EngramTable&& o) noexcept { *this = std::move(o); }

EngramTable& EngramTable::operator=(EngramTable&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    name_ = std::move(o.name_);
    type_ = o.type_;
    rows_ = o.rows_;
    row_bytes_ = o.row_bytes_;
    dim_ = o.dim_;
    access_ = o.access_;
    data_ = o.data_;
    fd_ = std::exchange(o.fd_, -1);
    offset_ = o.offset_;
  }
  return *this;
}

EngramTable::~EngramTable() {
  if (fd_ >= 0) ::close(fd_);
}

Status EngramTable::check_ids(std::span<const uint32_t> ids) const {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] >= rows_) return Status::errorf("{}: row {} (request {}) beyond its {} rows", name_, ids[i], i, rows_);
  return Status::ok();
}

Status EngramTable::read_raw(std::span<const uint32_t> ids, std::span<uint8_t> out) const {
  if (out.size() != ids.size() * row_bytes_)
    return Status::errorf("{}: {} bytes of output for {} rows of {}", name_, out.size(), ids.size(), row_bytes_);
  DSV4_TRY(check_ids(ids));
  for (size_t i = 0; i < ids.size(); ++i) {
    uint8_t* dst = out.data() + i * row_bytes_;
    if (access_ == Access::Mapped) {
      std::memcpy(dst, data_ + uint64_t{ids[i]} * row_bytes_, row_bytes_);
      continue;
    }
    const uint64_t at = offset_ + uint64_t{ids[i]} * row_bytes_;
    for (uint64_t done = 0; done < row_bytes_;) {
      const ssize_t n = ::pread(fd_, dst + done, row_bytes_ - done, static_cast<off_t>(at + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return Status::errorf("{}: reading row {} at offset {}: {}", name_, ids[i], at,
                              n < 0 ? std::strerror(errno) : "unexpected end of file");
      done += static_cast<uint64_t>(n);
    }
  }
  return Status::ok();
}

Status EngramTable::read(std::span<const uint32_t> ids, std::span<float> out) const {
  if (out.size() != ids.size() * dim_)
    return Status::errorf("{}: {} floats of output for {} rows of {}", name_, out.size(), ids.size(), dim_);
  std::vector<uint8_t> raw(ids.size() * row_bytes_);
  DSV4_TRY(read_raw(ids, raw));
  for (size_t i = 0; i < ids.size(); ++i) {
    const uint8_t* row = raw.data() + i * row_bytes_;
    float* dst = out.data() + i * dim_;
    if (type_ == GgmlType::I8)
      decode_engram_fp8_row(row, dim_, dst);
    else
      dequantize_row(type_, row, dst, dim_);
  }
  return Status::ok();
}

void EngramTable::prefetch(std::span<const uint32_t> ids) const {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint32_t id : ids) {
    if (id >= rows_) continue;
    const uint64_t begin = uint64_t{id} * row_bytes_;
    if (access_ == Access::Mapped) {
      const uintptr_t p = reinterpret_cast<uintptr_t>(data_ + begin);
      const uintptr_t aligned = p / page * page;
      madvise(reinterpret_cast<void*>(aligned), p + row_bytes_ - aligned, MADV_WILLNEED);
    } else {
      posix_fadvise(fd_, static_cast<off_t>(offset_ + begin), static_cast<off_t>(row_bytes_), POSIX_FADV_WILLNEED);
    }
  }
}

Result<std::vector<EngramTable>> open_engram_tables(const gguf::GgufFile& file, const ModelConfig& config,
                                                    EngramTable::Access access) {
  std::vector<EngramTable> tables;
  if (!config.engram) return tables;
  for (uint32_t layer : config.engram->layers) {
    const std::string name = block_tensor_name(layer, BlockTensor::EngramEmbd);
    const gguf::TensorInfo* info = file.find_tensor(name);
    if (!info) return Status::errorf("{}: tensor {} is missing", file.path(), name);
    if (info->type == GgmlType::I8) {
      const std::string key = fmt::format("{}.engram.encoding", config.architecture());
      const std::string want = engram_row_encoding(config.engram->dim);
      if (file.find(key)) {
        DSV4_ASSIGN_OR_RETURN(std::string encoding, file.get_string(key));
        if (encoding != want)
          return Status::errorf("{}: key {} is \"{}\"; I8 Engram rows of {} values need \"{}\"", file.path(), key,
                                encoding, config.engram->dim, want);
      }
    }
    DSV4_ASSIGN_OR_RETURN(EngramTable t, EngramTable::open(file, *info, config.engram->dim, access));
    tables.push_back(std::move(t));
  }
  return tables;
}

EngramGather::EngramGather(const EngramHasher& hasher, std::span<const EngramTable> tables)
    : hasher_(hasher), tables_(tables), layer_ids_(tables.size()), rows_(tables.size()) {}

EngramGather::~EngramGather() {
  if (pending_.valid()) pending_.wait();
}

Status EngramGather::start(EngramHasher::History& history, std::span<const int32_t> tokens,
                           std::span<const uint8_t> live) {
  if (pending_.valid()) return Status::error("engram gather: start() before the previous step was waited");
  if (tables_.size() != hasher_.n_layers())
    return Status::errorf("engram gather: {} tables for {} Engram layers", tables_.size(), hasher_.n_layers());
  n_tokens_ = tokens.size();
  ids_.assign(n_tokens_ * hasher_.rows_per_token(), 0);
  DSV4_TRY(hasher_.hash(history, tokens, live, ids_));
  const uint32_t cols = hasher_.columns();
  for (size_t l = 0; l < tables_.size(); ++l) {
    auto& ids = layer_ids_[l];
    ids.resize(n_tokens_ * cols);
    for (size_t t = 0; t < n_tokens_; ++t)
      std::memcpy(ids.data() + t * cols, ids_.data() + (t * tables_.size() + l) * cols, cols * sizeof(uint32_t));
    rows_[l].resize(ids.size() * tables_[l].dim());
  }
  pending_ = std::async(std::launch::async, [this] { return read_all(); });
  return Status::ok();
}

Status EngramGather::read_all() {
  for (size_t l = 0; l < tables_.size(); ++l) DSV4_TRY(tables_[l].read(layer_ids_[l], rows_[l]));
  return Status::ok();
}

Status EngramGather::wait() {
  if (!pending_.valid()) return Status::error("engram gather: wait() without start()");
  return pending_.get();
}

std::span<const float> EngramGather::rows(size_t engram_layer) const { return rows_.at(engram_layer); }

}  // namespace dsv4
