#include "model/kv_cache.h"

#include "model/kv_graft.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <span>

#include "util/counter_rng.h"
#include "util/thread_pool.h"

namespace dsv4 {

using backend::Tensor;

// Pages of one row width, shared by every list of that width.
struct KvCache::Pool {
  uint32_t width = 0;
  int64_t page_rows = 0;
  int64_t n_pages = 0;
  Tensor data;                                        // F32 [n_pages * page_rows, width]
  std::vector<int32_t> free;                          // page ids, taken from the back
  std::vector<uint32_t> refs;                         // sequences referencing each page
  std::vector<std::shared_ptr<CacheBudget>> charged;  // the budget each page is charged to

  uint64_t page_bytes() const { return static_cast<uint64_t>(page_rows) * width * sizeof(float); }
};

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<int64_t> shape2(int64_t rows, int64_t cols) { return {rows, cols}; }

}  // namespace

KvCacheBytes KvCache::plan_bytes(const ModelConfig& c, const ModelPlan& plan, const KvCacheOptions& o) {
  // The same arithmetic as create(), part by part.
  KvCacheBytes b;
  const uint64_t slots = o.max_sequences, P = std::max<uint32_t>(o.page_rows, 1);
  const uint64_t max_context = o.max_context ? std::min<uint64_t>(o.max_context, c.context_length) : c.context_length;
  b.slots = slots * plan.n_rings * (plan.window + kRewindTokens) * plan.ring_width * sizeof(float);
  for (const CompressorStatePlan& s : plan.states)
    b.slots += 2 * slots * (s.rows + kRewindTokens) * s.cols * sizeof(float);
  std::map<uint32_t, uint64_t> full_pages;
  for (const CacheListPlan& l : plan.lists) {
    const uint64_t max_pages =
        std::max<uint64_t>(static_cast<uint64_t>(ceil_div(static_cast<int64_t>(max_context) / l.ratio, P)), 1);
    b.tables += (slots * max_pages + slots) * sizeof(int32_t);
    full_pages[l.width] += slots * max_pages;
  }
  uint64_t full_bytes = 0;
  for (auto [width, pages] : full_pages) full_bytes += pages * P * width * sizeof(float);
  for (auto [width, pages] : full_pages) {
    const uint64_t n_pages = o.pool_bytes == 0 || full_bytes == 0
                                 ? pages
                                 : std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<double>(o.pool_bytes) *
                                                                               static_cast<double>(pages) /
                                                                               static_cast<double>(full_bytes)));
    b.pages += n_pages * P * width * sizeof(float);
  }
  return b;
}

KvCacheBytes KvCache::allocated_bytes() const {
  // Every tensor here is F32 or I32.
  const auto tensor_bytes = [](const Tensor& t) { return static_cast<uint64_t>(t.rows()) * t.cols() * 4; };
  KvCacheBytes b;
  for (const Tensor& t : rings_) b.slots += tensor_bytes(t);
  for (size_t s = 0; s < states_kv_.size(); ++s)
    b.slots += tensor_bytes(states_kv_[s]) + tensor_bytes(states_score_[s]);
  for (const ListTable& t : tables_) b.tables += tensor_bytes(t.device) + tensor_bytes(t.first_row);
  for (const auto& p : pools_) b.pages += tensor_bytes(p->data);
  return b;
}

KvCache::KvCache(const ModelPlan& plan, backend::Backend& be) : plan_(plan), be_(be) {}
KvCache::~KvCache() = default;

Result<std::unique_ptr<KvCache>> KvCache::create(const ModelConfig& c, const ModelPlan& plan,
                                                 backend::Backend& be, const KvCacheOptions& o) {
  if (o.max_sequences == 0 || o.page_rows == 0)
    return Status::errorf("cache: max_sequences {} and page_rows {} must be positive", o.max_sequences,
                          o.page_rows);
  std::unique_ptr<KvCache> kc(new KvCache(plan, be));
  kc->options_ = o;
  kc->max_context_ = o.max_context ? std::min<uint64_t>(o.max_context, c.context_length) : c.context_length;
  kc->ring_rows_ = plan.window + kRewindTokens;
  const int64_t slots = o.max_sequences, P = o.page_rows;

  for (uint32_t r = 0; r < plan.n_rings; ++r) {
    DSV4_ASSIGN_OR_RETURN(Tensor t, be.reserve(GgmlType::F32, shape2(slots * kc->ring_rows_, plan.ring_width)));
    kc->rings_.push_back(t);
  }
  for (const CompressorStatePlan& s : plan.states) {
    const int64_t rows = int64_t{s.rows} + kRewindTokens;
    DSV4_ASSIGN_OR_RETURN(Tensor kv, be.reserve(GgmlType::F32, shape2(slots * rows, s.cols)));
    DSV4_ASSIGN_OR_RETURN(Tensor score, be.reserve(GgmlType::F32, shape2(slots * rows, s.cols)));
    kc->states_kv_.push_back(kv);
    kc->states_score_.push_back(score);
    kc->state_rows_.push_back(rows);
  }
  kc->fixed_bytes_ = uint64_t{plan.n_rings} * kc->ring_rows_ * plan.ring_width * sizeof(float);
  for (int64_t s = 0; s < static_cast<int64_t>(plan.states.size()); ++s)
    kc->fixed_bytes_ += 2ull * kc->state_rows_[s] * plan.states[s].cols * sizeof(float);

  // Page tables, and the pages every slot needs at the full context per width.
  std::map<uint32_t, int64_t> full_pages;  // width -> pages for all slots at max_context
  for (const CacheListPlan& l : plan.lists) {
    ListTable t;
    t.max_pages = ceil_div(static_cast<int64_t>(kc->max_context_) / l.ratio, P);
    t.max_pages = std::max<int64_t>(t.max_pages, 1);
    DSV4_ASSIGN_OR_RETURN(t.device, be.reserve(GgmlType::I32, shape2(slots, t.max_pages)));
    t.host.assign(static_cast<size_t>(slots * t.max_pages), -1);
    t.dirty.assign(slots, true);
    DSV4_ASSIGN_OR_RETURN(t.first_row, be.reserve(GgmlType::I32, std::vector<int64_t>{slots}));
    t.first_row_host.assign(slots, 0);
    full_pages[l.width] += slots * t.max_pages;
    kc->tables_.push_back(std::move(t));
  }
  uint64_t full_bytes = 0;
  for (auto [width, pages] : full_pages) full_bytes += static_cast<uint64_t>(pages) * P * width * sizeof(float);
  for (auto [width, pages] : full_pages) {
    auto pool = std::make_unique<Pool>();
    pool->width = width;
    pool->page_rows = P;
    // A budget is split between the widths in the proportion the full context needs them.
    pool->n_pages = o.pool_bytes == 0 || full_bytes == 0
                        ? pages
                        : std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(o.pool_bytes) *
                                                                    pages / full_bytes));
    DSV4_ASSIGN_OR_RETURN(pool->data, be.reserve(GgmlType::F32, shape2(pool->n_pages * P, width)));
    pool->refs.assign(pool->n_pages, 0);
    pool->charged.resize(pool->n_pages);
    for (int64_t p = pool->n_pages - 1; p >= 0; --p) pool->free.push_back(static_cast<int32_t>(p));
    for (size_t l = 0; l < plan.lists.size(); ++l)
      if (plan.lists[l].width == width) kc->tables_[l].pool = static_cast<int32_t>(kc->pools_.size());
    kc->pools_.push_back(std::move(pool));
  }
  for (uint32_t s = slots; s > 0; --s) kc->free_slots_.push_back(s - 1);
  for (ListTable& t : kc->tables_) DSV4_TRY(be.fill(t.device, -1));
  return kc;
}

uint64_t KvCache::free_pages(uint32_t width) const {
  for (const auto& p : pools_)
    if (p->width == width) return p->free.size();
  return 0;
}

backend::PagedRows KvCache::list(int32_t id) const {
  const ListTable& t = tables_.at(id);
  return {pools_[t.pool]->data, t.device, pools_[t.pool]->page_rows, t.first_row};
}

uint64_t KvCache::page_bytes(int32_t list) const { return pools_[tables_.at(list).pool]->page_bytes(); }

uint64_t KvCache::referenced_bytes(const Sequence& seq) const {
  uint64_t n = 0;
  for (size_t l = 0; l < seq.pages_.size(); ++l)
    n += std::count_if(seq.pages_[l].begin(), seq.pages_[l].end(), [](int32_t p) { return p >= 0; }) *
         page_bytes(static_cast<int32_t>(l));
  return n;
}

int64_t KvCache::rows_at(int32_t list, int64_t position) const { return position / plan_.lists[list].ratio; }

void KvCache::set_page(int32_t list, uint32_t slot, size_t index, int32_t page) {
  ListTable& t = tables_[list];
  t.host[slot * t.max_pages + index] = page;
  t.dirty[slot] = true;
}

Status KvCache::reset_states(uint32_t slot) {
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    const int64_t rows = state_rows_[s];
    // Empty slots score -inf, so a block's missing "previous" half weighs nothing; their
    // values must be finite (0 * inf would be NaN).
    DSV4_TRY(be_.fill(states_kv_[s].slice(slot * rows, rows), 0.0f));
    DSV4_TRY(be_.fill(states_score_[s].slice(slot * rows, rows), -std::numeric_limits<float>::infinity()));
  }
  return Status::ok();
}

Status KvCache::attach(Sequence& seq) {
  if (free_slots_.empty())
    return Status::errorf(StatusCode::kResourceExhausted, "cache: all {} sequence slots are in use",
                          options_.max_sequences);
  if (seq.plan_.context > max_context_)
    return Status::errorf(StatusCode::kOutOfRange, "cache: a context of {} tokens exceeds the cache's {}",
                          seq.plan_.context, max_context_);
  if (seq.budget_) DSV4_TRY(seq.budget_->commit(seq.plan_.fixed(), "new sequence (windows, compressor states)"));
  const uint32_t slot = free_slots_.back();
  if (Status st = reset_states(slot); !st) {
    if (seq.budget_) seq.budget_->release(seq.plan_.fixed());
    return st;
  }
  free_slots_.pop_back();
  seq.cache_ = this;
  seq.slot_ = slot;
  seq.pages_.assign(plan_.lists.size(), {});
  for (ListTable& t : tables_) {
    t.first_row_host[slot] = 0;
    t.first_row_dirty = true;
  }
  return Status::ok();
}

Result<int32_t> KvCache::take_page(int32_t list, const std::shared_ptr<CacheBudget>& budget) {
  Pool& pool = *pools_[tables_[list].pool];
  if (pool.free.empty())
    return Status::errorf(StatusCode::kResourceExhausted, "cache: no free page of {}-wide rows ({} pages in all)",
                          pool.width, pool.n_pages);
  const int32_t page = pool.free.back();
  pool.free.pop_back();
  pool.refs[page] = 1;
  pool.charged[page] = budget;
  return page;
}

void KvCache::drop_page(int32_t list, int32_t page) {
  if (page < 0) return;  // no page below a graft's first row
  Pool& pool = *pools_[tables_[list].pool];
  if (--pool.refs[page] > 0) return;
  if (pool.charged[page]) pool.charged[page]->release(pool.page_bytes());
  pool.charged[page].reset();
  pool.free.push_back(page);
}

Status KvCache::prepare(Sequence& seq, int64_t end) {
  if (seq.cache_ != this) return Status::error(StatusCode::kInternal, "cache: sequence from another cache");
  // First count what is needed, so a refusal changes nothing.
  struct Need { int32_t list; size_t index; bool copy; };
  std::vector<Need> needs;
  std::vector<int64_t> per_pool(pools_.size(), 0);
  uint64_t bytes = 0;
  for (size_t l = 0; l < plan_.lists.size(); ++l) {
    const int32_t list = static_cast<int32_t>(l);
    const int64_t before = rows_at(list, seq.position_), after = rows_at(list, end);
    if (after <= before) continue;
    const int64_t P = pools_[tables_[l].pool]->page_rows;
    if (ceil_div(after, P) > tables_[l].max_pages)
      return Status::errorf(StatusCode::kOutOfRange, "cache: {} rows exceed the page table's {} pages of {}",
                            after, tables_[l].max_pages, P);
    const std::vector<int32_t>& pages = seq.pages_[l];
    for (int64_t i = before / P; i <= (after - 1) / P; ++i) {
      const bool exists = i < static_cast<int64_t>(pages.size()) && pages[i] >= 0;
      if (exists && pools_[tables_[l].pool]->refs[pages[i]] <= 1) continue;  // private already
      needs.push_back({list, static_cast<size_t>(i), exists});
      ++per_pool[tables_[l].pool];
      bytes += pools_[tables_[l].pool]->page_bytes();
    }
  }
  if (needs.empty()) return Status::ok();
  for (size_t p = 0; p < pools_.size(); ++p)
    if (per_pool[p] > static_cast<int64_t>(pools_[p]->free.size()))
      return Status::errorf(StatusCode::kResourceExhausted,
                            "cache: a sequence at position {} needs {} more pages of {}-wide rows through "
                            "position {}, {} free", seq.position_, per_pool[p], pools_[p]->width, end,
                            pools_[p]->free.size());
  if (seq.budget_)
    DSV4_TRY(seq.budget_->commit(bytes, fmt::format("sequence at position {}: compressed entries through "
                                                    "position {}", seq.position_, end)));
  for (const Need& n : needs) {
    DSV4_ASSIGN_OR_RETURN(int32_t page, take_page(n.list, seq.budget_));  // cannot fail: counted
    std::vector<int32_t>& pages = seq.pages_[n.list];
    if (n.copy) {  // copy on write: the rows so far, then this sequence's own page
      const Pool& pool = *pools_[tables_[n.list].pool];
      const int64_t P = pool.page_rows;
      DSV4_TRY(be_.copy_rows(pool.data.slice(int64_t{pages[n.index]} * P, P), pool.data.slice(int64_t{page} * P, P)));
      drop_page(n.list, pages[n.index]);
      pages[n.index] = page;
    } else {
      if (pages.size() <= n.index) pages.resize(n.index + 1, -1);
      pages[n.index] = page;
    }
    set_page(n.list, seq.slot_, n.index, page);
  }
  return Status::ok();
}

Status KvCache::sync() {
  for (ListTable& t : tables_)
    if (t.first_row_dirty) {
      DSV4_TRY(be_.upload(t.first_row, t.first_row_host.data(), t.first_row_host.size() * sizeof(int32_t)));
      t.first_row_dirty = false;
    }
  for (ListTable& t : tables_)
    for (size_t s = 0; s < t.dirty.size(); ++s) {
      if (!t.dirty[s]) continue;
      DSV4_TRY(be_.upload(t.device.slice(static_cast<int64_t>(s), 1), &t.host[s * t.max_pages],
                          t.max_pages * sizeof(int32_t)));
      t.dirty[s] = false;
    }
  return Status::ok();
}

void KvCache::detach(Sequence& seq) {
  if (seq.cache_ != this) return;
  for (size_t l = 0; l < seq.pages_.size(); ++l) {
    for (size_t i = 0; i < seq.pages_[l].size(); ++i) {
      drop_page(static_cast<int32_t>(l), seq.pages_[l][i]);
      set_page(static_cast<int32_t>(l), seq.slot_, i, -1);
    }
    seq.pages_[l].clear();
  }
  if (seq.budget_) seq.budget_->release(seq.plan_.fixed());
  free_slots_.push_back(seq.slot_);
  seq.cache_ = nullptr;
}

Status KvCache::fork(const Sequence& seq, Sequence& copy) {
  DSV4_TRY(attach(copy));
  for (size_t r = 0; r < rings_.size(); ++r)
    DSV4_TRY(be_.copy_rows(rings_[r].slice(seq.slot_ * ring_rows_, ring_rows_), rings_[r].slice(copy.slot_ * ring_rows_, ring_rows_)));
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    const int64_t rows = state_rows_[s];
    DSV4_TRY(be_.copy_rows(states_kv_[s].slice(seq.slot_ * rows, rows), states_kv_[s].slice(copy.slot_ * rows, rows)));
    DSV4_TRY(be_.copy_rows(states_score_[s].slice(seq.slot_ * rows, rows), states_score_[s].slice(copy.slot_ * rows, rows)));
  }
  for (size_t l = 0; l < seq.pages_.size(); ++l) {
    copy.pages_[l] = seq.pages_[l];
    for (size_t i = 0; i < copy.pages_[l].size(); ++i) {
      if (copy.pages_[l][i] >= 0) ++pools_[tables_[l].pool]->refs[copy.pages_[l][i]];
      set_page(static_cast<int32_t>(l), copy.slot_, i, copy.pages_[l][i]);
    }
    tables_[l].first_row_host[copy.slot_] = tables_[l].first_row_host[seq.slot_];
    tables_[l].first_row_dirty = true;
  }
  copy.position_ = seq.position_;
  copy.engram_history_ = seq.engram_history_;
  copy.mtp_position_ = seq.mtp_position_;
  return Status::ok();
}

Status KvCache::plant(Sequence& seq, const KvGraft& graft) {
  if (seq.cache_ != this || seq.position_ != 0)
    return Status::error(StatusCode::kInternal, "cache: a graft is planted in a fresh sequence only");
  const int64_t F = graft.footprint;
  if (static_cast<uint64_t>(F) >= seq.plan_.context)
    return Status::errorf(StatusCode::kOutOfRange, "cache: the graft's footprint of {} tokens fills the sequence's context of {}",
                          F, seq.plan_.context);
  // Count the pages first, so a refusal changes nothing.
  std::vector<int64_t> per_pool(pools_.size(), 0);
  uint64_t bytes = 0;
  for (size_t l = 0; l < plan_.lists.size(); ++l) {
    const KvGraftLayer* gl = graft.find(plan_.lists[l].block);
    if (!gl) continue;
    const int64_t P = pools_[tables_[l].pool]->page_rows, top = F / plan_.lists[l].ratio, first = top - gl->slots;
    const int64_t pages = (top - 1) / P - first / P + 1;
    per_pool[tables_[l].pool] += pages;
    bytes += static_cast<uint64_t>(pages) * pools_[tables_[l].pool]->page_bytes();
  }
  for (size_t p = 0; p < pools_.size(); ++p)
    if (per_pool[p] > static_cast<int64_t>(pools_[p]->free.size()))
      return Status::errorf(StatusCode::kResourceExhausted, "cache: the graft needs {} pages of {}-wide rows, {} free",
                            per_pool[p], pools_[p]->width, pools_[p]->free.size());
  if (seq.budget_) DSV4_TRY(seq.budget_->commit(bytes, "KV graft rows"));
  for (size_t l = 0; l < plan_.lists.size(); ++l) {
    const int32_t list = static_cast<int32_t>(l);
    const CacheListPlan& lp = plan_.lists[l];
    const KvGraftLayer* gl = graft.find(lp.block);
    const int64_t top = F / lp.ratio, first = top - (gl ? gl->slots : 0);
    tables_[l].first_row_host[seq.slot_] = static_cast<int32_t>(first);
    tables_[l].first_row_dirty = true;
    if (!gl) continue;
    const Pool& pool = *pools_[tables_[l].pool];
    const int64_t P = pool.page_rows, width = lp.width;
    const std::vector<float>& rows = lp.index_keys ? gl->keys : gl->kv;
    std::vector<int32_t>& pages = seq.pages_[l];
    pages.assign(static_cast<size_t>((top + P - 1) / P), -1);
    for (int64_t pi = first / P; pi <= (top - 1) / P; ++pi) {
      DSV4_ASSIGN_OR_RETURN(int32_t page, take_page(list, seq.budget_));  // cannot fail: counted
      pages[pi] = page;
      set_page(list, seq.slot_, static_cast<size_t>(pi), page);
      const int64_t lo = std::max(first, pi * P), hi = std::min(top, (pi + 1) * P);
      DSV4_TRY(be_.upload(pool.data.slice(int64_t{page} * P + lo % P, hi - lo), &rows[(lo - first) * width],
                          static_cast<size_t>((hi - lo) * width) * sizeof(float)));
    }
  }
  seq.position_ = F;
  seq.mtp_position_ = F;
  seq.window_start_ = F;
  return Status::ok();
}

Result<std::vector<float>> KvCache::read_rows(const Sequence& seq, int32_t list, int64_t begin, int64_t count) {
  const CacheListPlan& lp = plan_.lists.at(list);
  const Pool& pool = *pools_[tables_[list].pool];
  const int64_t P = pool.page_rows, width = lp.width;
  const std::vector<int32_t>& pages = seq.pages_[list];
  std::vector<float> out(static_cast<size_t>(count * width));
  for (int64_t r = begin; r < begin + count;) {
    const int64_t pi = r / P, end = std::min(begin + count, (pi + 1) * P);
    if (pi >= static_cast<int64_t>(pages.size()) || pages[pi] < 0)
      return Status::errorf(StatusCode::kInternal, "cache: row {} of list {} has no page", r, list);
    DSV4_TRY(be_.download(pool.data.slice(int64_t{pages[pi]} * P + r % P, end - r), &out[(r - begin) * width],
                          static_cast<size_t>((end - r) * width) * sizeof(float)));
    r = end;
  }
  return out;
}

namespace {

// Values uniform in [-sqrt 3, sqrt 3) (unit variance), element i of the part keyed by `key`.
void random_unit_values(uint64_t key, std::span<float> out) {
  const int64_t n = static_cast<int64_t>(out.size());
  ThreadPool::global().parallel_for(n, [&](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i)
      out[i] = static_cast<float>((2 * unit_double(splitmix64(key + static_cast<uint64_t>(i))) - 1) * std::sqrt(3.0));
  }, 1 << 16);
}

}  // namespace

Status KvCache::fill_random(Sequence& seq, int64_t position, uint64_t seed) {
  if (seq.cache_ != this) return Status::error(StatusCode::kInternal, "cache: sequence from another cache");
  if (seq.position_ != 0) return Status::errorf("cache: fill_random needs an empty sequence, not one at position {}", seq.position_);
  DSV4_TRY(prepare(seq, position));
  DSV4_TRY(sync());
  std::vector<float> host;
  const auto fill = [&](const Tensor& t, uint64_t key) -> Status {
    host.resize(static_cast<size_t>(t.rows() * t.cols()));
    random_unit_values(key, host);
    return be_.upload(t, host.data(), host.size() * sizeof(float));
  };
  uint64_t part = 0;  // each part of the slot gets its own key
  for (const Tensor& r : rings_) DSV4_TRY(fill(r.slice(seq.slot_ * ring_rows_, ring_rows_), mix_keys(seed, ++part)));
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    const int64_t rows = state_rows_[s];
    DSV4_TRY(fill(states_kv_[s].slice(seq.slot_ * rows, rows), mix_keys(seed, ++part)));
    DSV4_TRY(fill(states_score_[s].slice(seq.slot_ * rows, rows), mix_keys(seed, ++part)));
  }
  for (size_t l = 0; l < seq.pages_.size(); ++l) {
    const Pool& pool = *pools_[tables_[l].pool];
    const uint64_t list_key = mix_keys(seed, ++part);
    for (size_t i = 0; i < seq.pages_[l].size(); ++i)
      if (seq.pages_[l][i] >= 0)
        DSV4_TRY(fill(pool.data.slice(int64_t{seq.pages_[l][i]} * pool.page_rows, pool.page_rows),
                      mix_keys(list_key, i)));
  }
  seq.position_ = position;
  seq.mtp_position_ = seq.with_mtp_ ? position : 0;
  return Status::ok();
}

Result<SlotSnapshot> KvCache::snapshot(const Sequence& seq) {
  SlotSnapshot snap;
  snap.position = seq.position_;
  snap.mtp_position = seq.mtp_position_;
  snap.context = seq.plan_.context;
  snap.engram_history = seq.engram_history_;
  for (const Tensor& r : rings_) {
    std::vector<float> host(static_cast<size_t>(ring_rows_ * r.cols()));
    DSV4_TRY(be_.download(r.slice(seq.slot_ * ring_rows_, ring_rows_), host.data(), host.size() * sizeof(float)));
    snap.rings.push_back(std::move(host));
  }
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    const int64_t rows = state_rows_[s], n = rows * states_kv_[s].cols();
    std::vector<float> host(static_cast<size_t>(2 * n));
    DSV4_TRY(be_.download(states_kv_[s].slice(seq.slot_ * rows, rows), host.data(), n * sizeof(float)));
    DSV4_TRY(be_.download(states_score_[s].slice(seq.slot_ * rows, rows), host.data() + n, n * sizeof(float)));
    snap.states.push_back(std::move(host));
  }
  return snap;
}

Status KvCache::restore(Sequence& seq, const SlotSnapshot& snap) {
  if (snap.rings.size() != rings_.size() || snap.states.size() != states_kv_.size() ||
      snap.context != seq.plan_.context)
    return Status::errorf("cache restore: a snapshot of a sequence of context {} does not fit one of context {}",
                          snap.context, seq.plan_.context);
  if (snap.position > seq.position_ || snap.position < seq.window_start_)
    return Status::errorf(StatusCode::kOutOfRange,
                          "cache restore: snapshot at position {} does not fit a sequence at position {} "
                          "(first position {})", snap.position, seq.position_, seq.window_start_);
  for (size_t r = 0; r < rings_.size(); ++r)
    DSV4_TRY(be_.upload(rings_[r].slice(seq.slot_ * ring_rows_, ring_rows_), snap.rings[r].data(),
                        snap.rings[r].size() * sizeof(float)));
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    const int64_t rows = state_rows_[s], n = rows * states_kv_[s].cols();
    DSV4_TRY(be_.upload(states_kv_[s].slice(seq.slot_ * rows, rows), snap.states[s].data(), n * sizeof(float)));
    DSV4_TRY(be_.upload(states_score_[s].slice(seq.slot_ * rows, rows), snap.states[s].data() + n, n * sizeof(float)));
  }
  drop_pages_past(seq, snap.position);
  seq.position_ = snap.position;
  seq.engram_history_ = snap.engram_history;
  seq.mtp_position_ = snap.mtp_position;
  return Status::ok();
}

void KvCache::drop_pages_past(Sequence& seq, int64_t position) {
  for (size_t l = 0; l < seq.pages_.size(); ++l) {
    const int32_t list = static_cast<int32_t>(l);
    const size_t keep = static_cast<size_t>(ceil_div(rows_at(list, position), pools_[tables_[l].pool]->page_rows));
    std::vector<int32_t>& pages = seq.pages_[l];
    for (size_t i = keep; i < pages.size(); ++i) {
      drop_page(list, pages[i]);
      set_page(list, seq.slot_, i, -1);
    }
    if (pages.size() > keep) pages.resize(keep);
  }
}

Status KvCache::rewind(Sequence& seq, int64_t position, int64_t mtp_position) {
  if (seq.cache_ != this) return Status::error(StatusCode::kInternal, "cache: sequence from another cache");
  if (plan_.v41)
    return Status::error("cache rewind: a V4.1 sequence keeps an n-gram history on the host; use snapshot and restore");
  const auto check = [&](const char* what, int64_t to, int64_t from, int64_t first) -> Status {
    if (to > from || from - to > kRewindTokens || to < first)
      return Status::errorf(StatusCode::kOutOfRange,
                            "cache rewind: {} {} from {} (at most {} back, not before position {})", what, to, from,
                            kRewindTokens, first);
    return Status::ok();
  };
  DSV4_TRY(check("position", position, seq.position_, seq.window_start_));
  DSV4_TRY(check("MTP position", mtp_position, seq.mtp_position_, 0));
  if (mtp_position > position)
    return Status::errorf(StatusCode::kOutOfRange, "cache rewind: MTP position {} past the position {}", mtp_position,
                          position);
  drop_pages_past(seq, position);
  seq.position_ = position;
  seq.mtp_position_ = mtp_position;
  return Status::ok();
}

Status KvCache::restore_mtp(Sequence& seq, const SlotSnapshot& snap) {
  if (snap.rings.size() != rings_.size() || snap.context != seq.plan_.context)
    return Status::errorf("cache restore: a snapshot of a sequence of context {} does not fit one of context {}",
                          snap.context, seq.plan_.context);
  if (snap.mtp_position > seq.mtp_position_ || snap.position > seq.position_)
    return Status::errorf(StatusCode::kOutOfRange,
                          "cache restore: snapshot at MTP position {} does not fit a sequence at MTP position {}",
                          snap.mtp_position, seq.mtp_position_);
  for (const LayerPlan& l : plan_.layers) {
    if (!l.mtp) continue;
    if (l.ratio)  // no such checkpoint: V4's MTP blocks attend over their window only
      return Status::error("cache restore: an MTP block with a compressor is not rewound separately");
    if (l.ring < 0) continue;
    DSV4_TRY(be_.upload(rings_[l.ring].slice(seq.slot_ * ring_rows_, ring_rows_), snap.rings[l.ring].data(),
                        snap.rings[l.ring].size() * sizeof(float)));
  }
  seq.mtp_position_ = snap.mtp_position;
  return Status::ok();
}

}  // namespace dsv4

namespace dsv4 {
namespace {

// Little-endian (the only byte order dsv4 runs on) writer and bounds-checked reader.
struct StateWriter {
  std::vector<uint8_t> out;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  void i64(int64_t v) { bytes(&v, sizeof v); }
  uint8_t* grow(size_t n) {
    out.resize(out.size() + n);
    return out.data() + out.size() - n;
  }
};

struct StateReader {
  std::span<const uint8_t> in;
  size_t at = 0;
  Result<const uint8_t*> take(size_t n, const char* what) {
    if (n > in.size() - at)
      return Status::errorf("sequence state: {} at byte {} needs {} bytes, {} left", what, at, n, in.size() - at);
    const uint8_t* p = in.data() + at;
    at += n;
    return p;
  }
  Result<int64_t> i64(const char* what) {
    DSV4_ASSIGN_OR_RETURN(const uint8_t* p, take(sizeof(int64_t), what));
    int64_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  // A field that must equal this cache's value.
  Status expect(int64_t want, const char* what) {
    DSV4_ASSIGN_OR_RETURN(int64_t v, i64(what));
    if (v != want)
      return Status::errorf("sequence state: {} is {}, this model's cache has {}", what, v, want);
    return Status::ok();
  }
};

constexpr char kStateMagic[8] = {'D', 'S', 'V', '4', 'S', 'E', 'Q', '2'};

}  // namespace

Status KvCache::write_rows(const Sequence& seq, int32_t list, int64_t begin, int64_t count, const float* rows) {
  const Pool& pool = *pools_[tables_[list].pool];
  const int64_t P = pool.page_rows, width = plan_.lists.at(list).width;
  const std::vector<int32_t>& pages = seq.pages_[list];
  for (int64_t r = begin; r < begin + count;) {
    const int64_t pi = r / P, end = std::min(begin + count, (pi + 1) * P);
    if (pi >= static_cast<int64_t>(pages.size()) || pages[pi] < 0)
      return Status::errorf(StatusCode::kInternal, "cache: row {} of list {} has no page", r, list);
    DSV4_TRY(be_.upload(pool.data.slice(int64_t{pages[pi]} * P + r % P, end - r), rows + (r - begin) * width,
                        static_cast<size_t>((end - r) * width) * sizeof(float)));
    r = end;
  }
  return Status::ok();
}

Result<std::vector<uint8_t>> KvCache::export_state(const Sequence& seq) {
  if (seq.cache_ != this) return Status::error(StatusCode::kInternal, "cache: sequence from another cache");
  if (seq.window_start_ != 0)
    return Status::error("sequence state: a grafted sequence is not exported (its first rows are the graft's)");
  StateWriter w;
  w.bytes(kStateMagic, sizeof kStateMagic);
  w.i64(static_cast<int64_t>(rings_.size()));
  w.i64(ring_rows_);
  w.i64(static_cast<int64_t>(states_kv_.size()));
  w.i64(static_cast<int64_t>(plan_.lists.size()));
  w.i64(seq.position_);
  w.i64(seq.mtp_position_);
  // Canonical bytes (V4): rows of positions outside [lo, hi) as a fresh slot has them. The
  // rows are copied out first: the state's bytes need not be aligned for floats.
  const auto canonical = [&](uint8_t* bytes, int64_t rows, int64_t cols, int64_t lo, int64_t hi, float fresh) {
    if (plan_.v41) return;
    std::vector<char> live(static_cast<size_t>(rows), 0);
    // Negative positions (a first block's missing previous half) are fresh rows anyway.
    for (int64_t p = std::max<int64_t>({lo, hi - rows, 0}); p < hi; ++p) live[static_cast<size_t>(p % rows)] = 1;
    const std::vector<float> fill(static_cast<size_t>(cols), fresh);
    for (int64_t r = 0; r < rows; ++r)
      if (!live[static_cast<size_t>(r)]) std::memcpy(bytes + r * cols * sizeof(float), fill.data(), cols * sizeof(float));
  };
  std::vector<const LayerPlan*> ring_layer(rings_.size(), nullptr), state_layer(states_kv_.size(), nullptr);
  for (const LayerPlan& l : plan_.layers) {
    if (l.ring >= 0) ring_layer.at(l.ring) = &l;
    if (l.kv_state >= 0) state_layer.at(l.kv_state) = &l;
    if (l.key_state >= 0) state_layer.at(l.key_state) = &l;
  }
  const int64_t window = plan_.window;
  for (size_t i = 0; i < rings_.size(); ++i) {
    const Tensor& r = rings_[i];
    w.i64(r.cols());
    const size_t n = static_cast<size_t>(ring_rows_ * r.cols()) * sizeof(float);
    uint8_t* out = w.grow(n);  // valid until the next grow
    DSV4_TRY(be_.download(r.slice(seq.slot_ * ring_rows_, ring_rows_), out, n));
    // A step at position p reads the window positions p - window .. p - 1 (a draft block
    // reads `window` of them; a token row one fewer).
    const int64_t at = ring_layer[i] && ring_layer[i]->mtp ? seq.mtp_position_ : seq.position_;
    canonical(out, ring_rows_, r.cols(), at - window, at, 0.0f);
  }
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    const int64_t rows = state_rows_[s], cols = states_kv_[s].cols();
    w.i64(rows);
    w.i64(cols);
    const size_t n = static_cast<size_t>(rows * cols) * sizeof(float);
    const size_t at = w.out.size();
    w.grow(2 * n);
    uint8_t* kv = w.out.data() + at;
    uint8_t* score = kv + n;
    DSV4_TRY(be_.download(states_kv_[s].slice(seq.slot_ * rows, rows), kv, n));
    DSV4_TRY(be_.download(states_score_[s].slice(seq.slot_ * rows, rows), score, n));
    // The open block's pool reads positions from its start, less a block with overlap.
    const LayerPlan* l = state_layer[s];
    if (!l || l->ratio <= 0) continue;
    const int64_t p = seq.position_, lo = p - p % l->ratio - (l->overlap ? l->ratio : 0);
    canonical(kv, rows, cols, lo, p, 0.0f);
    canonical(score, rows, cols, lo, p, -std::numeric_limits<float>::infinity());
  }
  for (size_t l = 0; l < plan_.lists.size(); ++l) {
    const int32_t list = static_cast<int32_t>(l);
    const int64_t rows = rows_at(list, seq.position_);
    w.i64(plan_.lists[l].ratio);
    w.i64(plan_.lists[l].width);
    w.i64(rows);
    DSV4_ASSIGN_OR_RETURN(std::vector<float> host, read_rows(seq, list, 0, rows));
    w.bytes(host.data(), host.size() * sizeof(float));
  }
  return std::move(w.out);
}

Status KvCache::import_state(Sequence& seq, std::span<const uint8_t> bytes) {
  if (seq.cache_ != this || seq.position_ != 0)
    return Status::error(StatusCode::kInternal, "cache: a state is imported into a fresh sequence only");
  StateReader r{bytes};
  DSV4_ASSIGN_OR_RETURN(const uint8_t* magic, r.take(sizeof kStateMagic, "the magic"));
  if (std::memcmp(magic, kStateMagic, sizeof kStateMagic) != 0)
    return Status::error("sequence state: not a dsv4 sequence state of this version (bad magic)");
  DSV4_TRY(r.expect(static_cast<int64_t>(rings_.size()), "the window ring count"));
  DSV4_TRY(r.expect(ring_rows_, "the window length"));
  DSV4_TRY(r.expect(static_cast<int64_t>(states_kv_.size()), "the compressor state count"));
  DSV4_TRY(r.expect(static_cast<int64_t>(plan_.lists.size()), "the cache list count"));
  DSV4_ASSIGN_OR_RETURN(int64_t position, r.i64("the position"));
  DSV4_ASSIGN_OR_RETURN(int64_t mtp_position, r.i64("the MTP position"));
  if (position < 0 || mtp_position < 0 || mtp_position > position ||
      static_cast<uint64_t>(position) > seq.plan_.context)
    return Status::errorf(StatusCode::kOutOfRange,
                          "sequence state: position {} (MTP {}) outside the sequence's context of {}", position,
                          mtp_position, seq.plan_.context);
  // Every field is checked before the pages are committed, so a damaged state changes nothing.
  const size_t body = r.at;
  for (const Tensor& ring : rings_) {
    DSV4_TRY(r.expect(ring.cols(), "a window ring's width"));
    DSV4_TRY(r.take(static_cast<size_t>(ring_rows_ * ring.cols()) * sizeof(float), "a window ring").status());
  }
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    DSV4_TRY(r.expect(state_rows_[s], "a compressor state's rows"));
    DSV4_TRY(r.expect(states_kv_[s].cols(), "a compressor state's width"));
    DSV4_TRY(r.take(2 * static_cast<size_t>(state_rows_[s] * states_kv_[s].cols()) * sizeof(float),
                    "a compressor state").status());
  }
  for (size_t l = 0; l < plan_.lists.size(); ++l) {
    DSV4_TRY(r.expect(plan_.lists[l].ratio, "a cache list's ratio"));
    DSV4_TRY(r.expect(plan_.lists[l].width, "a cache list's width"));
    DSV4_TRY(r.expect(rows_at(static_cast<int32_t>(l), position), "a cache list's rows at the state's position"));
    DSV4_TRY(r.take(static_cast<size_t>(rows_at(static_cast<int32_t>(l), position) * plan_.lists[l].width) *
                        sizeof(float), "a cache list's rows").status());
  }
  if (r.at != bytes.size())
    return Status::errorf("sequence state: {} bytes after the state's end at byte {}", bytes.size() - r.at, r.at);

  DSV4_TRY(prepare(seq, position));
  r.at = body;
  for (const Tensor& ring : rings_) {
    r.at += sizeof(int64_t);
    const size_t n = static_cast<size_t>(ring_rows_ * ring.cols()) * sizeof(float);
    DSV4_TRY(be_.upload(ring.slice(seq.slot_ * ring_rows_, ring_rows_), *r.take(n, "a window ring"), n));
  }
  for (size_t s = 0; s < states_kv_.size(); ++s) {
    r.at += 2 * sizeof(int64_t);
    const int64_t rows = state_rows_[s];
    const size_t n = static_cast<size_t>(rows * states_kv_[s].cols()) * sizeof(float);
    DSV4_TRY(be_.upload(states_kv_[s].slice(seq.slot_ * rows, rows), *r.take(n, "a compressor state"), n));
    DSV4_TRY(be_.upload(states_score_[s].slice(seq.slot_ * rows, rows), *r.take(n, "a compressor state"), n));
  }
  for (size_t l = 0; l < plan_.lists.size(); ++l) {
    r.at += 3 * sizeof(int64_t);
    const int32_t list = static_cast<int32_t>(l);
    const int64_t rows = rows_at(list, position);
    const size_t n = static_cast<size_t>(rows * plan_.lists[l].width) * sizeof(float);
    // The rows are copied out first: the state's bytes need not be aligned for floats.
    std::vector<float> host(static_cast<size_t>(rows * plan_.lists[l].width));
    std::memcpy(host.data(), *r.take(n, "a cache list's rows"), n);
    DSV4_TRY(write_rows(seq, list, 0, rows, host.data()));
  }
  seq.position_ = position;
  seq.mtp_position_ = mtp_position;
  return Status::ok();
}

}  // namespace dsv4
