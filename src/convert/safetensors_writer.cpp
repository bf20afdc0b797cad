#include "convert/safetensors_writer.h"

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

namespace dsv4::convert {

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, std::map<std::string, std::string> metadata)
    : path_(std::move(path)), temp_path_(path_.string() + ".tmp"), metadata_(std::move(metadata)) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_) std::fclose(file_);
  if (!finished_) {
    std::error_code ec;
    std::filesystem::remove(temp_path_, ec);
  }
}

void SafetensorsWriter::add_tensor(std::string name, StDtype dtype, std::vector<uint64_t> shape) {
  uint64_t n = st_dtype_size(dtype);
  for (uint64_t d : shape) n *= d;
  entries_.push_back({std::move(name), dtype, std::move(shape), n});
  data_bytes_ += n;
}

Status SafetensorsWriter::begin() {
  nlohmann::ordered_json header;
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const Entry& e : entries_) {
    header[e.name] = {{"dtype", st_dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.nbytes}}};
    offset += e.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  file_ = std::fopen(temp_path_.c_str(), "wb");
  if (!file_) return Status::errorf("{}: cannot create: {}", temp_path_.string(), std::strerror(errno));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, file_) != 8 || std::fwrite(text.data(), 1, text.size(), file_) != text.size())
    return Status::errorf("{}: write failed: {}", temp_path_.string(), std::strerror(errno));
  return Status::ok();
}

Status SafetensorsWriter::write(std::span<const uint8_t> bytes) {
  if (!file_) return Status::errorf("{}: write() before begin()", path_.string());
  if (written_ + bytes.size() > data_bytes_)
    return Status::errorf("{}: {} bytes written, more than the {} the tensors hold", path_.string(),
                          written_ + bytes.size(), data_bytes_);
  if (std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size())
    return Status::errorf("{}: write failed: {}", temp_path_.string(), std::strerror(errno));
  written_ += bytes.size();
  return Status::ok();
}

Status SafetensorsWriter::finish() {
  if (!file_) return Status::errorf("{}: finish() before begin()", path_.string());
  if (written_ != data_bytes_)
    return Status::errorf("{}: {} bytes of tensor data written, the tensors hold {}", path_.string(), written_,
                          data_bytes_);
  const int rc = std::fclose(file_);
  file_ = nullptr;
  if (rc != 0) return Status::errorf("{}: close failed: {}", temp_path_.string(), std::strerror(errno));
  std::error_code ec;
  std::filesystem::rename(temp_path_, path_, ec);
  if (ec) return Status::errorf("{}: cannot rename to {}: {}", temp_path_.string(), path_.string(), ec.message());
  finished_ = true;
  return Status::ok();
}

}  // namespace dsv4::convert
