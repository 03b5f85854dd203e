// llm.c token shards: round trip and every kind of corruption the reader must name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../test_files.h"
#include "data/token_shards.h"

namespace fs = std::filesystem;
using mt::test::TestDir;

namespace {

std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void dump(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void put_i32(std::vector<char>& bytes, size_t offset, int32_t v) { std::memcpy(bytes.data() + offset, &v, 4); }

// Expects TokenShard(path, vocab) to throw a message holding every string in `needles`.
void expect_error(const std::string& path, int64_t vocab, const std::vector<std::string>& needles) {
  try {
    mt::TokenShard s(path, vocab);
    FAIL() << "expected an error for " << path;
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

}  // namespace

TEST(TokenShards, RoundTripAndLayout) {
  TestDir dir;
  const std::string path = dir.file("a.bin");
  std::vector<int32_t> tokens;
  for (int i = 0; i < 1000; ++i) tokens.push_back((i * 7919) % 50257);
  tokens.push_back(65535);
  tokens.push_back(0);
  mt::write_token_shard(path, tokens);

  const auto bytes = slurp(path);
  ASSERT_EQ(bytes.size(), 1024 + 2 * tokens.size());
  int32_t header[256];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], static_cast<int32_t>(tokens.size()));
  for (int i = 3; i < 256; ++i) EXPECT_EQ(header[i], 0);
  uint16_t t3;
  std::memcpy(&t3, bytes.data() + 1024 + 2 * 3, 2);
  EXPECT_EQ(t3, tokens[3]);

  EXPECT_EQ(mt::read_token_shard_header(path), static_cast<int64_t>(tokens.size()));
  mt::TokenShard shard(path);
  EXPECT_EQ(shard.path(), path);
  ASSERT_EQ(shard.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) ASSERT_EQ(shard[i], tokens[i]) << i;
  const auto copy = mt::read_token_shard(path);
  EXPECT_EQ(std::vector<int32_t>(copy.begin(), copy.end()), tokens);

  // uint16 overload and moves.
  const std::vector<uint16_t> small = {1, 2, 3};
  mt::write_token_shard(dir.file("b.bin"), std::span<const uint16_t>(small));
  mt::TokenShard b(dir.file("b.bin"), 4);
  mt::TokenShard moved(std::move(b));
  EXPECT_EQ(moved.size(), 3u);
  EXPECT_EQ(moved[2], 3);
  EXPECT_EQ(b.size(), 0u);  // NOLINT(bugprone-use-after-move): a moved-from shard is empty
  moved = std::move(shard);
  EXPECT_EQ(moved.size(), tokens.size());
}

TEST(TokenShards, EmptyShardIsValid) {
  TestDir dir;
  mt::write_token_shard(dir.file("e.bin"), std::vector<int32_t>{});
  mt::TokenShard s(dir.file("e.bin"), 256);
  EXPECT_EQ(s.size(), 0u);
  EXPECT_TRUE(s.tokens().empty());
}

TEST(TokenShards, WriterRejectsIdsThatDoNotFitUint16) {
  TestDir dir;
  const std::vector<int32_t> bad = {1, 2, 70000};
  try {
    mt::write_token_shard(dir.file("w.bin"), bad);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("70000"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("w.bin"), std::string::npos) << e.what();
  }
  EXPECT_THROW(mt::write_token_shard(dir.file("no/such/dir/x.bin"), std::vector<int32_t>{1}), std::runtime_error);
}

TEST(TokenShards, BadMagicNamesFileAndOffset) {
  TestDir dir;
  const std::string path = dir.file("magic.bin");
  mt::write_token_shard(path, std::vector<int32_t>{1, 2, 3});
  auto bytes = slurp(path);
  put_i32(bytes, 0, 12345);
  dump(path, bytes);
  expect_error(path, 0, {path, "magic", "byte offset 0", "12345", "20240520"});
}

TEST(TokenShards, BadVersionNamesFileAndOffset) {
  TestDir dir;
  const std::string path = dir.file("version.bin");
  mt::write_token_shard(path, std::vector<int32_t>{1, 2, 3});
  auto bytes = slurp(path);
  put_i32(bytes, 4, 7);
  dump(path, bytes);
  expect_error(path, 0, {path, "version", "byte offset 4", "found 7"});
}

TEST(TokenShards, TruncatedFileNamesFileAndOffset) {
  TestDir dir;
  const std::string path = dir.file("trunc.bin");
  mt::write_token_shard(path, std::vector<int32_t>(100, 5));
  auto bytes = slurp(path);
  bytes.resize(bytes.size() - 3);  // 1221 bytes instead of 1224
  dump(path, bytes);
  expect_error(path, 0, {path, "truncated", "byte offset 1221", "1224"});

  bytes.resize(500);  // not even a whole header
  dump(path, bytes);
  expect_error(path, 0, {path, "truncated", "byte offset 500"});

  mt::write_token_shard(path, std::vector<int32_t>(10, 5));
  bytes = slurp(path);
  bytes.push_back(0);  // trailing garbage: the count no longer matches the size
  dump(path, bytes);
  expect_error(path, 0, {path, "byte offset 1044", "1045"});

  put_i32(bytes, 8, -4);
  dump(path, bytes);
  expect_error(path, 0, {path, "byte offset 8", "-4"});

  expect_error(dir.file("missing.bin"), 0, {dir.file("missing.bin"), "cannot open"});
}

TEST(TokenShards, IdAtOrAboveVocabNamesFileOffsetAndValue) {
  TestDir dir;
  const std::string path = dir.file("vocab.bin");
  std::vector<int32_t> tokens(20, 7);
  tokens[5] = 300;
  tokens[9] = 400;
  mt::write_token_shard(path, tokens);
  EXPECT_NO_THROW(mt::TokenShard(path, 0));    // no vocabulary check
  EXPECT_NO_THROW(mt::TokenShard(path, 401));  // every id fits
  // The first offending token: index 5, at byte 1024 + 2*5.
  expect_error(path, 256, {path, "token id 300", "byte offset 1034", "vocabulary size 256"});
  expect_error(path, 300, {path, "token id 300", "byte offset 1034"});
  expect_error(path, 301, {path, "token id 400", "byte offset 1042"});
}

// prepare's shards record the tokenizer's vocabulary and the bytes of text behind their tokens;
// shards without the record (llm.c's) still load and report 0 (unknown).
TEST(TokenShards, RecordTheTextTheyCameFrom) {
  TestDir dir;
  const std::string path = dir.file("t.bin");
  const std::vector<uint16_t> bytes_of_id = {1, 3, 0, 7};
  {
    mt::TokenShardWriter w(path, 5, 2);
    w.describe_text(4, bytes_of_id);
    const std::vector<uint32_t> t = {0, 1, 1, 2, 3};
    w.write(t);
    w.close();
  }
  const mt::TokenShardInfo info = mt::read_token_shard_info(path);
  EXPECT_EQ(info.tokens, 5);
  EXPECT_EQ(info.vocab_size, 4);
  EXPECT_EQ(info.text_bytes, 1 + 3 + 3 + 0 + 7);
  mt::TokenShard s(path, 4);
  EXPECT_EQ(s.text_bytes(), 14);
  EXPECT_EQ(s.tokenizer_vocab_size(), 4);
  // More than 2^32 bytes: the high word holds the rest.
  auto raw = slurp(path);
  put_i32(raw, 16, 5);
  put_i32(raw, 20, 2);
  dump(path, raw);
  EXPECT_EQ(mt::read_token_shard_info(path).text_bytes, (int64_t{2} << 32) + 5);
  // A model whose vocabulary is smaller than the shard's tokenizer's is refused, naming both.
  expect_error(path, 3, {path, "prepared with a tokenizer of 4 tokens", "vocab_size 3"});
  // llm.c's shards: nothing recorded.
  mt::write_token_shard(dir.file("old.bin"), std::vector<int32_t>{1, 2, 3});
  const mt::TokenShard old(dir.file("old.bin"), 4);
  EXPECT_EQ(old.text_bytes(), 0);
  EXPECT_EQ(old.tokenizer_vocab_size(), 0);
}
