// Official DeepSeek-V4 checkpoint (safetensors, FP8/FP4) -> GGUF in llama.cpp's
// `deepseek4` convention, streaming.
//
// The plan (every output tensor with its type and its official sources) is built from
// config.json and the tensor catalog, then checked against the checkpoint before anything
// is written: a missing, misshapen or mistyped tensor, or a checkpoint tensor that the plan
// does not use, is an error and no output file appears. Tensors are then produced a chunk
// of rows at a time on all threads, so the resident memory is bounded by the chunk size,
// not the model size; checkpoint pages are dropped from the resident set once used. The
// output is written to a temporary file and renamed into place only when complete.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "convert/checkpoint_config.h"
#include "convert/name_map.h"
#include "convert/recipe.h"
#include "gguf/ggml_types.h"
#include "model/model_files.h"
#include "model/tensor_catalog.h"
#include "util/status.h"

namespace dsv4::convert {

struct PlannedTensor {
  TensorSpec spec;
  GgmlType type = GgmlType::F32;
  GgmlType requested = GgmlType::F32;  // differs when the block did not fit (a fallback)
  TensorSource source;
  uint64_t nbytes = 0;                 // bytes in the GGUF file
};

struct ConversionPlan {
  CheckpointConfig config;
  Recipe recipe;
  std::vector<PlannedTensor> tensors;  // in writing order

  uint64_t total_bytes() const;
  uint64_t total_elements() const;
  double bits_per_weight() const;      // all tensor bytes * 8 / all elements
};

// The plan for a configuration and recipe (no checkpoint needed: `dsv4 convert --dry-run`
// uses it to predict the output size).
Result<ConversionPlan> plan_conversion(const CheckpointConfig& config, const Recipe& recipe);

struct ConvertProgress {
  uint64_t tensors_done = 0, tensors_total = 0;
  uint64_t bytes_done = 0, bytes_total = 0;  // output bytes
  std::string_view current;                  // the tensor being written
};

struct ConvertOptions {
  std::filesystem::path checkpoint_dir;
  std::filesystem::path output;
  Recipe recipe;
  uint64_t split_max_bytes = 0;  // 0: one file (the trunk's; the sidecar is never split)
  // llama.cpp's layout: the trunk at `output` and, with MTP, its sidecar "mtp-<name>" beside
  // it; or one bundled file.
  WriteLayout layout = WriteLayout::TrunkAndSidecar;
  int threads = 0;               // 0: all hardware threads
  bool force = false;            // replace an existing output
  uint64_t chunk_bytes = 64ull << 20;  // f32 working set per chunk of rows
  // Called after each chunk (from the converting thread).
  std::function<void(const ConvertProgress&)> on_progress;
  // Checked between chunks: when set, the conversion stops with kInterrupted and removes
  // its temporary output (`dsv4 convert` sets it on SIGINT / SIGTERM).
  const std::atomic<bool>* cancel = nullptr;
};

// The message of the Status a cancelled conversion returns.
inline constexpr std::string_view kInterrupted = "interrupted";

struct ConvertSummary {
  ConversionPlan plan;
  std::vector<std::string> output_paths;  // the trunk's parts (or the bundled file's), then the sidecar
  bool tokenizer_written = false;
  std::string tokenizer_note;  // V4.1: why a tokenizer.json was not written (used for Engram only)
  double seconds = 0;
  std::map<GgmlType, uint64_t> tensors_by_type;
  std::vector<const PlannedTensor*> fallbacks;  // into plan.tensors (keep the summary whole)
  uint64_t peak_rss_bytes = 0;  // of this process so far (getrusage), after the conversion

  // The summary of a plan before anything is written (types, fallbacks); `--dry-run`.
  static ConvertSummary of_plan(ConversionPlan plan);
  std::string to_string() const;  // the report `dsv4 convert` prints
};

Result<ConvertSummary> convert_checkpoint(const ConvertOptions& options);

}  // namespace dsv4::convert
