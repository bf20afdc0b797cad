// `dsv4 run` end to end through the built program, on the built-in tiny model (random
// weights: the text is noise, so the tests check structure, determinism and limits).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

#include "support/test_support.h"

namespace dsv4 {
namespace {

// One cache folder for the built-in model, shared by the text tests of this build.
std::string run(const std::string& args, int* exit_code = nullptr) {
  const std::string env = "DSV4_CACHE_DIR=" + (std::filesystem::path(DSV4_BINARY_DIR) / "test-cache-text").string();
  const auto r = test::run_command(env + " " + test::cli_path().string() + " run " + args);
  if (exit_code) *exit_code = r.exit_code;
  return r.output;
}

nlohmann::json run_json(const std::string& args) {
  int rc = -1;
  const std::string out = run(args + " --json 2>/dev/null", &rc);
  EXPECT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << out;
  return j.is_discarded() ? nlohmann::json::object() : j;
}

void expect_contains(const std::string& out, const std::string& part) {
  EXPECT_NE(out.find(part), std::string::npos) << "output lacks \"" << part << "\":\n" << out;
}

TEST(RunCliTest, StreamsReasoningThenReportsSpeedOnTheBuiltinModel) {
  int rc = -1;
  const std::string out = run("-p 'Hello there' -n 12 --seed 3", &rc);
  ASSERT_EQ(rc, 0) << out;
  expect_contains(out, "<think>\n");
  expect_contains(out, "prompt: ");
  expect_contains(out, " tokens/s | generation: ");
  expect_contains(out, "random weights; its output is noise");
}

TEST(RunCliTest, JsonReportsTheReplyAndTheSameSeedRepeatsIt) {
  const auto a = run_json("-p 'Count to three' -n 16 --seed 11");
  const auto b = run_json("-p 'Count to three' -n 16 --seed 11");
  const auto c = run_json("-p 'Count to three' -n 16 --seed 12");
  ASSERT_TRUE(a.contains("content") && a.contains("reasoning"));
  EXPECT_EQ(a["seed"], 11);
  EXPECT_EQ(a["builtin_model"], true);
  EXPECT_EQ(a["thinking"], true);
  EXPECT_GT(a["prompt_tokens"].get<int>(), 3);
  EXPECT_LE(a["generated_tokens"].get<int>(), 16);
  EXPECT_GT(a["generation_tokens_per_second"].get<double>(), 0.0);
  EXPECT_EQ(a["reasoning"], b["reasoning"]);
  EXPECT_EQ(a["content"], b["content"]);
  EXPECT_TRUE(a["reasoning"] != c["reasoning"] || a["content"] != c["content"]) << "seeds 11 and 12 agree";
}

TEST(RunCliTest, NothinkGreedyAndLimits) {
  const auto a = run_json("-p 'Hi' --nothink --temp 0 -n 10 --seed 1");
  const auto b = run_json("-p 'Hi' --nothink --temp 0 -n 10 --seed 2");
  EXPECT_EQ(a["thinking"], false);
  EXPECT_EQ(a["reasoning"], "");
  EXPECT_EQ(a["content"], b["content"]);  // greedy ignores the seed
  const std::string reason = a["finish_reason"];
  EXPECT_TRUE(reason == "length" || reason == "eos") << reason;
  if (reason == "length") {
    EXPECT_EQ(a["generated_tokens"], 10);
  }
}

// --spec: greedy output identical to plain greedy; the JSON reports the acceptance.
TEST(RunCliTest, SpecKeepsGreedyOutputAndReportsAcceptance) {
  const auto plain = run_json("-p 'Hi' --raw --temp 0 -n 24 --seed 1");
  const auto spec = run_json("-p 'Hi' --raw --temp 0 -n 24 --seed 1 --spec 3");
  EXPECT_EQ(plain["content"], spec["content"]);
  EXPECT_EQ(plain["generated_tokens"], spec["generated_tokens"]);
  EXPECT_FALSE(plain.contains("speculative"));
  ASSERT_TRUE(spec.contains("speculative"));
  EXPECT_EQ(spec["speculative"]["max_drafts"], 3);
  EXPECT_GT(spec["speculative"]["steps"].get<int>(), 0);
  const double acceptance = spec["speculative"]["acceptance"];
  EXPECT_GE(acceptance, 0.0);
  EXPECT_LE(acceptance, 1.0);
  int rc = -1;
  const std::string bad = run("-p 'Hi' --spec 5 2>&1", &rc);
  EXPECT_NE(rc, 0);
  expect_contains(bad, "--spec");
  // auto, the default, speculates only on a device: off on the CPU backend.
  const auto automatic = run_json("-p 'Hi' --raw --temp 0 -n 24 --seed 1 --spec auto");
  EXPECT_EQ(plain["content"], automatic["content"]);
  EXPECT_FALSE(automatic.contains("speculative"));
  rc = -1;
  const std::string word = run("-p 'Hi' --spec often 2>&1", &rc);
  EXPECT_NE(rc, 0);
  expect_contains(word, "expected auto or a draft count 0..4");
}

TEST(RunCliTest, StopStringCutsTheOutput) {
  const auto full = run_json("--raw -p 'The' --temp 0 -n 24");
  const std::string content = full["content"];
  // A stop string taken from the middle of the greedy output, on character boundaries.
  size_t start = content.size() / 2;
  while (start > 0 && (static_cast<unsigned char>(content[start]) & 0xC0) == 0x80) --start;
  size_t end = start + 1;
  while (end < content.size() && (static_cast<unsigned char>(content[end]) & 0xC0) == 0x80) ++end;
  if (content.size() < 4 || content.find('\'') != std::string::npos) GTEST_SKIP() << "output too short to cut";
  const std::string stop = content.substr(start, end - start);
  const auto cut = run_json("--raw -p 'The' --temp 0 -n 24 --stop '" + stop + "'");
  EXPECT_EQ(cut["content"], content.substr(0, content.find(stop)));
  EXPECT_EQ(cut["finish_reason"], "stop_string");
}

TEST(RunCliTest, BadFlagsAreUsageErrorsNamingTheFlag) {
  struct Case {
    const char* args;
    const char* message;
  };
  const Case cases[] = {
      {"-p x --top-p 1.5", "--top-p = 1.5"},
      {"-p x --temp -1", "--temp = -1"},
      {"-p x --min-p 3", "--min-p"},
      {"-p x --top-k -2", "--top-k"},
      {"-p x --repeat-penalty 0", "--repeat-penalty"},
      {"-p x --logit-bias 12", "--logit-bias '12'"},
      {"-p x --think --nothink", "excludes"},
      {"-p x --effort low", "--effort low"},
      {"-p x --effort-table v5", "--effort-table"},
      {"-p x --stop ''", "--stop"},
      {"-p x -n -3", "--max-tokens"},
      {"-p x -m /nonexistent/model.gguf", "/nonexistent/model.gguf"},
      {"-n 3", "--prompt"},
  };
  for (const Case& c : cases) {
    int rc = -1;
    const std::string out = run(c.args, &rc);
    EXPECT_EQ(rc, 2) << c.args << ":\n" << out;
    expect_contains(out, c.message);
  }
}

TEST(RunCliTest, ModelErrorsAreFailures) {
  test::TempDir dir;
  const std::string bad = (dir / "bad.gguf").string();
  { std::ofstream(bad) << "not a gguf file"; }
  int rc = -1;
  const std::string out = run("-p x -m " + bad, &rc);
  EXPECT_EQ(rc, 1) << out;
  expect_contains(out, bad);
  const std::string big = run("-p x --logit-bias 999999=1", &rc);
  EXPECT_EQ(rc, 1) << big;
  expect_contains(big, "token id 999999");
}

}  // namespace
}  // namespace dsv4
