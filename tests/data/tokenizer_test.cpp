// Tokenizers: byte, GPT-2 BPE against the reference encodings in tests/data/fixtures, the factory,
// and `meshtrain tokenize`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../cli/run_command.h"
#include "../test_files.h"
#include "cli/data_commands.h"
#include "data/tokenizer.h"
#include "data/unicode_tables.h"

namespace fs = std::filesystem;

namespace {

// The GPT-2 files ship with the repository (assets/gpt2), so these tests never skip.
const std::string kGpt2Dir = std::string(MT_SOURCE_DIR) + "/assets/gpt2";



// One GPT-2 tokenizer for the whole test program (loading parses a 1 MB JSON file).
const mt::Gpt2Tokenizer& gpt2() {
  static const mt::Gpt2Tokenizer tok(kGpt2Dir);
  return tok;
}


std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (auto p : mt::Gpt2Tokenizer::pretokenize(text)) out.emplace_back(p);
  return out;
}

}  // namespace

TEST(ByteTokenizer, RoundTripsEveryByte) {
  mt::ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.eot_token(), -1);
  EXPECT_EQ(tok.name(), "byte");
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const auto ids = tok.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(tok.decode(ids), all);
  EXPECT_EQ(tok.encode("").size(), 0u);
  const std::vector<int32_t> bad = {65, 256};
  EXPECT_THROW(tok.decode(bad), std::out_of_range);
}

TEST(UnicodeTables, ClassesOfSampleCodePoints) {
  using mt::unicode::CharClass;
  using mt::unicode::char_class;
  EXPECT_EQ(char_class('a'), CharClass::Letter);
  EXPECT_EQ(char_class('Z'), CharClass::Letter);
  EXPECT_EQ(char_class('7'), CharClass::Number);
  EXPECT_EQ(char_class(' '), CharClass::Space);
  EXPECT_EQ(char_class('\t'), CharClass::Space);
  EXPECT_EQ(char_class('\n'), CharClass::Space);
  EXPECT_EQ(char_class(0x0B), CharClass::Space);
  EXPECT_EQ(char_class(0x1C), CharClass::Other);  // not White_Space (Python's str.isspace differs)
  EXPECT_EQ(char_class('!'), CharClass::Other);
  EXPECT_EQ(char_class(0x85), CharClass::Space);
  EXPECT_EQ(char_class(0xA0), CharClass::Space);
  EXPECT_EQ(char_class(0x3000), CharClass::Space);
  EXPECT_EQ(char_class(0x200B), CharClass::Other);  // zero-width space is not White_Space
  EXPECT_EQ(char_class(0xBD), CharClass::Number);   // ½ (No)
  EXPECT_EQ(char_class(0xB2), CharClass::Number);   // ² (No)
  EXPECT_EQ(char_class(0x2167), CharClass::Number);  // Roman numeral eight (Nl)
  EXPECT_EQ(char_class(0x4E2D), CharClass::Letter);  // 中
  EXPECT_EQ(char_class(0x0416), CharClass::Letter);  // Ж
  EXPECT_EQ(char_class(0x1F999), CharClass::Other);  // 🦙
  EXPECT_EQ(char_class(0x10FFFF), CharClass::Other);
  EXPECT_EQ(char_class(0x110000), CharClass::Other);
}

TEST(Gpt2Tokenizer, PretokenizeFollowsTheGpt2Pattern) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("  Hello"), (V{" ", " Hello"}));
  EXPECT_EQ(pieces("a\n\nb"), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces("x   "), (V{"x", "   "}));
  EXPECT_EQ(pieces("x   y"), (V{"x", "  ", " y"}));
  EXPECT_EQ(pieces("I'll don't they're"), (V{"I", "'ll", " don", "'t", " they", "'re"}));
  EXPECT_EQ(pieces("IT'S"), (V{"IT", "'", "S"}));  // contractions are case-sensitive
  EXPECT_EQ(pieces("abc123 456!!? ?"), (V{"abc", "123", " 456", "!!?", " ?"}));
  EXPECT_EQ(pieces("!'s"), (V{"!'", "s"}));
  EXPECT_EQ(pieces(" 's"), (V{" '", "s"}));
  EXPECT_EQ(pieces("\t\tfoo"), (V{"\t", "\t", "foo"}));  // only a literal space prefixes a word
  EXPECT_EQ(pieces("Führer"), (V{"Führer"}));
  EXPECT_EQ(pieces(""), V{});
}

TEST(Gpt2Tokenizer, LoadsTheVocabulary) {
  const auto& tok = gpt2();
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eot_token(), 50256);
  EXPECT_EQ(tok.name(), "gpt2");
  const std::vector<int32_t> eot = {50256};
  EXPECT_EQ(tok.decode(eot), "<|endoftext|>");
  EXPECT_EQ(tok.token_bytes(220), " ");
  EXPECT_EQ(tok.token_bytes(198), "\n");
  EXPECT_THROW(tok.token_bytes(50257), std::out_of_range);
  const std::vector<int32_t> bad = {-1};
  EXPECT_THROW(tok.decode(bad), std::out_of_range);
}

TEST(Gpt2Tokenizer, ReproducesAllReferenceEncodings) {
  // 117 reference encodings (llama.cpp, gpt-tokenizer and GPT-3-Encoder test sets; MIT).
  const std::string path = std::string(MT_SOURCE_DIR) + "/tests/data/fixtures/gpt2_vectors.json";
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path;
  const auto cases = nlohmann::json::parse(f);
  ASSERT_EQ(cases.size(), 117u) << path;
  const auto& tok = gpt2();
  int n = 0;
  for (const auto& c : cases) {
    const std::string text = c.at("text").get<std::string>();
    const std::vector<int32_t> want = c.at("ids").get<std::vector<int32_t>>();
    const std::string label = "case " + std::to_string(n) + " (" + c.at("source").get<std::string>() + "): \"" +
                              text.substr(0, 60) + "\"";
    EXPECT_EQ(tok.encode(text), want) << label;
    EXPECT_EQ(tok.decode(want), text) << label;
    EXPECT_EQ(tok.encode(text), want) << label << " (second call, from the cache)";
    ++n;
  }
  EXPECT_EQ(n, 117);
}

TEST(Gpt2Tokenizer, SpecialTextIsOrdinaryAndInvalidUtf8RoundTrips) {
  const auto& tok = gpt2();
  const auto ids = tok.encode("a<|endoftext|>b");
  for (int32_t id : ids) EXPECT_NE(id, 50256);
  EXPECT_EQ(tok.decode(ids), "a<|endoftext|>b");
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  // Bytes that are not UTF-8 (lone continuation, truncated sequences, overlong, surrogate) survive.
  const std::string raw = std::string("ok \xff\xfe x\x80y \xc3") + "z\xe2\x82 \xc0\xaf \xed\xa0\x80 end\xf0\x9f";
  EXPECT_EQ(tok.decode(tok.encode(raw)), raw);
  // A long run without spaces (exercises the BPE heap on a big word).
  std::string long_word(5000, 'a');
  long_word += std::string(3000, '!');
  EXPECT_EQ(tok.decode(tok.encode(long_word)), long_word);
}

// tests/data/fixtures/tinyshakespeare_head.txt: the first 277 lines (8 KB) of tinyshakespeare's
// input.txt (Shakespeare, public domain), shipped so the test runs in a fresh clone.
TEST(Gpt2Tokenizer, RoundTripsShakespeare) {
  const std::string path = std::string(MT_SOURCE_DIR) + "/tests/data/fixtures/tinyshakespeare_head.txt";
  std::ifstream f(path, std::ios::binary);
  ASSERT_TRUE(f.good()) << "missing fixture " << path;
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_GT(text.size(), 8000u) << path;
  const auto ids = gpt2().encode(text);
  EXPECT_LT(ids.size(), text.size() / 2);  // BPE compresses English well over 2x
  EXPECT_EQ(gpt2().decode(ids), text);
  // First tokens of tinyshakespeare ("First Citizen:\nBefore we proceed") as tiktoken encodes them.
  const std::vector<int32_t> head = {5962, 22307, 25, 198, 8421, 356, 5120};
  ASSERT_GE(ids.size(), head.size());
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 7), head);
}

TEST(MakeTokenizer, NamesAndErrors) {
  EXPECT_EQ(mt::make_tokenizer("byte")->vocab_size(), 256);
  try {
    mt::make_tokenizer("sentencepiece");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("sentencepiece"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("byte, gpt2, gpt2:N or hf"), std::string::npos) << e.what();
  }
  try {
    mt::make_tokenizer("gpt2", "/nonexistent/gpt2dir");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/gpt2dir"), std::string::npos) << e.what();
  }
  mt::test::TestDir tmp;
  try {
    mt::make_tokenizer("gpt2", tmp.path.string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("encoder.json"), std::string::npos) << e.what();
  }
  std::ofstream(tmp.path / "encoder.json") << "{\"a\": 0}";
  try {
    mt::make_tokenizer("gpt2", tmp.path.string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab.bpe"), std::string::npos) << e.what();
  }
  // Without a directory: $MESHTRAIN_GPT2_DIR, else the repository's assets/gpt2.
  const char* old = std::getenv("MESHTRAIN_GPT2_DIR");
  const std::string saved = old ? old : "";
  ::unsetenv("MESHTRAIN_GPT2_DIR");
  EXPECT_EQ(mt::make_tokenizer("gpt2")->eot_token(), 50256);
  ::setenv("MESHTRAIN_GPT2_DIR", tmp.path.string().c_str(), 1);
  EXPECT_EQ(mt::default_gpt2_dir(), tmp.path.string());
  EXPECT_THROW(mt::make_tokenizer("gpt2"), std::runtime_error);  // tmp holds no vocab.bpe
  try {
    mt::make_tokenizer("hf");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--tokenizer-file"), std::string::npos) << e.what();
  }
  if (old)
    ::setenv("MESHTRAIN_GPT2_DIR", saved.c_str(), 1);
  else
    ::unsetenv("MESHTRAIN_GPT2_DIR");
}

TEST(Gpt2Tokenizer, RejectsMalformedMerges) {
  mt::test::TestDir tmp;
  // A tiny byte-level vocabulary: the 256 single bytes written in GPT-2's alphabet, plus "ab".
  nlohmann::json enc = nlohmann::json::object();
  auto alphabet = [](int b) -> std::string {
    int extra = 0;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
      const int cp = printable ? c : 256 + extra++;
      if (c == b) {
        std::string s;
        if (cp < 0x80) {
          s.push_back(static_cast<char>(cp));
        } else {
          s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
          s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
        }
        return s;
      }
    }
    return "";
  };
  for (int b = 0; b < 256; ++b) enc[alphabet(b)] = b;
  enc["ab"] = 256;
  std::ofstream(tmp.path / "encoder.json") << enc.dump();
  std::ofstream(tmp.path / "vocab.bpe") << "#version: 0.2\na b\n";
  mt::Gpt2Tokenizer ok(tmp.path.string());
  EXPECT_EQ(ok.vocab_size(), 257);
  EXPECT_EQ(ok.eot_token(), -1);
  EXPECT_EQ(ok.encode("abab a"), (std::vector<int32_t>{256, 256, ' ', 'a'}));
  std::ofstream(tmp.path / "vocab.bpe") << "#version: 0.2\na b\nb c\n";
  try {
    mt::Gpt2Tokenizer bad(tmp.path.string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab.bpe line 3"), std::string::npos) << e.what();
  }
}

TEST(TokenizeCommand, PrintsIdsOnOneLine) {
  std::string out, err;
  EXPECT_EQ(run_cmd(mt::run_tokenize_command, {"tokenize", "--tokenizer", "byte", "--text", "Hi!"}, &out, &err), 0)
      << err;
  EXPECT_EQ(out, "72 105 33\n");
  {
    EXPECT_EQ(run_cmd(mt::run_tokenize_command, {"tokenize", "--tokenizer", "gpt2", "--gpt2-dir", kGpt2Dir, "--text",
                                                 "Hello world"},
                      &out, &err),
              0)
        << err;
    EXPECT_EQ(out, "15496 995\n");
    mt::test::TestDir tmp;
    std::ofstream(tmp.path / "in.txt") << " Hello World!";
    EXPECT_EQ(run_cmd(mt::run_tokenize_command,
                      {"tokenize", "--gpt2-dir=" + kGpt2Dir, "--input", (tmp.path / "in.txt").string()}, &out, &err),
              0)
        << err;
    EXPECT_EQ(out, "18435 2159 0\n");
  }
}

TEST(TokenizeCommand, HelpAndErrors) {
  std::string out, err;
  EXPECT_EQ(run_cmd(mt::run_tokenize_command, {"tokenize", "--help"}, &out, &err), 0);
  EXPECT_NE(out.find("usage: meshtrain tokenize"), std::string::npos);
  EXPECT_NE(out.find("--gpt2-dir"), std::string::npos);
  EXPECT_TRUE(err.empty());

  EXPECT_EQ(run_cmd(mt::run_tokenize_command, {"tokenize", "--tokenizer", "byte", "--text", "a", "--input", "f"}, &out,
                    &err),
            2);
  EXPECT_NE(err.find("either --text or --input"), std::string::npos) << err;
  EXPECT_TRUE(out.empty());

  EXPECT_EQ(run_cmd(mt::run_tokenize_command, {"tokenize", "--tokenizer", "byte", "--input", "/nonexistent/file.txt"},
                    &out, &err),
            2);
  EXPECT_NE(err.find("/nonexistent/file.txt"), std::string::npos) << err;

  EXPECT_EQ(run_cmd(mt::run_tokenize_command, {"tokenize", "--bogus", "1"}, &out, &err), 2);
  EXPECT_NE(err.find("--bogus"), std::string::npos) << err;

  EXPECT_EQ(run_cmd(mt::run_tokenize_command, {"tokenize", "--tokenizer", "gpt2", "--gpt2-dir", "/nonexistent/dir",
                                               "--text", "x"},
                    &out, &err),
            2);
  EXPECT_NE(err.find("/nonexistent/dir"), std::string::npos) << err;
}

// gpt2:N keeps the byte tokens and the first N - 257 merges: its ids are GPT-2's where GPT-2's are
// below N - 1, every id stays below N, and text still round-trips.
TEST(Gpt2Tokenizer, CutVocabularyKeepsTheMostFrequentMerges) {
  const auto cut = mt::make_tokenizer("gpt2:2048", kGpt2Dir);
  EXPECT_EQ(cut->vocab_size(), 2048);
  EXPECT_EQ(cut->eot_token(), 2047);
  EXPECT_EQ(cut->name(), "gpt2:2048");
  const std::vector<int32_t> eot = {2047};
  EXPECT_EQ(cut->decode(eot), "<|endoftext|>");
  EXPECT_EQ(cut->token_text_bytes(2047), 0u);
  const std::string text = "In the beginning God created the heaven and the earth. Zebras quixotically jumped.";
  const auto ids = cut->encode(text);
  const auto full = gpt2().encode(text);
  EXPECT_GT(ids.size(), full.size());  // fewer merges: more tokens for the rare words
  for (int32_t id : ids) EXPECT_LT(id, 2047);
  EXPECT_EQ(cut->decode(ids), text);
  // " the" (262) and " and" (290) are among the first merges: the same ids as GPT-2's.
  EXPECT_EQ(cut->encode(" the and"), (std::vector<int32_t>{262, 290}));
  for (const char* bad : {"gpt2:256", "gpt2:50258", "gpt2:x", "gpt2:"}) {
    try {
      mt::make_tokenizer(bad, kGpt2Dir);
      FAIL() << "expected an error for " << bad;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("gpt2:N"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(mt::make_tokenizer("gpt2:50257", kGpt2Dir)->encode(text), full);
}
