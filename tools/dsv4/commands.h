// Each `dsv4` subcommand lives in its own cmd_<name>.cpp and registers itself here.
// A command returns the process exit code (see docs/CLI.md for their meaning).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace dsv4::cli {

// Exit codes shared by every command.
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      // the operation failed (bad file, model error, I/O)
  kExitUsage = 2,        // invalid command line
  kExitInterrupted = 130,
};

using CommandRunner = std::function<int()>;

// Adds the subcommand's options to `app` and returns the function to run when chosen.
void register_tokenize(CLI::App& app, CommandRunner& run);  // cmd_tokenize.cpp
void register_run(CLI::App& app, CommandRunner& run);       // cmd_run.cpp
void register_chat(CLI::App& app, CommandRunner& run);      // cmd_chat.cpp
void register_gguf(CLI::App& app, CommandRunner& run);      // cmd_gguf.cpp
void register_info(CLI::App& app, CommandRunner& run);      // cmd_info.cpp
void register_synth(CLI::App& app, CommandRunner& run);     // cmd_synth.cpp
void register_convert(CLI::App& app, CommandRunner& run);   // cmd_convert.cpp
void register_synth_checkpoint(CLI::App& app, CommandRunner& run);  // cmd_synth_checkpoint.cpp
void register_score(CLI::App& app, CommandRunner& run);     // cmd_score.cpp
void register_quant(CLI::App& app, CommandRunner& run);     // cmd_quant.cpp
void register_engram(CLI::App& app, CommandRunner& run);    // cmd_engram.cpp
void register_bench(CLI::App& app, CommandRunner& run);     // cmd_bench.cpp
void register_chat_render(CLI::App& app, CommandRunner& run);  // cmd_chat_render.cpp
void register_serve(CLI::App& app, CommandRunner& run);     // cmd_serve.cpp
void register_glp(CLI::App& app, CommandRunner& run);       // cmd_glp.cpp
void register_graft(CLI::App& app, CommandRunner& run);     // cmd_graft.cpp

}  // namespace dsv4::cli
