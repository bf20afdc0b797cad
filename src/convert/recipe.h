// Conversion recipes: which GGUF element type each kind of tensor gets.
//
// A recipe assigns a type to each role; `--type ROLE=TYPE` overrides one role ("all" sets
// every role). Vector tensors (norms, biases, sinks, APE, hc base/scale) take the small
// role's type, which must be a float type; tid2eid is always I32. When a matrix's row
// length is not a multiple of the chosen type's block (K-quants need 256), the tensor gets
// the smallest type we can produce whose bits per weight are at least the requested one
// and whose block fits, and the conversion summary lists it (docs/CONVERT.md).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/ggml_types.h"
#include "model/tensor_catalog.h"
#include "util/status.h"

namespace dsv4::convert {

enum class ConvertRole : uint8_t {
  Experts,      // routed experts gate/up (ffn_gate_exps, ffn_up_exps)
  ExpertsDown,  // routed experts down (ffn_down_exps)
  Attention,    // attn_q_a, attn_q_b, attn_kv, attn_output_a, attn_output_b
  Shared,       // shared expert (ffn_*_shexp)
  Embedding,    // token_embd
  Head,         // output
  Indexer,      // indexer.*, indexer_compressor_kv/gate
  Compressor,   // attn_compressor_kv/gate
  Router,       // ffn_gate_inp
  Mtp,          // nextn.eh_proj
  Small,        // norms, hyper-connection tensors, sinks, APE, biases
  Engram,       // V4.1 engram_embd tables: i8 (the official FP8 rows, lossless) or a matrix type
};
inline constexpr size_t kConvertRoleCount = 12;

std::string_view convert_role_name(ConvertRole role);  // "experts_down"
Result<ConvertRole> convert_role_from_name(std::string_view name);
ConvertRole convert_role_of(const TensorSpec& spec);

struct Recipe {
  std::string name;
  std::array<GgmlType, kConvertRoleCount> types{};
  // V4.1: keep the vision tower (vision.*, aligner.*, image delimiters) and the image-token
  // routing bias; dropped by default, since dsv4 refuses image input.
  bool keep_vision = false;
  GgmlType type(ConvertRole role) const { return types[static_cast<size_t>(role)]; }
  void set(ConvertRole role, GgmlType t) { types[static_cast<size_t>(role)] = t; }
};

struct RecipeInfo {
  std::string_view name;
  std::string_view summary;  // one line for --help and the docs
};
const std::vector<RecipeInfo>& recipe_list();
Result<Recipe> recipe_by_name(std::string_view name);

// "ROLE=TYPE", e.g. "experts_down=q4_k", "all=f32". The type must be one dsv4 can write.
Status apply_type_override(Recipe& recipe, std::string_view spec);

struct TypeChoice {
  GgmlType type;       // what the tensor gets
  GgmlType requested;  // what the recipe asked for
  bool fallback() const { return type != requested; }
};
// The type of one catalog tensor under `recipe`; an error when the recipe's type is not
// allowed for the tensor's class (e.g. q8_0 for a norm).
Result<TypeChoice> choose_type(const Recipe& recipe, const TensorSpec& spec);

// Bits per weight of a type (block bytes * 8 / block elements).
double bits_per_weight(GgmlType type);

}  // namespace dsv4::convert
