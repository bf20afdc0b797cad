// dsv4 score: logits of a token sequence, for quality checks and comparisons against
// reference implementations. Reads whitespace-separated token ids, runs them through the
// model in prefill chunks, and writes float32 logits [tokens, vocab] as a NumPy .npy file
// (row t predicts token t+1). With --mtp it writes the MTP block's draft logits instead:
// [tokens - 1, vocab], row t from the final streams at position t and token t+1
// (predicting token t+2), the pairing of the fixture README. On a V4.1 model --mtp runs the
// DSpark stages teacher-forced: after position t (t = 0 .. tokens-2) a block drafted from
// token t+1, written as [(tokens - 1) * block, vocab] (row t*block + i predicts token
// t+2+i), and each block's drafts and confidences printed, one line per position.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "backend_choice.h"
#include "commands.h"
#include "gguf/gguf_file.h"
#include "interventions.h"
#include "model/model.h"

namespace dsv4::cli {
namespace {

struct ScoreOptions {
  std::string model;
  std::string mtp_file;
  std::string tokens;
  std::string output;
  int64_t chunk = 0;  // 0: the whole sequence in one call
  bool no_qat = false;
  bool mtp = false;
  BackendFlags backend;
  InterventionFlags interventions;
};

// The footprint a bank declares (checked against the model once it is loaded), to size a
// device cache before loading.
Result<uint64_t> declared_footprint(const std::string& path) {
  gguf::OpenOptions header_only;
  header_only.map_data = false;
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(path, header_only));
  return file.get_uint("graft.footprint");
}

Result<std::vector<int32_t>> read_tokens(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::errorf("{}: cannot open the token file", path);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v > INT32_MAX)
      return Status::errorf("{}: token {} (\"{}\") is not a non-negative integer id", path,
                            ids.size(), word);
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) return Status::errorf("{}: no token ids", path);
  return ids;
}

// NumPy format 1.0: magic, header length, a Python dict literal padded to 64 bytes.
Status write_npy(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols) {
  std::string header = fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}",
                                   rows, cols);
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return Status::errorf("{}: cannot create the output file", path);
  const uint16_t len = static_cast<uint16_t>(header.size());
  const bool ok = std::fwrite("\x93NUMPY\x01\x00", 1, 8, f) == 8 && std::fwrite(&len, 2, 1, f) == 1 &&
                  std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
                  std::fwrite(data.data(), sizeof(float), data.size(), f) == data.size();
  if (std::fclose(f) != 0 || !ok) return Status::errorf("{}: write failed", path);
  return Status::ok();
}

Status run_score(const ScoreOptions& o) {
  DSV4_TRY(validate_intervention_flags(o.interventions));
  DSV4_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, read_tokens(o.tokens));
  uint64_t footprint = 0;
  if (!o.interventions.kv_graft.empty()) {
    DSV4_ASSIGN_OR_RETURN(footprint, declared_footprint(o.interventions.kv_graft));
  }
  DSV4_ASSIGN_OR_RETURN(ChosenBackend chosen, make_backend(o.backend, "dsv4 score"));
  ModelOptions mo;
  mo.qat = !o.no_qat;
  mo.matmul = matmul_mode(o.backend, chosen);
  DSV4_ASSIGN_OR_RETURN(mo.device_memory, device_memory_bytes(o.backend));
  mo.cache = cache_options(chosen, 1, footprint + tokens.size());
  mo.mtp_path = o.mtp_file;
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::load(o.model, *chosen.backend, mo));
  const int64_t n = static_cast<int64_t>(tokens.size()), vocab = model->config().vocab_size;
  if (o.mtp && !model->has_mtp()) return Status::errorf("{}: the model has no MTP block", o.model);
  if (o.mtp && n < 2) return Status::error("--mtp needs at least 2 tokens");
  DSV4_ASSIGN_OR_RETURN(std::shared_ptr<const KvGraft> graft, apply_interventions(o.interventions, *model));

  SequenceOptions so;
  so.max_context = static_cast<uint64_t>(n) + (graft ? static_cast<uint64_t>(graft->footprint) : 0);
  so.with_mtp = o.mtp;
  so.graft = graft;
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, model->new_sequence(so));
  const int64_t chunk = o.chunk > 0 ? o.chunk : n;
  std::vector<float> logits, streams;
  for (int64_t at = 0; at < n; at += chunk) {
    const int64_t len = std::min(chunk, n - at);
    const BatchItem item{seq.get(), std::span<const int32_t>(tokens.data() + at, len), true, o.mtp};
    ForwardOutput out;
    DSV4_TRY(model->forward(std::span<const BatchItem>(&item, 1), out));
    logits.insert(logits.end(), out.logits.begin(), out.logits.end());
    streams.insert(streams.end(), out.streams.begin(), out.streams.end());
  }
  if (!o.mtp) return write_npy(o.output, logits, n, vocab);

  const int64_t width = static_cast<int64_t>(streams.size()) / n;
  std::vector<float> draft;
  if (model->config().is_v41()) {
    for (int64_t t = 0; t + 1 < n; ++t) {
      const DsparkItem item{seq.get(), std::span<const float>(streams.data() + t * width, width), tokens[t + 1]};
      DSV4_ASSIGN_OR_RETURN(std::vector<DsparkDraft> got, model->dspark(std::span<const DsparkItem>(&item, 1)));
      const DsparkDraft& d = got.at(0);
      std::string line = fmt::format("{} {}:", t, tokens[t + 1]);
      for (int32_t id : d.tokens) line += fmt::format(" {}", id);
      line += " |";
      for (float c : d.confidence) line += fmt::format(" {:.4g}", c);
      std::printf("%s\n", line.c_str());
      draft.insert(draft.end(), d.logits.begin(), d.logits.end());
    }
    return write_npy(o.output, draft, static_cast<int64_t>(draft.size()) / vocab, vocab);
  }
  for (int64_t at = 0; at < n - 1; at += chunk) {
    const int64_t len = std::min(chunk, n - 1 - at);
    const MtpItem item{seq.get(), std::span<const float>(streams.data() + at * width, len * width),
                       std::span<const int32_t>(tokens.data() + at + 1, len)};
    DSV4_ASSIGN_OR_RETURN(std::vector<float> rows, model->mtp(std::span<const MtpItem>(&item, 1)));
    draft.insert(draft.end(), rows.begin(), rows.end());
  }
  return write_npy(o.output, draft, n - 1, vocab);
}

}  // namespace

void register_score(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<ScoreOptions>();
  app.add_option("-m,--model", o->model, "GGUF model file")->required();
  app.add_option("--mtp-file", o->mtp_file, "MTP sidecar of a trunk-only model (default: mtp-*.gguf next to it)");
  app.add_option("--tokens", o->tokens, "file of whitespace-separated token ids")->required();
  app.add_option("-o,--output", o->output, "output .npy file (float32 [tokens, vocab])")->required();
  app.add_option("--chunk", o->chunk, "prefill chunk size (default: all tokens in one call)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-qat", o->no_qat, "switch off the official QAT roundings (FP8 KV, FP4 indexer)");
  app.add_flag("--mtp", o->mtp,
               "write the MTP block's draft logits [tokens-1, vocab] instead (V4.1: the DSpark blocks, "
               "[(tokens-1)*block, vocab], drafts printed)");
  add_backend_flags(app, o->backend);
  add_intervention_flags(app, o->interventions);
  app.add_option("-t,--threads", o->backend.threads, "CPU threads (default: all)");
  run = [o] {
    const Status s = run_score(*o);
    if (!s.is_ok()) {
      std::fprintf(stderr, "dsv4 score: %s\n", s.message().c_str());
      return static_cast<int>(kExitFailure);
    }
    return static_cast<int>(kExitOk);
  };
}

}  // namespace dsv4::cli
