// The files a DeepSeek-V4 model comes in, and which of llama.cpp's layouts they follow
// (docs/MODEL-FILES.md, "File layouts"):
//
//   bundled   one file with the trunk and its MTP block(s) (what dsv4 wrote before it wrote
//             llama.cpp's layout; MTP head tensors as blk.N.nextn.hc_head_*)
//   trunk     the trunk alone; nextn_predict_layers may still say 1 (files published for
//             llama.cpp): without the MTP block's tensors that means no MTP, as in llama.cpp
//   trunk + sidecar
//             the trunk, plus an MTP file next to it ("mtp-*.gguf", as llama.cpp's converter
//             writes with --mtp) that holds the MTP block with its hyper-connection head
//             under the root names output_hc_*
//
// ModelFiles opens the trunk, finds the sidecar (by name next to the trunk, or the file
// given as --mtp), checks that the two belong together, and presents every tensor under the
// catalog's names (tensor_catalog.h), so the loader does not care which layout it came in.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/gguf_file.h"
#include "model/config.h"
#include "model/tensor_catalog.h"
#include "util/status.h"

namespace dsv4 {

enum class ModelLayout { Bundled, Trunk, TrunkAndSidecar };
std::string_view model_layout_name(ModelLayout layout);  // "bundled", "trunk", "trunk + MTP sidecar"

struct ModelFilesOptions {
  std::string mtp_path;      // an MTP sidecar to use (--mtp FILE); empty: look next to the trunk
  bool find_sidecar = true;  // look for "mtp-*.gguf" next to the trunk when mtp_path is empty
  gguf::OpenOptions open;    // how both files are opened (map_data = false for `info`)
};

class ModelFiles {
 public:
  // Opens `path` (a trunk or bundled file, or any part of a split set) and its sidecar.
  // Errors name the file: a sidecar given as the model, an --mtp file that is not an MTP
  // sidecar of this trunk (geometry, layer count), tensors a sidecar must not hold.
  static Result<ModelFiles> open(const std::string& path, const ModelFilesOptions& options = {});

  ModelFiles(ModelFiles&&) noexcept;
  ModelFiles& operator=(ModelFiles&&) noexcept;
  ~ModelFiles();

  // The model's configuration: the trunk's, with the MTP blocks that are really there
  // (config().n_mtp is 0 when there is no MTP).
  const ModelConfig& config() const { return config_; }
  ModelLayout layout() const { return layout_; }
  const gguf::GgufFile& trunk() const { return *trunk_; }
  const gguf::GgufFile* sidecar() const { return sidecar_.get(); }
  // Things the user may want to know (a declared MTP block without tensors, a sidecar found
  // by name, sidecars skipped), one sentence each.
  const std::vector<std::string>& notes() const { return notes_; }
  // "m.gguf", or "m.gguf + mtp-m.gguf": what messages about tensors name.
  const std::string& label() const { return label_; }

  // Every tensor under its catalog name (the sidecar's renamed), trunk first. The data
  // pointers stay valid as long as this object (when the files were mapped).
  const std::vector<gguf::TensorInfo>& tensors() const { return tensors_; }
  const gguf::TensorInfo* find_tensor(std::string_view catalog_name) const;
  // The file a tensor of tensors() comes from.
  const gguf::GgufFile& file_of(const gguf::TensorInfo& tensor) const;

  // check_tensors() of tensors() against the catalog of config().
  Status check() const;

 private:
  ModelFiles() = default;
  std::unique_ptr<gguf::GgufFile> trunk_;
  std::unique_ptr<gguf::GgufFile> sidecar_;
  ModelConfig config_;
  ModelLayout layout_ = ModelLayout::Trunk;
  std::vector<std::string> notes_;
  std::string label_;
  std::vector<gguf::TensorInfo> tensors_;
  size_t n_trunk_tensors_ = 0;  // tensors_[0, n) are the trunk's
};

// How many of a file's blocks are MTP blocks: nextn_predict_layers when the first MTP
// block's nextn.eh_proj is in the file, else 0 (llama.cpp's rule). `declared` receives the
// key's value (0 when absent).
Result<uint32_t> mtp_blocks_present(const gguf::GgufFile& file, uint32_t* declared = nullptr);

// The sidecar llama.cpp would pair with `trunk_path`, by name: "mtp-<trunk file name>" in the
// same folder if it exists, else the only "mtp-*.gguf" there; empty when there is none.
// With several candidates and no exact match, none is chosen and `ambiguous` lists them.
std::string find_sidecar_path(const std::string& trunk_path, std::vector<std::string>* ambiguous = nullptr);

// ---- writing llama.cpp's layout -------------------------------------------------------------

// What synth and convert write: llama.cpp's trunk + MTP sidecar, or the bundled file.
enum class WriteLayout { TrunkAndSidecar, Bundled };

// "<folder>/mtp-<file name>": where the sidecar of a trunk goes (and is looked for first).
std::string sidecar_path_for(const std::string& trunk_path);

// Where a catalog tensor goes in llama.cpp's layout. The trunk holds the globals and the
// trunk blocks; the sidecar holds the MTP block(s), the MTP block's hyper-connection head
// as output_hc_* and copies of token_embd, output_norm and output (llama.cpp loads the
// sidecar as a model of its own and needs them). Without MTP everything is in the trunk.
struct Placement {
  bool in_trunk = false;
  bool in_sidecar = false;
  std::string sidecar_name;  // its name in the sidecar
};
Placement place_tensor(const TensorSpec& spec, const ModelConfig& config);

}  // namespace dsv4
