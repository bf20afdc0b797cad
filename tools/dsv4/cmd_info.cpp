// dsv4 info: what a model file (or a preset, or the built-in model) is, without loading
// it: the config, tensor counts and bytes by type and by role, the catalog check, and the
// memory plan (weights, and the per-sequence cache of spec §6 in both layouts).
// Only the GGUF header is read (map_data = false), so it is instant on a 150 GB split file.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend_choice.h"
#include "commands.h"
#include "gguf/gguf_file.h"
#include "synth/builtin_model.h"
#include "model/cache_layout.h"
#include "model/config.h"
#include "model/device_plan.h"
#include "model/layer_plan.h"
#include "model/kv_graft.h"
#include "model/model_files.h"
#include "model/partition.h"
#include "synth/presets.h"
#include "synth/synth.h"
#include "model/tensor_catalog.h"
#ifdef DSV4_HAVE_CUDA
#include "backend/cuda/device_info.h"
#endif

namespace dsv4::cli {
namespace {

struct InfoOptions {
  std::string file;
  std::string mtp;
  std::string preset;
  uint64_t ctx = 0;  // 0: the model's training context
  uint32_t layers = 0;
  std::string expert_type;
  std::string dense_type;
  std::string kv_graft;  // --kv-graft FILE: describe a bank instead
  std::string model;     // -m: with --kv-graft, the model it must fit
  uint32_t gpus = 0;              // 0: no partition plan
  double gpu_memory_gib = 139;    // usable per GPU (an H200's 141 GB less the driver's share)
  double gpu_reserve_gib = 4;     // per GPU: activations, workspace, graphs
  uint32_t sequences = 1;
  std::string dense_parallel = "auto";
  std::string backend = "cpu";   // cuda: print the device memory plan (model/device_plan.h)
  std::string device_memory;     // with --backend cuda: the capacity to check against
};

std::string with_commas(uint64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string bytes_both(uint64_t bytes) {
  return fmt::format("{} ({} B)", human_bytes(static_cast<double>(bytes)), with_commas(bytes));
}

// One tensor as counted by `info`: from a file's header or from what synth would write.
struct TensorEntry {
  std::string name;
  GgmlType type;
  uint64_t nbytes;
  std::optional<TensorRole> role;  // nullopt: not in the catalog
};

char kind_letter(AttentionKind k) {
  return k == AttentionKind::Window ? 'W' : (k == AttentionKind::CSA ? 'C' : 'H');
}

// ---- V4.1: the layer schedule with sources, Engram and DSpark ----
std::string v41_role_text(const ModelConfig& c, uint32_t b) {
  const LayerRoles r = c.layer_roles(b);
  if (c.is_mtp(b)) return "DSpark stage (window only)";
  if (c.ratio(b) == 0) return "window only";
  std::string role = r.kv_source ? (r.index_source ? "KV + index source" : "KV source")
                                 : (r.index_source ? "index source" : "consumer");
  if (r.candidate_source) role += ", candidate source";
  if (r.uses_candidates) role += ", uses candidates";
  return role;
}

void print_config_v41(const ModelConfig& c) {
  fmt::print("  V4.1 schedule       layer  ratio  role                                    KV cache  selection  engram\n");
  for (uint32_t b = 0; b < c.n_blocks(); ++b) {
    const LayerRoles r = c.layer_roles(b);
    auto layer_text = [](int32_t l) { return l < 0 ? std::string("-") : std::to_string(l); };
    const std::string name = c.is_mtp(b) ? fmt::format("mtp.{}", b - c.n_layers) : std::to_string(b);
    fmt::print("                      {:>5}  {:>5}  {:<38}  {:>8}  {:>9}  {}\n", name, c.ratio(b), v41_role_text(c, b),
               layer_text(r.kv_source_layer), layer_text(r.index_source_layer), c.is_engram_layer(b) ? "yes" : "");
  }
  fmt::print("  sources             KV [{}], index [{}]\n", fmt::join(c.kv_source_layers, ", "),
             fmt::join(c.index_source_layers, ", "));
  if (c.candidate)
    fmt::print("  candidate blocks    source layer {}, top {} blocks of {} entries\n", c.candidate->source_layer,
               c.candidate->topk_blocks, c.candidate->block_size);
  if (c.engram) {
    const EngramConfig& e = *c.engram;
    fmt::print("  engram              layers [{}], n-grams 2-{} x {} heads = {} rows of {} per token and layer; "
               "table rows [{}]; hash vocabulary {}, compressed vocabulary {}, pad token {}\n",
               fmt::join(e.layers, ", "), e.ngram, e.heads, e.columns(), e.dim, fmt::join(e.table_rows, ", "),
               with_commas(e.hash_vocab_size), with_commas(e.compressed_vocab_size), e.pad_token_id);
  }
  if (c.dspark)
    fmt::print("  DSpark              {} stages, blocks of {}, {} experts top-{}, Markov rank {}, noise token {}, "
               "targets [{}]\n", c.n_mtp, c.dspark->block_size, c.dspark->n_experts, c.dspark->n_experts_used,
               c.dspark->markov_rank, c.dspark->noise_token_id, fmt::join(c.dspark->target_layers, ", "));
  if (c.vision)
    fmt::print("  vision              image token {}; tower {} (image input is refused)\n", c.vision->image_token_id,
               c.vision->in_file ? fmt::format("in the file ({} layers x {})", c.vision->n_layers, c.vision->hidden)
                                 : std::string("not in the file"));
}

void print_config(const ModelConfig& c) {
  uint32_t n_window = 0, n_csa = 0, n_hca = 0;
  std::map<uint32_t, uint32_t> hca_ratios;
  std::string schedule;
  for (uint32_t b = 0; b < c.n_layers; ++b) {
    const AttentionKind k = c.attention_kind(b);
    n_window += k == AttentionKind::Window;
    n_csa += k == AttentionKind::CSA;
    if (k == AttentionKind::HCA) {
      ++n_hca;
      ++hca_ratios[c.ratio(b)];
    }
    schedule += kind_letter(k);
  }
  std::string hca_text;
  for (auto [ratio, n] : hca_ratios)
    hca_text += hca_ratios.size() == 1
                    ? fmt::format("ratio {}", ratio)
                    : fmt::format("{}{} at ratio {}", hca_text.empty() ? "" : ", ", n, ratio);
  std::string mtp_schedule;
  for (uint32_t b = c.n_layers; b < c.n_blocks(); ++b) mtp_schedule += kind_letter(c.attention_kind(b));

  fmt::print("config:\n");
  fmt::print("  vocabulary          {} tokens\n", with_commas(c.vocab_size));
  fmt::print("  trunk               hidden {}, {} layer{} + {} MTP block{}, training context {}\n",
             c.hidden, c.n_layers, c.n_layers == 1 ? "" : "s", c.n_mtp, c.n_mtp == 1 ? "" : "s",
             with_commas(c.context_length));
  fmt::print("  attention           {} heads x {} (rope {}), q rank {}, output {} groups x rank {}, "
             "window {}\n", c.n_heads, c.head_dim, c.rope.dims, c.q_lora_rank, c.o_groups,
             c.o_lora_rank, c.sliding_window);
  if (c.is_v41()) {
    print_config_v41(c);
  } else {
    fmt::print("  layer kinds         {} window, {} CSA (ratio 4), {} HCA{}{}\n", n_window, n_csa, n_hca,
               hca_text.empty() ? "" : " (", hca_text.empty() ? "" : hca_text + ")");
    fmt::print("  schedule            {}{}{}  (W window, C CSA, H HCA)\n", schedule,
               mtp_schedule.empty() ? "" : " | MTP ", mtp_schedule);
  }
  if (n_csa > 0 || !c.index_source_layers.empty())
    fmt::print("  indexer             {} heads x {}, top-k {}\n", c.index_heads, c.index_head_dim,
               c.index_topk);
  fmt::print("  MoE                 {} experts, top-{} + {} shared, width {}, {} hash-routed "
             "layer{}, routed scale {}, renormalised {}\n", c.n_experts, c.n_experts_used,
             c.n_shared_experts, c.expert_ffn, c.n_hash_layers, c.n_hash_layers == 1 ? "" : "s",
             c.routed_scale, c.norm_topk ? "yes" : "no");
  const bool uniform_limit =
      std::all_of(c.swiglu_limit.begin(), c.swiglu_limit.end(),
                  [&](float x) { return x == c.swiglu_limit.front(); }) &&
      c.swiglu_limit == c.swiglu_limit_shared;
  if (uniform_limit)
    fmt::print("  SwiGLU clamp        {} (routed and shared)\n", c.swiglu_limit.front());
  else
    fmt::print("  SwiGLU clamp        routed [{}], shared [{}]\n", fmt::join(c.swiglu_limit, ", "),
               fmt::join(c.swiglu_limit_shared, ", "));
  fmt::print("  hyper-connections   {} streams, {} Sinkhorn iterations, eps {}\n", c.hc_mult,
             c.hc_sinkhorn_iters, c.hc_eps);
  fmt::print("  rope                base {} (window layers, MTP); base {} with YaRN x{} over {} "
             "(beta {}/{}) in compressed layers\n", c.rope.freq_base, c.rope.compress_freq_base,
             c.rope.yarn_factor, with_commas(c.rope.yarn_original_context), c.rope.yarn_beta_fast,
             c.rope.yarn_beta_slow);
  fmt::print("  RMSNorm eps         {}\n", c.rms_eps);
}

uint64_t print_tensors(const std::vector<TensorEntry>& tensors, size_t n_catalog_required) {
  struct Sum {
    uint64_t count = 0, bytes = 0;
  };
  std::map<std::string, Sum> by_type;
  std::map<int, Sum> by_role;
  Sum all;
  for (const auto& t : tensors) {
    auto& ty = by_type[std::string(ggml_type_name(t.type))];
    ++ty.count;
    ty.bytes += t.nbytes;
    auto& r = by_role[t.role ? static_cast<int>(*t.role) : -1];
    ++r.count;
    r.bytes += t.nbytes;
    ++all.count;
    all.bytes += t.nbytes;
  }
  fmt::print("tensors: {} ({} required by the catalog), {}\n", with_commas(all.count),
             with_commas(n_catalog_required), bytes_both(all.bytes));
  fmt::print("  by type:\n");
  for (const auto& [name, s] : by_type)
    fmt::print("    {:<10} {:>6}  {:>12}\n", name, s.count, human_bytes(static_cast<double>(s.bytes)));
  fmt::print("  by role:\n");
  for (const auto& [role, s] : by_role) {
    const std::string name = role < 0 ? std::string("not in the catalog")
                                      : std::string(tensor_role_name(static_cast<TensorRole>(role)));
    fmt::print("    {:<42} {:>6}  {:>12}\n", name, s.count, human_bytes(static_cast<double>(s.bytes)));
  }
  return all.bytes;
}

std::string per_token_text(double bytes) {
  if (bytes == static_cast<double>(static_cast<uint64_t>(bytes)))
    return fmt::format("{} B", with_commas(static_cast<uint64_t>(bytes)));
  return fmt::format("{:.2f} B", bytes);
}

// Engram tables stay in the file: their bytes, and what a token reads from them.
void print_engram_plan(const ModelConfig& c, uint64_t table_bytes, uint64_t row_bytes) {
  if (!c.engram) return;
  const uint64_t rows_per_token = uint64_t{c.engram->columns()} * c.engram->layers.size();
  fmt::print("  engram tables (streamed from the file, not resident): {}; {} rows of {} B read per token "
             "({} per token)\n", bytes_both(table_bytes), rows_per_token, row_bytes,
             bytes_both(rows_per_token * row_bytes));
}

void print_memory_plan(const ModelConfig& c, uint64_t weight_bytes, uint64_t ctx) {
  const CacheLayout ref = plan_cache_layout(c, CacheFormat::ReferenceBf16);
  const CacheLayout packed = plan_cache_layout(c, CacheFormat::Packed);
  const CacheTotals rt = ref.totals_at(ctx), pt = packed.totals_at(ctx);
  auto row = [](std::string_view label, const std::string& a, const std::string& b) {
    fmt::print("    {:<34} {:>18} {:>18}\n", label, a, b);
  };
  auto hb = [](uint64_t x) { return human_bytes(static_cast<double>(x)); };
  fmt::print("memory plan:\n");
  fmt::print("  weights{}                      {}\n", c.engram ? " (engram tables apart)" : "", bytes_both(weight_bytes));
  fmt::print("  cache per sequence (spec §6):\n");
  row("", std::string(cache_format_name(CacheFormat::ReferenceBf16)),
      std::string(cache_format_name(CacheFormat::Packed)));
  if (c.is_v41()) {
    auto sizes = [&](CacheFormat f) {
      return fmt::format("{} / {} / {} B", v41_window_entry_bytes(c, f), v41_compressed_entry_bytes(c, f),
                         index_key_bytes(c, f));
    };
    row("window slot / entry / index key", sizes(CacheFormat::ReferenceBf16), sizes(CacheFormat::Packed));
  } else {
    row("KV entry / indexer key",
        fmt::format("{} / {} B", kv_entry_bytes(c, CacheFormat::ReferenceBf16),
                    index_key_bytes(c, CacheFormat::ReferenceBf16)),
        fmt::format("{} / {} B", kv_entry_bytes(c, CacheFormat::Packed),
                    index_key_bytes(c, CacheFormat::Packed)));
  }
  row("growth per token", per_token_text(ref.bytes_per_token()), per_token_text(packed.bytes_per_token()));
  row(fmt::format("fixed: windows ({} x {} slots)", c.n_blocks(), c.sliding_window), hb(rt.windows),
      hb(pt.windows));
  row("fixed: compressor states (fp32)", hb(rt.compressor_states), hb(pt.compressor_states));
  fmt::print("    at {} tokens:\n", with_commas(ctx));
  if (c.is_v41()) {
    row("  compressed KV (KV sources)", hb(rt.shared_entries), hb(pt.shared_entries));
    row("  index keys (KV sources)", hb(rt.index_keys), hb(pt.index_keys));
  } else {
    row("  CSA compressed KV", hb(rt.csa_entries), hb(pt.csa_entries));
    row("  CSA indexer keys", hb(rt.index_keys), hb(pt.index_keys));
    row("  HCA compressed KV", hb(rt.hca_entries), hb(pt.hca_entries));
  }
  row("  total", hb(rt.total()), hb(pt.total()));
  row("  total bytes", with_commas(rt.total()), with_commas(pt.total()));
  fmt::print("  weights + one sequence at {} tokens: {} (reference), {} (packed)\n", with_commas(ctx),
             hb(weight_bytes + rt.total()), hb(weight_bytes + pt.total()));
  if (c.is_v41())
    fmt::print("  (V4.1 also keeps per sequence the Engram n-gram history and the carried fp32 hyper-connection mix)\n");
}

uint64_t engram_bytes(const std::vector<TensorEntry>& tensors) {
  uint64_t n = 0;
  for (const auto& t : tensors)
    if (t.role == TensorRole::EngramTables) n += t.nbytes;
  return n;
}

// Bytes of one table row as stored (the first table's).
uint64_t engram_row_bytes_of(const std::vector<TensorEntry>& tensors, const ModelConfig& c) {
  if (!c.engram) return 0;
  for (const auto& t : tensors)
    if (t.role == TensorRole::EngramTables) {
      const uint64_t rows = c.engram->table_rows.empty() ? 1 : c.engram->table_rows.front();
      return rows ? t.nbytes / rows : 0;
    }
  return 0;
}

// The plan over --gpus N GPUs (model/partition.h); false when it does not fit.
bool print_partition(const ModelConfig& c, const std::vector<PlacedTensor>& tensors, const InfoOptions& o,
                     uint64_t ctx) {
  PartitionOptions po;
  po.gpus.count = o.gpus;
  po.gpus.usable_bytes = static_cast<uint64_t>(o.gpu_memory_gib * (1ull << 30));
  po.gpus.reserve_bytes = static_cast<uint64_t>(o.gpu_reserve_gib * (1ull << 30));
  po.context_tokens = ctx;
  po.sequences = o.sequences;
  if (o.dense_parallel == "replicated") po.mode = DenseMode::Replicated;
  if (o.dense_parallel == "tensor") po.mode = DenseMode::TensorParallel;
  auto plan = plan_partition(c, tensors, po);
  if (!plan.is_ok()) {
    fmt::print(stderr, "dsv4 info: {}\n", plan.status().message());
    return false;
  }
  auto hb = [](uint64_t x) { return human_bytes(static_cast<double>(x)); };
  const uint32_t n = o.gpus;
  fmt::print("partition over {} GPU{} ({} usable each, {} reserved for activations), {} sequence{} of {} tokens:\n",
             n, n == 1 ? "" : "s", hb(po.gpus.usable_bytes), hb(po.gpus.reserve_bytes), o.sequences,
             o.sequences == 1 ? "" : "s", with_commas(ctx));
  fmt::print("  routed experts      expert-parallel: {} experts per layer over {} GPUs, {} in all\n",
             c.n_experts, n, hb(plan->expert_bytes_total));
  fmt::print("  other weights       {} ({} in all, {} of it split by tensor parallelism: attn_q_b, "
             "attn_output_a/b, shared expert, embedding and head)\n", dense_mode_name(plan->mode),
             hb(plan->dense_bytes_total), hb(plan->split_bytes_total));
  fmt::print("  KV cache            {} per sequence; {}\n", hb(plan->cache_bytes_per_sequence),
             plan->mode == DenseMode::Replicated ? "each sequence on the GPU that runs its attention"
                                                 : "every sequence on every GPU (one latent KV head for all heads)");
  fmt::print("    GPU  experts        expert bytes    weights        cache          total\n");
  for (size_t i = 0; i < plan->gpus.size(); ++i) {
    const GpuShare& g = plan->gpus[i];
    fmt::print("    {:>3}  {:>3}-{:<3} ({:>3})  {:>12}  {:>12}  {:>12}  {:>12}\n", i, g.first_expert,
               g.first_expert + g.n_experts - 1, g.n_experts, hb(g.expert_bytes), hb(g.dense_bytes),
               hb(g.cache_bytes), hb(g.total()));
  }
  const TokenTraffic& t = plan->per_layer;
  const uint64_t layers = plan->moe_layers;
  fmt::print("  traffic per token, bytes over all links (per MoE layer / over the {} MoE layers):\n", layers);
  fmt::print("    all-to-all dispatch + combine (bf16)            {:>10} / {:>12}\n", with_commas(t.all_to_all()),
             with_commas(t.all_to_all() * layers));
  fmt::print("    all-gather (bf16) + reduce-scatter (fp32)       {:>10} / {:>12}\n", with_commas(t.gather_scatter()),
             with_commas(t.gather_scatter() * layers));
  if (plan->mode == DenseMode::TensorParallel)
    fmt::print("    tensor-parallel all-reduce (fp32, per block)    {:>10} / {:>12}\n", with_commas(t.tp_all_reduce),
               with_commas(t.tp_all_reduce * c.n_blocks()));
  fmt::print("    decode batch b moves b times these; a prefill chunk of P tokens P times; the cheaper exchange: {}\n",
             n == 1 ? "none (one GPU)"
                    : t.gather_scatter() < t.all_to_all() ? "all-gather + reduce-scatter" : "all-to-all");
  fmt::print("  batch-1 decode step estimate: {:.2f} ms replicated, {:.2f} ms tensor-parallel (bytes at HBM "
             "bandwidth + {:.0f} us per collective)\n", plan->decode_step_s_replicated * 1e3,
             plan->decode_step_s_tensor_parallel * 1e3, po.gpus.collective_latency_s * 1e6);
  if (plan->fits) {
    fmt::print("  fits: yes (largest GPU {} + reserve, of {})\n", hb(plan->max_gpu_bytes()), hb(po.gpus.usable_bytes));
    return true;
  }
  fmt::print("  fits: no\n");
  fmt::print(stderr, "dsv4 info: does not fit {} GPU{}: {}\n", n, n == 1 ? "" : "s", plan->why_not);
  return false;
}

// With --backend cuda: what loading puts in device memory for --sequences slots of --ctx
// tokens, and whether it fits --device-memory (else the device's memory, when one answers).
bool print_device_plan(const ModelConfig& c, std::span<const gguf::TensorInfo> tensors, const InfoOptions& o,
                       uint64_t ctx) {
  uint64_t capacity = 0;
  std::string capacity_source;
  if (!o.device_memory.empty()) {
    auto bytes = parse_byte_size("--device-memory", o.device_memory);
    if (!bytes.is_ok()) {
      fmt::print(stderr, "dsv4 info: {}\n", bytes.status().message());
      return false;
    }
    capacity = *bytes;
    capacity_source = "--device-memory";
  }
#ifdef DSV4_HAVE_CUDA
  if (!capacity)
    if (auto device = cuda::query_device(0); device.is_ok()) {
      capacity = device->global_memory_bytes;
      capacity_source = fmt::format("{}'s memory", device->name);
    }
#endif
  KvCacheOptions cache;
  cache.max_sequences = o.sequences;
  cache.max_context = ctx;
  const DeviceMemoryPlan p = plan_device_memory(c, ModelPlan::build(c), tensors, cache,
                                                backend::kDefaultDeviceScratchBytes + backend::kDeviceWorkspaceBytes,
                                                capacity);
  fmt::print("device memory (--backend cuda, {} slot{} of {} tokens):\n", p.sequences, p.sequences == 1 ? "" : "s",
             with_commas(p.context));
  fmt::print("  weights             {}\n", plan_bytes_text(p.weights_bytes));
  if (p.host_weights_bytes) fmt::print("  Engram tables       {} (host: read from the file)\n", plan_bytes_text(p.host_weights_bytes));
  fmt::print("  caches              {}\n", plan_bytes_text(p.cache.total()));
  fmt::print("    windows, states   {}\n", plan_bytes_text(p.cache.slots));
  fmt::print("    page tables       {}\n", plan_bytes_text(p.cache.tables));
  fmt::print("    pages             {}\n", plan_bytes_text(p.cache.pages));
  fmt::print("  scratch             {} (first arena chunk and workspace; grows when a step needs more)\n",
             plan_bytes_text(p.scratch_bytes));
  fmt::print("  total               {}\n", plan_bytes_text(p.total()));
  if (!capacity) {
    fmt::print("  fits: unknown (no CUDA device answers; --device-memory BYTES to check)\n");
    return true;
  }
  fmt::print("  capacity            {} ({})\n", plan_bytes_text(capacity), capacity_source);
  if (p.fits()) {
    fmt::print("  fits: yes\n");
    return true;
  }
  fmt::print("  fits: no\n");
  fmt::print(stderr, "dsv4 info: {}\n", check_device_fit(p, "the model").message());
  return false;
}

int report_error(const Status& s) {
  fmt::print(stderr, "dsv4 info: {}\n", s.message());
  return kExitFailure;
}

int info_for_file(const std::string& path, const std::string& mtp_path, const InfoOptions& o) {
  const uint64_t ctx = o.ctx;
  ModelFilesOptions fo;
  fo.open.map_data = false;
  fo.mtp_path = mtp_path;
  auto files = ModelFiles::open(path, fo);
  if (!files.is_ok()) return report_error(files.status());
  const gguf::GgufFile& file = files->trunk();
  auto arch = file.get_string("general.architecture");
  fmt::print("file: {} ({} part{}, {}, GGUF v{})\n", path, file.part_paths().size(),
             file.part_paths().size() == 1 ? "" : "s", bytes_both(file.file_bytes()), file.version());
  if (const gguf::GgufFile* sidecar = files->sidecar())
    fmt::print("MTP sidecar: {} ({}, GGUF v{})\n", sidecar->path(), bytes_both(sidecar->file_bytes()),
               sidecar->version());
  fmt::print("architecture: {}\n", arch.is_ok() ? *arch : std::string("(missing)"));
  const ModelConfig& config = files->config();
  fmt::print("layout: {}\n", model_layout_name(files->layout()));
  fmt::print("MTP: {}\n", config.n_mtp == 0 ? std::string("none")
                           : files->layout() == ModelLayout::TrunkAndSidecar
                               ? fmt::format("{} block(s), from the sidecar", config.n_mtp)
                               : fmt::format("{} block(s), in the file", config.n_mtp));
  for (const std::string& note : files->notes()) fmt::print("note: {}\n", note);
  if (!config.name.empty()) fmt::print("name: {}\n", config.name);
  if (file.find(kSynthPresetKey)) {
    auto preset = file.get_string(kSynthPresetKey);
    auto seed = file.get_uint(kSynthSeedKey);
    fmt::print("synthetic: preset {}, seed {} (random weights)\n", preset.is_ok() ? *preset : "?",
               seed.is_ok() ? std::to_string(*seed) : "?");
  }
  print_config(config);

  const TensorCatalog catalog = build_tensor_catalog(config);
  std::vector<TensorEntry> entries;
  for (const auto& t : files->tensors()) {
    const TensorSpec* spec = catalog.find(t.name);
    entries.push_back({t.name, t.type, t.nbytes, spec ? std::optional(spec->role) : std::nullopt});
  }
  const uint64_t weight_bytes = print_tensors(entries, catalog.n_required());
  const Status check = files->check();
  fmt::print("catalog check: {}\n", check.is_ok() ? "ok" : check.message());
  print_memory_plan(config, weight_bytes - engram_bytes(entries), ctx ? ctx : config.context_length);
  print_engram_plan(config, engram_bytes(entries), engram_row_bytes_of(entries, config));
  if (!check.is_ok()) return kExitFailure;
  if (o.backend == "cuda" && !print_device_plan(config, files->tensors(), o, ctx ? ctx : config.context_length))
    return kExitFailure;
  if (o.gpus) {
    std::vector<PlacedTensor> placed;
    for (const auto& t : files->tensors())
      if (const TensorSpec* spec = catalog.find(t.name)) placed.push_back({spec, t.nbytes});
    if (!print_partition(config, placed, o, ctx ? ctx : config.context_length)) return kExitFailure;
  }
  return kExitOk;
}

int info_for_preset(const InfoOptions& o) {
  auto preset = find_preset(o.preset);
  if (!preset.is_ok()) return report_error(preset.status());
  ModelConfig config = preset->config;
  if (o.layers) {
    auto cut = keep_first_layers(config, o.layers);
    if (!cut.is_ok()) return report_error(cut.status());
    config = *cut;
  }
  GgmlType experts = preset->default_expert_type, dense = preset->default_dense_type;
  for (auto [text, target] : {std::pair{&o.expert_type, &experts}, std::pair{&o.dense_type, &dense}}) {
    if (text->empty()) continue;
    auto t = ggml_type_from_name(*text);
    if (!t) return report_error(Status::errorf("unknown tensor type \"{}\"", *text));
    *target = *t;
  }
  fmt::print("preset: {} — {}\n", preset->name, preset->description);
  fmt::print("architecture: {}\n", config.architecture());
  print_config(config);
  const TensorCatalog catalog = build_tensor_catalog(config);
  std::vector<TensorEntry> entries;
  std::vector<PlacedTensor> placed;
  for (const TensorSpec* spec : synth_tensor_list(catalog)) {
    const GgmlType type = synth_tensor_type(*spec, experts, dense, nullptr);
    entries.push_back({spec->name, type, *stored_bytes(*spec, type), spec->role});
    placed.push_back({spec, entries.back().nbytes});
  }
  fmt::print("as `dsv4 synth` writes it (experts {}, other matrices {}):\n", ggml_type_name(experts),
             ggml_type_name(dense));
  const uint64_t weight_bytes = print_tensors(entries, catalog.n_required());
  print_memory_plan(config, weight_bytes - engram_bytes(entries), o.ctx ? o.ctx : config.context_length);
  print_engram_plan(config, engram_bytes(entries), engram_row_bytes_of(entries, config));
  if (o.gpus && !print_partition(config, placed, o, o.ctx ? o.ctx : config.context_length)) return kExitFailure;
  return kExitOk;
}

// A KV graft bank (kv_graft.h) as its header states it; with a model, whether it fits.
int info_for_graft(const InfoOptions& o) {
  gguf::OpenOptions header_only;
  header_only.map_data = false;
  auto file = gguf::GgufFile::open(o.kv_graft, header_only);
  if (!file.is_ok()) return report_error(file.status());
  auto version = file->get_uint("graft.version");
  auto identity = file->get_string("graft.model.identity");
  auto layers = file->get_uint_array("graft.layers");
  auto slots = file->get_uint_array("graft.slots");
  auto footprint = file->get_uint("graft.footprint");
  for (const Status& s : {version.status(), identity.status(), layers.status(), slots.status(), footprint.status()})
    if (!s.is_ok()) return report_error(Status::errorf("{}: not a KV graft bank: {}", o.kv_graft, s.message()));
  uint64_t row_bytes = 0;
  for (const auto& t : file->tensors()) row_bytes += t.nbytes;
  fmt::print("KV graft bank: {} (graft.version {})\n", o.kv_graft, *version);
  fmt::print("made for: {}\n", *identity);
  fmt::print("footprint F: {} tokens (a grafted sequence starts at position {})\n", *footprint, *footprint);
  fmt::print("rows: {}\n", bytes_both(row_bytes));
  fmt::print("covered layers: {}\n", layers->size());
  for (size_t i = 0; i < layers->size(); ++i) {
    const std::string index = fmt::format("graft.index.{}", (*layers)[i]);
    fmt::print("  layer {:>3}: N = {}{}\n", (*layers)[i], i < slots->size() ? (*slots)[i] : 0,
               file->find_tensor(index) ? " (+ indexer keys)" : "");
  }
  if (o.model.empty() && o.file.empty()) return kExitOk;
  const std::string model = o.model.empty() ? o.file : o.model;
  ModelFilesOptions fo;
  fo.open.map_data = false;
  auto files = ModelFiles::open(model, fo);
  if (!files.is_ok()) return report_error(files.status());
  auto bank = KvGraft::read(o.kv_graft, files->config());
  if (!bank.is_ok()) {
    fmt::print("fits {}: no\n", model);
    return report_error(bank.status());
  }
  fmt::print("fits {}: yes ({} of its context of {} tokens used by the graft)\n", model, bank->footprint,
             files->config().context_length);
  return kExitOk;
}

int run_info(const InfoOptions& o) {
  if (!o.kv_graft.empty()) {
    if (!o.preset.empty()) {
      fmt::print(stderr, "dsv4 info: --kv-graft takes a model (FILE or -m), not --preset\n");
      return kExitUsage;
    }
    return info_for_graft(o);
  }
  if (!o.model.empty() && !o.file.empty()) {
    fmt::print(stderr, "dsv4 info: give the model as FILE or -m, not both\n");
    return kExitUsage;
  }
  if (!o.model.empty() && o.preset.empty()) return info_for_file(o.model, o.mtp, o);
  if (!o.model.empty()) {
    fmt::print(stderr, "dsv4 info: -m and --preset: give one\n");
    return kExitUsage;
  }
  if (o.backend == "cuda" && !o.preset.empty()) {
    fmt::print(stderr, "dsv4 info: --backend cuda plans a model file (FILE or -m), not --preset\n");
    return kExitUsage;
  }
  if (!o.file.empty() && !o.preset.empty()) {
    fmt::print(stderr, "dsv4 info: give a FILE or --preset, not both\n");
    return kExitUsage;
  }
  if (!o.preset.empty()) return info_for_preset(o);
  if (o.layers || !o.expert_type.empty() || !o.dense_type.empty()) {
    fmt::print(stderr, "dsv4 info: --layers, --experts and --dense apply to --preset only\n");
    return kExitUsage;
  }
  if (!o.file.empty()) return info_for_file(o.file, o.mtp, o);
  auto builtin = ensure_builtin_model([](std::string_view line) { fmt::print(stderr, "dsv4: {}\n", line); });
  if (!builtin.is_ok()) return report_error(builtin.status());
  fmt::print("built-in model (no FILE given)\n");
  return info_for_file(builtin->string(), o.mtp, o);
}

}  // namespace

void register_info(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<InfoOptions>();
  app.add_option("file", o->file, "GGUF model file (any part of a split set); default: the built-in model");
  app.add_option("--mtp", o->mtp, "MTP sidecar of a trunk-only file (default: mtp-*.gguf found next to it)");
  app.add_option("--preset", o->preset, "describe a preset instead of a file: tiny, interop, small, flash, pro, tiny41, small41, flash41");
  app.add_option("--ctx", o->ctx, "tokens per sequence for the cache plan (default: training context)")
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", o->layers, "with --preset: keep the first N layers")->check(CLI::PositiveNumber);
  app.add_option("--experts", o->expert_type, "with --preset: routed-expert type (default: the preset's)");
  app.add_option("--dense", o->dense_type, "with --preset: type of the other matrices");
  app.add_option("--kv-graft", o->kv_graft, "describe a KV graft bank: layers, slot counts, footprint, model")
      ->check(CLI::ExistingFile);
  app.add_option("-m,--model", o->model, "the model file (as FILE); with --kv-graft: check that the bank fits it")
      ->check(CLI::ExistingFile);
  app.add_option("--gpus", o->gpus, "print the partition plan over N GPUs (experts, weights, cache, traffic)")
      ->check(CLI::PositiveNumber);
  app.add_option("--gpu-memory", o->gpu_memory_gib, "with --gpus: usable memory per GPU in GiB")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--gpu-reserve", o->gpu_reserve_gib, "with --gpus: GiB per GPU kept for activations and workspace")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--backend", o->backend, "cuda: also the device memory plan (weights, caches, scratch) and its fit")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--device-memory", o->device_memory,
                 "with --backend cuda: device memory to fit, e.g. 80G (default: the GPU's, when one answers)");
  app.add_option("--sequences", o->sequences, "with --gpus or --backend cuda: sequences of --ctx tokens to hold")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--dense-parallel", o->dense_parallel, "with --gpus: auto, replicated or tensor")
      ->capture_default_str()->check(CLI::IsMember({"auto", "replicated", "tensor"}));
  run = [o] { return run_info(*o); };
}

}  // namespace dsv4::cli
