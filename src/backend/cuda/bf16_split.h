// The BF16 split of f32 values, for Float32 products on the BF16 tensor cores (gemm_prefill.h's
// split products). Each f32 v is hi + mid + lo exactly: hi = bf16(v), mid = bf16(v - hi),
// lo = bf16(v - hi - mid), each remainder exact in f32 (v has 24 significant bits, hi takes
// the top 8 with its sign, mid the next 8, and the last 8 fit lo whole). A product of two
// parts is exact in f32, so a split product sums chosen part products in f32:
//   3 terms: hi.hi + hi.mid + mid.hi; what is left out (mid.mid and the lo parts' products)
//            is at most ~3 * 2^-18 of each |x_i w_i|, a per-row relative error of ~5e-6;
//   6 terms: + mid.mid + hi.lo + lo.hi; what is left out is ~2^-24, below the f32 sums.
// Header-only, host and device: the CPU checks (tests/backend/test_bf16_split.cpp) run the
// same arithmetic as the kernel. docs/CUDA.md, "The fp32 products".
#pragma once

#include <cstdint>

#include "util/float_formats.h"

namespace dsv4::cuda {

struct Bf16Parts {
  uint16_t part[3];  // hi, mid, lo
};

// Round to nearest even throughout (f32_to_bf16), as the GPU's __float2bfloat16_rn.
DSV4_HOST_DEVICE inline Bf16Parts bf16_split(float v) {
  Bf16Parts p;
  p.part[0] = f32_to_bf16(v);
  const float rest = v - bf16_to_f32(p.part[0]);  // exact
  p.part[1] = f32_to_bf16(rest);
  p.part[2] = f32_to_bf16(rest - bf16_to_f32(p.part[1]));  // exact, and exactly a bf16
  return p;
}

enum class Bf16SplitSide { activations, weights };
inline constexpr int kBf16SplitMaxTerms = 6;
DSV4_HOST_DEVICE constexpr bool bf16_split_terms_valid(int terms) { return terms == 3 || terms == 6; }

// The part (0 hi, 1 mid, 2 lo) that term `t` of a split product of `terms` takes from each
// side: activations hi hi mid | mid hi lo, weights hi mid hi | mid lo hi.
DSV4_HOST_DEVICE constexpr int bf16_split_part(Bf16SplitSide side, int t) {
  constexpr int kActivations[kBf16SplitMaxTerms] = {0, 0, 1, 1, 0, 2};
  constexpr int kWeights[kBf16SplitMaxTerms] = {0, 1, 0, 1, 2, 0};
  return side == Bf16SplitSide::activations ? kActivations[t] : kWeights[t];
}

}  // namespace dsv4::cuda
