// llama_logits: the logits llama.cpp computes for a token sequence, for comparing dsv4 with
// llama.cpp (tests/llamacpp/). Ours, not upstream's: a small program over libllama's C API.
//   llama_logits MODEL.gguf TOKENS.txt OUT.npy [--threads N] [--batch N] [--load-only]
// Reads whitespace-separated token ids, decodes them in one sequence with every position an
// output (f32 KV cache, flash attention off, the CPU backend), and writes float32 logits
// [tokens, vocab] as a NumPy .npy file, row t predicting token t+1 (as `dsv4 score` does).
// --load-only loads the model with its MTP layers (as llama.cpp loads an MTP sidecar for
// speculative decoding) and stops: llama.cpp accepted every tensor.
#include <llama.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "llama_logits: %s\n", msg.c_str());
  return 1;
}

bool write_npy(const std::string& path, const std::vector<float>& data, size_t rows, size_t cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const uint16_t len = static_cast<uint16_t>(header.size());
  bool ok = std::fwrite("\x93NUMPY\x01\x00", 1, 8, f) == 8 && std::fwrite(&len, 2, 1, f) == 1 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data.data(), sizeof(float), data.size(), f) == data.size();
  return std::fclose(f) == 0 && ok;
}

void quiet_log(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_WARN || std::getenv("LLAMA_LOGITS_VERBOSE")) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return fail("usage: llama_logits MODEL.gguf TOKENS.txt OUT.npy [--threads N] [--batch N]");
  const std::string model_path = argv[1], tokens_path = argv[2], out_path = argv[3];
  int threads = 2, batch = 0;
  bool load_only = false;
  for (int i = 4; i < argc; ++i) {
    if (std::strcmp(argv[i], "--load-only") == 0) load_only = true;
    else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc) batch = std::atoi(argv[++i]);
    else return fail(std::string("unknown option ") + argv[i]);
  }

  std::vector<llama_token> tokens;
  {
    std::ifstream in(tokens_path);
    if (!in) return fail(tokens_path + ": cannot open");
    long long v;
    while (in >> v) tokens.push_back(static_cast<llama_token>(v));
    if (tokens.empty()) return fail(tokens_path + ": no token ids");
  }
  const int n = static_cast<int>(tokens.size());
  if (batch <= 0) batch = n;

  llama_log_set(quiet_log, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  // No CPU weight repacking (ggml's "extra buffer types", llama.cpp's --no-repack; build.sh
  // builds without it): a repacked matrix supports only some products, and upstream's
  // deepseek4 graph uses such weights elsewhere too, which then have no backend at all
  // (GGML_ASSERT(*cur_backend_id != -1) in ggml_backend_sched): the Q8_0 attention weights
  // of upstream's converter, and the grouped attn_output_a (a 3-d view multiplied by permuted
  // activations) in Q6_K. Plain buffers run every op.
  mp.use_extra_bufts = false;
  mp.load_mtp = load_only;
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (!model) return fail(model_path + ": llama.cpp could not load the model");
  if (load_only) {
    llama_model_free(model);
    llama_backend_free();
    return 0;
  }
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(n);
  cp.n_batch = static_cast<uint32_t>(batch);
  cp.n_ubatch = static_cast<uint32_t>(batch);
  cp.n_seq_max = 1;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  cp.type_k = GGML_TYPE_F32;
  cp.type_v = GGML_TYPE_F32;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return fail("llama.cpp could not create a context");

  std::vector<float> logits(static_cast<size_t>(n) * vocab);
  llama_batch b = llama_batch_init(batch, 0, 1);
  for (int at = 0; at < n; at += batch) {
    const int len = n - at < batch ? n - at : batch;
    b.n_tokens = len;
    for (int i = 0; i < len; ++i) {
      b.token[i] = tokens[at + i];
      b.pos[i] = at + i;
      b.n_seq_id[i] = 1;
      b.seq_id[i][0] = 0;
      b.logits[i] = 1;
    }
    if (llama_decode(ctx, b) != 0) return fail("llama_decode failed at token " + std::to_string(at));
    for (int i = 0; i < len; ++i) {
      const float* row = llama_get_logits_ith(ctx, i);
      if (!row) return fail("no logits for token " + std::to_string(at + i));
      std::memcpy(logits.data() + static_cast<size_t>(at + i) * vocab, row, sizeof(float) * vocab);
    }
  }
  llama_batch_free(b);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  if (!write_npy(out_path, logits, static_cast<size_t>(n), static_cast<size_t>(vocab)))
    return fail(out_path + ": write failed");
  return 0;
}
