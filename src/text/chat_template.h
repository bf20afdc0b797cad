// tokenizer.chat_template: a Jinja template of our own that renders DeepSeek-V4's chat
// encoding exactly as render_chat (text/chat.h) does, for programs that format prompts from
// the GGUF's template (llama.cpp, Hugging Face-style servers). Written from spec
// checkpoint-tokenizer-chat.md §5 and text/chat.cpp; docs/TEXT.md lists its variables.
//
// Inputs (all optional except messages):
//   messages               OpenAI-style message objects; the fields render_chat reads (role,
//                          content, reasoning_content, tool_calls, tool_call_id, tools,
//                          response_format, task, wo_eos). Tool-call arguments as an object
//                          (decoded JSON; llama.cpp passes them so); a string argument is
//                          rendered as the official encoder renders text that is not JSON.
//   tools, response_format request-level: placed on message 0 when it is a system or
//                          developer message, else on a new empty system message before it
//                          (text::attach_request_tools).
//   thinking | enable_thinking   thinking mode (default true), `thinking` wins.
//   reasoning_effort, effort_table ("v4", default, or "0731"), drop_thinking (default true).
//   add_generation_prompt  the transition after the last message (<｜Assistant｜><think> …)
//                          is written only when true (Hugging Face convention).
// The output starts with <｜begin▁of▁sentence｜>. Errors of the encoder (unknown role or
// task, null user content, bad arguments, unknown effort) call raise_exception.
//
// JSON inside the prompt (tool schemas, response formats, non-string arguments) is written
// by a macro as Python's json.dumps(ensure_ascii=False) does. Control characters other than
// \b \t \n \f \r are escaped through a table that holds them as raw bytes (Jinja literals
// have no \u escape in every engine); U+0000 cannot be escaped (C strings end there).
// Floats print as the engine prints them: Python's repr in jinja2, which equals dsv4's;
// other engines may differ for exponents or more than six decimals (docs/TEXT.md).
#pragma once

#include <string>

namespace dsv4::text {

// The template text (the same bytes on every call).
const std::string& chat_template_jinja();

}  // namespace dsv4::text
