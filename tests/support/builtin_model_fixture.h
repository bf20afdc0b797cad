// The built-in tiny model (synth/builtin_model.h) and its tokenizer, loaded once per test
// process on a 2-thread CPU backend: the model of the scheduler suites, which need real
// chat prompts. Its GGUF is cached under the build tree (test-cache-text).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <memory>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "synth/builtin_model.h"
#include "text/tokenizer.h"

namespace dsv4::test {

struct BuiltinModel {
  backend::CpuBackend cpu{2};
  std::unique_ptr<Model> model;
  std::shared_ptr<const text::Tokenizer> tokenizer;
};

inline BuiltinModel& builtin_model() {
  static BuiltinModel* f = [] {
    setenv("DSV4_CACHE_DIR", (std::filesystem::path(DSV4_BINARY_DIR) / "test-cache-text").c_str(), 1);
    auto* fx = new BuiltinModel;
    auto path = ensure_builtin_model();
    EXPECT_TRUE(path.is_ok()) << path.status().message();
    auto model = Model::load(path->string(), fx->cpu);
    EXPECT_TRUE(model.is_ok()) << model.status().message();
    fx->model = std::move(*model);
    fx->tokenizer = *text::Tokenizer::builtin();
    return fx;
  }();
  return *f;
}

}  // namespace dsv4::test
