#include "model/kv_graft.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"

namespace dsv4 {
namespace {

// FNV-1a over bytes, continued from `h`.
uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

Result<std::vector<float>> read_rows(const gguf::GgufFile& file, const std::string& name, int64_t rows, int64_t cols) {
  const gguf::TensorInfo* t = file.find_tensor(name);
  if (!t) return Status::errorf("{}: tensor {} is missing", file.path(), name);
  if (t->type != GgmlType::F32 || t->ne.size() != 2 || t->ne[0] != static_cast<uint64_t>(cols) ||
      t->ne[1] != static_cast<uint64_t>(rows))
    return Status::errorf("{}: tensor {} is {} {}, expected f32 [{}, {}]", file.path(), name, ggml_type_name(t->type),
                          t->shape_string(), rows, cols);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  std::memcpy(v.data(), t->data, v.size() * sizeof(float));
  for (float x : v)
    if (!std::isfinite(x)) return Status::errorf("{}: tensor {} has a non-finite value", file.path(), name);
  return v;
}

}  // namespace

const KvGraftLayer* KvGraft::find(uint32_t block) const {
  for (const KvGraftLayer& l : layers)
    if (l.block == block) return &l;
  return nullptr;
}

Status KvGraft::finalize(const ModelConfig& c) {
  footprint = 0;
  hash = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < layers.size(); ++i) {
    const KvGraftLayer& l = layers[i];
    if (l.block >= c.n_layers || c.ratio(l.block) == 0)
      return Status::errorf("graft: layer {} is not a compressed layer of the model", l.block);
    if (i && l.block <= layers[i - 1].block) return Status::error("graft: layers must be strictly ascending");
    if (l.slots <= 0) return Status::errorf("graft: layer {} has {} slots", l.block, l.slots);
    const bool csa = c.attention_kind(l.block) == AttentionKind::CSA;
    if (l.kv.size() != static_cast<size_t>(l.slots) * c.head_dim ||
        l.keys.size() != (csa ? static_cast<size_t>(l.slots) * c.index_head_dim : 0))
      return Status::errorf("graft: layer {}: {} kv values and {} key values for {} slots (widths {} and {})", l.block,
                            l.kv.size(), l.keys.size(), l.slots, c.head_dim, csa ? c.index_head_dim : 0);
    footprint = std::max<int64_t>(footprint, l.slots * static_cast<int64_t>(c.ratio(l.block)));
    hash = fnv1a(hash, &l.block, sizeof l.block);
    hash = fnv1a(hash, &l.slots, sizeof l.slots);
    hash = fnv1a(hash, l.kv.data(), l.kv.size() * sizeof(float));
    hash = fnv1a(hash, l.keys.data(), l.keys.size() * sizeof(float));
  }
  if (layers.empty()) return Status::error("graft: no layers");
  if (static_cast<uint64_t>(footprint) >= c.context_length)
    return Status::errorf("graft: footprint of {} tokens leaves nothing of the model's context of {}", footprint,
                          c.context_length);
  return Status::ok();
}

Result<KvGraft> KvGraft::read(const std::string& path, const ModelConfig& c) {
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(path));
  const auto bad = [&](const std::string& what) { return Status::errorf("{}: {}", path, what); };
  DSV4_ASSIGN_OR_RETURN(uint64_t version, file.get_uint("graft.version"));
  if (version != 1) return bad(fmt::format("graft.version {} (this reader knows 1)", version));
  KvGraft g;
  DSV4_ASSIGN_OR_RETURN(g.model_identity, file.get_string("graft.model.identity"));
  if (g.model_identity != c.identity())
    return bad(fmt::format("made for another model:\n  file:  {}\n  model: {}", g.model_identity, c.identity()));
  DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> blocks, file.get_uint_array("graft.layers"));
  DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> slots, file.get_uint_array("graft.slots"));
  DSV4_ASSIGN_OR_RETURN(uint64_t footprint, file.get_uint("graft.footprint"));
  if (blocks.size() != slots.size())
    return bad(fmt::format("graft.layers has {} entries, graft.slots {}", blocks.size(), slots.size()));
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] >= c.n_layers) return bad(fmt::format("graft.layers names layer {}, the model has {}", blocks[i], c.n_layers));
    if (c.ratio(static_cast<uint32_t>(blocks[i])) == 0)
      return bad(fmt::format("graft.layers names layer {}, which has no compressed cache", blocks[i]));
    if (slots[i] == 0 || slots[i] > c.context_length)
      return bad(fmt::format("graft.slots[{}] = {} outside [1, {}]", i, slots[i], c.context_length));
    KvGraftLayer l;
    l.block = static_cast<uint32_t>(blocks[i]);
    l.slots = static_cast<int64_t>(slots[i]);
    DSV4_ASSIGN_OR_RETURN(l.kv, read_rows(file, fmt::format("graft.kv.{}", l.block), l.slots, c.head_dim));
    if (c.attention_kind(l.block) == AttentionKind::CSA) {
      DSV4_ASSIGN_OR_RETURN(l.keys, read_rows(file, fmt::format("graft.index.{}", l.block), l.slots, c.index_head_dim));
    }
    g.layers.push_back(std::move(l));
  }
  DSV4_TRY(g.finalize(c).with_context(path));
  if (footprint != static_cast<uint64_t>(g.footprint))
    return bad(fmt::format("graft.footprint {} but the slot counts give {}", footprint, g.footprint));
  return g;
}

Status KvGraft::write(const std::string& path, bool overwrite) const {
  gguf::WriterOptions wo;
  wo.overwrite = overwrite;
  gguf::GgufWriter w(path, wo);
  w.set("general.architecture", gguf::Value::string("graft"));
  w.set("graft.version", gguf::Value::u32(1));
  w.set("graft.model.identity", gguf::Value::string(model_identity));
  std::vector<int32_t> blocks, slots;
  for (const KvGraftLayer& l : layers) {
    blocks.push_back(static_cast<int32_t>(l.block));
    slots.push_back(static_cast<int32_t>(l.slots));
  }
  w.set("graft.layers", gguf::Value::array_i32(blocks));
  w.set("graft.slots", gguf::Value::array_i32(slots));
  w.set("graft.footprint", gguf::Value::u64(static_cast<uint64_t>(footprint)));
  for (const KvGraftLayer& l : layers) {
    DSV4_TRY(w.add_tensor(fmt::format("graft.kv.{}", l.block), GgmlType::F32,
                          {l.kv.size() / static_cast<size_t>(l.slots), static_cast<uint64_t>(l.slots)}));
    if (!l.keys.empty())
      DSV4_TRY(w.add_tensor(fmt::format("graft.index.{}", l.block), GgmlType::F32,
                            {l.keys.size() / static_cast<size_t>(l.slots), static_cast<uint64_t>(l.slots)}));
  }
  DSV4_TRY(w.begin());
  for (const KvGraftLayer& l : layers) {
    DSV4_TRY(w.write_tensor_data({reinterpret_cast<const uint8_t*>(l.kv.data()), l.kv.size() * sizeof(float)}));
    if (!l.keys.empty())
      DSV4_TRY(w.write_tensor_data({reinterpret_cast<const uint8_t*>(l.keys.data()), l.keys.size() * sizeof(float)}));
  }
  return w.finish();
}

}  // namespace dsv4
