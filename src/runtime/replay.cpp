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

void ReplayStore::insert(TurnPtr turn) {
  if (turn->text.empty()) return;
  by_text_[turn->text] = turn;  // the same text generated again: the newest wins
  for (const std::string& id : turn->call_ids)
    if (!id.empty()) by_call_id_[id] = turn;
  order_.push_back(std::move(turn));
  while (order_.size() > capacity_) {
    const TurnPtr old = order_.front();
    order_.pop_front();
    if (auto it = by_text_.find(old->text); it != by_text_.end() && it->second == old) by_text_.erase(it);
    for (const std::string& id : old->call_ids)
      if (auto it = by_call_id_.find(id); it != by_call_id_.end() && it->second == old) by_call_id_.erase(it);
  }
}

void ReplayStore::remember(std::vector<int32_t> ids, std::string text, std::vector<std::string> call_ids,
                           int32_t think_end) {
  // Clients see (and send back) the text as decoded for them: invalid UTF-8 the model
  // produced became U+FFFD. The turn is keyed by that text and replays the raw tokens.
  text = text::utf8_lossy(text);
  std::lock_guard<std::mutex> lock(mu_);
  auto turn = std::make_shared<Turn>();
  if (size_t at = text.find(kCallsMarker); at != std::string::npos) turn->calls_block = text.substr(at);
  // The part after </think>: what a history that drops the reasoning renders.
  const size_t think_text = text.find("</think>");
  size_t think_token = 0;
  while (think_token < ids.size() && ids[think_token] != think_end) ++think_token;
  if (think_text != std::string::npos && think_token < ids.size()) {
    auto tail = std::make_shared<Turn>();
    tail->text = text.substr(think_text + 8);
    tail->ids.assign(ids.begin() + static_cast<std::ptrdiff_t>(think_token) + 1, ids.end());
    tail->calls_block = turn->calls_block;
    insert(std::move(tail));
  }
  turn->text = std::move(text);
  turn->ids = std::move(ids);
  turn->call_ids = std::move(call_ids);
  insert(std::move(turn));
}

void ReplayStore::apply(std::vector<text::ChatMessage>& messages) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (text::ChatMessage& m : messages) {
    if (m.role != "assistant" || m.tool_calls.empty() || m.raw_tool_calls) continue;
    auto first = by_call_id_.find(m.tool_calls[0].id);
    if (first == by_call_id_.end() || first->second->calls_block.empty()) continue;
    bool same_turn = true;
    for (const text::ToolCall& c : m.tool_calls) {
      auto it = by_call_id_.find(c.id);
      same_turn = same_turn && it != by_call_id_.end() && it->second == first->second;
    }
    if (!same_turn) continue;
    text::OutputParser parser(text::ThinkingMode::kChat);
    parser.push(first->second->calls_block);
    parser.finish();
    const auto& parsed = parser.result().tool_calls;
    bool match = parsed.size() == m.tool_calls.size();
    for (size_t i = 0; match && i < parsed.size(); ++i)
      match = parsed[i].name == m.tool_calls[i].name && same_arguments(parsed[i].arguments, m.tool_calls[i].arguments);
    if (match) m.raw_tool_calls = first->second->calls_block;
  }
}

Result<std::vector<int32_t>> ReplayStore::tokenize(const text::Tokenizer& tok, std::string_view rendered,
                                                   std::span<const text::ChatMessage> messages) const {
  std::vector<int32_t> out;
  auto encode = [&](std::string_view piece) -> Status {
    if (piece.empty()) return Status::ok();
    DSV4_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok.encode(piece));
    out.insert(out.end(), ids.begin(), ids.end());
    return Status::ok();
  };
  std::lock_guard<std::mutex> lock(mu_);
  // The turns the assistant messages came from, in order (null: not known by a call id).
  std::vector<TurnPtr> hints;
  for (const text::ChatMessage& m : messages) {
    if (m.role != "assistant") continue;
    auto it = m.tool_calls.empty() ? by_call_id_.end() : by_call_id_.find(m.tool_calls[0].id);
    hints.push_back(it == by_call_id_.end() ? nullptr : it->second);
  }
  size_t done = 0;  // rendered[0, done) is encoded
  size_t body_index = 0;
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
    const std::string_view body = rendered.substr(start, end - start);
    TurnPtr turn = body_index < hints.size() ? hints[body_index] : nullptr;
    ++body_index;
    if (!turn || turn->text != body) {
      auto it = by_text_.find(std::string(body));
      turn = it == by_text_.end() ? nullptr : it->second;
    }
    if (!turn || text::utf8_lossy(tok.decode(turn->ids)) != body) continue;
    DSV4_TRY(encode(rendered.substr(done, start - done)));
    out.insert(out.end(), turn->ids.begin(), turn->ids.end());
    done = end;
    ++replayed_;
  }
  DSV4_TRY(encode(rendered.substr(done)));
  return out;
}

Status ReplayStore::save(const std::string& path, const std::string& identity) const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json turns = nlohmann::json::array();
  for (const TurnPtr& t : order_)
    turns.push_back({{"text", t->text}, {"ids", t->ids}, {"calls_block", t->calls_block}, {"call_ids", t->call_ids}});
  const nlohmann::json j = {{"identity", identity}, {"turns", turns}};
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
      !j.contains("turns") || !j["turns"].is_array())
    return Status::errorf("{}: not a replay store of this model (ignored)", path);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& t : j["turns"]) {
    if (!t.is_object() || !t.contains("text") || !t["text"].is_string() || !t.contains("ids") || !t["ids"].is_array() ||
        !t.contains("calls_block") || !t["calls_block"].is_string() || !t.contains("call_ids") || !t["call_ids"].is_array())
      continue;
    auto turn = std::make_shared<Turn>();
    turn->text = t["text"].get<std::string>();
    for (const auto& id : t["ids"])
      if (id.is_number_integer()) turn->ids.push_back(id.get<int32_t>());
    turn->calls_block = t["calls_block"].get<std::string>();
    for (const auto& id : t["call_ids"])
      if (id.is_string()) turn->call_ids.push_back(id.get<std::string>());
    insert(std::move(turn));
  }
  return Status::ok();
}

size_t ReplayStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return order_.size();
}

uint64_t ReplayStore::replayed_turns() const {
  std::lock_guard<std::mutex> lock(mu_);
  return replayed_;
}

}  // namespace dsv4::runtime
