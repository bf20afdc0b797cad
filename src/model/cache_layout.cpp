#include "model/cache_layout.h"

namespace dsv4 {
namespace {

constexpr uint64_t kBf16Bytes = 2;
constexpr uint64_t kFp32Bytes = 4;
constexpr uint64_t kScaleBytes = 1;      // ue8m0
constexpr uint64_t kKvFp8Block = 64;     // e4m3 values per scale (spec §3.7)
constexpr uint64_t kIndexFp4Block = 32;  // e2m1 values per scale
constexpr uint64_t kEntryAlign = 8;

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

std::string_view cache_format_name(CacheFormat format) {
  switch (format) {
    case CacheFormat::F32: return "fp32";
    case CacheFormat::ReferenceBf16: return "reference bf16";
    case CacheFormat::Packed: return "packed fp8/fp4";
  }
  return "?";
}

uint64_t kv_entry_bytes(const ModelConfig& c, CacheFormat format) {
  switch (format) {
    case CacheFormat::F32: return uint64_t{c.head_dim} * kFp32Bytes;
    case CacheFormat::ReferenceBf16: return uint64_t{c.head_dim} * kBf16Bytes;
    case CacheFormat::Packed: break;
  }
  const uint64_t nope = c.nope_dims();
  const uint64_t raw = nope + uint64_t{c.rope_dims()} * kBf16Bytes + nope / kKvFp8Block * kScaleBytes;
  return round_up(raw, kEntryAlign);
}

uint64_t index_key_bytes(const ModelConfig& c, CacheFormat format) {
  const uint64_t d = c.index_head_dim;
  switch (format) {
    case CacheFormat::F32: return d * kFp32Bytes;
    case CacheFormat::ReferenceBf16: return d * kBf16Bytes;
    case CacheFormat::Packed: break;
  }
  return d / 2 + d / kIndexFp4Block * kScaleBytes;
}

uint64_t compressor_state_bytes(uint32_t ratio, uint32_t width, uint32_t overlap) {
  const uint64_t rows = uint64_t{overlap} * ratio, cols = uint64_t{overlap} * width;
  return 2 * rows * cols * kFp32Bytes;  // kv + score
}

uint64_t CacheLayout::fixed_bytes() const {
  uint64_t n = 0;
  for (const auto& b : blocks) n += b.fixed_bytes();
  return n;
}

double CacheLayout::bytes_per_token() const {
  double n = 0;
  for (const auto& b : blocks) n += b.bytes_per_token();
  return n;
}

uint64_t CacheLayout::bytes_at(uint64_t n_tokens) const { return totals_at(n_tokens).total(); }

CacheTotals CacheLayout::totals_at(uint64_t n_tokens, uint64_t page_rows) const {
  CacheTotals t;
  for (const auto& b : blocks) {
    t.windows += b.window_bytes;
    t.compressor_states += b.compressor_state_bytes + b.indexer_state_bytes;
    const uint64_t rows = round_up(b.entries(n_tokens), page_rows ? page_rows : 1);
    if (b.kv_source_layer >= 0) {  // V4.1: only the KV source itself holds entries
      t.shared_entries += rows * b.entry_bytes;
      t.index_keys += rows * b.index_key_bytes;
    } else if (b.kind == AttentionKind::CSA) {
      t.csa_entries += rows * b.entry_bytes;
      t.index_keys += rows * b.index_key_bytes;
    } else if (b.kind == AttentionKind::HCA) {
      t.hca_entries += rows * b.entry_bytes;
    }
  }
  return t;
}

uint64_t v41_window_entry_bytes(const ModelConfig& c, CacheFormat format) {
  if (format != CacheFormat::Packed) return kv_entry_bytes(c, format);
  return uint64_t{c.head_dim} + c.head_dim / 32 * kScaleBytes;  // e4m3 + ue8m0 per 32
}

uint64_t v41_compressed_entry_bytes(const ModelConfig& c, CacheFormat format) {
  if (format != CacheFormat::Packed) return kv_entry_bytes(c, format);
  return uint64_t{c.head_dim} / 2 + c.head_dim / 16;  // e2m1 nibbles + one e4m3 per 16
}

namespace {

CacheLayout plan_cache_layout_v41(const ModelConfig& c, CacheFormat format) {
  CacheLayout layout;
  layout.format = format;
  const uint64_t window_entry = v41_window_entry_bytes(c, format);
  for (uint32_t b = 0; b < c.n_blocks(); ++b) {
    BlockCache bc;
    bc.block = b;
    bc.kind = c.attention_kind(b);
    bc.ratio = c.ratio(b);
    bc.window_slots = c.sliding_window;
    bc.window_bytes = uint64_t{c.sliding_window} * window_entry;
    const LayerRoles roles = c.layer_roles(b);
    bc.kv_source_layer = roles.kv_source_layer;
    if (roles.kv_source) {
      bc.entry_bytes = v41_compressed_entry_bytes(c, format);
      bc.index_key_bytes = index_key_bytes(c, format);
      // The open group of a pooled (ratio > 1) compressor; ratio 1 keeps nothing pending.
      bc.compressor_state_bytes = bc.ratio > 1 ? compressor_state_bytes(bc.ratio, c.head_dim, 1) : 0;
    }
    layout.blocks.push_back(bc);
  }
  return layout;
}

}  // namespace

CacheLayout plan_cache_layout(const ModelConfig& c, CacheFormat format) {
  if (c.is_v41()) return plan_cache_layout_v41(c, format);
  CacheLayout layout;
  layout.format = format;
  const uint64_t entry = kv_entry_bytes(c, format);
  for (uint32_t b = 0; b < c.n_blocks(); ++b) {
    BlockCache bc;
    bc.block = b;
    bc.kind = c.attention_kind(b);
    bc.ratio = c.ratio(b);
    bc.window_slots = c.sliding_window;
    bc.window_bytes = uint64_t{c.sliding_window} * entry;
    if (bc.ratio != 0) {
      const uint32_t overlap = c.compressor_overlap(b);
      bc.entry_bytes = entry;
      bc.compressor_state_bytes = compressor_state_bytes(bc.ratio, c.head_dim, overlap);
      if (bc.kind == AttentionKind::CSA) {
        bc.index_key_bytes = index_key_bytes(c, format);
        bc.indexer_state_bytes = compressor_state_bytes(bc.ratio, c.index_head_dim, overlap);
      }
    }
    layout.blocks.push_back(bc);
  }
  return layout;
}

}  // namespace dsv4
