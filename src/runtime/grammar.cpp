#include "runtime/grammar.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <numeric>

namespace dsv4::runtime {
namespace {

constexpr uint32_t kInfinite = std::numeric_limits<uint32_t>::max() / 4;
constexpr int kMaxExpandDepth = 512;   // nesting guard: deeper parses are dropped
constexpr size_t kMaxStacks = 1024;     // ambiguity guard: parses beyond this many are dropped
constexpr size_t kMaxCompletion = 1 << 20;  // bytes of a shortest completion, at most

}  // namespace

uint32_t Grammar::add_rule() {
  rules_.emplace_back();
  return static_cast<uint32_t>(rules_.size() - 1);
}

void Grammar::add_alternative(uint32_t rule, Sequence seq) { rules_[rule].push_back(std::move(seq)); }

Grammar::Symbol Grammar::byte_class(const ByteClass& c) {
  for (size_t i = 0; i < classes_.size(); ++i)
    if (classes_[i] == c) return {false, static_cast<uint32_t>(i)};
  classes_.push_back(c);
  return {false, static_cast<uint32_t>(classes_.size() - 1)};
}

Grammar::Sequence Grammar::literal(std::string_view bytes) {
  Sequence s;
  for (unsigned char b : bytes) {
    ByteClass c;
    c.set(b);
    s.push_back(byte_class(c));
  }
  return s;
}

Status Grammar::finish(uint32_t root) {
  if (root >= rules_.size()) return Status::errorf("grammar: root rule {} does not exist", root);
  for (size_t r = 0; r < rules_.size(); ++r) {
    if (rules_[r].empty()) return Status::errorf("grammar: rule {} has no alternative", r);
    for (const Sequence& s : rules_[r])
      for (const Symbol& x : s)
        if (x.is_rule && x.id >= rules_.size()) return Status::errorf("grammar: rule {} refers to missing rule {}", r, x.id);
  }
  // Shortest sentence of each rule, by fixed point.
  min_rule_.assign(rules_.size(), kInfinite);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < rules_.size(); ++r)
      for (const Sequence& s : rules_[r]) {
        uint64_t n = 0;
        for (const Symbol& x : s) n += x.is_rule ? min_rule_[x.id] : 1;
        if (n < min_rule_[r]) {
          min_rule_[r] = static_cast<uint32_t>(std::min<uint64_t>(n, kInfinite));
          changed = true;
        }
      }
  }
  for (size_t r = 0; r < rules_.size(); ++r)
    if (min_rule_[r] >= kInfinite) return Status::errorf("grammar: rule {} derives no finite sentence", r);
  min_alt_.assign(rules_.size(), 0);
  for (size_t r = 0; r < rules_.size(); ++r)
    for (size_t a = 0; a < rules_[r].size(); ++a) {
      uint64_t n = 0;
      for (const Symbol& x : rules_[r][a]) n += x.is_rule ? min_rule_[x.id] : 1;
      if (n == min_rule_[r]) {
        min_alt_[r] = static_cast<uint32_t>(a);
        break;
      }
    }
  // Left recursion: a rule reachable from itself through prefixes that match nothing.
  std::vector<std::vector<uint32_t>> left(rules_.size());
  for (size_t r = 0; r < rules_.size(); ++r)
    for (const Sequence& s : rules_[r])
      for (const Symbol& x : s) {
        if (!x.is_rule) break;
        left[r].push_back(x.id);
        if (min_rule_[x.id] > 0) break;
      }
  std::vector<uint8_t> mark(rules_.size(), 0);  // 0 new, 1 on the path, 2 done
  for (size_t start = 0; start < rules_.size(); ++start) {
    if (mark[start]) continue;
    std::vector<std::pair<uint32_t, size_t>> path{{static_cast<uint32_t>(start), 0}};
    mark[start] = 1;
    while (!path.empty()) {
      auto& [r, i] = path.back();
      if (i == left[r].size()) {
        mark[r] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t next = left[r][i++];
      if (mark[next] == 1) return Status::errorf("grammar: rule {} is left-recursive", next);
      if (mark[next] == 0) {
        mark[next] = 1;
        path.push_back({next, 0});
      }
    }
  }
  program_.clear();
  alt_starts_.assign(rules_.size(), {});
  for (size_t r = 0; r < rules_.size(); ++r)
    for (const Sequence& s : rules_[r]) {
      alt_starts_[r].push_back(static_cast<uint32_t>(program_.size()));
      for (const Symbol& x : s) program_.push_back({x.is_rule ? Element::kRule : Element::kClass, x.id});
      program_.push_back({Element::kEnd, 0});
    }
  min_rest_.assign(program_.size(), 0);
  for (size_t i = program_.size(); i-- > 0;) {
    const Element& e = program_[i];
    if (e.kind == Element::kEnd) continue;
    min_rest_[i] = (e.kind == Element::kClass ? 1 : min_rule_[e.id]) + min_rest_[i + 1];
  }
  root_ = root;
  finished_ = true;
  return Status::ok();
}

std::shared_ptr<const VocabTrie> VocabTrie::build(const text::Tokenizer& tok) {
  auto t = std::make_shared<VocabTrie>();
  const size_t n = tok.vocab_size();
  t->token_bytes_.resize(n);
  t->usable_.assign(n, false);
  t->eos_ = tok.eos_id();
  std::vector<int32_t> order;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    t->token_bytes_[i] = std::string(tok.token_bytes(id));
    const std::string& b = t->token_bytes_[i];
    const bool spellable = !tok.is_added(id) || b == "</think>" || b == "｜DSML｜";
    if (!b.empty() && spellable && id != t->eos_) {
      t->usable_[i] = true;
      order.push_back(id);
    }
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return t->token_bytes_[a] != t->token_bytes_[b] ? t->token_bytes_[a] < t->token_bytes_[b] : a < b;
  });
  // Breadth first, so each node's children are contiguous: (node, range of `order`, depth).
  struct Work { uint32_t node; size_t lo, hi, depth; };
  t->nodes_.push_back({});
  std::deque<Work> work{{0, 0, order.size(), 0}};
  while (!work.empty()) {
    const Work w = work.front();
    work.pop_front();
    size_t i = w.lo;
    while (i < w.hi && t->token_bytes_[order[i]].size() == w.depth) {
      if (t->nodes_[w.node].token < 0) t->nodes_[w.node].token = order[i];
      ++i;
    }
    const uint32_t first = static_cast<uint32_t>(t->nodes_.size());
    std::vector<Work> children;
    while (i < w.hi) {
      const auto byte = static_cast<uint8_t>(t->token_bytes_[order[i]][w.depth]);
      size_t j = i;
      while (j < w.hi && static_cast<uint8_t>(t->token_bytes_[order[j]][w.depth]) == byte) ++j;
      Node child;
      child.byte = byte;
      t->nodes_.push_back(child);
      children.push_back({static_cast<uint32_t>(t->nodes_.size() - 1), i, j, w.depth + 1});
      i = j;
    }
    t->nodes_[w.node].first_child = first;
    t->nodes_[w.node].n_children = static_cast<uint32_t>(children.size());
    for (const Work& c : children) work.push_back(c);
  }
  return t;
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabTrie> vocab)
    : g_(std::move(grammar)), vocab_(std::move(vocab)) {
  for (uint32_t a : g_->alt_starts_[g_->root_]) expand(Stack{a}, stacks_, 0);
  std::sort(stacks_.begin(), stacks_.end());
  stacks_.erase(std::unique(stacks_.begin(), stacks_.end()), stacks_.end());
}

void GrammarMatcher::expand(Stack stack, Stacks& out, int depth) const {
  if (depth > kMaxExpandDepth || stack.size() > static_cast<size_t>(kMaxExpandDepth)) return;
  for (;;) {
    if (stack.empty()) {
      out.push_back(std::move(stack));
      return;
    }
    const uint32_t p = stack.back();
    const Grammar::Element& e = g_->program_[p];
    if (e.kind == Grammar::Element::kEnd) {
      stack.pop_back();
      continue;
    }
    if (e.kind == Grammar::Element::kClass) {
      out.push_back(std::move(stack));
      return;
    }
    // A rule: this frame continues after it (dropped when nothing follows, so right
    // recursion does not grow the stack), and each alternative is pushed on top.
    stack.back() = p + 1;
    if (g_->program_[p + 1].kind == Grammar::Element::kEnd) stack.pop_back();
    const auto& alts = g_->alt_starts_[e.id];
    for (size_t i = 0; i < alts.size(); ++i) {
      Stack s = i + 1 == alts.size() ? std::move(stack) : stack;
      s.push_back(alts[i]);
      expand(std::move(s), out, depth + 1);
    }
    return;
  }
}

GrammarMatcher::Stacks GrammarMatcher::step(const Stacks& from, uint8_t byte) const {
  Stacks out;
  for (const Stack& s : from) {
    if (s.empty()) continue;
    const Grammar::Element& e = g_->program_[s.back()];
    if (e.kind != Grammar::Element::kClass || !g_->classes_[e.id].test(byte)) continue;
    Stack next = s;
    next.back() += 1;
    expand(std::move(next), out, 0);
  }
  if (out.size() > 1) {
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    if (out.size() > kMaxStacks) out.resize(kMaxStacks);
  }
  return out;
}

GrammarMatcher::Stacks GrammarMatcher::walk(std::string_view bytes) const {
  Stacks s = stacks_;
  for (unsigned char b : bytes) {
    s = step(s, b);
    if (s.empty()) break;
  }
  return s;
}

uint32_t GrammarMatcher::min_remaining(const Stacks& stacks) const {
  uint32_t best = kInfinite;
  for (const Stack& s : stacks) {
    uint64_t n = 0;
    for (uint32_t p : s) n += g_->min_rest_[p];
    best = static_cast<uint32_t>(std::min<uint64_t>(best, n));
  }
  return best;
}

uint32_t GrammarMatcher::min_remaining() const { return min_remaining(stacks_); }

// A byte of `c` that reads well in a completion: a letter, a digit, else the lowest.
uint8_t representative(const ByteClass& c) {
  for (int b : {'a', '0', ' '})
    if (c.test(static_cast<size_t>(b))) return static_cast<uint8_t>(b);
  for (int b = 'a'; b <= 'z'; ++b)
    if (c.test(static_cast<size_t>(b))) return static_cast<uint8_t>(b);
  for (int b = 0x20; b < 0x7f; ++b)
    if (c.test(static_cast<size_t>(b))) return static_cast<uint8_t>(b);
  for (int b = 0; b < 256; ++b)
    if (c.test(static_cast<size_t>(b))) return static_cast<uint8_t>(b);
  return 0;
}

void GrammarMatcher::expand_shortest(uint32_t p, std::string& out, int depth) const {
  if (depth > kMaxExpandDepth) return;
  for (; g_->program_[p].kind != Grammar::Element::kEnd && out.size() < kMaxCompletion; ++p) {
    const Grammar::Element& e = g_->program_[p];
    if (e.kind == Grammar::Element::kClass) out.push_back(static_cast<char>(representative(g_->classes_[e.id])));
    else expand_shortest(g_->alt_starts_[e.id][g_->min_alt_[e.id]], out, depth + 1);
  }
}

std::string GrammarMatcher::shortest_completion() const {
  const Stack* best = nullptr;
  uint64_t best_n = UINT64_MAX;
  for (const Stack& s : stacks_) {
    uint64_t n = 0;
    for (uint32_t p : s) n += g_->min_rest_[p];
    if (n < best_n) {
      best_n = n;
      best = &s;
    }
  }
  std::string out;
  if (!best) return out;
  for (size_t i = best->size(); i-- > 0;) expand_shortest((*best)[i], out, 0);
  return out;
}

std::vector<int32_t> GrammarMatcher::plan() const {
  const std::string s = shortest_completion();
  std::vector<int32_t> out;
  for (size_t at = 0; at < s.size();) {
    // The longest token spelling a prefix of the rest.
    uint32_t node = 0;
    int32_t best = -1;
    size_t best_len = 0;
    for (size_t k = at; k < s.size(); ++k) {
      const VocabTrie::Node& n = vocab_->nodes_[node];
      uint32_t next = 0;
      for (uint32_t c = n.first_child; c < n.first_child + n.n_children; ++c)
        if (vocab_->nodes_[c].byte == static_cast<uint8_t>(s[k])) next = c;
      if (!next) break;
      node = next;
      if (vocab_->nodes_[node].token >= 0) {
        best = vocab_->nodes_[node].token;
        best_len = k + 1 - at;
      }
    }
    if (best < 0) break;  // a byte no token spells: the plan stops short
    out.push_back(best);
    at += best_len;
  }
  return out;
}

bool GrammarMatcher::can_end() const {
  return std::any_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

bool GrammarMatcher::must_end() const {
  return !stacks_.empty() && std::all_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

bool GrammarMatcher::accepts(int32_t token) const {
  if (token == vocab_->eos_) return can_end();
  if (token < 0 || static_cast<size_t>(token) >= vocab_->vocab_size() || !vocab_->usable_[token]) return false;
  return !walk(vocab_->token_bytes_[token]).empty();
}

void GrammarMatcher::visit(uint32_t node, const Stacks& s, std::vector<uint8_t>& mask) const {
  const VocabTrie::Node& n = vocab_->nodes_[node];
  for (uint32_t c = n.first_child; c < n.first_child + n.n_children; ++c) {
    const VocabTrie::Node& child = vocab_->nodes_[c];
    Stacks next = step(s, child.byte);
    if (next.empty()) continue;
    if (child.token >= 0) mask[child.token] = 1;
    visit(c, next, mask);
  }
}

void GrammarMatcher::allowed(std::vector<uint8_t>& mask) const {
  mask.assign(vocab_->vocab_size(), 0);
  if (can_end() && vocab_->eos_ >= 0) mask[vocab_->eos_] = 1;
  visit(0, stacks_, mask);
}

Status GrammarMatcher::advance(int32_t token) {
  if (token == vocab_->eos_) {
    if (!can_end()) return Status::error("grammar: end of output before the grammar is complete");
    stacks_.clear();
    return Status::ok();
  }
  if (token < 0 || static_cast<size_t>(token) >= vocab_->vocab_size())
    return Status::errorf("grammar: token {} outside the vocabulary", token);
  Stacks after = walk(vocab_->token_bytes_[token]);
  if (after.empty()) return Status::errorf("grammar: token {} does not fit the grammar here", token);
  stacks_ = std::move(after);
  return Status::ok();
}

}  // namespace dsv4::runtime
