// `meshtrain prepare` with JSON lines, directories, the Hugging Face tokenizer, several shards,
// uint32 shards, bad input, and thread-count independence; `tokenize` with tokenizer.json.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../test_files.h"
#include "run_command.h"
#include "cli/data_commands.h"
#include "data/corpus.h"
#include "data/data_loader.h"
#include "data/hf_tokenizer.h"
#include "data/token_shards.h"

namespace fs = std::filesystem;

namespace {

const std::string kTok = std::string(MT_SOURCE_DIR) + "/tests/data/fixtures/bpe-llama3-style.json";

std::vector<uint32_t> all_tokens(const std::vector<std::string>& files) {
  std::vector<uint32_t> v;
  for (const auto& f : files) {
    const auto t = mt::read_token_shard32(f);
    v.insert(v.end(), t.begin(), t.end());
  }
  return v;
}

std::vector<std::string> docs() {
  std::vector<std::string> d;
  for (int i = 0; i < 60; ++i)
    d.push_back("Document " + std::to_string(i) + ": to be, or not to be, that is the question " +
                std::string(static_cast<size_t>(i % 7), '!') + "\nWhether 'tis nobler in the mind " + std::to_string(i * 31));
  return d;
}

}  // namespace

TEST(PrepareCorpus, JsonlWithHfTokenizerIsTheDocumentsJoinedByEos) {
  mt::test::TestDir dir;
  const auto d = docs();
  fs::create_directories(dir.file("in/sub"));
  std::ofstream a(dir.file("in/a.jsonl")), b(dir.file("in/sub/b.jsonl"));
  for (size_t i = 0; i < d.size(); ++i) {
    (i < 25 ? a : b) << nlohmann::json{{"id", i}, {"body", d[i]}}.dump() << "\n";
    if (i == 3) a << "\n";  // blank lines are skipped
  }
  a.close();
  b.close();
  std::string out, err;
  ASSERT_EQ(run_cmd(mt::run_prepare_command,
                    {"prepare", "--input", dir.file("in"), "--jsonl-field", "body", "--out", dir.file("o"), "--tokenizer",
                     "hf", "--tokenizer-file", kTok, "--val-fraction", "0.1"},
                    &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("60 documents"), std::string::npos) << out;
  // The expected stream, from the tokenizer itself: <|begin_of_text|> doc <|end_of_text|> ...
  mt::HfTokenizer tok(kTok);
  std::vector<int32_t> want;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) want.push_back(tok.eot_token());
    tok.encode_document(d[i], want);
  }
  const auto got = all_tokens({dir.file("o/train.bin"), dir.file("o/val.bin")});
  EXPECT_EQ(std::vector<int32_t>(got.begin(), got.end()), want);
  EXPECT_EQ(mt::read_token_shard_header(dir.file("o/val.bin")), static_cast<int64_t>(want.size() / 10));
}

TEST(PrepareCorpus, ShardsAndThreadsDoNotChangeTheTokens) {
  mt::test::TestDir dir;
  std::ofstream f(dir.file("c.jsonl"));
  for (const auto& s : docs()) f << nlohmann::json{{"text", s}}.dump() << "\n";
  f.close();
  mt::HfTokenizer tok(kTok);
  auto run = [&](int threads, int64_t shard_tokens, size_t batch, const std::string& out) {
    mt::PrepareOptions o;
    o.inputs = {dir.file("c.jsonl")};
    o.out_dir = dir.file(out);
    o.threads = threads;
    o.shard_tokens = shard_tokens;
    o.batch_bytes = batch;
    o.val_fraction = 0.25;
    return mt::prepare_corpus(o, tok);
  };
  const auto one = run(1, 0, size_t{8} << 20, "one");
  const auto many = run(2, 300, 500, "many");
  EXPECT_EQ(one.train_files.size(), 1u);
  EXPECT_GT(many.train_files.size(), 3u);
  EXPECT_EQ(many.train_files[0], dir.file("many/train_000000.bin"));
  EXPECT_EQ(all_tokens(one.train_files), all_tokens(many.train_files));
  EXPECT_EQ(all_tokens(one.val_files), all_tokens(many.val_files));
  for (const auto& s : many.train_files) EXPECT_LE(mt::read_token_shard_header(s), 300);
  // A glob of the shards is a training dataset.
  mt::TokenDataset ds(dir.file("many/train_*.bin"), tok.vocab_size());
  EXPECT_EQ(ds.total_tokens(), one.train_tokens);
  // A second run into the same directory leaves no stale shard behind.
  run(1, 0, size_t{8} << 20, "many");
  EXPECT_EQ(mt::expand_file_pattern(dir.file("many/train*.bin")).size(), 1u);
}

TEST(PrepareCorpus, BadInputNamesFileAndLineOrIsSkipped) {
  mt::test::TestDir dir;
  std::ofstream f(dir.file("bad.jsonl"), std::ios::binary);
  f << R"({"text": "fine one"})" << "\n"
    << "this is not json\n"
    << "{\"text\": \"bad \xFF utf8\"}\n"
    << R"({"other": "no text field"})" << "\n"
    << R"({"text": 42})" << "\n"
    << R"({"text": "fine two"})" << "\n";
  f.close();
  std::string out, err;
  const std::vector<std::string> args = {"prepare", "--input", dir.file("bad.jsonl"), "--out", dir.file("o"),
                                         "--tokenizer", "byte", "--val-fraction", "0"};
  EXPECT_EQ(run_cmd(mt::run_prepare_command, args, &out, &err), 2);
  EXPECT_NE(err.find(dir.file("bad.jsonl") + " line 2: not JSON"), std::string::npos) << err;
  auto with_skip = args;
  with_skip.push_back("--skip-bad");
  ASSERT_EQ(run_cmd(mt::run_prepare_command, with_skip, &out, &err), 0) << err;
  for (const std::string n : {"line 2: not JSON", "line 3: invalid UTF-8", "line 4: no field \"text\"",
                              "line 5: field \"text\" is not a string", "4 bad documents skipped"})
    EXPECT_NE(err.find(n), std::string::npos) << n << "\n" << err;
  const auto t = mt::read_token_shard(dir.file("o/train.bin"));
  EXPECT_EQ(std::string(t.begin(), t.end()), "fine one\nfine two");
}

TEST(PrepareCorpus, IdsAboveUint16GoToVersion2Shards) {
  mt::test::TestDir dir;
  std::ifstream in(kTok);
  nlohmann::json j = nlohmann::json::parse(in);
  j["added_tokens"].push_back({{"id", 70000}, {"content", "<big>"}, {"single_word", false}, {"lstrip", false},
                               {"rstrip", false}, {"normalized", false}, {"special", true}});
  std::ofstream(dir.file("tok.json")) << j.dump();
  std::ofstream(dir.file("t.txt")) << "a <big> b <big>";
  std::string out, err;
  ASSERT_EQ(run_cmd(mt::run_prepare_command,
                    {"prepare", "--input", dir.file("t.txt"), "--out", dir.file("o"), "--tokenizer", "hf",
                     "--tokenizer-file", dir.file("tok.json"), "--val-fraction", "0"},
                    &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("uint32"), std::string::npos) << out;
  mt::TokenShard s(dir.file("o/train.bin"), 70001);
  EXPECT_EQ(s.token_bytes(), 4);
  mt::HfTokenizer tok(dir.file("tok.json"));
  std::vector<int32_t> want;
  tok.encode_document("a <big> b <big>", want);
  std::vector<int32_t> got(s.size());
  s.copy(0, s.size(), got.data());
  EXPECT_EQ(got, want);
  EXPECT_THROW(mt::TokenShard(dir.file("o/train.bin"), 2048), std::runtime_error);  // id 70000 >= vocab
}

TEST(TokenizeCommand, HfTokenizerFileAndJsonlAndDecode) {
  mt::test::TestDir dir;
  mt::HfTokenizer tok(kTok);
  std::string out, err;
  ASSERT_EQ(run_cmd(mt::run_tokenize_command,
                    {"tokenize", "--tokenizer", "hf", "--tokenizer-file", kTok, "--text", "It's 2024, friends"}, &out,
                    &err),
            0)
      << err;
  std::string want;
  for (int32_t id : tok.encode("It's 2024, friends")) want += (want.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(out, want + "\n");
  std::ofstream(dir.file("d.jsonl")) << "{\"text\": \"a\"}\n{\"text\": \"b c\"}\n";
  ASSERT_EQ(run_cmd(mt::run_tokenize_command,
                    {"tokenize", "--tokenizer", "hf", "--tokenizer-file", kTok, "--input", dir.file("d.jsonl"), "--special"},
                    &out, &err),
            0)
      << err;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2);
  EXPECT_EQ(out.rfind(std::to_string(tok.prefix_tokens()[0]) + " ", 0), 0u) << out;
  std::ofstream(dir.file("ids.txt")) << want << "\n";
  ASSERT_EQ(run_cmd(mt::run_tokenize_command,
                    {"tokenize", "--tokenizer", "hf", "--tokenizer-file", kTok, "--decode", "--input", dir.file("ids.txt")},
                    &out, &err),
            0)
      << err;
  EXPECT_EQ(out, "It's 2024, friends\n");
}

// The shards record the text's bytes (special tokens count 0), so the datasets know bytes per token.
TEST(PrepareCorpus, ShardsRecordTheBytesOfText) {
  mt::test::TestDir dir;
  std::ofstream f(dir.file("c.jsonl"));
  size_t text_bytes = 0;
  for (const auto& s : docs()) {
    f << nlohmann::json{{"text", s}}.dump() << "\n";
    text_bytes += s.size();
  }
  f.close();
  mt::HfTokenizer tok(kTok);
  mt::PrepareOptions o;
  o.inputs = {dir.file("c.jsonl")};
  o.out_dir = dir.file("o");
  o.val_fraction = 0.25;
  const auto r = mt::prepare_corpus(o, tok);
  const auto train = mt::read_token_shard_info(r.train_files[0]), val = mt::read_token_shard_info(r.val_files[0]);
  EXPECT_EQ(train.vocab_size, tok.vocab_size());
  EXPECT_EQ(static_cast<size_t>(train.text_bytes + val.text_bytes), text_bytes);
  EXPECT_GT(val.text_bytes, 0);
  const mt::TokenDataset ds(r.train_files[0]);
  EXPECT_DOUBLE_EQ(ds.bytes_per_token(), static_cast<double>(train.text_bytes) / static_cast<double>(train.tokens));
}
