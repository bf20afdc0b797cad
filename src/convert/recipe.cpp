#include "convert/recipe.h"

#include <algorithm>

#include "gguf/quant.h"

namespace dsv4::convert {
namespace {

constexpr std::array<std::string_view, kConvertRoleCount> kRoleNames = {
    "experts", "experts_down", "attention", "shared", "embedding", "head",
    "indexer", "compressor",   "router",    "mtp",    "small",  "engram",
};

bool is_float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

// What the recipe table in docs/CONVERT.md lists, role by role in ConvertRole order.
struct RecipeRow {
  RecipeInfo info;
  std::array<GgmlType, kConvertRoleCount> types;
};

using T = GgmlType;
const std::vector<RecipeRow>& recipe_rows() {
  static const std::vector<RecipeRow> rows = {
      {{"q2k", "experts gate/up Q2_K, down Q3_K; dense Q8_0; head Q6_K (V4-Flash fits one H200)"},
       {T::Q2_K, T::Q3_K, T::Q8_0, T::Q8_0, T::Q8_0, T::Q6_K, T::Q8_0, T::Q8_0, T::BF16, T::Q8_0, T::F32}},
      {{"q4k", "experts gate/up Q4_K, down Q5_K; dense Q8_0; head Q6_K"},
       {T::Q4_K, T::Q5_K, T::Q8_0, T::Q8_0, T::Q8_0, T::Q6_K, T::Q8_0, T::Q8_0, T::BF16, T::Q8_0, T::F32}},
      {{"q8", "every linear Q8_0"},
       {T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::BF16, T::Q8_0, T::F32}},
      {{"mxfp4", "experts native FP4 as MXFP4 (lossless); dense Q8_0"},
       {T::MXFP4, T::MXFP4, T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::Q8_0, T::BF16, T::Q8_0, T::F32}},
      {{"bf16", "experts MXFP4, everything else BF16: lossless"},
       {T::MXFP4, T::MXFP4, T::BF16, T::BF16, T::BF16, T::BF16, T::BF16, T::BF16, T::BF16, T::BF16, T::F32}},
      {{"f32", "experts MXFP4, everything else F32: lossless, for fp32 test runs"},
       {T::MXFP4, T::MXFP4, T::F32, T::F32, T::F32, T::F32, T::F32, T::F32, T::F32, T::F32, T::F32}},
  };
  return rows;
}

// Types the converter can produce, in order of preference among equal sizes.
constexpr std::array kWritableTypes = {T::Q2_K, T::Q3_K, T::MXFP4, T::Q4_K, T::Q5_K, T::Q6_K,
                                       T::Q8_0, T::BF16, T::F16,   T::F32};

bool writable(GgmlType t) {
  return std::find(kWritableTypes.begin(), kWritableTypes.end(), t) != kWritableTypes.end() &&
         can_quantize(t);
}

}  // namespace

std::string_view convert_role_name(ConvertRole role) { return kRoleNames[static_cast<size_t>(role)]; }

Result<ConvertRole> convert_role_from_name(std::string_view name) {
  for (size_t i = 0; i < kRoleNames.size(); ++i)
    if (kRoleNames[i] == name) return static_cast<ConvertRole>(i);
  std::string all;
  for (auto n : kRoleNames) all += (all.empty() ? "" : ", ") + std::string(n);
  return Status::errorf("unknown tensor role \"{}\" (roles: {}, or all)", name, all);
}

ConvertRole convert_role_of(const TensorSpec& spec) {
  if (spec.global_kind) {
    switch (*spec.global_kind) {
      case GlobalTensor::TokenEmbd: return ConvertRole::Embedding;
      case GlobalTensor::Output: return ConvertRole::Head;
      case GlobalTensor::DsparkMarkovEmbd: return ConvertRole::Embedding;
      case GlobalTensor::DsparkMarkovHead: return ConvertRole::Head;
      default: return ConvertRole::Small;
    }
  }
  using BT = BlockTensor;
  switch (spec.block_kind.value_or(BT::AttnNorm)) {
    case BT::AttnQA:
    case BT::AttnQB:
    case BT::AttnKv:
    case BT::AttnOutputA:
    case BT::AttnOutputB: return ConvertRole::Attention;
    case BT::CompressorKv:
    case BT::CompressorGate: return ConvertRole::Compressor;
    case BT::IndexerProj:
    case BT::IndexerQB:
    case BT::IndexerCompressorKv:
    case BT::IndexerCompressorGate: return ConvertRole::Indexer;
    case BT::FfnGateInp: return ConvertRole::Router;
    case BT::FfnGateExps:
    case BT::FfnUpExps: return ConvertRole::Experts;
    case BT::FfnDownExps: return ConvertRole::ExpertsDown;
    case BT::FfnGateShexp:
    case BT::FfnUpShexp:
    case BT::FfnDownShexp: return ConvertRole::Shared;
    case BT::NextnEhProj: return ConvertRole::Mtp;
    case BT::NextnEmbedTokens: return ConvertRole::Embedding;
    case BT::NextnSharedHeadHead: return ConvertRole::Head;
    // V4.1
    case BT::IndexerK: return ConvertRole::Indexer;
    case BT::EngramKv: return ConvertRole::Attention;
    case BT::DsparkMainProj: return ConvertRole::Mtp;
    case BT::EngramEmbd: return ConvertRole::Engram;
    default: return ConvertRole::Small;
  }
}

const std::vector<RecipeInfo>& recipe_list() {
  static const std::vector<RecipeInfo> list = [] {
    std::vector<RecipeInfo> l;
    for (const auto& r : recipe_rows()) l.push_back(r.info);
    return l;
  }();
  return list;
}

Result<Recipe> recipe_by_name(std::string_view name) {
  for (const auto& r : recipe_rows())
    if (r.info.name == name) {
      Recipe recipe{std::string(name), r.types};
      // Every recipe keeps V4.1's Engram tables lossless: the official FP8 rows as I8.
      recipe.set(ConvertRole::Engram, GgmlType::I8);
      return recipe;
    }
  std::string all;
  for (const auto& r : recipe_rows()) all += (all.empty() ? "" : ", ") + std::string(r.info.name);
  return Status::errorf("unknown recipe \"{}\" (recipes: {})", name, all);
}

Status apply_type_override(Recipe& recipe, std::string_view spec) {
  const size_t eq = spec.find('=');
  if (eq == std::string_view::npos)
    return Status::errorf("--type {}: expected ROLE=TYPE, e.g. experts_down=q4_k", spec);
  const std::string_view role_name = spec.substr(0, eq), type_name = spec.substr(eq + 1);
  const auto type = ggml_type_from_name(type_name);
  if (role_name == "engram" && type == GgmlType::I8) {  // the lossless FP8 rows
    recipe.set(ConvertRole::Engram, GgmlType::I8);
    return Status::ok();
  }
  if (!type || !writable(*type)) {
    std::string names;
    for (GgmlType t : kWritableTypes)
      if (can_quantize(t)) names += (names.empty() ? "" : ", ") + std::string(ggml_type_name(t));
    return Status::errorf("--type {}: cannot write type \"{}\" (types: {})", spec, type_name, names);
  }
  if (role_name == "all") {
    // "all" covers every role; the small tensors take it only when it is a float type.
    for (size_t i = 0; i < kConvertRoleCount; ++i)
      if (static_cast<ConvertRole>(i) != ConvertRole::Small || is_float_type(*type))
        recipe.types[i] = *type;
    // Engram tables stay as they are unless named: they are most of V4.1's bytes.
    return Status::ok();
  }
  auto role = convert_role_from_name(role_name);
  if (!role) return role.status().with_context(fmt::format("--type {}", spec));
  if (*role == ConvertRole::Small && !is_float_type(*type))
    return Status::errorf("--type {}: small tensors (norms, biases, hyper-connections) must be "
                          "f32, f16 or bf16", spec);
  recipe.set(*role, *type);
  return Status::ok();
}

double bits_per_weight(GgmlType type) {
  const auto& t = ggml_traits(type);
  return 8.0 * t.block_bytes / t.block_elems;
}

Result<TypeChoice> choose_type(const Recipe& recipe, const TensorSpec& spec) {
  if (spec.type_class == TypeClass::Index) return TypeChoice{GgmlType::I32, GgmlType::I32};
  if (spec.type_class == TypeClass::EngramTable && recipe.type(ConvertRole::Engram) == GgmlType::I8)
    return TypeChoice{GgmlType::I8, GgmlType::I8};
  const GgmlType requested = recipe.type(convert_role_of(spec));
  if (!type_allowed(spec.type_class, requested))
    return Status::errorf("tensor {}: type {} is not allowed for a {}", spec.name,
                          ggml_type_name(requested), type_class_name(spec.type_class));
  const uint64_t row = spec.ne.empty() ? 1 : spec.ne[0];
  if (ggml_row_bytes(requested, row)) return TypeChoice{requested, requested};
  // The smallest writable type at least as precise (in bits per weight) whose block fits.
  GgmlType best = GgmlType::F32;
  for (GgmlType t : kWritableTypes) {
    if (!writable(t) || !ggml_row_bytes(t, row) || bits_per_weight(t) < bits_per_weight(requested)) continue;
    if (bits_per_weight(t) < bits_per_weight(best)) best = t;
  }
  return TypeChoice{best, requested};
}

}  // namespace dsv4::convert
