// The chat encoder against the worked examples of spec checkpoint-tokenizer-chat.md §5.8
// (renderings of DeepSeek's official encoder and its golden tests) and the rules of §5.
#include <gtest/gtest.h>

#include "text/chat.h"

namespace dsv4::text {
namespace {

using json = OrderedJson;

std::string render(const json& messages, const ChatOptions& opts = {}) {
  auto msgs = chat_messages_from_json(messages);
  EXPECT_TRUE(msgs.is_ok()) << msgs.status().message();
  if (!msgs.is_ok()) return "<parse error>";
  auto r = render_chat(*msgs, opts);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.is_ok() ? *r : "<render error>";
}

Status render_status(const json& messages, const ChatOptions& opts = {}) {
  auto msgs = chat_messages_from_json(messages);
  if (!msgs.is_ok()) return msgs.status();
  return render_chat(*msgs, opts).status();
}

ChatOptions chat_mode() {
  ChatOptions o;
  o.thinking = ThinkingMode::kChat;
  return o;
}

// The §5.4 block around the given schema lines.
std::string tools_block(const std::string& schema_lines) {
  return "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
         "invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
         "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter "
         "name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n"
         "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n"
         "</｜DSML｜tool_calls>\n\nString parameters should be specified as is and set "
         "`string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value "
         "in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by "
         "<think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool "
         "calls or final response.\n\nOtherwise, output directly after </think> with tool calls or "
         "final response.\n\n### Available Tool Schemas\n\n" +
         schema_lines +
         "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
         "tool calls.\n";
}

const char* kBos = "<｜begin▁of▁sentence｜>";

TEST(Chat, A_ChatModeSystemAndUser) {
  json m = json::parse(R"([{"role":"system","content":"You are a helpful assistant."},
                            {"role":"user","content":"What is 2+2?"}])");
  EXPECT_EQ(render(m, chat_mode()),
            std::string(kBos) + "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>");
}

json example_b() {
  return json::parse(R"([
    {"role":"system","content":"You are a helpful assistant."},
    {"role":"user","content":"Hello"},
    {"role":"assistant","reasoning_content":"The user said hello, I should greet back.","content":"Hi there! How can I help you?"},
    {"role":"user","content":"What is the capital of France?"},
    {"role":"assistant","reasoning_content":"The user asks about the capital of France. It is Paris.","content":"The capital of France is Paris."}])");
}

TEST(Chat, B_ThinkingMultiTurnDropsEarlierReasoning) {
  EXPECT_EQ(render(example_b()),
            std::string(kBos) +
                "You are a helpful assistant.<｜User｜>Hello<｜Assistant｜></think>Hi there! How can I help "
                "you?<｜end▁of▁sentence｜><｜User｜>What is the capital of France?<｜Assistant｜><think>The user "
                "asks about the capital of France. It is Paris.</think>The capital of France is "
                "Paris.<｜end▁of▁sentence｜>");
  json prompt_only = example_b();
  prompt_only.erase(prompt_only.end() - 1);
  const std::string p = render(prompt_only);
  EXPECT_TRUE(p.ends_with("France?<｜Assistant｜><think>")) << p;
}

TEST(Chat, B_ReasoningEffortTables) {
  json m = example_b();
  m.erase(m.end() - 1);
  const std::string plain = render(m);
  const std::string absolute =
      "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
      "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
      "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
      "Explicitly write out your entire deliberation process, documenting every intermediate step, "
      "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
      "unchecked.\n\n";
  const std::string beyond =
      "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\nYou MUST reason "
      "with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the "
      "problem into its most fundamental components, trace every causal chain to its root, and resolve "
      "the underlying cause rather than any surface symptom.\nDo not stop reasoning until you have "
      "independently verified the solution from multiple angles and are certain that no assumption "
      "remains unchecked and no error remains undiscovered.\n\n";
  auto with = [&](EffortTable table, const char* effort) {
    ChatOptions o;
    o.effort_table = table;
    o.reasoning_effort = effort;
    return render(m, o);
  };
  const std::string rest = plain.substr(std::string(kBos).size());
  EXPECT_EQ(with(EffortTable::kV4, "max"), kBos + absolute + rest);
  EXPECT_EQ(with(EffortTable::kV4, "high"), plain);
  EXPECT_EQ(with(EffortTable::kV4_0731, "high"), kBos + absolute + rest);
  EXPECT_EQ(with(EffortTable::kV4_0731, "max"), kBos + beyond + rest);
  EXPECT_EQ(with(EffortTable::kV4_0731, "low"), plain);
  EXPECT_EQ(with(EffortTable::kV4_0731, ""), plain);
  // Chat mode never gets a prefix; unknown efforts are errors.
  ChatOptions o = chat_mode();
  o.reasoning_effort = "max";
  EXPECT_EQ(render(m, o).find("Reasoning Effort"), std::string::npos);
  ChatOptions bad;
  bad.reasoning_effort = "low";
  EXPECT_NE(render_status(m, bad).message().find("reasoning effort 'low'"), std::string::npos);
  bad.effort_table = EffortTable::kV4_0731;
  bad.reasoning_effort = "medium";
  EXPECT_FALSE(render_status(m, bad).is_ok());
}

const char* kWeatherTools = R"([
  {"type":"function","function":{"name":"get_weather","description":"Get the weather for a specific location",
   "parameters":{"type":"object","properties":{"location":{"type":"string","description":"The city name"},
   "unit":{"type":"string","enum":["celsius","fahrenheit"],"description":"Temperature unit"}},"required":["location"]}}},
  {"type":"function","function":{"name":"search","description":"Search the web for information",
   "parameters":{"type":"object","properties":{"query":{"type":"string","description":"Search query"},
   "num_results":{"type":"integer","description":"Number of results to return"}},"required":["query"]}}}])";

json example_c() {
  json m = json::parse(R"([
    {"role":"system","content":"You are a helpful assistant."},
    {"role":"user","content":"What's the weather in Beijing?"},
    {"role":"assistant","reasoning_content":"The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls":[{"id":"call_001","type":"function","function":{"name":"get_weather","arguments":"{\"location\": \"Beijing\", \"unit\": \"celsius\"}"}}]},
    {"role":"tool","tool_call_id":"call_001","content":"{\"temperature\": 22, \"condition\": \"sunny\", \"humidity\": 45}"},
    {"role":"assistant","reasoning_content":"Got the weather data. Let me format a nice response.",
     "content":"The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."}])");
  m[0]["tools"] = json::parse(kWeatherTools);
  return m;
}

TEST(Chat, C_ToolRoundTripKeepsReasoning) {
  const std::string schemas =
      R"({"name": "get_weather", "description": "Get the weather for a specific location", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}})"
      "\n"
      R"({"name": "search", "description": "Search the web for information", "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "Search query"}, "num_results": {"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}})";
  const std::string expected =
      std::string(kBos) + "You are a helpful assistant.\n\n" + tools_block(schemas) +
      "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in "
      "Beijing. I should use the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke "
      "name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{\"temperature\": 22, \"condition\": "
      "\"sunny\", \"humidity\": 45}</tool_result><｜Assistant｜><think>Got the weather data. Let me format a "
      "nice response.</think>The weather in Beijing is currently sunny with a temperature of 22°C and 45% "
      "humidity.<｜end▁of▁sentence｜>";
  EXPECT_EQ(render(example_c()), expected);

  // Chat-mode variant: every <｜Assistant｜><think> becomes </think>, reasoning disappears.
  std::string chat = render(example_c(), chat_mode());
  EXPECT_EQ(chat.find("<｜Assistant｜><think>"), std::string::npos);
  EXPECT_EQ(chat.find("The user wants"), std::string::npos);
  EXPECT_NE(chat.find("<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>"), std::string::npos) << chat;
  EXPECT_NE(chat.find("<｜Assistant｜></think>The weather"), std::string::npos);
}

TEST(Chat, C_ToolResultsFollowCallOrderAndMergeWithUserText) {
  json m = json::parse(R"([
    {"role":"user","content":"q"},
    {"role":"assistant","content":"","tool_calls":[
      {"id":"a","function":{"name":"f","arguments":"{}"}},
      {"id":"b","function":{"name":"g","arguments":"{\"n\": 1.50, \"xs\": [1, 2e2], \"o\": {\"k\": null}, \"t\": true}"}}]},
    {"role":"tool","tool_call_id":"b","content":"RB"},
    {"role":"tool","tool_call_id":"a","content":"RA"},
    {"role":"user","content":"then?"}])");
  const std::string out = render(m, chat_mode());
  EXPECT_NE(out.find("<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>"), std::string::npos) << out;
  EXPECT_NE(out.find("<｜DSML｜parameter name=\"n\" string=\"false\">1.5</｜DSML｜parameter>\n"
                     "<｜DSML｜parameter name=\"xs\" string=\"false\">[1, 200.0]</｜DSML｜parameter>\n"
                     "<｜DSML｜parameter name=\"o\" string=\"false\">{\"k\": null}</｜DSML｜parameter>\n"
                     "<｜DSML｜parameter name=\"t\" string=\"false\">true</｜DSML｜parameter>"),
            std::string::npos)
      << out;
  EXPECT_TRUE(out.ends_with("<｜end▁of▁sentence｜><｜User｜><tool_result>RA</tool_result>\n\n<tool_result>RB"
                            "</tool_result>\n\nthen?<｜Assistant｜></think>"))
      << out;
}

TEST(Chat, D_LatestReminderAndActionTaskChatMode) {
  json m = json::parse(R"([
    {"role":"system","content":"该助手为DeepSeek-V3，由深度求索公司创造。\n今天是2025年10月17日，星期五。"},
    {"role":"latest_reminder","content":"2024-11-15,上海市,App,中文"},
    {"role":"user","content":"热海大滚锅是世界著名温泉吗"},
    {"role":"assistant","content":"A1","mask":1},
    {"role":"user","content":"世界著名温泉有哪些","task":"action"},
    {"role":"assistant","content":"Search"}])");
  EXPECT_EQ(render(m, chat_mode()),
            std::string(kBos) +
                "该助手为DeepSeek-V3，由深度求索公司创造。\n今天是2025年10月17日，星期五。<｜latest_reminder｜>"
                "2024-11-15,上海市,App,中文<｜User｜>热海大滚锅是世界著名温泉吗<｜Assistant｜></think>A1"
                "<｜end▁of▁sentence｜><｜User｜>世界著名温泉有哪些<｜Assistant｜></think><｜action｜>Search"
                "<｜end▁of▁sentence｜>");
}

TEST(Chat, E_DeveloperWithToolsThinking) {
  // The official test has three tools; the spec quotes the first schema line, which is
  // used alone here (the other two lines only extend the schema list).
  json tools = json::parse(R"([{"type":"function","function":{"name":"search","description":"Web search. Split multiple queries with '||'.",
    "parameters":{"type":"object","properties":{"queries":{"type":"string","description":"query1||query2"}},
    "required":["queries"],"additionalProperties":false,"$schema":"http://json-schema.org/draft-07/schema#"}}}])");
  json m = json::parse(R"([
    {"role":"system","content":"该助手为DeepSeek，由深度求索公司创造。"},
    {"role":"latest_reminder","content":"2026-02-21,星期六,广州,App,中文"},
    {"role":"developer","content":"小柴胡冲剂和布洛芬能一起吃吗？\n\nCITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】"},
    {"role":"assistant","reasoning_content":"用户想知道小柴胡冲剂和布洛芬能否一起服用。","content":"",
     "tool_calls":[{"function":{"name":"search","arguments":"{\"queries\": \"小柴胡冲剂 布洛芬 相互作用 一起吃\"}"}}]},
    {"role":"tool","content":"[0]"},
    {"role":"assistant","reasoning_content":"现在开始组织回答。","content":"请及时就医。","tool_calls":[]}])");
  m[2]["tools"] = tools;
  const std::string schema =
      R"({"name": "search", "description": "Web search. Split multiple queries with '||'.", "parameters": {"type": "object", "properties": {"queries": {"type": "string", "description": "query1||query2"}}, "required": ["queries"], "additionalProperties": false, "$schema": "http://json-schema.org/draft-07/schema#"}})";
  EXPECT_EQ(render(m),
            std::string(kBos) +
                "该助手为DeepSeek，由深度求索公司创造。<｜latest_reminder｜>2026-02-21,星期六,广州,App,中文<｜User｜>"
                "小柴胡冲剂和布洛芬能一起吃吗？\n\nCITATION FORMAT: 【{cursor_id}†L{start_line_id}(-L{end_line_id})?】"
                "\n\n" + tools_block(schema) +
                "<｜Assistant｜><think>用户想知道小柴胡冲剂和布洛芬能否一起服用。</think>\n\n<｜DSML｜tool_calls>\n"
                "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"queries\" string=\"true\">小柴胡冲剂 "
                "布洛芬 相互作用 一起吃</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
                "<｜end▁of▁sentence｜><｜User｜><tool_result>[0]</tool_result><｜Assistant｜><think>现在开始组织回答。"
                "</think>请及时就医。<｜end▁of▁sentence｜>");
}

TEST(Chat, RequestToolsGoOnAnEmptySystemMessage) {
  auto msgs = chat_messages_from_json(json::parse(R"([{"role":"user","content":"hi"}])"));
  ASSERT_TRUE(msgs.is_ok());
  attach_request_tools(*msgs, json::parse(kWeatherTools));
  auto r = render_chat(*msgs, chat_mode());
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_TRUE(r->starts_with(std::string(kBos) + "\n\n## Tools\n\nYou have access")) << *r;
  EXPECT_TRUE(r->ends_with("invoke tool calls.\n<｜User｜>hi<｜Assistant｜></think>"));
}

TEST(Chat, ContextRendersOnlyTheNewMessagesWithoutBos) {
  json all = example_b();
  auto msgs = chat_messages_from_json(all);
  ASSERT_TRUE(msgs.is_ok());
  std::span<const ChatMessage> span(*msgs);
  auto whole = render_chat(span.first(4), ChatOptions{});
  auto first = render_chat(span.first(2), ChatOptions{});
  auto rest = render_chat(span.subspan(2, 2), ChatOptions{}, span.first(2));
  ASSERT_TRUE(whole.is_ok() && first.is_ok() && rest.is_ok());
  EXPECT_EQ(rest->find(kBos), std::string::npos);
  EXPECT_TRUE(whole->ends_with(*rest)) << *whole << "\n---\n" << *rest;
}

TEST(Chat, PrefillAndTitleAndQueryTasks) {
  json m = json::parse(R"([{"role":"user","content":"q"},{"role":"assistant","content":"part","wo_eos":true}])");
  EXPECT_EQ(render(m, chat_mode()), std::string(kBos) + "<｜User｜>q<｜Assistant｜></think>part");
  json t = json::parse(R"([{"role":"user","content":"q","task":"query"}])");
  EXPECT_EQ(render(t, chat_mode()), std::string(kBos) + "<｜User｜>q<｜query｜>");
  json title = json::parse(R"([{"role":"user","content":"q"},{"role":"assistant","content":"a","task":"title"}])");
  EXPECT_EQ(render(title, chat_mode()), std::string(kBos) + "<｜User｜>q<｜Assistant｜></think>a<｜end▁of▁sentence｜><｜title｜>");
}

TEST(Chat, ErrorsNameTheProblem) {
  EXPECT_NE(render_status(json::parse(R"([{"role":"robot","content":"x"}])")).message().find("unknown role 'robot'"),
            std::string::npos);
  EXPECT_NE(render_status(json::parse(R"([{"role":"user","content":"x","task":"fly"}])")).message().find("unknown task 'fly'"),
            std::string::npos);
  EXPECT_NE(render_status(json::parse(R"([{"role":"developer","content":""}])")).message().find("developer"),
            std::string::npos);
  EXPECT_NE(render_status(json::parse(R"([{"role":"user","content":null}])")).message().find("null content"),
            std::string::npos);
  EXPECT_FALSE(render_status(json::parse(
      R"([{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"[1]"}}]}])")).is_ok());
  EXPECT_FALSE(chat_messages_from_json(json::parse(R"({"role":"user"})")).is_ok());
  EXPECT_FALSE(chat_messages_from_json(json::parse(R"([{"content":"x"}])")).is_ok());
}

TEST(PythonJson, MatchesJsonDumps) {
  EXPECT_EQ(python_json_dumps(json::parse(R"({"b": [1, -2, 2.0, 0.0001, 1e-05, 1e16, 1e15, 123456789012345678, -0.0],
    "a": "é\n\"\\\u0001\u007f/\u2028", "n": null, "t": false})")),
            "{\"b\": [1, -2, 2.0, 0.0001, 1e-05, 1e+16, 1000000000000000.0, 123456789012345678, -0.0], "
            "\"a\": \"é\\n\\\"\\\\\\u0001\x7f/\u2028\", \"n\": null, \"t\": false}");
  EXPECT_EQ(python_float_repr(0.1), "0.1");
  EXPECT_EQ(python_float_repr(1.5e-7), "1.5e-07");
  EXPECT_EQ(python_float_repr(123.456), "123.456");
  EXPECT_EQ(python_float_repr(1e300), "1e+300");
}

}  // namespace
}  // namespace dsv4::text
