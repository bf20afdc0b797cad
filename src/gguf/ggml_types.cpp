#include "gguf/ggml_types.h"

#include <array>
#include <cctype>
#include <string>

#include "gguf/quant_blocks.h"

namespace dsv4 {
namespace {

constexpr uint32_t kQK_K = 256;

// Sizes of the types dsv4 does not decode are listed too, so `info` can still count the
// bytes of a file that holds them.
constexpr std::array kTraits = {
    GgmlTypeTraits{GgmlType::F32, "f32", 1, 4, true},
    GgmlTypeTraits{GgmlType::F16, "f16", 1, 2, true},
    GgmlTypeTraits{GgmlType::Q4_0, "q4_0", 32, sizeof(block_q4_0), true},
    GgmlTypeTraits{GgmlType::Q4_1, "q4_1", 32, sizeof(block_q4_1), true},
    GgmlTypeTraits{GgmlType::Q5_0, "q5_0", 32, sizeof(block_q5_0), true},
    GgmlTypeTraits{GgmlType::Q5_1, "q5_1", 32, sizeof(block_q5_1), true},
    GgmlTypeTraits{GgmlType::Q8_0, "q8_0", 32, sizeof(block_q8_0), true},
    GgmlTypeTraits{GgmlType::Q8_1, "q8_1", 32, 36, false},
    GgmlTypeTraits{GgmlType::Q2_K, "q2_K", kQK_K, sizeof(block_q2_K), true},
    GgmlTypeTraits{GgmlType::Q3_K, "q3_K", kQK_K, sizeof(block_q3_K), true},
    GgmlTypeTraits{GgmlType::Q4_K, "q4_K", kQK_K, sizeof(block_q4_K), true},
    GgmlTypeTraits{GgmlType::Q5_K, "q5_K", kQK_K, sizeof(block_q5_K), true},
    GgmlTypeTraits{GgmlType::Q6_K, "q6_K", kQK_K, sizeof(block_q6_K), true},
    GgmlTypeTraits{GgmlType::Q8_K, "q8_K", kQK_K, sizeof(block_q8_K), false},
    GgmlTypeTraits{GgmlType::IQ2_XXS, "iq2_xxs", kQK_K, sizeof(block_iq2_xxs), true},
    GgmlTypeTraits{GgmlType::IQ2_XS, "iq2_xs", kQK_K, sizeof(block_iq2_xs), true},
    GgmlTypeTraits{GgmlType::IQ3_XXS, "iq3_xxs", kQK_K, sizeof(block_iq3_xxs), true},
    GgmlTypeTraits{GgmlType::IQ1_S, "iq1_s", kQK_K, sizeof(block_iq1_s), true},
    GgmlTypeTraits{GgmlType::IQ4_NL, "iq4_nl", 32, sizeof(block_iq4_nl), true},
    GgmlTypeTraits{GgmlType::IQ3_S, "iq3_s", kQK_K, sizeof(block_iq3_s), true},
    GgmlTypeTraits{GgmlType::IQ2_S, "iq2_s", kQK_K, sizeof(block_iq2_s), true},
    GgmlTypeTraits{GgmlType::IQ4_XS, "iq4_xs", kQK_K, sizeof(block_iq4_xs), true},
    GgmlTypeTraits{GgmlType::I8, "i8", 1, 1, false},
    GgmlTypeTraits{GgmlType::I16, "i16", 1, 2, false},
    GgmlTypeTraits{GgmlType::I32, "i32", 1, 4, true},
    GgmlTypeTraits{GgmlType::I64, "i64", 1, 8, false},
    GgmlTypeTraits{GgmlType::F64, "f64", 1, 8, false},
    GgmlTypeTraits{GgmlType::IQ1_M, "iq1_m", kQK_K, sizeof(block_iq1_m), true},
    GgmlTypeTraits{GgmlType::BF16, "bf16", 1, 2, true},
    GgmlTypeTraits{GgmlType::TQ1_0, "tq1_0", kQK_K, 54, false},
    GgmlTypeTraits{GgmlType::TQ2_0, "tq2_0", kQK_K, 66, false},
    GgmlTypeTraits{GgmlType::MXFP4, "mxfp4", 32, sizeof(block_mxfp4), true},
};

}  // namespace

std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t type_id) {
  for (const auto& t : kTraits)
    if (static_cast<uint32_t>(t.type) == type_id) return t;
  return std::nullopt;
}

const GgmlTypeTraits& ggml_traits(GgmlType type) {
  for (const auto& t : kTraits)
    if (t.type == type) return t;
  return kTraits[0];  // unreachable for enum values listed above
}

std::string_view ggml_type_name(GgmlType type) { return ggml_traits(type).name; }

std::optional<GgmlType> ggml_type_from_name(std::string_view name) {
  auto lower = [](std::string_view s) {
    std::string r(s);
    for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return r;
  };
  const std::string want = lower(name);
  for (const auto& t : kTraits)
    if (lower(t.name) == want) return t.type;
  return std::nullopt;
}

std::optional<uint64_t> ggml_row_bytes(GgmlType type, uint64_t n) {
  const auto& t = ggml_traits(type);
  if (n % t.block_elems != 0) return std::nullopt;
  return n / t.block_elems * t.block_bytes;
}

}  // namespace dsv4
