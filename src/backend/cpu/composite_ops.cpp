// The Backend operations that are compositions of others (backend.h): their defaults, the
// separate calls, which every backend inherits and a device backend may replace by one
// kernel with the same results. Built with the CPU backend (the module every backend links).
#include <vector>

#include "backend/backend.h"

namespace dsv4::backend {

Status check_row_finish(const char* op, const Tensor& x, const RowFinish& f) {
  if (f.group <= 0 || x.cols() % f.group != 0)
    return Status::errorf("{}: group {} does not divide x {}", op, f.group, x.describe());
  if (f.rope && (f.rope->dims <= 0 || f.rope->dims % 2 || f.rope->dims > f.group))
    return Status::errorf("{}: RoPE of {} dims in groups of {}", op, f.rope ? f.rope->dims : 0, f.group);
  if (f.hadamard && (f.group & (f.group - 1)))
    return Status::errorf("{}: a Hadamard rotation of {} values (a power of two is needed)", op, f.group);
  switch (f.round) {
    case QatRounding::None: break;
    case QatRounding::Fp8:
      if (x.cols() != f.group || f.round_block <= 0 || f.round_cols < 0 || f.round_cols > f.group ||
          f.round_cols % f.round_block)
        return Status::errorf("{}: FP8 rounding of columns [0, {}) in blocks of {} for x {} in groups of {}", op,
                              f.round_cols, f.round_block, x.describe(), f.group);
      break;
    case QatRounding::Fp4:
      if (f.round_block <= 0 || f.group % f.round_block)
        return Status::errorf("{}: FP4 rounding in blocks of {} for groups of {}", op, f.round_block, f.group);
      break;
  }
  return Status::ok();
}

Status Backend::finish_rows(const Tensor& x, const Tensor& positions, const RowFinish& f) {
  DSV4_TRY(check_row_finish("finish_rows", x, f));
  if (f.norm) DSV4_TRY(rms_norm(x, f.norm_weight, f.eps, f.group, x));
  if (f.rope) DSV4_TRY(rope(x, f.group, positions, *f.rope, false));
  if (f.hadamard) DSV4_TRY(hadamard(x, f.group));
  if (f.round == QatRounding::Fp8) DSV4_TRY(round_fp8_blocks(x, f.round_cols, f.round_block));
  if (f.round == QatRounding::Fp4) DSV4_TRY(round_fp4_blocks(x, f.round_block));
  return Status::ok();
}

Status Backend::compress_entries(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                                 const StepRows& rows, const SlotRows& state_kv, const SlotRows& state_score,
                                 const RowFinish& finish, const PagedRows& dst) {
  const int64_t n = rows.n, width = dst.pool.cols();
  // One pooled row per step row; only the rows that close a block are written (and
  // stored), the others stay zero and are never read.
  DSV4_ASSIGN_OR_RETURN(const Tensor pooled, scratch(GgmlType::F32, std::vector<int64_t>{n, width}));
  DSV4_TRY(fill(pooled, 0.0f));
  DSV4_TRY(compress(kv, score, ape, ratio, overlap, rows, state_kv, state_score, pooled));
  DSV4_ASSIGN_OR_RETURN(const Tensor first_pos, scratch(GgmlType::I32, std::vector<int64_t>{n}));
  DSV4_TRY(block_positions(rows, ratio, first_pos));
  DSV4_TRY(finish_rows(pooled, first_pos, finish));
  return store_entries(pooled, ratio, rows, dst);
}

}  // namespace dsv4::backend
