#include "text/chat_template.h"

#include <fmt/format.h>

#include <string_view>

namespace dsv4::text {
namespace {

// The template, read top to bottom as render_chat (chat.cpp) runs: request-level tools,
// merging tool results and user messages into turns, the last user turn, dropping earlier
// reasoning, then each turn and the transition after it. Every tag trims the whitespace
// around it, so only {{ }} expressions write text. @CONTROL_ESCAPES@ becomes the table of
// raw control characters and their \u00xx escapes (chat_template_jinja()).
constexpr std::string_view kTemplate = R"JINJA(
{#- DeepSeek-V4 chat encoding (dsv4, src/text/chat_template.cpp; variables in docs/TEXT.md). -#}
{%- set bos_text = '<｜begin▁of▁sentence｜>' -%}
{%- set eos_text = '<｜end▁of▁sentence｜>' -%}
{%- set user_text = '<｜User｜>' -%}
{%- set assistant_text = '<｜Assistant｜>' -%}
{%- set dsml_token = '｜DSML｜' -%}
{%- set control_escapes = @CONTROL_ESCAPES@ -%}

{#- JSON as Python's json.dumps(value, ensure_ascii=False) writes it. -#}
{%- macro json_string(s) -%}
{%- set ns = namespace(s=s|replace('\\', '\\\\')|replace('"', '\\"')|replace('\n', '\\n')|replace('\r', '\\r')|replace('\t', '\\t')|replace('\b', '\\b')|replace('\f', '\\f')) -%}
{%- for pair in control_escapes -%}
{%- if pair[0] in ns.s -%}{%- set ns.s = ns.s|replace(pair[0], pair[1]) -%}{%- endif -%}
{%- endfor -%}
{{- '"' ~ ns.s ~ '"' -}}
{%- endmacro -%}
{%- macro json(v) -%}
{%- if v is none -%}{{- 'null' -}}
{%- elif v is boolean -%}{{- 'true' if v else 'false' -}}
{%- elif v is string -%}{{- json_string(v) -}}
{%- elif v is mapping -%}
{{- '{' -}}
{%- for key, item in v.items() -%}{{- (', ' if not loop.first else '') ~ json_string(key) ~ ': ' ~ json(item) -}}{%- endfor -%}
{{- '}' -}}
{%- elif v is sequence -%}
{{- '[' -}}
{%- for item in v -%}{{- (', ' if not loop.first else '') ~ json(item) -}}{%- endfor -%}
{{- ']' -}}
{%- else -%}{{- v -}}
{%- endif -%}
{%- endmacro -%}

{#- The tools block (spec §5.4) and the response-format block of a system/developer message. -#}
{%- macro tools_and_format(tool_list, rf) -%}
{%- if tool_list is sequence and tool_list|length > 0 -%}
{{- '\n\n## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<' ~ dsml_token ~ 'tool_calls>" block like the following:\n\n<' ~ dsml_token ~ 'tool_calls>\n<' ~ dsml_token ~ 'invoke name="$TOOL_NAME">\n<' ~ dsml_token ~ 'parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</' ~ dsml_token ~ 'parameter>\n...\n</' ~ dsml_token ~ 'invoke>\n<' ~ dsml_token ~ 'invoke name="$TOOL_NAME2">\n...\n</' ~ dsml_token ~ 'invoke>\n</' ~ dsml_token ~ 'tool_calls>\n\nString parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n' -}}
{%- for tool in tool_list -%}
{%- if tool is not mapping or tool.function is not defined -%}{{- raise_exception('chat: tool ' ~ json(tool) ~ ' has no "function" object (OpenAI format expected)') -}}{%- endif -%}
{{- ('\n' if not loop.first else '') ~ json(tool.function) -}}
{%- endfor -%}
{{- '\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n' -}}
{%- endif -%}
{%- if not (rf is none or rf is false or ((rf is mapping or rf is string or rf is sequence) and rf|length == 0)) -%}
{{- '\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n' ~ json(rf) -}}
{%- endif -%}
{%- endmacro -%}

{#- One tool call's parameters: keys of the decoded arguments in order; text that is not a
    JSON object (given as a string) becomes one string parameter named "arguments". -#}
{%- macro tool_call_parameters(call) -%}
{%- set fn = call.function if call.function is defined and call.function is mapping else {} -%}
{%- set args = fn.arguments if fn.arguments is defined and fn.arguments is not none else '' -%}
{%- if args is string -%}
{{- '<' ~ dsml_token ~ 'parameter name="arguments" string="true">' ~ args ~ '</' ~ dsml_token ~ 'parameter>' -}}
{%- elif args is mapping -%}
{%- for key, value in args.items() -%}
{{- ('\n' if not loop.first else '') ~ '<' ~ dsml_token ~ 'parameter name="' ~ key ~ '" string="' ~ ('true' if value is string else 'false') ~ '">' ~ (value if value is string else json(value)) ~ '</' ~ dsml_token ~ 'parameter>' -}}
{%- endfor -%}
{%- else -%}
{{- raise_exception('chat: tool call \'' ~ fn.name ~ '\': arguments ' ~ json(args) ~ ' are not a JSON object') -}}
{%- endif -%}
{%- endmacro -%}

{#- A message's text: missing content is empty, null content is `none_text`. -#}
{%- macro content_or(m, none_text) -%}
{%- if m.content is not defined -%}{{- '' -}}
{%- elif m.content is none -%}{{- none_text -}}
{%- elif m.content is string -%}{{- m.content -}}
{%- else -%}{{- raise_exception('chat: a ' ~ m.role ~ ' message\'s content must be a string') -}}
{%- endif -%}
{%- endmacro -%}

{#- A tool result's text: a list of parts keeps its text parts, joined by blank lines. -#}
{%- macro tool_result_text(m) -%}
{%- if m.content is defined and m.content is not none and m.content is not string and m.content is sequence -%}
{%- for part in m.content -%}
{%- set type = part.type if part is mapping and part.type is defined and part.type is string else 'None' -%}
{{- '\n\n' if not loop.first else '' -}}
{%- if type == 'text' -%}{{- part.text if part.text is defined and part.text is string else '' -}}
{%- else -%}{{- '[Unsupported ' ~ type ~ ']' -}}
{%- endif -%}
{%- endfor -%}
{%- elif m.content is defined and m.content is not none and m.content is not string -%}
{{- raise_exception('chat: a tool message\'s content must be a string or a list of parts') -}}
{%- else -%}{{- content_or(m, 'None') -}}
{%- endif -%}
{%- endmacro -%}

{#- Options. -#}
{%- if thinking is defined and thinking is not none -%}{%- set think = thinking -%}
{%- elif enable_thinking is defined and enable_thinking is not none -%}{%- set think = enable_thinking -%}
{%- else -%}{%- set think = true -%}
{%- endif -%}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else '' -%}
{%- set table = effort_table if effort_table is defined and effort_table is not none else 'v4' -%}
{%- set absolute_maximum = 'Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n' -%}
{%- set beyond_maximum = 'Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\nYou MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any surface symptom.\nDo not stop reasoning until you have independently verified the solution from multiple angles and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n' -%}
{%- if table == 'v4' -%}
{%- if effort == '' or effort == 'high' -%}{%- set effort_text = '' -%}
{%- elif effort == 'max' -%}{%- set effort_text = absolute_maximum -%}
{%- else -%}{{- raise_exception('chat: reasoning effort \'' ~ effort ~ '\' is not one of high, max (DeepSeek-V4)') -}}
{%- endif -%}
{%- elif table == '0731' -%}
{%- if effort == '' or effort == 'low' -%}{%- set effort_text = '' -%}
{%- elif effort == 'high' -%}{%- set effort_text = absolute_maximum -%}
{%- elif effort == 'max' -%}{%- set effort_text = beyond_maximum -%}
{%- else -%}{{- raise_exception('chat: reasoning effort \'' ~ effort ~ '\' is not one of low, high, max (DeepSeek-V4-0731)') -}}
{%- endif -%}
{%- else -%}{{- raise_exception('chat: effort_table \'' ~ table ~ '\' is not v4 or 0731') -}}
{%- endif -%}
{%- set generation_prompt = add_generation_prompt is defined and add_generation_prompt is true -%}

{#- Request-level tools and response format go on message 0 when it is a system or developer
    message, else on a new empty system message before the conversation. -#}
{%- set request_tools = tools if tools is defined and tools is sequence and tools is not string and tools|length > 0 else [] -%}
{%- set request_format = response_format if response_format is defined and response_format is not none else none -%}
{%- set attach = request_tools|length > 0 or request_format is not none -%}
{%- if attach and not (messages|length > 0 and messages[0].role in ['system', 'developer']) -%}
{%- set msgs = [{'role': 'system', 'content': ''}] + messages -%}
{%- else -%}
{%- set msgs = messages -%}
{%- endif -%}

{#- Turns: a tool result joins the user turn before it (or opens one, without a task); a user
    message joins a user turn without a task. Each turn is a range of messages. -#}
{%- set ns = namespace(firsts=[], roles=[], tasks=[], in_user=false, user_task=none, any_tools=request_tools|length > 0) -%}
{%- for m in msgs -%}
{%- set task = m.task if m.task is defined and m.task is not none else none -%}
{%- if m.tools is defined and m.tools is sequence and m.tools is not string and m.tools|length > 0 -%}{%- set ns.any_tools = true -%}{%- endif -%}
{%- if m.role == 'tool' -%}
{%- if not ns.in_user -%}
{%- set ns.firsts = ns.firsts + [loop.index0] -%}{%- set ns.roles = ns.roles + ['user'] -%}{%- set ns.tasks = ns.tasks + [none] -%}
{%- set ns.user_task = none -%}
{%- endif -%}
{%- set ns.in_user = true -%}
{%- elif m.role == 'user' -%}
{%- if not ns.in_user or ns.user_task is not none -%}
{%- set ns.firsts = ns.firsts + [loop.index0] -%}{%- set ns.roles = ns.roles + ['user'] -%}{%- set ns.tasks = ns.tasks + [task] -%}
{%- set ns.user_task = task -%}
{%- endif -%}
{%- set ns.in_user = true -%}
{%- else -%}
{%- set ns.firsts = ns.firsts + [loop.index0] -%}{%- set ns.roles = ns.roles + [m.role] -%}{%- set ns.tasks = ns.tasks + [task] -%}
{%- set ns.in_user = false -%}
{%- endif -%}
{%- endfor -%}
{%- set turn_count = ns.firsts|length -%}
{%- set ns.last_user = -1 -%}
{%- for k in range(turn_count) -%}
{%- if ns.roles[k] in ['user', 'developer'] -%}{%- set ns.last_user = k -%}{%- endif -%}
{%- endfor -%}
{%- set last_user = ns.last_user -%}
{%- set drop = (drop_thinking if drop_thinking is defined and drop_thinking is not none else true) and not ns.any_tools -%}

{#- In thinking mode with drop on, turns before the last user turn keep only user, system,
    latest_reminder and (without their reasoning) assistant turns. -#}
{%- set ns.kept = [] -%}
{%- for k in range(turn_count) -%}
{%- if not (think and drop) or k >= last_user or ns.roles[k] in ['user', 'system', 'latest_reminder', 'assistant'] -%}
{%- set ns.kept = ns.kept + [k] -%}
{%- endif -%}
{%- endfor -%}
{%- set kept = ns.kept -%}

{{- bos_text -}}
{%- for k in kept -%}
{%- set p = loop.index0 -%}
{%- set first = ns.firsts[k] -%}
{%- set last = ns.firsts[k + 1] - 1 if k + 1 < turn_count else msgs|length - 1 -%}
{%- set m = msgs[first] -%}
{%- set role = ns.roles[k] -%}
{%- if p == 0 and think -%}{{- effort_text -}}{%- endif -%}

{%- if role == 'system' or role == 'developer' -%}
{%- set own_tools = m.tools if m.tools is defined and m.tools is not none else [] -%}
{%- set own_format = m.response_format if m.response_format is defined else none -%}
{%- set turn_tools = request_tools if first == 0 and request_tools|length > 0 else own_tools -%}
{%- set turn_format = request_format if first == 0 and request_format is not none else own_format -%}
{%- if role == 'system' -%}
{{- content_or(m, '') -}}
{%- else -%}
{%- if m.content is not defined or m.content is none or m.content|length == 0 -%}{{- raise_exception('chat: a developer message needs non-empty content') -}}{%- endif -%}
{{- user_text ~ m.content -}}
{%- endif -%}
{{- tools_and_format(turn_tools, turn_format) -}}

{%- elif role == 'user' -%}
{#- The latest assistant message with tool calls before this turn orders its tool results. -#}
{%- set order = namespace(calls=[], results=[]) -%}
{%- for j in range(first) -%}
{%- if msgs[j].role == 'assistant' and msgs[j].tool_calls is defined and msgs[j].tool_calls is sequence and msgs[j].tool_calls|length > 0 -%}
{%- set order.calls = msgs[j].tool_calls -%}
{%- endif -%}
{%- endfor -%}
{%- for c in range(order.calls|length if order.calls|length > 0 else 1) -%}
{%- for j in range(first, last + 1) -%}
{%- if msgs[j].role == 'tool' -%}
{%- set result_id = msgs[j].tool_call_id if msgs[j].tool_call_id is defined and msgs[j].tool_call_id is string else '' -%}
{%- set position = namespace(at=-1) -%}
{%- for call in order.calls -%}
{%- if position.at < 0 and call.id is defined and call.id is string and call.id|length > 0 and call.id == result_id -%}{%- set position.at = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if (position.at if position.at >= 0 else 0) == c -%}{%- set order.results = order.results + [j] -%}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- endfor -%}
{{- user_text -}}
{%- set slot = namespace(next=0) -%}
{%- for j in range(first, last + 1) -%}
{{- '\n\n' if not loop.first else '' -}}
{%- if msgs[j].role == 'tool' -%}
{{- '<tool_result>' ~ tool_result_text(msgs[order.results[slot.next]]) ~ '</tool_result>' -}}
{%- set slot.next = slot.next + 1 -%}
{%- else -%}
{%- if msgs[j].content is defined and msgs[j].content is none -%}{{- raise_exception('chat: a user message has null content') -}}{%- endif -%}
{{- content_or(msgs[j], '') -}}
{%- endif -%}
{%- endfor -%}

{%- elif role == 'latest_reminder' -%}
{{- '<｜latest_reminder｜>' ~ (content_or(m, 'None') if m.content is defined else 'None') -}}

{%- elif role == 'assistant' -%}
{%- set prev_has_task = p > 0 and ns.tasks[kept[p - 1]] is not none -%}
{%- if think and not prev_has_task and (not drop or k > last_user) -%}
{{- ('' if m.reasoning_content is not defined or m.reasoning_content is none else m.reasoning_content) ~ '</think>' -}}
{%- endif -%}
{{- content_or(m, '') -}}
{%- if m.tool_calls is defined and m.tool_calls is sequence and m.tool_calls|length > 0 -%}
{{- '\n\n<' ~ dsml_token ~ 'tool_calls>\n' -}}
{%- for call in m.tool_calls -%}
{{- ('\n' if not loop.first else '') ~ '<' ~ dsml_token ~ 'invoke name="' ~ call.function.name ~ '">\n' ~ tool_call_parameters(call) ~ '\n</' ~ dsml_token ~ 'invoke>' -}}
{%- endfor -%}
{{- '\n</' ~ dsml_token ~ 'tool_calls>' -}}
{%- endif -%}
{%- if not (m.wo_eos is defined and m.wo_eos is true) -%}{{- eos_text -}}{%- endif -%}

{%- else -%}
{{- raise_exception('chat: unknown role \'' ~ role ~ '\' (expected system, user, assistant, tool, latest_reminder or developer)') -}}
{%- endif -%}

{#- The transition into the next assistant turn, or the generation prompt after the last. -#}
{%- set next_role = ns.roles[kept[p + 1]] if p + 1 < kept|length else none -%}
{%- if (next_role is none and generation_prompt) or next_role in ['assistant', 'latest_reminder'] -%}
{%- set task = ns.tasks[k] -%}
{%- if task is not none -%}
{%- set task_tokens = {'action': '<｜action｜>', 'query': '<｜query｜>', 'authority': '<｜authority｜>', 'domain': '<｜domain｜>', 'title': '<｜title｜>', 'read_url': '<｜read_url｜>'} -%}
{%- if task not in task_tokens -%}{{- raise_exception('chat: unknown task \'' ~ task ~ '\' (expected action, query, authority, domain, read_url or title)') -}}{%- endif -%}
{%- if task == 'action' -%}{{- assistant_text ~ ('<think>' if think else '</think>') -}}{%- endif -%}
{{- task_tokens[task] -}}
{%- elif role == 'user' or role == 'developer' -%}
{{- assistant_text ~ ('<think>' if think and (not drop or k >= last_user) else '</think>') -}}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
)JINJA";

// Control characters that json.dumps writes as \u00xx (all below U+0020 but \b \t \n \f \r,
// which have short escapes, and U+0000), as a Jinja list of [raw, escape] pairs.
std::string control_escape_table() {
  std::string table = "[";
  for (int c = 1; c < 0x20; ++c) {
    if (c == '\b' || c == '\t' || c == '\n' || c == '\f' || c == '\r') continue;
    if (table.size() > 1) table += ", ";
    table += fmt::format("['{}', '\\\\u{:04x}']", static_cast<char>(c), c);
  }
  return table + "]";
}

}  // namespace

const std::string& chat_template_jinja() {
  static const std::string text = [] {
    std::string t(kTemplate.substr(1));  // without the raw string's first newline
    const std::string_view placeholder = "@CONTROL_ESCAPES@";
    t.replace(t.find(placeholder), placeholder.size(), control_escape_table());
    return t;
  }();
  return text;
}

}  // namespace dsv4::text
