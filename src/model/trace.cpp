#include "model/trace.h"

namespace dsv4 {

int64_t TracedTensor::rows() const {
  const size_t n = type == GgmlType::I32 ? i32.size() : f32.size();
  return cols ? static_cast<int64_t>(n) / cols : 0;
}

Status ForwardTrace::record(const std::string& name, const backend::Tensor& t, int32_t index_offset) {
  if (t.rank != 2 || (t.type != GgmlType::F32 && t.type != GgmlType::I32))
    return Status::errorf("trace {}: {} is not an F32 or I32 matrix", name, t.describe());
  auto [it, fresh] = tensors_.try_emplace(name);
  TracedTensor& dst = it->second;
  if (fresh) {
    dst.type = t.type;
    dst.cols = t.cols();
  } else if (dst.type != t.type || dst.cols != t.cols()) {
    return Status::errorf("trace {}: {} does not extend the earlier rows ({} columns of {})", name,
                          t.describe(), dst.cols, ggml_type_name(dst.type));
  }
  if (t.rows() == 0) return Status::ok();

  // Downloads need contiguous rows; views (columns of a wider tensor) are copied first.
  backend::Backend& be = *t.backend;
  backend::Tensor src = t;
  if (!t.contiguous()) {
    DSV4_ASSIGN_OR_RETURN(src, be.alloc(t.type, std::vector<int64_t>{t.rows(), t.cols()}));
    DSV4_TRY(be.copy_rows(t, src));
  }
  const size_t n = static_cast<size_t>(t.rows() * t.cols());
  if (t.type == GgmlType::F32) {
    const size_t at = dst.f32.size();
    dst.f32.resize(at + n);
    return be.download(src, dst.f32.data() + at, n * sizeof(float));
  }
  const size_t at = dst.i32.size();
  dst.i32.resize(at + n);
  DSV4_TRY(be.download(src, dst.i32.data() + at, n * sizeof(int32_t)));
  for (size_t i = at; i < at + n; ++i)
    if (dst.i32[i] >= 0) dst.i32[i] -= index_offset;
  return Status::ok();
}

const TracedTensor* ForwardTrace::find(const std::string& name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

}  // namespace dsv4
