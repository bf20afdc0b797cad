// `dsv4 chat` end to end, driven through a pseudo-terminal as a person would: messages,
// /nothink, /reset, unknown commands, Ctrl-C during a reply and at the prompt, /quit.
#include <gtest/gtest.h>

#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "support/test_support.h"

namespace dsv4 {
namespace {

class PtyProcess {
 public:
  explicit PtyProcess(const std::vector<std::string>& args) {
    pid_ = forkpty(&fd_, nullptr, nullptr, nullptr);
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~PtyProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) close(fd_);
  }
  bool started() const { return pid_ > 0; }

  void send(const std::string& s) { ASSERT_EQ(write(fd_, s.data(), s.size()), static_cast<ssize_t>(s.size())); }

  // Reads until `text` appears after the current mark (then moves the mark past it).
  bool expect(const std::string& text, double seconds = 120) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      if (size_t at = out_.find(text, mark_); at != std::string::npos) {
        mark_ = at + text.size();
        return true;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(fd_, buf, sizeof buf);
      if (n <= 0) return out_.find(text, mark_) != std::string::npos;
      out_.append(buf, static_cast<size_t>(n));
    }
  }

  int wait_exit(double seconds = 30) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      expect("\x01never", 0.05);  // drain output so the child is not blocked
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
    }
    return -1;
  }
  const std::string& output() const { return out_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  bool exited_ = false;
  std::string out_;
  size_t mark_ = 0;
};

std::vector<std::string> chat_args(std::vector<std::string> extra) {
  static const std::string cache = "DSV4_CACHE_DIR=" + (std::filesystem::path(DSV4_BINARY_DIR) / "test-cache-text").string();
  std::vector<std::string> args = {"/usr/bin/env", cache, test::cli_path().string(), "chat"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(ChatCliTest, ConversationCommandsAndCtrlC) {
  PtyProcess p(chat_args({"--seed", "5", "-n", "6"}));
  ASSERT_TRUE(p.started());
  ASSERT_TRUE(p.expect("random weights: expect noise")) << p.output();
  ASSERT_TRUE(p.expect("> ")) << p.output();

  p.send("Hello!\n");
  ASSERT_TRUE(p.expect("<think>")) << p.output();
  ASSERT_TRUE(p.expect("generation: ")) << p.output();
  ASSERT_TRUE(p.expect("> ")) << p.output();

  p.send("/nothink\n");
  ASSERT_TRUE(p.expect("(chat mode)")) << p.output();
  p.send("And now?\n");
  // The second turn reuses the cache for the first turn's tokens.
  ASSERT_TRUE(p.expect("generation: ")) << p.output();
  ASSERT_TRUE(p.expect("> ")) << p.output();

  p.send("/bogus\n");
  ASSERT_TRUE(p.expect("unknown command /bogus")) << p.output();
  p.send("/reset\n");
  ASSERT_TRUE(p.expect("(new conversation)")) << p.output();

  p.send("\x03");  // Ctrl-C at the prompt
  ASSERT_TRUE(p.expect("(type /quit to leave)")) << p.output();

  p.send("/quit\n");
  EXPECT_EQ(p.wait_exit(), 0) << p.output();
}

TEST(ChatCliTest, CtrlCStopsALongReplyAndReturnsToThePrompt) {
  PtyProcess p(chat_args({"--seed", "9", "-n", "100000", "--nothink", "--ctx", "4000"}));
  ASSERT_TRUE(p.started());
  ASSERT_TRUE(p.expect("> ")) << p.output();
  p.send("Tell me everything.\n");
  ASSERT_TRUE(p.expect("Tell me everything.\r\n")) << p.output();  // the terminal's echo
  // Let the reply run a moment, then interrupt it.
  p.expect("\x01never", 1.5);
  p.send("\x03");
  ASSERT_TRUE(p.expect("(stopped)")) << p.output();
  ASSERT_TRUE(p.expect("cancelled")) << p.output();
  ASSERT_TRUE(p.expect("> ")) << p.output();
  p.send("/quit\n");
  EXPECT_EQ(p.wait_exit(), 0) << p.output();
}

TEST(ChatCliTest, EndOfInputLeaves) {
  const std::string cache = (std::filesystem::path(DSV4_BINARY_DIR) / "test-cache-text").string();
  const auto r = test::run_command("printf 'hi\\n' | DSV4_CACHE_DIR=" + cache + " " + test::cli_path().string() +
                                   " chat -n 4 --seed 1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("generation: "), std::string::npos) << r.output;
}

}  // namespace
}  // namespace dsv4
