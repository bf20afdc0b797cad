#include "text/tokenizer_json.h"

#include <nlohmann/json.hpp>

#include <limits>
#include <optional>

#include "text/chat_template.h"
#include "text/pretokenizer.h"

namespace dsv4::text {
namespace {

using nlohmann::json;

// llama.cpp's convert_hf_to_gguf marks added tokens shaped like control tokens as CONTROL
// even when the file does not flag them special; we follow it so GGUFs agree.
bool looks_special(std::string_view t) {
  auto wrapped = [&](std::string_view open, std::string_view close) {
    return t.size() >= open.size() + close.size() && t.starts_with(open) && t.ends_with(close);
  };
  return wrapped("<|", "|>") || wrapped("<｜", "｜>");
}

const json* find_key(const json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

std::string type_of(const json* j) {
  if (!j || j->is_null()) return "null";
  if (const json* t = find_key(*j, "type"); t && t->is_string()) return t->get<std::string>();
  return "?";
}

// The pre-tokenizer must be DeepSeek-V3's: Split×3 with its regexes, then ByteLevel
// without its own regex.
Status check_pre_tokenizer(const json* pre, std::string_view source) {
  auto bad = [&](const std::string& why) {
    return Status::errorf("{}: pre_tokenizer: {} (only the DeepSeek-V3 byte-level split is supported)",
                          source, why);
  };
  if (type_of(pre) != "Sequence") return bad("type " + type_of(pre) + ", expected Sequence");
  const json* list = find_key(*pre, "pretokenizers");
  if (!list || !list->is_array() || list->size() != 4)
    return bad("expected 4 steps (3 Split + ByteLevel)");
  for (size_t i = 0; i < 3; ++i) {
    const json& step = (*list)[i];
    if (type_of(&step) != "Split") return bad(fmt::format("step {} is {}, expected Split", i, type_of(&step)));
    const json* pattern = find_key(step, "pattern");
    const json* regex = pattern ? find_key(*pattern, "Regex") : nullptr;
    if (!regex || !regex->is_string() || regex->get<std::string>() != kDeepSeekV3SplitRegexes[i])
      return bad(fmt::format("step {} regex differs from DeepSeek-V3's", i));
    const json* behavior = find_key(step, "behavior");
    if (!behavior || *behavior != "Isolated") return bad(fmt::format("step {} behavior is not Isolated", i));
    const json* invert = find_key(step, "invert");
    if (invert && *invert != false) return bad(fmt::format("step {} is inverted", i));
  }
  const json& last = (*list)[3];
  if (type_of(&last) != "ByteLevel") return bad("step 3 is " + type_of(&last) + ", expected ByteLevel");
  const json* use_regex = find_key(last, "use_regex");
  const json* prefix = find_key(last, "add_prefix_space");
  if ((use_regex && *use_regex != false) || (prefix && *prefix != false))
    return bad("ByteLevel step has use_regex or add_prefix_space set");
  return Status::ok();
}

Result<uint32_t> id_of(const std::vector<std::string>& tokens, const std::string& name,
                       std::string_view what, std::string_view source) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] == name) return static_cast<uint32_t>(i);
  return Status::errorf("{}: {} token '{}' not in the vocabulary", source, what, name);
}

}  // namespace

Result<TokenizerVocab> parse_tokenizer_json(std::string_view text, std::string_view source,
                                            const TokenizerJsonOptions& opts) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object())
    return Status::errorf("{}: not a JSON object (tokenizer.json expected)", source);

  const json* model = find_key(root, "model");
  if (type_of(model) != "BPE")
    return Status::errorf("{}: model.type is {}, expected BPE", source, type_of(model));
  if (const json* fb = find_key(*model, "byte_fallback"); fb && *fb == true)
    return Status::errorf("{}: model.byte_fallback is true; only byte-level BPE is supported", source);
  if (type_of(find_key(root, "decoder")) != "ByteLevel")
    return Status::errorf("{}: decoder.type is {}, expected ByteLevel", source,
                          type_of(find_key(root, "decoder")));
  if (const json* norm = find_key(root, "normalizer"); norm && !norm->is_null()) {
    const json* inner = find_key(*norm, "normalizers");
    if (!(type_of(norm) == "Sequence" && inner && inner->is_array() && inner->empty()))
      return Status::errorf("{}: normalizer {} is not supported (expected none)", source, type_of(norm));
  }
  if (!opts.vocabulary_only) DSV4_TRY(check_pre_tokenizer(find_key(root, "pre_tokenizer"), source));

  const json* vocab = find_key(*model, "vocab");
  const json* merges = find_key(*model, "merges");
  if (!vocab || !vocab->is_object()) return Status::errorf("{}: model.vocab missing or not an object", source);
  if (!merges || !merges->is_array()) return Status::errorf("{}: model.merges missing or not an array", source);
  const json* added = find_key(root, "added_tokens");
  if (added && !added->is_array()) return Status::errorf("{}: added_tokens is not an array", source);

  // Collect (id, text, type); added tokens may repeat a vocab entry with the same id.
  constexpr uint32_t kMaxTokens = 1u << 24;
  std::vector<std::optional<std::string>> by_id;
  std::vector<TokenType> types;
  auto place = [&](const json& id_json, std::string tok, TokenType type, bool may_repeat) -> Status {
    if (!id_json.is_number_unsigned() || id_json.get<uint64_t>() >= kMaxTokens)
      return Status::errorf("{}: token '{}' has id {}, expected an integer in [0, {})", source, tok,
                            id_json.dump(), kMaxTokens);
    const auto id = id_json.get<uint32_t>();
    if (id >= by_id.size()) {
      by_id.resize(id + 1);
      types.resize(id + 1, TokenType::kUnused);
    }
    if (by_id[id] && !(may_repeat && *by_id[id] == tok))
      return Status::errorf("{}: id {} used by both '{}' and '{}'", source, id, *by_id[id], tok);
    by_id[id] = std::move(tok);
    types[id] = type;
    return Status::ok();
  };
  for (const auto& [tok, id] : vocab->items()) DSV4_TRY(place(id, tok, TokenType::kNormal, false));
  if (added) {
    for (const json& a : *added) {
      const json* content = find_key(a, "content");
      const json* id = find_key(a, "id");
      if (!content || !content->is_string() || !id)
        return Status::errorf("{}: added_tokens entry without content/id: {}", source, a.dump());
      const json* special = find_key(a, "special");
      std::string tok = content->get<std::string>();
      const bool control = (special && *special == true) || looks_special(tok);
      DSV4_TRY(place(*id, std::move(tok), control ? TokenType::kControl : TokenType::kUserDefined, true));
    }
  }

  TokenizerVocab out;
  const size_t n = std::max<size_t>(by_id.size(), opts.min_vocab_size);
  out.tokens.reserve(n);
  out.token_types.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (i < by_id.size() && by_id[i]) {
      out.tokens.push_back(std::move(*by_id[i]));
      out.token_types.push_back(types[i]);
    } else {
      out.tokens.push_back(fmt::format("[PAD{}]", i));
      out.token_types.push_back(TokenType::kUnused);
    }
  }

  out.merges.reserve(merges->size());
  for (const json& m : *merges) {
    if (m.is_string()) {
      std::string s = m.get<std::string>();
      if (std::count(s.begin(), s.end(), ' ') != 1)
        return Status::errorf("{}: merge '{}' is not two tokens separated by one space", source, s);
      out.merges.push_back(std::move(s));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      out.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    } else {
      return Status::errorf("{}: merge {} is neither \"a b\" nor [\"a\", \"b\"]", source, m.dump());
    }
  }

  DSV4_ASSIGN_OR_RETURN(out.bos_id, id_of(out.tokens, opts.bos_token, "BOS", source));
  DSV4_ASSIGN_OR_RETURN(out.eos_id, id_of(out.tokens, opts.eos_token, "EOS", source));
  DSV4_ASSIGN_OR_RETURN(out.pad_id, id_of(out.tokens, opts.pad_token, "PAD", source));
  return out;
}

void write_tokenizer_metadata(const TokenizerVocab& vocab, gguf::GgufWriter& writer) {
  using gguf::Value;
  std::vector<int32_t> types(vocab.token_types.size());
  for (size_t i = 0; i < types.size(); ++i) types[i] = static_cast<int32_t>(vocab.token_types[i]);
  writer.set("tokenizer.ggml.model", Value::string("gpt2"));
  writer.set("tokenizer.ggml.pre", Value::string(vocab.pre));
  writer.set("tokenizer.ggml.tokens", Value::array_string(vocab.tokens));
  writer.set("tokenizer.ggml.token_type", Value::array_i32(types));
  writer.set("tokenizer.ggml.merges", Value::array_string(vocab.merges));
  writer.set("tokenizer.ggml.bos_token_id", Value::u32(vocab.bos_id));
  writer.set("tokenizer.ggml.eos_token_id", Value::u32(vocab.eos_id));
  writer.set("tokenizer.ggml.padding_token_id", Value::u32(vocab.pad_id));
  writer.set("tokenizer.ggml.add_bos_token", Value::boolean(false));
  writer.set("tokenizer.ggml.add_eos_token", Value::boolean(false));
  writer.set("tokenizer.chat_template", Value::string(chat_template_jinja()));
}

Status write_tokenizer_metadata(std::string_view tokenizer_json, std::string_view source,
                                gguf::GgufWriter& writer, const TokenizerJsonOptions& opts) {
  DSV4_ASSIGN_OR_RETURN(TokenizerVocab vocab, parse_tokenizer_json(tokenizer_json, source, opts));
  write_tokenizer_metadata(vocab, writer);
  return Status::ok();
}

}  // namespace dsv4::text
