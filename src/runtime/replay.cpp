#include "runtime/replay.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "text/output_parser.h"

namespace dsv4::runtime {
namespace {

constexpr std::string_view kCallsMarker = "\n\n<｜DSML｜tool_calls";

bool same_arguments(const std::string& a, const std::string& b) {
  const auto ja = text::OrderedJson::parse(a, nullptr, false), jb = text::OrderedJson::parse(b, nullptr, false);
  if (ja.is_discarded() || jb.is_discarded()) return a == b;
  return nlohmann::json(ja) == nlohmann::json(jb);  // key order does not matter
}

}  // namespace

void ReplayStore::insert(std::string key, Turn turn) {
  if (key.empty()) return;
  // The same text generated again (maybe as other tokens): the newest turn is the one a
  // client is about to send back.
  if (auto it = turns_.find(key); it != turns_.end()) {
    it->second = std::move(turn);
    order_.remove(key);
    order_.push_back(std::move(key));
    return;
  }
  order_.push_back(key);
  turns_.emplace(std::move(key), std::move(turn));
  while (turns_.size() > capacity_) {
    const std::string& old = order_.front();
    for (auto it = by_call_id_.begin(); it != by_call_id_.end();)
      it = it->second == old ? by_call_id_.erase(it) : std::next(it);
    turns_.erase(old);
    order_.pop_front();
  }
}

void ReplayStore::remember(std::vector<int32_t> ids, std::string text, std::vector<std::string> call_ids,
                           int32_t think_end) {
  // Clients see (and send back) the text as decoded for them: invalid UTF-8 the model
  // produced became U+FFFD. The turn is keyed by that text and replays the raw tokens.
  text = text::utf8_lossy(text);
  std::lock_guard<std::mutex> lock(mu_);
  Turn turn;
  if (size_t at = text.find(kCallsMarker); at != std::string::npos) turn.calls_block = text.substr(at);
  for (const std::string& id : call_ids)
    if (!id.empty()) by_call_id_[id] = text;
  // The part after </think>: what a history that drops the reasoning renders.
  const size_t think_text = text.find("</think>");
  size_t think_token = 0;
  while (think_token < ids.size() && ids[think_token] != think_end) ++think_token;
  if (think_text != std::string::npos && think_token < ids.size()) {
    Turn tail{std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(think_token) + 1, ids.end()),
              turn.calls_block};
    insert(text.substr(think_text + 8), std::move(tail));
  }
  turn.ids = std::move(ids);
  insert(std::move(text), std::move(turn));
}

void ReplayStore::apply(std::vector<text::ChatMessage>& messages) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (text::ChatMessage& m : messages) {
    if (m.role != "assistant" || m.tool_calls.empty() || m.raw_tool_calls) continue;
    auto first = by_call_id_.find(m.tool_calls[0].id);
    if (first == by_call_id_.end()) continue;
    auto turn = turns_.find(first->second);
    if (turn == turns_.end() || turn->second.calls_block.empty()) continue;
    bool same_turn = true;
    for (const text::ToolCall& c : m.tool_calls) {
      auto it = by_call_id_.find(c.id);
      same_turn = same_turn && it != by_call_id_.end() && it->second == first->second;
    }
    if (!same_turn) continue;
    text::OutputParser parser(text::ThinkingMode::kChat);
    parser.push(turn->second.calls_block);
    parser.finish();
    const auto& parsed = parser.result().tool_calls;
    bool match = parsed.size() == m.tool_calls.size();
    for (size_t i = 0; match && i < parsed.size(); ++i)
      match = parsed[i].name == m.tool_calls[i].name && same_arguments(parsed[i].arguments, m.tool_calls[i].arguments);
    if (match) m.raw_tool_calls = turn->second.calls_block;
  }
}

Result<std::vector<int32_t>> ReplayStore::tokenize(const text::Tokenizer& tok, std::string_view rendered) const {
  std::vector<int32_t> out;
  auto encode = [&](std::string_view piece) -> Status {
    if (piece.empty()) return Status::ok();
    DSV4_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok.encode(piece));
    out.insert(out.end(), ids.begin(), ids.end());
    return Status::ok();
  };
  std::lock_guard<std::mutex> lock(mu_);
  size_t done = 0;  // rendered[0, done) is encoded
  for (size_t a = rendered.find(text::kAssistantText); a != std::string_view::npos;
       a = rendered.find(text::kAssistantText, a + 1)) {
    if (a < done) continue;
    size_t start = a + text::kAssistantText.size();
    if (rendered.substr(start).starts_with(text::kThinkStartText)) start += text::kThinkStartText.size();
    else if (rendered.substr(start).starts_with(text::kThinkEndText)) start += text::kThinkEndText.size();
    else continue;
    const size_t end = rendered.find(text::kEosText, start);
    const size_t next = rendered.find(text::kAssistantText, start);
    if (end == std::string_view::npos || (next != std::string_view::npos && next < end)) continue;
    auto it = turns_.find(std::string(rendered.substr(start, end - start)));
    if (it == turns_.end() || text::utf8_lossy(tok.decode(it->second.ids)) != rendered.substr(start, end - start))
      continue;
    DSV4_TRY(encode(rendered.substr(done, start - done)));
    out.insert(out.end(), it->second.ids.begin(), it->second.ids.end());
    done = end;
    ++replayed_;
  }
  DSV4_TRY(encode(rendered.substr(done)));
  return out;
}

Status ReplayStore::save(const std::string& path, const std::string& identity) const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json turns = nlohmann::json::array();
  for (const std::string& key : order_) {
    const Turn& t = turns_.at(key);
    turns.push_back({{"text", key}, {"ids", t.ids}, {"calls_block", t.calls_block}});
  }
  nlohmann::json calls = nlohmann::json::object();
  for (const auto& [id, key] : by_call_id_) calls[id] = key;
  const nlohmann::json j = {{"identity", identity}, {"turns", turns}, {"call_ids", calls}};
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (!out) return Status::errorf(StatusCode::kIo, "{}: write failed", temp);
  }
  std::error_code ec;
  std::filesystem::rename(temp, path, ec);
  if (ec) return Status::errorf(StatusCode::kIo, "{}: {}", path, ec.message());
  return Status::ok();
}

Status ReplayStore::load(const std::string& path, const std::string& identity) {
  std::ifstream in(path);
  if (!in) return Status::ok();  // nothing saved yet
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("identity") || j["identity"] != identity ||
      !j.contains("turns") || !j["turns"].is_array() || !j.contains("call_ids") || !j["call_ids"].is_object())
    return Status::errorf("{}: not a replay store of this model (ignored)", path);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& t : j["turns"]) {
    if (!t.is_object() || !t.contains("text") || !t["text"].is_string() || !t.contains("ids") || !t["ids"].is_array() ||
        !t.contains("calls_block") || !t["calls_block"].is_string())
      continue;
    Turn turn;
    for (const auto& id : t["ids"])
      if (id.is_number_integer()) turn.ids.push_back(id.get<int32_t>());
    turn.calls_block = t["calls_block"];
    insert(t["text"].get<std::string>(), std::move(turn));
  }
  for (const auto& [id, key] : j["call_ids"].items())
    if (key.is_string() && turns_.count(key.get<std::string>())) by_call_id_[id] = key;
  return Status::ok();
}

size_t ReplayStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return turns_.size();
}

uint64_t ReplayStore::replayed_turns() const {
  std::lock_guard<std::mutex> lock(mu_);
  return replayed_;
}

}  // namespace dsv4::runtime
