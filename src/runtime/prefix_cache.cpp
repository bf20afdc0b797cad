#include "runtime/prefix_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace dsv4::runtime {
namespace {

namespace fs = std::filesystem;

constexpr char kFileMagic[8] = {'D', 'S', 'V', '4', 'K', 'V', 'C', '1'};
constexpr const char* kFileSuffix = ".dsv4kv";
constexpr uint64_t kMaxIdentityBytes = 4096;

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// Reads a persisted file's header: identity and tokens. `limit_tokens` bounds what is
// allocated from the file's own count (the context length).
Status read_header(std::istream& in, uint64_t file_size, uint64_t limit_tokens, std::string& identity,
                   std::vector<int32_t>& tokens, const std::string& name) {
  char magic[sizeof kFileMagic];
  uint64_t id_len = 0, n_tokens = 0;
  if (!in.read(magic, sizeof magic) || std::memcmp(magic, kFileMagic, sizeof magic) != 0)
    return Status::errorf("{}: not a dsv4 prefix-cache file", name);
  if (!in.read(reinterpret_cast<char*>(&id_len), sizeof id_len) || id_len > kMaxIdentityBytes)
    return Status::errorf("{}: identity length {} over {}", name, id_len, kMaxIdentityBytes);
  identity.resize(id_len);
  if (!in.read(identity.data(), static_cast<std::streamsize>(id_len)) ||
      !in.read(reinterpret_cast<char*>(&n_tokens), sizeof n_tokens))
    return Status::errorf("{}: truncated header", name);
  if (n_tokens == 0 || n_tokens > limit_tokens || n_tokens * sizeof(int32_t) > file_size)
    return Status::errorf("{}: {} tokens (allowed 1 to {})", name, n_tokens, limit_tokens);
  tokens.resize(n_tokens);
  if (!in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(n_tokens * sizeof(int32_t))))
    return Status::errorf("{}: truncated tokens", name);
  return Status::ok();
}

}  // namespace

CacheEntry::~CacheEntry() {
  if (budget_ && snapshot_bytes) budget_->release(snapshot_bytes);
}

PrefixCache::PrefixCache(const Model& model, std::shared_ptr<CacheBudget> budget, uint64_t max_context,
                         PrefixCacheOptions options)
    : model_(model), budget_(std::move(budget)), max_context_(max_context), opt_(std::move(options)) {
  int64_t largest = 1;
  for (uint32_t b = 0; b < model_.config().n_layers; ++b) largest = std::max<int64_t>(largest, model_.config().ratio(b));
  block_ = opt_.block > 0 ? opt_.block : largest;
  interval_ = opt_.snapshot_interval > 0 ? std::max<int64_t>(block_, opt_.snapshot_interval / block_ * block_) : 8 * block_;
  if (!opt_.persist_dir.empty() && !opt_.graft) scan_disk();
}

PrefixCache::~PrefixCache() = default;

bool PrefixCache::is_snapshot_point(int64_t p, int64_t prompt_end) const {
  if (p <= 0 || p % block_ != 0) return false;
  return p % interval_ == 0 || p == (prompt_end - 1) / block_ * block_;
}

int64_t PrefixCache::chunk_end(const CacheEntry& e, int64_t want_end, int64_t prompt_end) const {
  const int64_t pos = tokens_in(*e.seq);
  int64_t end = std::min(want_end, (pos / interval_ + 1) * interval_);
  if (const int64_t last = (prompt_end - 1) / block_ * block_; last > pos) end = std::min(end, last);
  return std::max(end, pos + 1);
}

float PrefixCache::default_alpha() const { return model_.steering() ? model_.steering()->alpha : 0.0f; }

Result<std::unique_ptr<Sequence>> PrefixCache::make_sequence(float steering_alpha) {
  SequenceOptions so;
  so.max_context = max_context_;
  so.shared_budget = budget_;
  so.graft = opt_.graft;
  so.with_mtp = opt_.with_mtp;
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, model_.new_sequence(so));
  seq->set_steering_alpha(steering_alpha);
  return seq;
}

template <typename Make>
Result<std::unique_ptr<Sequence>> PrefixCache::with_room(Make make, const CacheEntry* keep) {
  for (;;) {
    auto r = make();
    if (r.is_ok() || r.status().code() != StatusCode::kResourceExhausted) return r;
    // Evict the least recently used idle entry other than `keep`.
    std::shared_ptr<CacheEntry> victim;
    for (const auto& e : entries_)
      if (!e->busy && e.get() != keep && (!victim || e->last_use < victim->last_use)) victim = e;
    if (!victim) return r;
    if (!opt_.persist_dir.empty()) (void)persist(*victim);
    remove(victim);
    ++stats_.evictions;
  }
}

std::shared_ptr<CacheEntry> PrefixCache::adopt(std::unique_ptr<Sequence> seq, std::span<const int32_t> tokens) {
  auto e = std::make_shared<CacheEntry>(budget_);
  e->seq = std::move(seq);
  e->tokens.assign(tokens.begin(), tokens.end());
  e->busy = true;
  e->last_use = ++clock_;
  entries_.push_back(e);
  return e;
}

void PrefixCache::copy_snapshots(const CacheEntry& from, CacheEntry& to, int64_t up_to) {
  for (const auto& [p, s] : from.snapshots) {
    if (p > up_to) break;
    if (budget_ && !budget_->commit(s.bytes(), "prefix-cache snapshot").is_ok()) break;
    to.snapshots[p] = s;
    to.snapshot_bytes += s.bytes();
  }
}

void PrefixCache::drop_snapshots_after(CacheEntry& e, int64_t position) {
  for (auto it = e.snapshots.upper_bound(position); it != e.snapshots.end();) {
    if (budget_) budget_->release(it->second.bytes());
    e.snapshot_bytes -= it->second.bytes();
    it = e.snapshots.erase(it);
  }
}

void PrefixCache::remove(const std::shared_ptr<CacheEntry>& e) {
  entries_.erase(std::remove(entries_.begin(), entries_.end(), e), entries_.end());
}

Result<PrefixCache::Lease> PrefixCache::acquire(std::span<const int32_t> tokens, float steering_alpha) {
  ++stats_.lookups;
  const int64_t n = static_cast<int64_t>(tokens.size());
  struct Candidate {
    std::shared_ptr<CacheEntry> entry;
    int64_t usable = 0;
    const SequenceSnapshot* snap = nullptr;
  } best;
  for (const auto& e : entries_) {
    if (e->seq && e->seq->steering_alpha() != steering_alpha) continue;  // other activations, other rows
    const int64_t lcp = static_cast<int64_t>(common_prefix(e->tokens, tokens));
    Candidate c{e, 0, nullptr};
    if (lcp == static_cast<int64_t>(e->tokens.size()) && lcp < n) {
      c.usable = lcp;
    } else if (auto it = e->snapshots.upper_bound(std::min(lcp, n - 1)); it != e->snapshots.begin()) {
      --it;
      c.usable = it->first;
      c.snap = &it->second;
    }
    const bool better = c.usable > best.usable ||
                        (c.usable == best.usable && c.usable > 0 &&
                         ((best.entry->busy && !e->busy) || (best.snap && !c.snap)));
    if (better) best = c;
  }
  // A persisted entry that extends further than anything in memory.
  for (size_t i = 0; steering_alpha == default_alpha() && i < disk_.size(); ++i) {
    const DiskEntry& d = disk_[i];
    const int64_t len = static_cast<int64_t>(d.tokens.size());
    if (len <= best.usable || len >= n || common_prefix(d.tokens, tokens) != d.tokens.size()) continue;
    auto loaded = load(d, best.entry.get());
    if (!loaded.is_ok()) {
      std::error_code ec;
      if (loaded.status().code() != StatusCode::kResourceExhausted) {
        fs::remove(d.file, ec);
        stats_.disk_bytes -= d.bytes;
        disk_.erase(disk_.begin() + static_cast<std::ptrdiff_t>(i));
        --i;
      }
      continue;
    }
    best = {*loaded, len, nullptr};
    break;
  }

  if (best.usable == 0) {
    DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, with_room([&] { return make_sequence(steering_alpha); }, nullptr));
    return Lease{adopt(std::move(seq), {}), 0};
  }
  CacheEntry& from = *best.entry;
  const bool take_over = !from.busy && (!best.snap || best.usable * 2 >= static_cast<int64_t>(from.tokens.size()));
  if (!take_over) {
    auto child = with_room([&] { return model_.fork(*from.seq); }, &from);
    if (child.is_ok() && (!best.snap || model_.restore(**child, *best.snap).is_ok())) {
      auto e = adopt(std::move(*child), tokens.first(static_cast<size_t>(best.usable)));
      copy_snapshots(from, *e, best.usable);
      ++stats_.hits;
      stats_.reused_tokens += static_cast<uint64_t>(best.usable);
      return Lease{e, best.usable};
    }
    if (from.busy) {  // no room for a copy: start from scratch
      DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, with_room([&] { return make_sequence(steering_alpha); }, nullptr));
      return Lease{adopt(std::move(seq), {}), 0};
    }
  }
  if (best.snap) {
    if (Status s = model_.restore(*from.seq, *best.snap); !s.is_ok()) {
      remove(best.entry);
      return acquire(tokens, steering_alpha);
    }
    from.tokens.resize(static_cast<size_t>(best.usable));
    drop_snapshots_after(from, best.usable);
  }
  from.busy = true;
  from.last_use = ++clock_;
  ++stats_.hits;
  stats_.reused_tokens += static_cast<uint64_t>(best.usable);
  return Lease{best.entry, best.usable};
}

void PrefixCache::release(const std::shared_ptr<CacheEntry>& e) {
  e->busy = false;
  e->last_use = ++clock_;
  if (e->tokens.empty()) {
    remove(e);
    return;
  }
  size_t idle = 0;
  for (const auto& x : entries_) idle += !x->busy;
  while (idle-- > opt_.max_idle && evict_one()) {
  }
}

void PrefixCache::discard(const std::shared_ptr<CacheEntry>& e) { remove(e); }

bool PrefixCache::evict_one() {
  std::shared_ptr<CacheEntry> victim;
  for (const auto& e : entries_)
    if (!e->busy && (!victim || e->last_use < victim->last_use)) victim = e;
  if (!victim) return false;
  if (!opt_.persist_dir.empty()) (void)persist(*victim);
  remove(victim);
  ++stats_.evictions;
  return true;
}

bool PrefixCache::drop_snapshots() {
  bool any = false;
  for (const auto& e : entries_)
    if (e->busy && !e->snapshots.empty()) {
      drop_snapshots_after(*e, -1);
      any = true;
    }
  return any;
}

void PrefixCache::on_advance(CacheEntry& e, int64_t prompt_end) {
  const int64_t p = tokens_in(*e.seq);
  if (!is_snapshot_point(p, prompt_end) || e.snapshots.count(p)) return;
  auto snap = model_.snapshot(*e.seq);
  if (!snap.is_ok()) return;
  if (budget_ && !budget_->commit(snap->bytes(), "prefix-cache snapshot").is_ok()) return;
  e.snapshot_bytes += snap->bytes();
  e.snapshots.emplace(p, std::move(*snap));
  // Thinning: drop the snapshot closest to its predecessor, keeping an even spread.
  while (e.snapshots.size() > opt_.max_snapshots) {
    auto victim = e.snapshots.begin();
    int64_t smallest = victim->first, prev = victim->first;
    for (auto it = std::next(e.snapshots.begin()); it != e.snapshots.end(); ++it) {
      if (it->first - prev < smallest) {
        smallest = it->first - prev;
        victim = it;
      }
      prev = it->first;
    }
    if (budget_) budget_->release(victim->second.bytes());
    e.snapshot_bytes -= victim->second.bytes();
    e.snapshots.erase(victim);
  }
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s = stats_;
  s.idle_entries = s.busy_entries = s.snapshots = s.snapshot_bytes = 0;
  for (const auto& e : entries_) {
    (e->busy ? s.busy_entries : s.idle_entries) += 1;
    s.snapshots += e->snapshots.size();
    s.snapshot_bytes += e->snapshot_bytes;
  }
  s.disk_entries = disk_.size();
  return s;
}

// ---- disk ------------------------------------------------------------------------------

Status PrefixCache::persist(const CacheEntry& e) {
  if (opt_.persist_dir.empty() || opt_.graft || static_cast<int64_t>(e.tokens.size()) < block_ || !e.seq ||
      e.seq->steering_alpha() != default_alpha())
    return Status::ok();
  const uint64_t h = fnv1a(e.tokens.data(), e.tokens.size() * sizeof(int32_t));
  const std::string file = (fs::path(opt_.persist_dir) / fmt::format("{:016x}{}", h, kFileSuffix)).string();
  for (const DiskEntry& d : disk_)
    if (d.file == file) return Status::ok();
  DSV4_ASSIGN_OR_RETURN(std::vector<uint8_t> state, model_.export_sequence(*e.seq));
  std::string head(kFileMagic, sizeof kFileMagic);
  put(head, static_cast<uint64_t>(opt_.identity.size()));
  head += opt_.identity;
  put(head, static_cast<uint64_t>(e.tokens.size()));
  head.append(reinterpret_cast<const char*>(e.tokens.data()), e.tokens.size() * sizeof(int32_t));
  const uint64_t bytes = head.size() + state.size();
  if (bytes > opt_.persist_budget) return Status::ok();
  const std::string temp = file + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    out.write(reinterpret_cast<const char*>(state.data()), static_cast<std::streamsize>(state.size()));
    if (!out) return Status::errorf(StatusCode::kIo, "{}: write failed", temp);
  }
  std::error_code ec;
  fs::rename(temp, file, ec);
  if (ec) return Status::errorf(StatusCode::kIo, "{}: {}", file, ec.message());
  disk_.push_back({file, e.tokens, bytes, ++disk_order_});
  stats_.disk_bytes += bytes;
  ++stats_.disk_writes;
  trim_disk();
  return Status::ok();
}

void PrefixCache::trim_disk() {
  while (stats_.disk_bytes > opt_.persist_budget && !disk_.empty()) {
    auto oldest = std::min_element(disk_.begin(), disk_.end(),
                                   [](const DiskEntry& a, const DiskEntry& b) { return a.order < b.order; });
    std::error_code ec;
    fs::remove(oldest->file, ec);
    stats_.disk_bytes -= oldest->bytes;
    disk_.erase(oldest);
  }
}

void PrefixCache::scan_disk() {
  std::error_code ec;
  fs::create_directories(opt_.persist_dir, ec);
  std::vector<std::pair<fs::file_time_type, DiskEntry>> found;
  for (const auto& f : fs::directory_iterator(opt_.persist_dir, ec)) {
    if (!f.is_regular_file() || f.path().extension() != kFileSuffix) continue;
    std::ifstream in(f.path(), std::ios::binary);
    std::string identity;
    DiskEntry d;
    d.file = f.path().string();
    d.bytes = f.file_size(ec);
    if (!read_header(in, d.bytes, max_context_, identity, d.tokens, d.file).is_ok() || identity != opt_.identity)
      continue;  // another model's (or a damaged) file: left alone
    found.push_back({f.last_write_time(ec), std::move(d)});
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [t, d] : found) {
    d.order = ++disk_order_;
    stats_.disk_bytes += d.bytes;
    disk_.push_back(std::move(d));
  }
  trim_disk();
}

Result<std::shared_ptr<CacheEntry>> PrefixCache::load(const DiskEntry& d, const CacheEntry* keep) {
  std::ifstream in(d.file, std::ios::binary);
  std::string identity;
  std::vector<int32_t> tokens;
  DSV4_TRY(read_header(in, d.bytes, max_context_, identity, tokens, d.file));
  if (identity != opt_.identity || tokens != d.tokens) return Status::errorf("{}: changed on disk", d.file);
  const auto header_end = static_cast<uint64_t>(in.tellg());
  std::vector<uint8_t> state(d.bytes - header_end);
  if (!in.read(reinterpret_cast<char*>(state.data()), static_cast<std::streamsize>(state.size())))
    return Status::errorf(StatusCode::kIo, "{}: truncated state", d.file);
  SequenceOptions so;
  so.max_context = max_context_;
  so.shared_budget = budget_;
  so.with_mtp = opt_.with_mtp;
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq,
                        with_room([&] { return model_.import_sequence(state, so); }, keep));
  if (seq->position() != static_cast<int64_t>(tokens.size()))
    return Status::errorf("{}: the state is at position {}, the file lists {} tokens", d.file, seq->position(),
                          tokens.size());
  auto e = adopt(std::move(seq), tokens);
  e->busy = false;
  ++stats_.disk_loads;
  return e;
}

Status PrefixCache::persist_all() {
  if (opt_.persist_dir.empty()) return Status::ok();
  for (const auto& e : entries_)
    if (!e->busy) DSV4_TRY(persist(*e));
  return Status::ok();
}

Result<std::string> model_identity(const std::string& path, const ModelOptions& options) {
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return Status::errorf(StatusCode::kIo, "{}: {}", path, ec.message());
  std::ifstream in(path, std::ios::binary);
  auto hash_range = [&](uint64_t offset, uint64_t n) -> Result<uint64_t> {
    std::vector<char> buf(1 << 20);
    uint64_t h = 1469598103934665603ull;
    in.seekg(static_cast<std::streamoff>(offset));
    while (n > 0) {
      const uint64_t k = std::min<uint64_t>(n, buf.size());
      if (!in.read(buf.data(), static_cast<std::streamsize>(k))) return Status::errorf(StatusCode::kIo, "{}: read failed", path);
      h = fnv1a(buf.data(), k, h);
      n -= k;
    }
    return h;
  };
  const uint64_t head_n = std::min<uint64_t>(size, 16u << 20), tail_n = std::min<uint64_t>(size, 1u << 20);
  DSV4_ASSIGN_OR_RETURN(uint64_t head, hash_range(0, head_n));
  DSV4_ASSIGN_OR_RETURN(uint64_t tail, hash_range(size - tail_n, tail_n));
  return fmt::format("dsv4 model size={} head={:016x} tail={:016x} qat={} matmul={}", size, head, tail,
                     options.qat ? 1 : 0, options.matmul == backend::MatmulMode::Exact ? "exact" : "quantized");
}

}  // namespace dsv4::runtime
