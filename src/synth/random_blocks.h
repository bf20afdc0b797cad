// Random valid quant blocks at memory speed, for benchmark models (`dsv4 synth --fill
// random-blocks`): quantising V4-Flash's 284 B weights takes hours, writing random blocks
// takes seconds.
//
// A block's bytes come from a counter-based generator keyed by (tensor key, block index),
// so they are a function of the inputs only, whatever the thread count or the pieces a
// writer asks for. Every byte is random except the block's scale fields, which are set so
// that the decoded values have the row's target standard deviation: the quants and
// sub-block scales are uniform over their ranges, so the decoded value's second moment per
// unit of the block scale is a constant of the type (random_block_unit_std), and
//   d = target * jitter / unit_std,
// with a per-block jitter 2^U(-1/2, 1/2) normalised to unit second moment (the spread the
// normal synth draws per group). Types whose blocks have a minimum (Q2_K, Q4_K, Q5_K) get
// dmin = d * E[scale] E[q] / E[min], so the decoded values have mean zero. The fp16 scales
// may be subnormal (Q6_K's quants and scales span 2^13 units); they are finite either way.
#pragma once

#include <cstdint>
#include <span>

#include "gguf/ggml_types.h"

namespace dsv4 {

// Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and MXFP4.
bool random_blocks_supported(GgmlType type);

// The standard deviation of a decoded value of a random block of `type` whose block scale
// is 1 (MXFP4: exponent byte 127), over the uniform quants and sub-block scales.
double random_block_unit_std(GgmlType type);

// Writes `row_std.size()` consecutive rows of `blocks_per_row` blocks each, starting at
// block `first_block` of the tensor keyed by `key` (a multiple of blocks_per_row), into
// `out` (row_std.size() * blocks_per_row blocks). row_std[r] is row r's target standard
// deviation. `type` must be random_blocks_supported.
void fill_random_blocks(GgmlType type, uint64_t key, uint64_t first_block, uint64_t blocks_per_row,
                        std::span<const float> row_std, uint8_t* out);

}  // namespace dsv4
