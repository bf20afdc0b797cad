// ModelFiles: every layout llama.cpp produces is read (trunk, trunk + MTP sidecar found by
// name or given, nextn_predict_layers without MTP tensors, dsv4's bundled file), each
// presents the same tensors under the catalog's names, and files that do not belong
// together are refused with a message naming them.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "model/model_files.h"
#include "model/tensor_catalog.h"
#include "synth/presets.h"
#include "synth/synth.h"
#include "support/test_support.h"

namespace dsv4 {
namespace {

ModelConfig small_config() {
  ModelConfig c = tiny_config();
  c.vocab_size = 512;
  return c;
}

void synth(const std::string& path, WriteLayout layout, uint64_t seed, const ModelConfig& c = small_config()) {
  SynthOptions o;
  o.config = c;
  o.seed = seed;
  o.write_tokenizer = false;
  o.layout = layout;
  o.overwrite = true;
  auto r = write_synthetic_model(path, o);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
}

// Copies a GGUF file with its tensors, setting `extra` keys on top of its metadata.
void rewrite(const std::string& src, const std::string& dst, std::vector<std::pair<std::string, gguf::Value>> extra) {
  auto f = gguf::GgufFile::open(src);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  gguf::GgufWriter w(dst);
  for (const auto& [k, v] : f->metadata()) w.set(k, v);
  for (auto& [k, v] : extra) w.set(k, v);
  for (const auto& t : f->tensors()) ASSERT_TRUE(w.add_tensor(t.name, t.type, t.ne).is_ok());
  ASSERT_TRUE(w.begin().is_ok());
  for (const auto& t : f->tensors()) ASSERT_TRUE(w.write_tensor_data(t.bytes()).is_ok());
  ASSERT_TRUE(w.finish().is_ok());
}

bool has_note(const ModelFiles& m, std::string_view text) {
  for (const auto& n : m.notes())
    if (n.find(text) != std::string::npos) return true;
  return false;
}

class ModelFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = test::test_seed();
    bundled_ = (dir_ / "bundled.gguf").string();
    trunk_ = (dir_ / "m.gguf").string();
    synth(bundled_, WriteLayout::Bundled, seed_);
    synth(trunk_, WriteLayout::TrunkAndSidecar, seed_);
  }
  test::TempDir dir_;
  uint64_t seed_ = 0;
  std::string bundled_, trunk_;
};

TEST_F(ModelFilesTest, SynthWritesLlamaCppsTrunkAndSidecar) {
  const std::string sidecar = (dir_ / "mtp-m.gguf").string();
  ASSERT_TRUE(std::filesystem::exists(sidecar));
  auto t = gguf::GgufFile::open(trunk_);
  auto s = gguf::GgufFile::open(sidecar);
  ASSERT_TRUE(t.is_ok() && s.is_ok());
  const ModelConfig c = small_config();
  EXPECT_EQ(*t->get_uint("deepseek4.block_count"), c.n_layers);
  EXPECT_EQ(t->find("deepseek4.nextn_predict_layers"), nullptr);
  EXPECT_EQ(*s->get_uint("deepseek4.block_count"), c.n_blocks());
  EXPECT_EQ(*s->get_uint("deepseek4.nextn_predict_layers"), 1u);
  EXPECT_EQ(t->find("deepseek4.attention.compress_ratios")->elem_type(), gguf::ValueType::INT32);
  // The trunk holds no MTP tensor; the sidecar only the MTP block, its head as output_hc_*,
  // and the copies of the embedding, head and final norm llama.cpp loads it with.
  const std::string mtp_prefix = "blk." + std::to_string(c.n_layers) + ".";
  for (const auto& x : t->tensors()) EXPECT_FALSE(x.name.starts_with(mtp_prefix)) << x.name;
  for (const auto& x : s->tensors())
    EXPECT_TRUE(x.name.starts_with(mtp_prefix) || x.name == "token_embd.weight" || x.name == "output.weight" ||
                x.name == "output_norm.weight" || x.name.starts_with("output_hc_"))
        << x.name;
  EXPECT_EQ(s->find_tensor(mtp_prefix + "nextn.hc_head_fn.weight"), nullptr);
  ASSERT_NE(s->find_tensor("output_hc_fn.weight"), nullptr);
  // The sidecar's output_hc_fn is the MTP block's head, not the trunk's.
  auto b = gguf::GgufFile::open(bundled_);
  ASSERT_TRUE(b.is_ok());
  const auto* mtp_head = b->find_tensor(mtp_prefix + "nextn.hc_head_fn.weight");
  const auto* sidecar_head = s->find_tensor("output_hc_fn.weight");
  ASSERT_EQ(mtp_head->nbytes, sidecar_head->nbytes);
  EXPECT_EQ(std::memcmp(mtp_head->data, sidecar_head->data, mtp_head->nbytes), 0);
  EXPECT_NE(std::memcmp(b->find_tensor("output_hc_fn.weight")->data, sidecar_head->data, mtp_head->nbytes), 0);
}

TEST_F(ModelFilesTest, TrunkAndSidecarPresentTheBundledTensors) {
  auto split = ModelFiles::open(trunk_);
  ASSERT_TRUE(split.is_ok()) << split.status().message();
  EXPECT_EQ(split->layout(), ModelLayout::TrunkAndSidecar);
  EXPECT_EQ(split->config().n_mtp, 1u);
  EXPECT_TRUE(has_note(*split, "found next to the trunk"));
  EXPECT_TRUE(split->check().is_ok()) << split->check().message();
  auto bundled = ModelFiles::open(bundled_);
  ASSERT_TRUE(bundled.is_ok()) << bundled.status().message();
  EXPECT_EQ(bundled->layout(), ModelLayout::Bundled);
  EXPECT_EQ(bundled->config().compress_ratios, split->config().compress_ratios);
  EXPECT_EQ(bundled->config().swiglu_limit, split->config().swiglu_limit);
  ASSERT_EQ(bundled->tensors().size(), split->tensors().size());
  for (const auto& t : bundled->tensors()) {
    const gguf::TensorInfo* u = split->find_tensor(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    ASSERT_EQ(u->type, t.type) << t.name;
    ASSERT_EQ(u->nbytes, t.nbytes) << t.name;
    EXPECT_EQ(std::memcmp(u->data, t.data, t.nbytes), 0) << t.name << " seed " << seed_;
  }
  const auto* head = split->find_tensor("blk.6.nextn.hc_head_fn.weight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(&split->file_of(*head), split->sidecar());
  EXPECT_EQ(&split->file_of(*split->find_tensor("output.weight")), &split->trunk());
}

TEST_F(ModelFilesTest, TrunkAloneHasNoMtp) {
  std::filesystem::remove(dir_ / "mtp-m.gguf");
  auto m = ModelFiles::open(trunk_);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  EXPECT_EQ(m->layout(), ModelLayout::Trunk);
  EXPECT_EQ(m->config().n_mtp, 0u);
  EXPECT_EQ(m->config().n_layers, small_config().n_layers);
  EXPECT_TRUE(m->check().is_ok()) << m->check().message();
  EXPECT_TRUE(m->notes().empty());
}

// Files published for llama.cpp: nextn_predict_layers = 1 and every block a trunk block.
TEST_F(ModelFilesTest, DeclaredMtpWithoutTensorsMeansNoMtp) {
  std::filesystem::remove(dir_ / "mtp-m.gguf");
  const std::string published = (dir_ / "published.gguf").string();
  rewrite(trunk_, published, {{"deepseek4.nextn_predict_layers", gguf::Value::u32(1)}});
  auto m = ModelFiles::open(published);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  EXPECT_EQ(m->layout(), ModelLayout::Trunk);
  EXPECT_EQ(m->config().n_mtp, 0u);
  EXPECT_EQ(m->config().n_layers, small_config().n_layers);
  EXPECT_TRUE(has_note(*m, "holds no MTP tensors")) << (m->notes().empty() ? "" : m->notes()[0]);
  EXPECT_TRUE(m->check().is_ok()) << m->check().message();
}

TEST_F(ModelFilesTest, SidecarGivenExplicitly) {
  const std::string elsewhere = (dir_ / "draft.gguf").string();
  std::filesystem::rename(dir_ / "mtp-m.gguf", elsewhere);
  auto none = ModelFiles::open(trunk_);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->config().n_mtp, 0u);
  ModelFilesOptions o;
  o.mtp_path = elsewhere;
  auto m = ModelFiles::open(trunk_, o);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  EXPECT_EQ(m->layout(), ModelLayout::TrunkAndSidecar);
  EXPECT_EQ(m->config().n_mtp, 1u);
  EXPECT_TRUE(m->check().is_ok()) << m->check().message();
  EXPECT_NE(m->label().find("draft.gguf"), std::string::npos);
}

TEST_F(ModelFilesTest, RefusesFilesThatDoNotBelongTogether) {
  // The sidecar given as the model.
  auto as_model = ModelFiles::open((dir_ / "mtp-m.gguf").string());
  ASSERT_FALSE(as_model.is_ok());
  EXPECT_NE(as_model.status().message().find("this is an MTP sidecar"), std::string::npos)
      << as_model.status().message();

  // A sidecar of another geometry: refused when asked for, skipped with a note when found.
  ModelConfig other = small_config();
  other.hidden = 128;
  const std::string other_trunk = (dir_ / "other.gguf").string();
  synth(other_trunk, WriteLayout::TrunkAndSidecar, seed_, other);
  ModelFilesOptions o;
  o.mtp_path = (dir_ / "mtp-other.gguf").string();
  auto wrong = ModelFiles::open(trunk_, o);
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_NE(wrong.status().message().find("embedding_length is 128, the trunk's is 256"), std::string::npos)
      << wrong.status().message();
  std::filesystem::remove(dir_ / "mtp-m.gguf");
  std::filesystem::rename(dir_ / "mtp-other.gguf", dir_ / "mtp-m.gguf");
  auto skipped = ModelFiles::open(trunk_);
  ASSERT_TRUE(skipped.is_ok()) << skipped.status().message();
  EXPECT_EQ(skipped->config().n_mtp, 0u);
  EXPECT_TRUE(has_note(*skipped, "skipped")) << (skipped->notes().empty() ? "" : skipped->notes()[0]);

  // A trunk given as --mtp is no sidecar.
  o.mtp_path = other_trunk;
  auto trunk_as_sidecar = ModelFiles::open(trunk_, o);
  ASSERT_FALSE(trunk_as_sidecar.is_ok());
  EXPECT_NE(trunk_as_sidecar.status().message().find("not an MTP sidecar"), std::string::npos)
      << trunk_as_sidecar.status().message();
}

TEST(ModelFilesNames, FindsTheSidecarLlamaCppWould) {
  test::TempDir dir;
  auto touch = [&](const std::string& name) { std::FILE* f = std::fopen((dir / name).string().c_str(), "wb"); std::fclose(f); };
  touch("V4-Q4_K_M.gguf");
  EXPECT_EQ(find_sidecar_path((dir / "V4-Q4_K_M.gguf").string()), "");
  touch("mtp-V4-Q8_0.gguf");
  EXPECT_EQ(find_sidecar_path((dir / "V4-Q4_K_M.gguf").string()), (dir / "mtp-V4-Q8_0.gguf").string());
  touch("mtp-V4-Q2_K.gguf");
  std::vector<std::string> ambiguous;
  EXPECT_EQ(find_sidecar_path((dir / "V4-Q4_K_M.gguf").string(), &ambiguous), "");
  EXPECT_EQ(ambiguous.size(), 2u);
  touch("mtp-V4-Q4_K_M.gguf");
  EXPECT_EQ(find_sidecar_path((dir / "V4-Q4_K_M.gguf").string()), (dir / "mtp-V4-Q4_K_M.gguf").string());
  // A split trunk pairs with the sidecar named after its prefix.
  touch("V5-00001-of-00002.gguf");
  touch("mtp-V5.gguf");
  EXPECT_EQ(find_sidecar_path((dir / "V5-00001-of-00002.gguf").string()), (dir / "mtp-V5.gguf").string());
  EXPECT_EQ(sidecar_path_for((dir / "a.gguf").string()), (dir / "mtp-a.gguf").string());
}

}  // namespace
}  // namespace dsv4
