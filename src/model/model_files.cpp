#include "model/model_files.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "model/tensor_catalog.h"

namespace dsv4 {
namespace fs = std::filesystem;

std::string_view model_layout_name(ModelLayout layout) {
  switch (layout) {
    case ModelLayout::Bundled: return "bundled (trunk and MTP in one file)";
    case ModelLayout::Trunk: return "trunk";
    case ModelLayout::TrunkAndSidecar: return "trunk + MTP sidecar";
  }
  return "?";
}

Result<uint32_t> mtp_blocks_present(const gguf::GgufFile& file, uint32_t* declared) {
  DSV4_ASSIGN_OR_RETURN(std::string arch, file.get_string("general.architecture"));
  uint32_t n = 0;
  if (const std::string key = arch + ".nextn_predict_layers"; file.find(key)) {
    DSV4_ASSIGN_OR_RETURN(uint64_t v, file.get_uint(key));
    DSV4_ASSIGN_OR_RETURN(uint64_t blocks, file.get_uint(arch + ".block_count"));
    if (v >= blocks)
      return Status::errorf("{}: key {}: {} MTP blocks leave no trunk layer of block_count {}", file.path(), key,
                            v, blocks);
    n = static_cast<uint32_t>(v);
    if (declared) *declared = n;
    // A V4 MTP block starts with eh_proj; a V4.1 DSpark stage set with its main projection.
    const auto first_mtp = static_cast<uint32_t>(blocks - n);
    if (n > 0 && !file.find_tensor(block_tensor_name(first_mtp, BlockTensor::NextnEhProj)) &&
        !file.find_tensor(block_tensor_name(first_mtp, BlockTensor::DsparkMainProj)))
      return 0;
    return n;
  }
  if (declared) *declared = 0;
  return n;
}

namespace {

bool is_gguf_name(const std::string& name) { return name.size() > 5 && name.ends_with(".gguf"); }

// "X-00001-of-00003.gguf" -> "X"; other names unchanged (without ".gguf").
std::string split_prefix(std::string name) {
  name.resize(name.size() - 5);
  const size_t of = name.rfind("-of-");
  if (of != std::string::npos && of >= 6 && name[of - 6] == '-' && name.size() - of == 9) return name.substr(0, of - 6);
  return name;
}

// Only the first part of a split set counts as a candidate.
bool is_later_split_part(const std::string& name) {
  const std::string stem = name.substr(0, name.size() - 5);
  const size_t of = stem.rfind("-of-");
  return of != std::string::npos && of >= 6 && stem[of - 6] == '-' && stem.substr(of - 5, 5) != "00001";
}

// The geometry a sidecar must share with its trunk, as (name, trunk value, sidecar value).
Status check_same_geometry(const ModelConfig& t, const ModelConfig& s, const std::string& trunk,
                           const std::string& sidecar) {
  const std::pair<const char*, std::pair<uint64_t, uint64_t>> fields[] = {
      {"trunk layers (block_count - nextn_predict_layers)", {t.n_layers, s.n_layers}},
      {"embedding_length", {t.hidden, s.hidden}},
      {"vocabulary size", {t.vocab_size, s.vocab_size}},
      {"attention.head_count", {t.n_heads, s.n_heads}},
      {"attention.key_length", {t.head_dim, s.head_dim}},
      {"attention.q_lora_rank", {t.q_lora_rank, s.q_lora_rank}},
      {"attention.output_lora_rank", {t.o_lora_rank, s.o_lora_rank}},
      {"attention.output_group_count", {t.o_groups, s.o_groups}},
      {"attention.sliding_window", {t.sliding_window, s.sliding_window}},
      {"rope.dimension_count", {t.rope.dims, s.rope.dims}},
      {"expert_count", {t.n_experts, s.n_experts}},
      {"expert_used_count", {t.n_experts_used, s.n_experts_used}},
      {"expert_shared_count", {t.n_shared_experts, s.n_shared_experts}},
      {"expert_feed_forward_length", {t.expert_ffn, s.expert_ffn}},
      {"hyper_connection.count", {t.hc_mult, s.hc_mult}},
  };
  for (const auto& [name, values] : fields)
    if (values.first != values.second)
      return Status::errorf("{}: not the MTP sidecar of {}: {} is {}, the trunk's is {}", sidecar, trunk, name,
                            values.second, values.first);
  return Status::ok();
}

// The sidecar's tensors under catalog names: the root hyper-connection head belongs to the
// first MTP block; its copies of the embedding, head and final norm are the trunk's and are
// not used (the MTP head falls back to the trunk's, as the bundled layout does).
Result<std::vector<gguf::TensorInfo>> sidecar_tensors(const gguf::GgufFile& sidecar, uint32_t n_layers) {
  std::vector<gguf::TensorInfo> out;
  const std::pair<GlobalTensor, BlockTensor> head[] = {{GlobalTensor::OutputHcFn, BlockTensor::NextnHcHeadFn},
                                                       {GlobalTensor::OutputHcBase, BlockTensor::NextnHcHeadBase},
                                                       {GlobalTensor::OutputHcScale, BlockTensor::NextnHcHeadScale}};
  for (const gguf::TensorInfo& t : sidecar.tensors()) {
    gguf::TensorInfo renamed = t;
    bool keep = true;
    for (const auto& [root, mtp] : head)
      if (t.name == global_tensor_name(root)) renamed.name = block_tensor_name(n_layers, mtp);
    if (t.name == global_tensor_name(GlobalTensor::TokenEmbd) || t.name == global_tensor_name(GlobalTensor::Output) ||
        t.name == global_tensor_name(GlobalTensor::OutputNorm))
      keep = false;
    unsigned block = 0;
    if (std::sscanf(t.name.c_str(), "blk.%u.", &block) == 1 && block < n_layers)
      return Status::errorf("{}: tensor {}: an MTP sidecar holds only the MTP block (blocks from {})", sidecar.path(),
                            t.name, n_layers);
    if (keep) out.push_back(std::move(renamed));
  }
  return out;
}

}  // namespace

std::string find_sidecar_path(const std::string& trunk_path, std::vector<std::string>* ambiguous) {
  const fs::path trunk(trunk_path);
  const fs::path dir = trunk.has_parent_path() ? trunk.parent_path() : fs::path(".");
  const std::string name = trunk.filename().string();
  if (!is_gguf_name(name)) return {};
  for (const std::string& exact : {"mtp-" + name, "mtp-" + split_prefix(name) + ".gguf"}) {
    std::error_code ec;
    if (fs::is_regular_file(dir / exact, ec)) return (dir / exact).string();
  }
  std::vector<std::string> candidates;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.starts_with("mtp-") && is_gguf_name(n) && n != name && !is_later_split_part(n) &&
        it->is_regular_file(ec))
      candidates.push_back(it->path().string());
  }
  std::sort(candidates.begin(), candidates.end());
  if (candidates.size() == 1) return candidates[0];
  if (ambiguous) *ambiguous = candidates;
  return {};
}

ModelFiles::ModelFiles(ModelFiles&&) noexcept = default;
ModelFiles& ModelFiles::operator=(ModelFiles&&) noexcept = default;
ModelFiles::~ModelFiles() = default;

Result<ModelFiles> ModelFiles::open(const std::string& path, const ModelFilesOptions& options) {
  ModelFiles m;
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile trunk, gguf::GgufFile::open(path, options.open));
  m.trunk_ = std::make_unique<gguf::GgufFile>(std::move(trunk));
  uint32_t declared = 0;
  DSV4_ASSIGN_OR_RETURN(uint32_t present, mtp_blocks_present(*m.trunk_, &declared));
  DSV4_ASSIGN_OR_RETURN(m.config_, ModelConfig::from_gguf(*m.trunk_, present));
  if (present > 0 && !m.trunk_->find_tensor(block_tensor_name(0, BlockTensor::AttnNorm)))
    return Status::errorf("{}: this is an MTP sidecar (only the MTP block); open the trunk file, which finds it "
                          "by name, or pass this one with --mtp", path);
  m.label_ = path;
  m.tensors_ = m.trunk_->tensors();
  m.n_trunk_tensors_ = m.tensors_.size();
  if (present > 0) {
    m.layout_ = ModelLayout::Bundled;
    if (!options.mtp_path.empty())
      m.notes_.push_back(fmt::format("{} holds its own MTP block; --mtp {} is not used", path, options.mtp_path));
    return m;
  }
  m.layout_ = ModelLayout::Trunk;
  if (declared > 0)
    m.notes_.push_back(fmt::format("{} declares {} MTP block(s) (nextn_predict_layers) but holds no MTP tensors: "
                                   "no MTP, as llama.cpp reads it",
                                   path, declared));

  std::string sidecar_path = options.mtp_path;
  const bool explicit_sidecar = !sidecar_path.empty();
  if (!explicit_sidecar && options.find_sidecar) {
    std::vector<std::string> ambiguous;
    sidecar_path = find_sidecar_path(path, &ambiguous);
    if (!ambiguous.empty())
      m.notes_.push_back(fmt::format("several MTP sidecars next to {} ({}): none used; choose one with --mtp", path,
                                     fmt::join(ambiguous, ", ")));
  }
  if (sidecar_path.empty()) return m;

  // A sidecar found by name that does not fit is skipped with a note; one asked for is an error.
  auto reject = [&](Status s) -> Result<ModelFiles> {
    if (explicit_sidecar) return s;
    m.notes_.push_back(fmt::format("{} skipped: {}", sidecar_path, s.message()));
    return std::move(m);
  };
  auto sidecar = gguf::GgufFile::open(sidecar_path, options.open);
  if (!sidecar.is_ok()) return reject(sidecar.status());
  auto sidecar_mtp = mtp_blocks_present(*sidecar);
  if (!sidecar_mtp.is_ok()) return reject(sidecar_mtp.status());
  if (*sidecar_mtp == 0)
    return reject(Status::errorf("{}: not an MTP sidecar (no nextn_predict_layers with an MTP block's "
                                 "nextn.eh_proj.weight)", sidecar_path));
  auto sidecar_config = ModelConfig::from_gguf(*sidecar, *sidecar_mtp);
  if (!sidecar_config.is_ok()) return reject(sidecar_config.status());
  if (Status s = check_same_geometry(m.config_, *sidecar_config, path, sidecar_path); !s.is_ok()) return reject(s);
  auto renamed = sidecar_tensors(*sidecar, m.config_.n_layers);
  if (!renamed.is_ok()) return reject(renamed.status());

  ModelConfig merged = m.config_;
  merged.n_mtp = sidecar_config->n_mtp;
  for (uint32_t b = merged.n_layers; b < sidecar_config->n_blocks(); ++b) {
    merged.compress_ratios.push_back(sidecar_config->compress_ratios[b]);
    merged.swiglu_limit.push_back(sidecar_config->swiglu_limit[b]);
    merged.swiglu_limit_shared.push_back(sidecar_config->swiglu_limit_shared[b]);
  }
  if (Status s = merged.validate(); !s.is_ok()) return reject(s.with_context(sidecar_path));

  m.config_ = std::move(merged);
  m.sidecar_ = std::make_unique<gguf::GgufFile>(std::move(*sidecar));
  m.layout_ = ModelLayout::TrunkAndSidecar;
  m.label_ = fmt::format("{} + {}", path, sidecar_path);
  if (!explicit_sidecar) m.notes_.push_back(fmt::format("MTP sidecar {} found next to the trunk", sidecar_path));
  for (gguf::TensorInfo& t : *renamed) m.tensors_.push_back(std::move(t));
  return m;
}

const gguf::TensorInfo* ModelFiles::find_tensor(std::string_view catalog_name) const {
  for (const auto& t : tensors_)
    if (t.name == catalog_name) return &t;
  return nullptr;
}

const gguf::GgufFile& ModelFiles::file_of(const gguf::TensorInfo& tensor) const {
  const size_t i = static_cast<size_t>(&tensor - tensors_.data());
  return i < n_trunk_tensors_ || !sidecar_ ? *trunk_ : *sidecar_;
}

Status ModelFiles::check() const { return check_tensors(build_tensor_catalog(config_), tensors_, label_); }

std::string sidecar_path_for(const std::string& trunk_path) {
  const fs::path p(trunk_path);
  return (p.parent_path() / ("mtp-" + p.filename().string())).string();
}

Placement place_tensor(const TensorSpec& spec, const ModelConfig& config) {
  Placement p;
  if (spec.global_kind) {
    p.in_trunk = true;
    const GlobalTensor g = *spec.global_kind;
    p.in_sidecar = config.n_mtp > 0 && (g == GlobalTensor::TokenEmbd || g == GlobalTensor::OutputNorm ||
                                        g == GlobalTensor::Output);
    p.sidecar_name = spec.name;
    return p;
  }
  if (!spec.block || !config.is_mtp(*spec.block)) {
    p.in_trunk = true;
    return p;
  }
  p.in_sidecar = true;
  p.sidecar_name = spec.name;
  const std::pair<BlockTensor, GlobalTensor> head[] = {{BlockTensor::NextnHcHeadFn, GlobalTensor::OutputHcFn},
                                                       {BlockTensor::NextnHcHeadBase, GlobalTensor::OutputHcBase},
                                                       {BlockTensor::NextnHcHeadScale, GlobalTensor::OutputHcScale}};
  for (const auto& [mtp, root] : head)
    if (spec.block_kind == mtp && *spec.block == config.n_layers) p.sidecar_name = std::string(global_tensor_name(root));
  return p;
}

}  // namespace dsv4
