// llama_quant: llama.cpp's quantiser (llama_model_quantize, the function behind
// llama-quantize) on a GGUF file, for the interoperability tests (tests/llamacpp/). Ours, not
// upstream's: a small program over libllama's C API, so that the tests need neither
// llama-quantize nor llama-imatrix and their llama-common library (half of llama.cpp's
// build time).
//   llama_quant [--allow-requantize] IN.gguf OUT.gguf TYPE [--threads N] [--imatrix SEED]
//               [--tensor-type REGEX=TYPE]...
// TYPE is a file type as llama-quantize names it (Q6_K, Q4_K_M, IQ1_S, ..., F32). Converting
// quantised tensors again is allowed (F32 turns a quantised file back into llama.cpp's own
// dequantisation of it). --imatrix SEED gives every quantisable tensor an importance matrix
// (what the very-low-bit types require): per input column, and per expert for the stacked
// expert tensors, a mean square of activations drawn from a fixed-seed generator in
// [0.25, 4.25). The values steer which code each block gets, not how a code decodes, which is
// what the tests check; llama-imatrix's statistics of a random model are no more meaningful.
// --tensor-type overrides the type of the tensors whose name matches REGEX (as llama-quantize's).
#include <gguf.h>
#include <llama.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "llama_quant: %s\n", msg.c_str());
  return 1;
}

const std::map<std::string, llama_ftype>& file_types() {
  static const std::map<std::string, llama_ftype> types = {
      {"F32", LLAMA_FTYPE_ALL_F32},          {"Q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},
      {"Q5_0", LLAMA_FTYPE_MOSTLY_Q5_0},     {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M},
      {"Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M}, {"Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K},
      {"IQ4_NL", LLAMA_FTYPE_MOSTLY_IQ4_NL}, {"IQ4_XS", LLAMA_FTYPE_MOSTLY_IQ4_XS},
      {"IQ3_S", LLAMA_FTYPE_MOSTLY_IQ3_S},   {"IQ3_XXS", LLAMA_FTYPE_MOSTLY_IQ3_XXS},
      {"IQ2_M", LLAMA_FTYPE_MOSTLY_IQ2_M},   {"IQ2_S", LLAMA_FTYPE_MOSTLY_IQ2_S},
      {"IQ2_XS", LLAMA_FTYPE_MOSTLY_IQ2_XS},
      {"IQ1_M", LLAMA_FTYPE_MOSTLY_IQ1_M},   {"IQ1_S", LLAMA_FTYPE_MOSTLY_IQ1_S},
  };
  return types;
}

// ggml's type names ("f32", "q6_K", "iq4_nl"), in any case.
bool parse_ggml_type(const std::string& name, ggml_type& out) {
  const auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
    const char* n = ggml_type_name(static_cast<ggml_type>(t));
    if (n && lower(name) == lower(n)) {
      out = static_cast<ggml_type>(t);
      return true;
    }
  }
  return false;
}

// One entry per tensor of two or more dimensions: ne[0] values per expert (ne[2]), as
// llama_model_quantize reads an importance matrix.
bool synthetic_imatrix(const std::string& path, uint32_t seed, std::vector<std::string>& names,
                       std::vector<std::vector<float>>& values) {
  ggml_context* meta = nullptr;
  gguf_init_params ip = {/*no_alloc=*/true, &meta};
  gguf_context* g = gguf_init_from_file(path.c_str(), ip);
  if (!g) return false;
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
    const char* name = gguf_get_tensor_name(g, i);
    const ggml_tensor* t = ggml_get_tensor(meta, name);
    if (!t || ggml_n_dims(t) < 2) continue;
    std::vector<float> v(static_cast<size_t>(t->ne[0] * t->ne[2]));
    for (float& x : v) {
      const float u = static_cast<float>(rng() >> 8) * (1.0f / 16777216.0f);
      x = 0.25f + 4.0f * u * u;
    }
    names.emplace_back(name);
    values.push_back(std::move(v));
  }
  gguf_free(g);
  ggml_free(meta);
  return true;
}

void quiet_log(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_WARN || std::getenv("LLAMA_QUANT_VERBOSE")) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char** argv) {
  // llama-quantize's leading --allow-requantize is accepted (and always in effect), so that
  // `llama_quant --allow-requantize IN OUT F32` runs where that llama-quantize line did.
  const int at = argc > 1 && std::strcmp(argv[1], "--allow-requantize") == 0 ? 2 : 1;
  if (argc < at + 3) return fail("usage: llama_quant IN.gguf OUT.gguf TYPE [--threads N] [--imatrix SEED] [--tensor-type REGEX=TYPE]");
  const std::string in = argv[at], out = argv[at + 1], type = argv[at + 2];
  const auto ft = file_types().find(type);
  if (ft == file_types().end()) return fail("unknown file type " + type);

  llama_model_quantize_params qp = llama_model_quantize_default_params();
  qp.ftype = ft->second;
  qp.allow_requantize = true;
  qp.nthread = 2;
  bool imatrix = false;
  uint32_t seed = 0;
  std::vector<std::string> patterns;
  std::vector<llama_model_tensor_override> overrides;
  for (int i = at + 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) {
      qp.nthread = std::atoi(argv[++i]);
    } else if (a == "--imatrix" && i + 1 < argc) {
      imatrix = true;
      seed = static_cast<uint32_t>(std::strtoul(argv[++i], nullptr, 10));
    } else if (a == "--tensor-type" && i + 1 < argc) {
      const std::string spec = argv[++i];
      const size_t eq = spec.find('=');
      ggml_type t;
      if (eq == std::string::npos || eq == 0 || !parse_ggml_type(spec.substr(eq + 1), t))
        return fail("--tensor-type " + spec + ": expected REGEX=TYPE with a ggml type");
      patterns.push_back(spec.substr(0, eq));
      overrides.push_back({nullptr, t});
    } else {
      return fail("unknown option " + a);
    }
  }
  for (size_t i = 0; i < overrides.size(); ++i) overrides[i].pattern = patterns[i].c_str();
  if (!overrides.empty()) {
    overrides.push_back({nullptr, GGML_TYPE_COUNT});
    qp.tt_overrides = overrides.data();
  }

  llama_log_set(quiet_log, nullptr);
  llama_backend_init();
  std::vector<std::string> names;
  std::vector<std::vector<float>> values;
  std::vector<llama_model_imatrix_data> entries;
  if (imatrix) {
    if (!synthetic_imatrix(in, seed, names, values)) return fail(in + ": cannot read its tensors");
    for (size_t i = 0; i < names.size(); ++i) entries.push_back({names[i].c_str(), values[i].data(), values[i].size()});
    entries.push_back({nullptr, nullptr, 0});
    qp.imatrix = entries.data();
  }
  const uint32_t rc = llama_model_quantize(in.c_str(), out.c_str(), &qp);
  llama_backend_free();
  if (rc != 0) return fail(in + " -> " + type + ": llama_model_quantize failed (" + std::to_string(rc) + ")");
  return 0;
}
