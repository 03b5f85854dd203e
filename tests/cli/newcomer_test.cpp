// What a newcomer meets: every mistake of a first session gives one line saying what is wrong and
// what to do, with exit code 2; Ctrl-C stops training cleanly. Runs the meshtrain binary.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../test_files.h"
#include "data/token_shards.h"
#include "runtime/strings.h"

namespace fs = std::filesystem;

namespace {

struct Out {
  int code = -1;
  std::string text;
};

// Runs `meshtrain ARGS` with stdout and stderr together.
Out meshtrain(const std::string& args) {
  Out r;
  FILE* p = ::popen((std::string(MT_BINARY) + " " + args + " 2>&1 </dev/null").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.text.append(buf.data(), n);
  const int st = ::pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

// Exit code 2 and a message holding every needle, without a C++ exception's type name.
void expect_usage_error(const std::string& args, const std::vector<std::string>& needles) {
  const Out o = meshtrain(args);
  EXPECT_EQ(o.code, 2) << args << "\n" << o.text;
  for (const auto& n : needles) EXPECT_NE(o.text.find(n), std::string::npos) << args << ": no '" << n << "' in\n" << o.text;
  EXPECT_EQ(o.text.find("std::"), std::string::npos) << o.text;
  EXPECT_EQ(o.text.find("terminate called"), std::string::npos) << o.text;
}

// A byte-level shard of `n` tokens of text recorded as prepared with a vocabulary of `vocab`.
void write_shard(const std::string& path, int64_t n, int32_t vocab) {
  std::vector<uint16_t> bytes_of_id(static_cast<size_t>(vocab), 1);
  mt::TokenShardWriter w(path, n, 2);
  w.describe_text(vocab, bytes_of_id);
  std::vector<uint32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<uint32_t>("the cat sat on the mat. "[i % 24]);
  w.write(t);
  w.close();
}

}  // namespace

TEST(ClosestName, FindsTyposOnly) {
  const std::vector<std::string> cmds = {"train", "prepare", "plan", "plot", "sample"};
  EXPECT_EQ(mt::closest_name("trian", cmds), "train");
  EXPECT_EQ(mt::closest_name("Train", cmds), "train");
  EXPECT_EQ(mt::closest_name("prepar", cmds), "prepare");
  EXPECT_EQ(mt::closest_name("plna", cmds), "plan");
  EXPECT_EQ(mt::closest_name("frobnicate", cmds), "");
  EXPECT_EQ(mt::closest_name("x", cmds), "");
}

TEST(Newcomer, NoArgumentsHelpAndMistypedCommands) {
  const Out none = meshtrain("");
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.text.find("no command given; to start, run: bash scripts/quickstart.sh"), std::string::npos) << none.text;
  for (const char* c : {"train", "prepare", "tokenize", "sample", "export", "model-info", "plot", "launch", "bench",
                        "schedule", "plan", "check-ops"}) {
    const Out h = meshtrain(std::string(c) + " --help");
    EXPECT_EQ(h.code, 0) << c << "\n" << h.text;
    EXPECT_NE(h.text.find("usage"), std::string::npos) << c << "\n" << h.text;
  }
  EXPECT_EQ(meshtrain("--help").code, 0);
  expect_usage_error("trian", {"unknown command 'trian' (did you mean 'train'?)"});
  expect_usage_error("frobnicate", {"unknown command 'frobnicate'", "meshtrain --help"});
  expect_usage_error("prepare --inptu x --out y --tokenizer byte", {"unknown option --inptu (did you mean --input?)"});
  expect_usage_error("sample --checkpiont x", {"did you mean --checkpoint?"});
  // More ranks than cores runs (oversubscribed) and says what it costs.
  const Out many = meshtrain("launch -n 4096 --dry-run -- train");
  EXPECT_EQ(many.code, 0) << many.text;
  EXPECT_NE(many.text.find("note: 4096 ranks on"), std::string::npos) << many.text;
}

TEST(Newcomer, ConfigMistakes) {
  mt::test::TestDir dir;
  expect_usage_error("train --train.stpes 5", {"unknown key --train.stpes (did you mean train.steps?)"});
  expect_usage_error("train --model.steps 5", {"steps belongs in [train]", "--train.steps"});
  {
    std::ofstream f(dir.file("wrong.toml"));
    f << "[model]\nlr = 0.001\n";
  }
  expect_usage_error("train --config " + dir.file("wrong.toml"), {"unknown key model.lr", "lr belongs in [train]"});
  expect_usage_error("train --config " + dir.file("none.toml"), {"the config file", "does not exist", "configs/"});
  expect_usage_error("train --config " + dir.path.string(), {"is a directory", "--config takes a TOML file"});
}

TEST(Newcomer, DataMistakes) {
  mt::test::TestDir dir;
  expect_usage_error("train --model.preset gpt2-tiny --data.train " + dir.file("missing.bin"),
                     {"data.train: ", "missing.bin does not exist", "meshtrain prepare"});
  expect_usage_error("train --model.preset gpt2-tiny --data.train " + dir.path.string(),
                     {"is a directory", "train.bin", "train_*.bin"});
  // Shards prepared with a 2048-token tokenizer for a model of 256.
  write_shard(dir.file("big.bin"), 4096, 2048);
  expect_usage_error("train --model.preset gpt2-tiny --train.eval_every 0 --data.train " + dir.file("big.bin"),
                     {"prepared with a tokenizer of 2048 tokens", "vocab_size 256", "vocab_size = 2048"});
  expect_usage_error("sample", {"give --checkpoint DIR"});
  expect_usage_error("sample --checkpoint " + dir.file("nothing"), {"does not exist", "train.checkpoint_dir"});
}

// Trains a tiny model for two steps with a checkpoint, then points train.resume at it with another
// model; Ctrl-C (SIGINT) during a long run stops after the step with a final checkpoint.
TEST(Newcomer, CheckpointOfAnotherModelAndCtrlC) {
  mt::test::TestDir dir;
  write_shard(dir.file("t.bin"), 20000, 256);
  const std::string base = "train --model.preset gpt2-tiny --model.seq_len 32 --train.micro_batch 2 --train.eval_every 0 "
                           "--train.threads 1 --data.train " + dir.file("t.bin");
  const Out first = meshtrain(base + " --train.steps 2 --train.checkpoint_dir " + dir.file("ck"));
  ASSERT_EQ(first.code, 0) << first.text;
  expect_usage_error(base + " --train.steps 3 --model.n_embd 64 --model.n_head 2 --train.resume " + dir.file("ck"),
                     {"config error: ", "a checkpoint of another model", "its trainer.json lists them"});

  // Ctrl-C: SIGINT once the first step is printed.
  const std::string cmd = std::string(MT_BINARY) + " " + base + " --train.steps 20000 --log.print_every 1 " +
                          "--train.checkpoint_dir " + dir.file("ck2") + " 2>&1";
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::signal(SIGINT, SIG_DFL);
    ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string text;
  char buf[4096];
  bool sent = false;
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) {
    text.append(buf, static_cast<size_t>(n));
    if (!sent && text.find("step     1/") != std::string::npos) {
      ::kill(pid, SIGINT);
      sent = true;
    }
  }
  ::close(fds[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  ASSERT_TRUE(sent) << text;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << text;
  EXPECT_NE(text.find("stop requested (SIGINT): stopped after step"), std::string::npos) << text;
  EXPECT_TRUE(fs::exists(dir.file("ck2/latest"))) << text;
}
