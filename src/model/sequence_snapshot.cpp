// Model::fork, snapshot, restore, export_sequence and import_sequence over today's
// Sequence (cache.h): deep copies through the backend's copy_rows, upload and download.
//
// What changes as a sequence advances: the window rings (slot = position mod window),
// the compressor states of the open blocks, the position and the entry counts. The
// compressed entries and indexer keys only grow: rows below the entry count are never
// rewritten, so a snapshot leaves them out and a restore only lowers the count.
#include <fmt/format.h>

#include <cstring>

#include "model/model.h"

namespace dsv4 {

using backend::Tensor;

struct SequenceSnapshot::State {
  struct Block {
    std::vector<float> window, comp_kv, comp_score, index_kv, index_score;
    int64_t n_entries = 0;
  };
  int64_t position = 0, mtp_position = 0;
  uint64_t max_context = 0;
  std::vector<Block> blocks;
  uint64_t bytes = 0;
};

SequenceSnapshot::SequenceSnapshot() = default;
SequenceSnapshot::~SequenceSnapshot() = default;
SequenceSnapshot::SequenceSnapshot(const SequenceSnapshot&) = default;
SequenceSnapshot& SequenceSnapshot::operator=(const SequenceSnapshot&) = default;
SequenceSnapshot::SequenceSnapshot(SequenceSnapshot&&) noexcept = default;
SequenceSnapshot& SequenceSnapshot::operator=(SequenceSnapshot&&) noexcept = default;
int64_t SequenceSnapshot::position() const { return state_ ? state_->position : 0; }
uint64_t SequenceSnapshot::bytes() const { return state_ ? state_->bytes : 0; }

namespace {

Status download_all(backend::Backend& be, const Tensor& t, std::vector<float>& host) {
  host.clear();
  if (!t.valid()) return Status::ok();
  host.resize(static_cast<size_t>(t.n_elements()));
  return be.download(t, host.data(), host.size() * sizeof(float));
}

Status upload_all(backend::Backend& be, const Tensor& t, const std::vector<float>& host, const char* what) {
  if (!t.valid() && host.empty()) return Status::ok();
  if (!t.valid() || host.size() != static_cast<size_t>(t.n_elements()))
    return Status::errorf("restore: {} holds {} values, the sequence's {} has {}", what, host.size(),
                          t.valid() ? t.describe() : "nothing", t.valid() ? t.n_elements() : 0);
  return be.upload(t, host.data(), host.size() * sizeof(float));
}

Status copy_whole(backend::Backend& be, const Tensor& src, const Tensor& dst) {
  return src.valid() ? be.copy_rows(src, dst) : Status::ok();
}

// A little-endian byte writer and checked reader for export/import.
struct Writer {
  std::vector<uint8_t> out;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  void i64(int64_t v) { bytes(&v, sizeof v); }
};

struct Reader {
  std::span<const uint8_t> in;
  size_t at = 0;
  Status bytes(void* p, size_t n, const char* what) {
    if (n > in.size() - at)
      return Status::errorf("import_sequence: {} at byte {} needs {} bytes, {} left", what, at, n, in.size() - at);
    std::memcpy(p, in.data() + at, n);
    at += n;
    return Status::ok();
  }
  Result<int64_t> i64(const char* what) {
    int64_t v = 0;
    DSV4_TRY(bytes(&v, sizeof v, what));
    return v;
  }
};

constexpr char kMagic[8] = {'D', 'S', 'V', '4', 'S', 'E', 'Q', '1'};

}  // namespace

Result<std::unique_ptr<Sequence>> Model::fork(const Sequence& seq) const {
  SequenceOptions o;
  o.max_context = seq.max_context();
  o.with_mtp = seq.blocks_.size() > config_.n_layers;
  o.shared_budget = seq.budget_;
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> copy, new_sequence(o));
  DSV4_TRY(copy->commit_through(seq.position_));
  backend::Backend& be = *backend_;
  for (size_t b = 0; b < seq.blocks_.size(); ++b) {
    const Sequence::Block& from = seq.blocks_[b];
    Sequence::Block& to = copy->blocks_[b];
    DSV4_TRY(copy_whole(be, from.window, to.window));
    DSV4_TRY(copy_whole(be, from.comp_kv, to.comp_kv));
    DSV4_TRY(copy_whole(be, from.comp_score, to.comp_score));
    DSV4_TRY(copy_whole(be, from.index_kv, to.index_kv));
    DSV4_TRY(copy_whole(be, from.index_score, to.index_score));
    if (from.n_entries > 0) {
      DSV4_TRY(be.copy_rows(from.entries.slice(0, from.n_entries), to.entries.slice(0, from.n_entries)));
      if (from.index_keys.valid())
        DSV4_TRY(be.copy_rows(from.index_keys.slice(0, from.n_entries), to.index_keys.slice(0, from.n_entries)));
    }
    to.n_entries = from.n_entries;
  }
  copy->position_ = seq.position_;
  copy->mtp_position_ = seq.mtp_position_;
  return copy;
}

Result<SequenceSnapshot> Model::snapshot(const Sequence& seq) const {
  auto state = std::make_shared<SequenceSnapshot::State>();
  state->position = seq.position_;
  state->mtp_position = seq.mtp_position_;
  state->max_context = seq.max_context();
  state->blocks.resize(seq.blocks_.size());
  backend::Backend& be = *backend_;
  uint64_t values = 0;
  for (size_t b = 0; b < seq.blocks_.size(); ++b) {
    const Sequence::Block& from = seq.blocks_[b];
    SequenceSnapshot::State::Block& to = state->blocks[b];
    DSV4_TRY(download_all(be, from.window, to.window));
    DSV4_TRY(download_all(be, from.comp_kv, to.comp_kv));
    DSV4_TRY(download_all(be, from.comp_score, to.comp_score));
    DSV4_TRY(download_all(be, from.index_kv, to.index_kv));
    DSV4_TRY(download_all(be, from.index_score, to.index_score));
    to.n_entries = from.n_entries;
    values += to.window.size() + to.comp_kv.size() + to.comp_score.size() + to.index_kv.size() + to.index_score.size();
  }
  state->bytes = values * sizeof(float) + sizeof(SequenceSnapshot::State) +
                 state->blocks.size() * sizeof(SequenceSnapshot::State::Block);
  SequenceSnapshot snap;
  snap.state_ = std::move(state);
  return snap;
}

Status Model::restore(Sequence& seq, const SequenceSnapshot& snap) const {
  if (!snap.valid()) return Status::error("restore: empty snapshot");
  const SequenceSnapshot::State& s = *snap.state_;
  if (s.blocks.size() != seq.blocks_.size() || s.max_context != seq.max_context())
    return Status::errorf("restore: the snapshot has {} blocks for a context of {}, the sequence {} for {}",
                          s.blocks.size(), s.max_context, seq.blocks_.size(), seq.max_context());
  if (s.position > seq.position_ || s.mtp_position > seq.mtp_position_)
    return Status::errorf(StatusCode::kOutOfRange,
                          "restore: the snapshot is at position {} (MTP {}), beyond the sequence's {} (MTP {})",
                          s.position, s.mtp_position, seq.position_, seq.mtp_position_);
  for (size_t b = 0; b < s.blocks.size(); ++b)
    if (s.blocks[b].n_entries > seq.blocks_[b].n_entries)
      return Status::errorf("restore: block {}: the snapshot has {} entries, the sequence only {}", b,
                            s.blocks[b].n_entries, seq.blocks_[b].n_entries);
  backend::Backend& be = *backend_;
  for (size_t b = 0; b < s.blocks.size(); ++b) {
    const SequenceSnapshot::State::Block& from = s.blocks[b];
    Sequence::Block& to = seq.blocks_[b];
    DSV4_TRY(upload_all(be, to.window, from.window, "the window"));
    DSV4_TRY(upload_all(be, to.comp_kv, from.comp_kv, "the compressor kv state"));
    DSV4_TRY(upload_all(be, to.comp_score, from.comp_score, "the compressor score state"));
    DSV4_TRY(upload_all(be, to.index_kv, from.index_kv, "the indexer kv state"));
    DSV4_TRY(upload_all(be, to.index_score, from.index_score, "the indexer score state"));
    to.n_entries = from.n_entries;
  }
  seq.position_ = s.position;
  seq.mtp_position_ = s.mtp_position;
  return Status::ok();
}

Result<std::vector<uint8_t>> Model::export_sequence(const Sequence& seq) const {
  backend::Backend& be = *backend_;
  Writer w;
  w.bytes(kMagic, sizeof kMagic);
  w.i64(static_cast<int64_t>(seq.blocks_.size()));
  w.i64(static_cast<int64_t>(seq.max_context()));
  w.i64(seq.position_);
  w.i64(seq.mtp_position_);
  std::vector<float> host;
  auto put = [&](const Tensor& t, int64_t rows) -> Status {
    w.i64(t.valid() ? rows : 0);
    w.i64(t.valid() ? t.cols() : 0);
    if (!t.valid() || rows == 0) return Status::ok();
    host.resize(static_cast<size_t>(rows * t.cols()));
    DSV4_TRY(be.download(rows == t.rows() ? t : t.slice(0, rows), host.data(), host.size() * sizeof(float)));
    w.bytes(host.data(), host.size() * sizeof(float));
    return Status::ok();
  };
  for (const Sequence::Block& b : seq.blocks_) {
    w.i64(b.ratio);
    w.i64(b.n_entries);
    DSV4_TRY(put(b.window, b.window.rows()));
    DSV4_TRY(put(b.comp_kv, b.comp_kv.rows()));
    DSV4_TRY(put(b.comp_score, b.comp_score.rows()));
    DSV4_TRY(put(b.index_kv, b.index_kv.rows()));
    DSV4_TRY(put(b.index_score, b.index_score.rows()));
    DSV4_TRY(put(b.entries, b.n_entries));
    DSV4_TRY(put(b.index_keys, b.n_entries));
  }
  return std::move(w.out);
}

Result<std::unique_ptr<Sequence>> Model::import_sequence(std::span<const uint8_t> bytes,
                                                         const SequenceOptions& options) const {
  Reader r{bytes};
  char magic[sizeof kMagic];
  DSV4_TRY(r.bytes(magic, sizeof magic, "the magic"));
  if (std::memcmp(magic, kMagic, sizeof kMagic) != 0)
    return Status::error("import_sequence: not a dsv4 sequence state (bad magic)");
  DSV4_ASSIGN_OR_RETURN(int64_t n_blocks, r.i64("the block count"));
  DSV4_ASSIGN_OR_RETURN(int64_t context, r.i64("the context"));
  DSV4_ASSIGN_OR_RETURN(int64_t position, r.i64("the position"));
  DSV4_ASSIGN_OR_RETURN(int64_t mtp_position, r.i64("the MTP position"));
  if (n_blocks != config_.n_layers && n_blocks != static_cast<int64_t>(config_.n_blocks()))
    return Status::errorf("import_sequence: {} blocks, the model has {} (or {} with MTP)", n_blocks, config_.n_layers,
                          config_.n_blocks());
  SequenceOptions o = options;
  o.with_mtp = n_blocks > config_.n_layers;
  const uint64_t max_context = o.max_context ? o.max_context : config_.context_length;
  if (position < 0 || mtp_position < 0 || static_cast<uint64_t>(position) > max_context ||
      static_cast<uint64_t>(mtp_position) > max_context)
    return Status::errorf(StatusCode::kOutOfRange, "import_sequence: position {} (MTP {}) outside [0, {}] (saved for a context of {})",
                          position, mtp_position, max_context, context);
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, new_sequence(o));
  DSV4_TRY(seq->commit_through(position));
  backend::Backend& be = *backend_;
  std::vector<float> host;
  auto get = [&](const Tensor& t, int64_t expect_rows, const char* what, size_t b) -> Status {
    DSV4_ASSIGN_OR_RETURN(int64_t rows, r.i64(what));
    DSV4_ASSIGN_OR_RETURN(int64_t cols, r.i64(what));
    const int64_t want_rows = t.valid() ? expect_rows : 0, want_cols = t.valid() ? t.cols() : 0;
    if (rows != want_rows || cols != want_cols)
      return Status::errorf("import_sequence: block {}: {} is [{}, {}], this model's is [{}, {}]", b, what, rows, cols,
                            want_rows, want_cols);
    if (rows == 0) return Status::ok();
    host.resize(static_cast<size_t>(rows * cols));
    DSV4_TRY(r.bytes(host.data(), host.size() * sizeof(float), what));
    return be.upload(rows == t.rows() ? t : t.slice(0, rows), host.data(), host.size() * sizeof(float));
  };
  for (size_t b = 0; b < seq->blocks_.size(); ++b) {
    Sequence::Block& blk = seq->blocks_[b];
    DSV4_ASSIGN_OR_RETURN(int64_t ratio, r.i64("a block's ratio"));
    DSV4_ASSIGN_OR_RETURN(int64_t n_entries, r.i64("a block's entry count"));
    const int64_t expect_entries = blk.ratio ? position / blk.ratio : 0;
    if (ratio != blk.ratio || n_entries != expect_entries)
      return Status::errorf("import_sequence: block {}: ratio {} with {} entries; this model's block has ratio {} "
                            "and {} entries at position {}", b, ratio, n_entries, blk.ratio, expect_entries, position);
    DSV4_TRY(get(blk.window, blk.window.rows(), "the window", b));
    DSV4_TRY(get(blk.comp_kv, blk.comp_kv.rows(), "the compressor kv state", b));
    DSV4_TRY(get(blk.comp_score, blk.comp_score.rows(), "the compressor score state", b));
    DSV4_TRY(get(blk.index_kv, blk.index_kv.rows(), "the indexer kv state", b));
    DSV4_TRY(get(blk.index_score, blk.index_score.rows(), "the indexer score state", b));
    DSV4_TRY(get(blk.entries, n_entries, "the compressed entries", b));
    DSV4_TRY(get(blk.index_keys, n_entries, "the indexer keys", b));
    blk.n_entries = n_entries;
  }
  if (r.at != bytes.size())
    return Status::errorf("import_sequence: {} bytes after the state's end at byte {}", bytes.size() - r.at, r.at);
  seq->position_ = position;
  seq->mtp_position_ = mtp_position;
  return seq;
}

}  // namespace dsv4
