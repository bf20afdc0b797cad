#include "util/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace dsv4 {

Result<MappedFile> MappedFile::open(const std::string& path, bool map) {
  MappedFile f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0) return Status::errorf(StatusCode::kIo, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(f.fd_, &st) != 0) return Status::errorf(StatusCode::kIo, "{}: cannot stat: {}", path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return Status::errorf("{}: not a regular file", path);
  f.size_ = static_cast<uint64_t>(st.st_size);
  if (map && f.size_ > 0) {
    void* p = ::mmap(nullptr, f.size_, PROT_READ, MAP_SHARED, f.fd_, 0);
    if (p == MAP_FAILED)
      return Status::errorf(StatusCode::kIo, "{}: cannot map {} bytes: {}", path, f.size_, std::strerror(errno));
    f.data_ = static_cast<const uint8_t*>(p);
    f.owns_mapping_ = true;
  }
  return f;
}

MappedFile MappedFile::from_bytes(std::string name, std::span<const uint8_t> bytes) {
  MappedFile f;
  f.path_ = std::move(name);
  f.memory_.assign(bytes.begin(), bytes.end());
  f.size_ = f.memory_.size();
  f.data_ = f.memory_.empty() ? nullptr : f.memory_.data();
  return f;
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this == &other) return *this;
  release();
  path_ = std::move(other.path_);
  size_ = std::exchange(other.size_, 0);
  fd_ = std::exchange(other.fd_, -1);
  owns_mapping_ = std::exchange(other.owns_mapping_, false);
  // A vector's buffer survives the move, so data_ keeps pointing at the same bytes.
  memory_ = std::move(other.memory_);
  data_ = std::exchange(other.data_, nullptr);
  return *this;
}

MappedFile::~MappedFile() { release(); }

void MappedFile::release() {
  if (owns_mapping_ && data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  fd_ = -1;
  owns_mapping_ = false;
  size_ = 0;
  memory_.clear();
}

Status MappedFile::read_at(uint64_t offset, void* out, size_t n) const {
  if (offset > size_ || n > size_ - offset)
    return Status::errorf("{}: read of {} bytes at offset {} runs past the end ({} bytes)", path_, n,
                          offset, size_);
  if (n == 0) return Status::ok();
  if (data_) {
    std::memcpy(out, data_ + offset, n);
    return Status::ok();
  }
  auto* dst = static_cast<uint8_t*>(out);
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, dst + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      return Status::errorf(StatusCode::kIo, "{}: read at offset {} failed: {}", path_, offset + done, std::strerror(errno));
    if (got == 0)
      return Status::errorf(StatusCode::kIo, "{}: file shrank while reading (offset {})", path_, offset + done);
    done += static_cast<size_t>(got);
  }
  return Status::ok();
}

}  // namespace dsv4
