// Exact replay of the model's own turns, so an agent's resent history hits the prefix
// cache. Two things differ between what the model generated and what a client sends back:
//   1. the DSML call block: the client returns parsed calls (name, JSON arguments), and
//      re-rendering them from JSON need not give the model's bytes (spacing, number forms,
//      string="false" strings). remember() keeps the block under the calls' ids; apply()
//      puts it back (ChatMessage::raw_tool_calls) when the calls still match it.
//   2. the tokens: the model may have sampled a tokenization of its text that BPE would
//      not produce. tokenize() encodes a rendered prompt but uses the generated ids for
//      every assistant turn whose text is exactly one that was generated.
// Turn texts start right after <think> or </think> and end right before EOS, all added
// tokens, so splitting the encoding there changes nothing else (tokenizer.h). A turn is
// known by its text as clients received it (invalid UTF-8 the model wrote shown as
// U+FFFD); its replay is the model's own tokens, raw bytes included.
// Thread-safe; the oldest turns are forgotten past `capacity`.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "text/chat.h"
#include "text/tokenizer.h"
#include "util/status.h"

namespace dsv4::runtime {

class ReplayStore {
 public:
  explicit ReplayStore(size_t capacity = 4096) : capacity_(capacity) {}

  // A turn that ended with EOS: `ids` the generated tokens (EOS excluded), `text` their
  // decoded text, `call_ids` the ids the API gave the calls parsed from it (in order).
  // `think_end` is the id of </think> (the part after it is remembered too, for
  // histories that drop the reasoning).
  void remember(std::vector<int32_t> ids, std::string text, std::vector<std::string> call_ids, int32_t think_end);

  // Sets raw_tool_calls on assistant messages whose calls are ones remembered (all ids
  // known, names and arguments equal as JSON).
  void apply(std::vector<text::ChatMessage>& messages) const;

  // `messages`: what was rendered; an assistant message whose calls are known takes that
  // turn's own tokens (two turns may have written the same text as different tokens).
  Result<std::vector<int32_t>> tokenize(const text::Tokenizer& tokenizer, std::string_view rendered,
                                        std::span<const text::ChatMessage> messages = {}) const;

  // The whole store as a file (with the prefix caches of --kv-persist) and back; a file
  // written for another `identity` (model_identity()) is ignored.
  Status save(const std::string& path, const std::string& identity) const;
  Status load(const std::string& path, const std::string& identity);

  size_t size() const;
  uint64_t replayed_turns() const;  // assistant turns tokenize() took from the store

 private:
  struct Turn {
    std::string text;             // as clients see it
    std::vector<int32_t> ids;
    std::string calls_block;      // "\n\n<｜DSML｜tool_calls" ... as generated, or empty
    std::vector<std::string> call_ids;
  };
  using TurnPtr = std::shared_ptr<const Turn>;
  void insert(TurnPtr turn);

  mutable std::mutex mu_;
  size_t capacity_;
  std::list<TurnPtr> order_;  // oldest first
  std::unordered_map<std::string, TurnPtr> by_text_;     // the newest turn of each text
  std::unordered_map<std::string, TurnPtr> by_call_id_;  // the turn that made each call
  mutable uint64_t replayed_ = 0;
};

}  // namespace dsv4::runtime
