// Tensor views: shape and stride arithmetic shared by every backend.
#include <fmt/format.h>

#include "backend/backend.h"

namespace dsv4::backend {

int64_t Tensor::n_elements() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

int64_t Tensor::rows() const {
  int64_t n = 1;
  for (int i = 0; i + 1 < rank; ++i) n *= shape[i];
  return n;
}

bool Tensor::contiguous() const {
  if (rank == 0) return true;
  const auto row_bytes = ggml_row_bytes(type, static_cast<uint64_t>(shape[rank - 1]));
  if (!row_bytes) return false;
  int64_t expected = static_cast<int64_t>(*row_bytes);
  for (int i = rank - 2; i >= 0; --i) {
    if (stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string Tensor::describe() const {
  std::string s = fmt::format("{} [", ggml_type_name(type));
  for (int i = 0; i < rank; ++i) s += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return s + "]";
}

Tensor Tensor::slice(int64_t begin, int64_t count) const {
  Tensor t = *this;
  t.shape[0] = count;
  t.data = static_cast<uint8_t*>(data) + begin * stride[0];
  return t;
}

Tensor Tensor::at(int64_t index) const {
  Tensor t = *this;
  t.data = static_cast<uint8_t*>(data) + index * stride[0];
  for (int i = 0; i + 1 < rank; ++i) {
    t.shape[i] = shape[i + 1];
    t.stride[i] = stride[i + 1];
  }
  t.shape[rank - 1] = 0;
  t.stride[rank - 1] = 0;
  t.rank = rank - 1;
  return t;
}

Tensor Tensor::as_matrix(int64_t n_rows, int64_t n_cols) const {
  Tensor t = *this;
  const int64_t row_bytes = static_cast<int64_t>(ggml_row_bytes(type, n_cols).value_or(0));
  t.rank = 2;
  t.shape = {n_rows, n_cols, 0, 0};
  t.stride = {row_bytes, static_cast<int64_t>(ggml_traits(type).block_bytes), 0, 0};
  return t;
}

Tensor Tensor::columns(int64_t begin, int64_t count) const {
  Tensor t = *this;
  t.shape[rank - 1] = count;
  t.data = static_cast<uint8_t*>(data) + begin * stride[rank - 1];
  return t;
}

Tensor Tensor::view(int64_t element_offset, int64_t n_rows, int64_t n_cols,
                    int64_t row_stride_elements) const {
  const int64_t elem = static_cast<int64_t>(ggml_traits(type).block_bytes);
  Tensor t = *this;
  t.rank = 2;
  t.shape = {n_rows, n_cols, 0, 0};
  t.stride = {row_stride_elements * elem, elem, 0, 0};
  t.data = static_cast<uint8_t*>(data) + element_offset * elem;
  return t;
}

Tensor make_descriptor(GgmlType type, std::span<const int64_t> shape) {
  Tensor t;
  t.type = type;
  t.rank = static_cast<int>(shape.size());
  for (int i = 0; i < t.rank; ++i) t.shape[i] = shape[i];
  if (t.rank == 0) return t;
  int64_t bytes = static_cast<int64_t>(ggml_row_bytes(type, shape[t.rank - 1]).value_or(0));
  for (int i = t.rank - 2; i >= 0; --i) {
    t.stride[i] = bytes;
    bytes *= shape[i];
  }
  t.stride[t.rank - 1] = static_cast<int64_t>(ggml_traits(type).block_bytes);
  return t;
}

}  // namespace dsv4::backend
