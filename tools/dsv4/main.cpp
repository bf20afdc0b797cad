// dsv4: the command-line entry point. Each subcommand is defined in its own file.
#include <fmt/format.h>

#include <cstdio>
#include <map>
#include <string>

#include "commands.h"

int main(int argc, char** argv) {
  using namespace dsv4::cli;
  CLI::App app{"dsv4 " DSV4_VERSION ": DeepSeek-V4 inference engine"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(DSV4_VERSION));

  std::map<CLI::App*, CommandRunner> runners;
  auto add = [&](const char* name, const char* help, auto register_fn) {
    CLI::App* sub = app.add_subcommand(name, help);
    register_fn(*sub, runners[sub]);
  };
  // One line per subcommand (each defined in cmd_<name>.cpp, declared in commands.h).
  (void)add;
  add("run", "Answer one prompt, streaming the reply (built-in tiny model without -m)", register_run);
  add("serve", "OpenAI-, Anthropic- and Responses-compatible HTTP server (continuous batching, prefix reuse)", register_serve);
  add("chat", "Talk with a model interactively (/think, /nothink, /reset, /quit; Ctrl-C stops a reply)", register_chat);
  add("tokenize", "Turn text into token ids (development tool)", register_tokenize);
  add("gguf", "Inspect or rewrite GGUF files: dump, copy (development tools)", register_gguf);
  add("info", "Describe a model file, a preset or the built-in model: config, tensors, memory plan", register_info);
  add("synth", "Write a synthetic deepseek4 GGUF with seeded random weights", register_synth);
  add("convert", "Convert DeepSeek's official checkpoint (safetensors FP8/FP4) to a deepseek4 GGUF", register_convert);
  add("synth-checkpoint", "Write a synthetic checkpoint in DeepSeek's official format (input of convert)", register_synth_checkpoint);
  add("score", "Write the logits of a token sequence as a NumPy .npy file", register_score);
  add("bench", "Measure prefill, decode and batched decode speed against the bounds of this machine", register_bench);
  add("quant", "Quantise / dequantise raw blocks of one element type (development tool)", register_quant);
  add("engram", "V4.1 Engram hash constants and row ids as JSON (development tool)", register_engram);
  add("glp", "Make a GLP steering direction from two sets of prompts: glp make (docs/STEERING.md)", register_glp);
  add("graft", "Make a compressed-KV bank from a prompt: graft make (docs/STEERING.md)", register_graft);
  add("chat-render", "Render conversations (JSON lines) with the chat encoder; --template prints the Jinja template (development tool)", register_chat_render);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  for (auto& [sub, run] : runners)
    if (sub->parsed() && run) return run();
  return kExitUsage;
}
