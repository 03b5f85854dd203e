// Instruction and chat data: records, the chatml and llama3 templates with their loss masks, the
// mask shards `prepare` writes beside the token shards, and the loader's targets (-1 where the
// mask does not train).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/corpus.h"
#include "data/data_loader.h"
#include "data/hf_tokenizer.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = std::string(MT_SOURCE_DIR) + "/tests/data/fixtures/";
const char* const kChatTokens[] = {"<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                                   "<|eot_id|>"};

class ChatData : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mt_chat_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // The small Llama-3-style fixture tokenizer with the chat templates' special tokens added.
    auto j = nlohmann::json::parse(std::ifstream(kFixtures + "bpe-llama3-style.json"));
    int id = static_cast<int>(j["model"]["vocab"].size());
    for (const char* t : kChatTokens)
      j["added_tokens"].push_back({{"id", id++}, {"content", t}, {"single_word", false}, {"lstrip", false},
                                   {"rstrip", false}, {"normalized", false}, {"special", true}});
    tok_path_ = (dir_ / "tokenizer.json").string();
    std::ofstream(tok_path_) << j.dump();
    tok_ = std::make_unique<HfTokenizer>(tok_path_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<std::vector<ChatMessage>> fixture_records() const {
    std::vector<std::vector<ChatMessage>> out;
    std::ifstream f(kFixtures + "chat_small.jsonl");
    std::string line;
    int64_t n = 0;
    while (std::getline(f, line)) out.push_back(parse_chat_record(line, "chat_small.jsonl", ++n));
    return out;
  }

  fs::path dir_;
  std::string tok_path_;
  std::unique_ptr<HfTokenizer> tok_;
};

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\n\r\f\v");
  return a == std::string::npos ? "" : s.substr(a, s.find_last_not_of(" \t\n\r\f\v") - a + 1);
}

// The template's text as a string, which the tokenizer encodes with its special tokens split out
// first; and the text the loss trains (each assistant message's content and closing token).
void render(const std::string& name, const std::vector<ChatMessage>& msgs, std::string* text, std::string* trained) {
  *text = name == "llama3" ? "<|begin_of_text|>" : "";
  trained->clear();
  for (const ChatMessage& m : msgs) {
    const bool a = m.role == "assistant";
    if (name == "chatml") {
      *text += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (a) *trained += m.content + "<|im_end|>";
    } else {
      *text += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + trim(m.content) + "<|eot_id|>";
      if (a) *trained += trim(m.content) + "<|eot_id|>";
    }
  }
}

TEST_F(ChatData, TemplatesEncodeTheRenderedTextAndTrainTheAssistantOnly) {
  const auto records = fixture_records();
  ASSERT_GE(records.size(), 30u);
  for (const std::string name : {"chatml", "llama3"}) {
    const ChatTemplate t(name, *tok_);
    for (size_t r = 0; r < records.size(); ++r) {
      std::vector<int32_t> ids, all_ids;
      std::vector<uint8_t> mask, all_mask;
      t.apply(records[r], false, ids, mask);
      t.apply(records[r], true, all_ids, all_mask);
      std::string text, trained;
      render(name, records[r], &text, &trained);
      ASSERT_EQ(ids, tok_->encode(text)) << name << " record " << r + 1;
      ASSERT_EQ(mask.size(), ids.size());
      std::vector<int32_t> kept;
      for (size_t i = 0; i < ids.size(); ++i)
        if (mask[i]) kept.push_back(ids[i]);
      EXPECT_EQ(tok_->decode(kept), trained) << name << " record " << r + 1;
      EXPECT_EQ(all_ids, ids);
      EXPECT_EQ(all_mask, std::vector<uint8_t>(ids.size(), 1));
    }
  }
}

TEST_F(ChatData, PromptCompletionIsAUserAndAnAssistantMessage) {
  const auto pc = parse_chat_record(R"({"prompt": "Who is there?", "completion": "Nay, answer me."})", "f", 1);
  const auto ms = parse_chat_record(
      R"({"messages": [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay, answer me."}]})",
      "f", 1);
  ASSERT_EQ(pc.size(), 2u);
  const ChatTemplate t("chatml", *tok_);
  std::vector<int32_t> a, b;
  std::vector<uint8_t> ma, mb;
  t.apply(pc, false, a, ma);
  t.apply(ms, false, b, mb);
  EXPECT_EQ(a, b);
  EXPECT_EQ(ma, mb);
}

TEST_F(ChatData, BadRecordsAreLocatedByFileAndLine) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"messages": [{"role": "user"}]})", "message 1 of \"messages\" has no string \"content\""},
      {R"({"messages": []})", "\"messages\" is not a non-empty list"},
      {R"({"prompt": "only a prompt"})", "no string \"completion\""},
      {R"({"text": "plain"})", "needs \"messages\""},
      {R"({"messages": [)", "not JSON"},
  };
  const std::string good = R"({"prompt": "a", "completion": "b"})";
  for (const auto& [line, why] : bad) {
    const std::string path = (dir_ / "bad.jsonl").string();
    std::ofstream(path) << good << "\n\n" << line << "\n";
    PrepareOptions o;
    o.inputs = {path};
    o.out_dir = (dir_ / "out").string();
    o.format = InputFormat::Chat;
    try {
      prepare_corpus(o, *tok_);
      ADD_FAILURE() << "accepted " << line;
    } catch (const BadInputError& e) {
      EXPECT_NE(std::string(e.what()).find(path + " line 3: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
}

TEST_F(ChatData, ATokenizerWithoutTheTemplatesTokensIsRefused) {
  const HfTokenizer plain(kFixtures + "bpe-llama3-style.json");
  const ByteTokenizer bytes;
  for (const Tokenizer* t : std::vector<const Tokenizer*>{&plain, &bytes}) {
    try {
      ChatTemplate("chatml", *t);
      ADD_FAILURE() << t->name();
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("needs the special token <|im_start|>"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(ChatTemplate("llama3", plain), std::invalid_argument);  // no <|start_header_id|>
  EXPECT_THROW(ChatTemplate("vicuna", *tok_), std::invalid_argument);
}

TEST_F(ChatData, PreparedShardsCarryMasksAndTheLoaderLeavesUntrainedTargetsOut) {
  PrepareOptions o;
  o.inputs = {kFixtures + "chat_small.jsonl"};
  o.out_dir = (dir_ / "sft").string();
  o.format = InputFormat::Chat;
  o.chat_template = "llama3";
  o.val_fraction = 0.0;
  const PrepareResult r = prepare_corpus(o, *tok_);
  EXPECT_EQ(r.documents, 36);
  const std::string shard = r.train_files.at(0);
  ASSERT_TRUE(fs::exists(mask_shard_path(shard)));
  const std::vector<uint32_t> toks = read_token_shard32(shard);
  const std::vector<uint8_t> mask = read_mask_shard(mask_shard_path(shard), static_cast<int64_t>(toks.size()));
  int64_t trained = 0;
  for (uint8_t m : mask) trained += m;
  EXPECT_EQ(trained, r.trained_tokens);
  EXPECT_GT(trained, 0);
  EXPECT_LT(trained, static_cast<int64_t>(toks.size()) / 2);

  const TokenDataset ds(shard);
  EXPECT_TRUE(ds.has_masks());
  const int B = 2, T = 32;
  BatchLoader loader(ds, B, T);
  std::vector<int32_t> x(B * T), y(B * T);
  const int64_t batches = loader.batches_per_epoch();
  for (int64_t k = 0; k < batches; ++k) {
    loader.next(x.data(), y.data());
    for (int64_t i = 0; i < B * T; ++i) {
      const size_t at = static_cast<size_t>(k * B * T + i + 1);  // the target's place in the shard
      ASSERT_EQ(y[static_cast<size_t>(i)], mask[at] ? static_cast<int32_t>(toks[at]) : -1) << "batch " << k << " " << i;
      ASSERT_EQ(x[static_cast<size_t>(i)], static_cast<int32_t>(toks[at - 1]));
    }
  }

  // Training on everything: every byte 1. Plain text into the same directory: no stale mask stays.
  o.train_on_all = true;
  const PrepareResult all = prepare_corpus(o, *tok_);
  EXPECT_EQ(all.trained_tokens, all.tokens);
  o.format = InputFormat::Jsonl;
  o.jsonl_field = "prompt";
  o.inputs = {(dir_ / "p.jsonl").string()};
  std::ofstream(o.inputs[0]) << R"({"prompt": "to be or not to be"})" << "\n";
  prepare_corpus(o, *tok_);
  EXPECT_FALSE(fs::exists(mask_shard_path(shard)));
  EXPECT_FALSE(TokenDataset(shard).has_masks());
}

// The shuffled loader and a blend read masked targets too: with token id = position in the shard,
// every input locates its target, which must be that token or -1 as the mask says.
TEST_F(ChatData, ShuffledAndBlendedLoadersHonourTheMask) {
  const std::string shard = (dir_ / "pos.bin").string();
  const int n = 4001, B = 2, T = 16;
  std::vector<int32_t> toks(n);
  std::vector<uint8_t> mask(n);
  for (int i = 0; i < n; ++i) {
    toks[static_cast<size_t>(i)] = i;
    mask[static_cast<size_t>(i)] = (i % 5 == 0 || i % 97 < 20) ? 1 : 0;
  }
  write_token_shard(shard, toks);
  write_mask_shard(mask_shard_path(shard), mask);
  auto check = [&](const std::vector<int32_t>& x, const std::vector<int32_t>& y, const std::string& what) {
    for (size_t i = 0; i < x.size(); ++i) {
      const auto at = static_cast<size_t>(x[i] + 1);
      ASSERT_EQ(y[i], mask[at] ? static_cast<int32_t>(at) : -1) << what << " element " << i;
    }
  };
  std::vector<int32_t> x(B * T), y(B * T);
  const TokenDataset ds(shard);
  BatchLoader shuffled(ds, B, T, 1, 2);
  shuffled.set_shuffle(7);
  for (int k = 0; k < 50; ++k) {
    shuffled.next(x.data(), y.data());
    check(x, y, "shuffled batch " + std::to_string(k));
  }
  BlendLoader blend("1:" + shard, "data.train", B, T, 0, 1, 7, true);
  EXPECT_TRUE(blend.has_masks());
  for (int k = 0; k < 50; ++k) {
    blend.next(x.data(), y.data());
    check(x, y, "blend batch " + std::to_string(k));
  }
}

TEST_F(ChatData, AMaskOfTheWrongLengthIsRefusedNamingTheFile) {
  const std::string shard = (dir_ / "t.bin").string();
  write_token_shard(shard, std::vector<int32_t>{1, 2, 3, 4});
  write_mask_shard(mask_shard_path(shard), std::vector<uint8_t>{1, 0, 1});
  try {
    TokenShard s(shard);
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(mask_shard_path(shard)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("3 mask bytes for a token shard of 4 tokens"), std::string::npos) << e.what();
  }
  write_mask_shard(mask_shard_path(shard), std::vector<uint8_t>{1, 0, 2, 1});
  EXPECT_THROW(TokenShard s(shard), std::runtime_error);
}

}  // namespace
}  // namespace mt
