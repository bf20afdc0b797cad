// Constrained decoding: a context-free grammar over bytes and an incremental matcher that
// says which tokens of the vocabulary may come next (the approach of llama.cpp's GBNF
// grammars, at the byte level so a token may end inside a UTF-8 character).
//
//   Grammar g;                                   // built by schema_grammar.h's functions
//   GrammarMatcher m(grammar, vocab);            // one per request
//   m.allowed(logits_mask) / m.accepts(token) / m.advance(token) / m.can_end()
//
// A rule is a list of alternatives, each a sequence of byte classes and rule references.
// Rules must not be left-recursive (every recursion consumes a byte first); the builders
// in schema_grammar.cpp only write right recursion. The matcher keeps the set of parse
// stacks (each the positions still to match, innermost last); a byte keeps the stacks
// whose next class contains it.
//
// Finishing within a token budget: plan() gives tokens that complete the grammar from
// the current state (the shortest completion in bytes, cut into the longest tokens of
// the vocabulary). A caller that keeps "plan length <= tokens left" true — taking a
// sampled token only when the plan after it still fits, else the plan's first token —
// always completes the grammar within max_tokens (scheduler.cpp does).
#pragma once

#include <bitset>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"
#include "util/status.h"

namespace dsv4::runtime {

using ByteClass = std::bitset<256>;

class Grammar {
 public:
  struct Symbol {
    bool is_rule = false;
    uint32_t id = 0;  // a class index, or a rule id
  };
  using Sequence = std::vector<Symbol>;

  uint32_t add_rule();                                // a rule with no alternatives yet
  void add_alternative(uint32_t rule, Sequence seq);  // may be empty (matches nothing)
  Symbol byte_class(const ByteClass& c);
  Symbol ref(uint32_t rule) const { return {true, rule}; }
  Sequence literal(std::string_view bytes);           // one class per byte
  // Checks every rule has an alternative and none is left-recursive, computes the
  // shortest completions, and fixes the root; no edits after.
  Status finish(uint32_t root);

  uint32_t root() const { return root_; }
  uint32_t min_length() const { return min_rule_.empty() ? 0 : min_rule_[root_]; }  // bytes of the shortest sentence
  size_t rule_count() const { return rules_.size(); }

 private:
  friend class GrammarMatcher;
  // Flat program: each alternative is its symbols then an end marker.
  struct Element {
    enum Kind : uint8_t { kClass, kRule, kEnd } kind;
    uint32_t id;
  };
  std::vector<std::vector<Sequence>> rules_;
  std::vector<ByteClass> classes_;
  std::vector<Element> program_;
  std::vector<std::vector<uint32_t>> alt_starts_;  // per rule, program offsets
  std::vector<uint32_t> min_rest_;  // per program offset: fewest bytes to the alternative's end
  std::vector<uint32_t> min_rule_;  // per rule: fewest bytes of a sentence
  std::vector<uint32_t> min_alt_;   // per rule: an alternative of that length
  uint32_t root_ = 0;
  bool finished_ = false;
};

// The vocabulary as a byte trie, built once per tokenizer. Added tokens are left out
// except those a grammar may spell (</think>, ｜DSML｜); EOS is handled by the matcher.
class VocabTrie {
 public:
  static std::shared_ptr<const VocabTrie> build(const text::Tokenizer& tokenizer);
  std::string_view bytes(int32_t token) const { return token_bytes_[token]; }
  size_t vocab_size() const { return token_bytes_.size(); }
  int32_t eos() const { return eos_; }

 private:
  friend class GrammarMatcher;
  struct Node {
    uint32_t first_child = 0, n_children = 0;
    uint8_t byte = 0;
    int32_t token = -1;  // the token spelled by the path to here, or -1
  };
  std::vector<Node> nodes_;       // nodes_[0] is the root; children contiguous
  std::vector<std::string> token_bytes_;
  std::vector<bool> usable_;      // may appear under a grammar
  int32_t eos_ = -1;
};

class GrammarMatcher {
 public:
  GrammarMatcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabTrie> vocab);

  bool accepts(int32_t token) const;            // may `token` come next?
  void allowed(std::vector<uint8_t>& mask) const;  // mask[t] = accepts(t)
  Status advance(int32_t token);
  bool can_end() const;   // the bytes so far are a sentence
  bool must_end() const;  // ... and nothing may follow
  bool failed() const { return stacks_.empty(); }
  uint32_t min_remaining() const;            // fewest bytes that complete a sentence
  std::string shortest_completion() const;   // such bytes
  std::vector<int32_t> plan() const;         // those bytes as tokens (longest match first)

 private:
  using Stack = std::vector<uint32_t>;  // program offsets, innermost last
  using Stacks = std::vector<Stack>;
  void expand(Stack stack, Stacks& out, int depth) const;
  Stacks step(const Stacks& from, uint8_t byte) const;
  Stacks walk(std::string_view bytes) const;
  uint32_t min_remaining(const Stacks& s) const;
  void expand_shortest(uint32_t offset, std::string& out, int depth) const;
  void visit(uint32_t node, const Stacks& s, std::vector<uint8_t>& mask) const;

  std::shared_ptr<const Grammar> g_;
  std::shared_ptr<const VocabTrie> vocab_;
  Stacks stacks_;
};

}  // namespace dsv4::runtime
