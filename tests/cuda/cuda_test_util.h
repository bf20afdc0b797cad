// Helpers for the GPU checks: device buffers, random valid quantised blocks, references.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/quant.h"
#include "util/float_formats.h"

namespace dsv4::cuda::test {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)
#define ASSERT_OK(expr)                           \
  do {                                            \
    const ::dsv4::Status s_ = (expr);             \
    ASSERT_TRUE(s_.is_ok()) << s_.message();      \
  } while (0)

// cudaMalloc'd bytes, rounded up to 16 (the kernels' readable-padding rule) and freed on exit.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&p_, (bytes + 15) / 16 * 16 + 16) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  template <class T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
  template <class T>
  static DeviceBuffer from(const std::vector<T>& v) {
    DeviceBuffer b(v.size() * sizeof(T));
    cudaMemcpy(b.p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    return b;
  }
  template <class T>
  std::vector<T> to_host(size_t count) const {
    std::vector<T> v(count);
    cudaMemcpy(v.data(), p_, count * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  // Every byte 0xFF: a NaN in f32, so an element a kernel leaves unwritten fails the check.
  void poison() const { cudaMemset(p_, 0xFF, bytes_); }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

inline size_t row_bytes(GgmlType type, int64_t k) { return *ggml_row_bytes(type, static_cast<uint64_t>(k)); }

// Random bytes with every scale field set to a sane value: valid blocks of any content.
inline std::vector<uint8_t> random_weights(GgmlType type, int64_t rows, int64_t k, std::mt19937_64& rng) {
  const size_t bytes = row_bytes(type, k) * static_cast<size_t>(rows);
  std::vector<uint8_t> w(bytes);
  if (type == GgmlType::BF16 || type == GgmlType::F16 || type == GgmlType::F32) {
    std::normal_distribution<float> normal(0.0f, 0.05f);
    const size_t width = type == GgmlType::F32 ? 4 : 2;
    for (size_t i = 0; i < bytes / width; ++i) {
      const float v = normal(rng);
      const uint16_t h = type == GgmlType::BF16 ? f32_to_bf16(v) : f32_to_fp16(v);
      if (type == GgmlType::F32) std::memcpy(&w[4 * i], &v, 4);
      else std::memcpy(&w[2 * i], &h, 2);
    }
    return w;
  }
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(0.5f, 1.5f);
  const auto& t = ggml_traits(type);
  auto put_half = [&](size_t at, float v) {
    const uint16_t h = f32_to_fp16(v);
    std::memcpy(&w[at], &h, 2);
  };
  for (size_t blk = 0; blk < bytes / t.block_bytes; ++blk) {
    const size_t at = blk * t.block_bytes;
    switch (type) {
      case GgmlType::Q8_0: put_half(at, scale(rng) * 0.01f); break;
      case GgmlType::Q2_K: put_half(at + 80, scale(rng) * 0.01f); put_half(at + 82, scale(rng) * 0.01f); break;
      case GgmlType::Q3_K: put_half(at + 108, scale(rng) * 0.01f); break;
      // The types with a minimum get one that centres the block on zero, as a quantiser's min(w)
      // does for real weights: with positive minimums every weight shared one sign, products
      // cancelled, and a row's error relative to its small result measured the data, not the
      // kernel (the H200's Q5_1 and Q4_K/Q5_K failures of 2026-12-02, MoeTest's Q4_1/Q5_1).
      // K-quants: the 6-bit scales and mins have the same mean, so dmin = d * mean(q).
      case GgmlType::Q4_K: put_half(at, scale(rng) * 0.01f); put_half(at + 2, scale(rng) * 0.075f); break;
      case GgmlType::Q5_K: put_half(at, scale(rng) * 0.005f); put_half(at + 2, scale(rng) * 0.0775f); break;
      case GgmlType::Q6_K: put_half(at + 208, scale(rng) * 0.001f); break;
      case GgmlType::IQ2_XXS: put_half(at, scale(rng) * 0.01f); break;
      case GgmlType::MXFP4: w[at] = static_cast<uint8_t>(118 + rng() % 8); break;
      case GgmlType::Q4_1:
      case GgmlType::Q5_1: {  // w = d * q + m, q in [0, 15] or [0, 31]: m = -d * mean(q)
        const float d = scale(rng) * 0.01f;
        put_half(at, d);
        put_half(at + 2, -d * (type == GgmlType::Q4_1 ? 7.5f : 15.5f) * scale(rng));
        break;
      }
      case GgmlType::Q4_0:
      case GgmlType::Q5_0:
      case GgmlType::IQ4_NL:
      case GgmlType::IQ4_XS:
      case GgmlType::IQ2_XS:
      case GgmlType::IQ2_S:
      case GgmlType::IQ3_XXS:
      case GgmlType::IQ3_S:
      case GgmlType::IQ1_S: put_half(at, scale(rng) * 0.01f); break;
      case GgmlType::IQ1_M: {  // the fp16 scale lives in the top nibbles of the four scale words
        const uint16_t h = f32_to_fp16(scale(rng) * 0.01f);
        for (int word = 0; word < 4; ++word) {
          uint8_t& top = w[at + 48 + 2 * word + 1];
          top = static_cast<uint8_t>((top & 0x0F) | (((h >> (4 * word)) & 0xF) << 4));
        }
        break;
      }
      default: break;
    }
  }
  return w;
}

// `batch` random n x k matrices of `type`, `stride` bytes apart (stride >= a matrix: the pad
// puts later matrices off 16-byte boundaries), drawn in order by random_weights.
inline std::vector<uint8_t> random_weight_batch(GgmlType type, int64_t n, int64_t k, int64_t batch, size_t stride,
                                                std::mt19937_64& rng) {
  std::vector<uint8_t> w(stride * static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const auto m = random_weights(type, n, k, rng);
    std::memcpy(&w[static_cast<size_t>(b) * stride], m.data(), m.size());
  }
  return w;
}

inline std::vector<float> dequantize(GgmlType type, const uint8_t* rows, int64_t n, int64_t k) {
  std::vector<float> out(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) dequantize_row(type, rows + r * row_bytes(type, k), &out[r * k], k);
  return out;
}

// The activations exactly as the kernels round them (src/backend/cuda/q8_block.cuh:
// d = max|x|/127, q = round-half-even(x * (127/max|x|))), dequantised: the reference the
// integer kernels should hit to f32 rounding.
inline std::vector<float> q8_round_trip(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0.0f;
    for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b + i]));
    const float d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (size_t i = 0; i < 32; ++i) {
      volatile float scaled = x[b + i] * inv;  // one f32 product, as on the device
      out[b + i] = static_cast<float>(std::nearbyint(scaled)) * d;
    }
  }
  return out;
}

// ||got - want|| / ||want||; infinite when any element of got is not finite.
inline double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

inline std::string type_name(GgmlType t) { return std::string(ggml_type_name(t)); }

}  // namespace dsv4::cuda::test
