// A checkpoint in DeepSeek's official release format (config.json, sharded safetensors
// with model.safetensors.index.json; FP8 E4M3 dense weights with 128x128 E8M0 block
// scales, packed FP4 E2M1 experts with E8M0 scales per 32, BF16/F32 small tensors, I64
// tid2eid) of any geometry, with random weights: tests and benchmarks exercise the
// converter at realistic tensor sizes without a 160 GB download.
//
// The values are synth's (model/synth.h: drawn like the tiny-v4 fixture), quantised the
// way the fixture was: FP8 scale per block 2^ceil(log2(amax/448)), FP4 scale per (row,
// 32 columns) 2^ceil(log2(amax/6)), codes rounded to nearest even. Streaming: one slab of
// rows at a time, so any geometry needs a few tens of MB.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "convert/checkpoint_config.h"
#include "util/status.h"

namespace dsv4::convert {

struct SyntheticCheckpointOptions {
  CheckpointConfig config;
  uint64_t seed = 0;
  uint64_t shard_max_bytes = 4'000'000'000;  // start a new shard beyond this many data bytes
  bool write_tokenizer = false;  // DeepSeek-V4's tokenizer.json (needs vocab >= its 129,280 ids)
  int threads = 0;               // 0: all hardware threads
  bool overwrite = false;        // write into a folder that already has a config.json
};

struct SyntheticCheckpointReport {
  std::vector<std::string> shards;  // file names, in order
  uint64_t n_tensors = 0;           // weights and scales
  uint64_t data_bytes = 0;
};

Result<SyntheticCheckpointReport> write_synthetic_checkpoint(const std::filesystem::path& dir,
                                                             const SyntheticCheckpointOptions& options);

}  // namespace dsv4::convert
