// The Hugging Face tokenizer.json loader against checked-in vectors produced by the `tokenizers`
// library (tests/data/hf_tokenizer_check.py --write-vectors), its refusals, the regex engine and
// NFC. The live comparison with the library is the HfTokenizerOracle ctest.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "../test_files.h"
#include "data/hf_tokenizer.h"
#include "data/regex.h"
#include "data/unicode_data.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kData = std::string(MT_SOURCE_DIR) + "/tests/data/fixtures";

json load(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return json::parse(f);
}

// Writes `j` as file `name` of `dir`; returns its path.
std::string write_json(const mt::test::TestDir& dir, const std::string& name, const json& j) {
  const std::string p = dir.file(name);
  std::ofstream(p) << j.dump();
  return p;
}

std::string error_of(const std::string& path) {
  try {
    mt::HfTokenizer t(path);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(HfTokenizer, MatchesTheOracleVectors) {
  const json base = load(kData + "/bpe-llama3-style.json");
  const json vectors = load(kData + "/hf_tokenizer_vectors.json");
  mt::test::TestDir tmp;
  int variants = 0, cases = 0;
  for (const auto& v : vectors.at("variants")) {
    json j = base;
    for (auto it = v.at("patch").begin(); it != v.at("patch").end(); ++it) j[it.key()] = it.value();
    const std::string name = v.at("name").get<std::string>();
    mt::HfTokenizer tok(write_json(tmp, name + ".json", j));
    for (const auto& c : v.at("cases")) {
      const std::string text = c.at("text").get<std::string>();
      const auto ids = c.at("ids").get<std::vector<int32_t>>();
      EXPECT_EQ(tok.encode(text), ids) << name << ": \"" << text << "\"";
      EXPECT_EQ(tok.encode_with_special(text), c.at("ids_special").get<std::vector<int32_t>>()) << name;
      EXPECT_EQ(tok.decode(ids), c.at("decoded").get<std::string>()) << name;
      ++cases;
    }
    ++variants;
  }
  EXPECT_GE(variants, 15);
  EXPECT_GE(cases, 1000);
}

TEST(HfTokenizer, SpecialTokensBosEosAndDocuments) {
  mt::HfTokenizer tok(kData + "/bpe-llama3-style.json");
  const int32_t bos = tok.token_id("<|begin_of_text|>"), eos = tok.token_id("<|end_of_text|>");
  ASSERT_GE(bos, 0);
  ASSERT_GE(eos, 0);
  EXPECT_EQ(tok.prefix_tokens(), std::vector<int32_t>{bos});
  EXPECT_EQ(tok.eot_token(), eos);
  EXPECT_EQ(tok.document_separator(), eos);
  EXPECT_EQ(tok.name(), "hf");
  EXPECT_EQ(tok.vocab_size(), 2048);
  // Special tokens in the text are never split; decode can skip them.
  const auto ids = tok.encode("to be<|end_of_text|>or not");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), eos), 1);
  EXPECT_EQ(tok.decode(ids), "to be<|end_of_text|>or not");
  EXPECT_EQ(tok.decode(ids, true), "to beor not");
  std::vector<int32_t> doc;
  tok.encode_document("to be", doc);
  EXPECT_EQ(doc.front(), bos);
  EXPECT_EQ(std::vector<int32_t>(doc.begin() + 1, doc.end()), tok.encode("to be"));
  const std::vector<int32_t> bad = {5000};
  EXPECT_THROW(tok.decode(bad), std::out_of_range);
}

TEST(HfTokenizer, ThreadsGiveTheSameIds) {
  mt::HfTokenizer tok(kData + "/bpe-llama3-style.json");
  std::string text;
  for (int i = 0; i < 300; ++i) text += "Word" + std::to_string(i * 7919 % 1000) + " and more words, it's " + std::to_string(i) + "\n";
  const auto want = tok.encode(text);
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) ts.emplace_back([&, t] { got[t] = tok.encode(text); });
  for (auto& t : ts) t.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
  EXPECT_EQ(tok.decode(want), text);
}

TEST(HfTokenizer, RefusesOtherFamiliesNamingTheComponent) {
  const json base = load(kData + "/bpe-llama3-style.json");
  mt::test::TestDir tmp;
  struct Case {
    std::string name;
    std::function<void(json&)> edit;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"unigram", [](json& j) { j["model"] = {{"type", "Unigram"}, {"vocab", json::array()}}; }, "Unigram"},
      {"wordpiece", [](json& j) { j["model"]["type"] = "WordPiece"; }, "WordPiece"},
      {"byte_fallback", [](json& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback"},
      {"metaspace", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}}; }, "Metaspace"},
      {"no_bytelevel", [](json& j) { j["pre_tokenizer"] = nullptr; }, "ByteLevel"},
      {"nfkc", [](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }, "normalizer type 'NFKC'"},
      {"decoder", [](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, "decoder type 'WordPiece'"},
      {"lookbehind",
       [](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(?<=a)b";
       },
       "look-behind"},
      {"bad_merge", [](json& j) { j["model"]["merges"].push_back(json::array({"zzz", "qqq"})); }, "model.merges"},
      {"not_json", [](json& j) { j = "x"; }, "model"},
  };
  for (const auto& c : cases) {
    json j = base;
    c.edit(j);
    const std::string path = write_json(tmp, c.name + ".json", j);
    const std::string msg = error_of(path);
    EXPECT_NE(msg.find(c.needle), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << c.name << ": " << msg;
  }
  EXPECT_NE(error_of((tmp.path / "missing.json").string()).find("missing.json"), std::string::npos);
}

TEST(Regex, OnigurumaSemantics) {
  auto find = [](const std::string& pat, const std::string& text) {
    mt::Regex re(pat);
    size_t a = 0, b = 0;
    if (!re.find(text, 0, &a, &b)) return std::string("<none>");
    return text.substr(a, b - a);
  };
  EXPECT_EQ(find("ab+", "xabbbc"), "abbb");
  EXPECT_EQ(find("ab+?", "xabbbc"), "ab");
  EXPECT_EQ(find("a|ab", "ab"), "a");               // the first alternative that matches, not the longest
  EXPECT_EQ(find("\\s+(?!\\S)", "x  \ty"), "  ");   // the greedy run gives back one character
  EXPECT_EQ(find("\\p{N}{1,3}", "a12345"), "123");
  EXPECT_EQ(find("(?i:'s|'t)", "IT'S"), "'S");
  EXPECT_EQ(find("(?i:'s)", "x'\xC5\xBF"), "'\xC5\xBF");  // U+017F folds to s
  EXPECT_EQ(find("[^\\r\\n\\p{L}\\p{N}]?\\p{L}+", "  \xD0\x96\xD1\x83\xD0\xBA!"), " \xD0\x96\xD1\x83\xD0\xBA");
  EXPECT_EQ(find("[a-c]{2,}", "xaxabcab"), "abcab");
  EXPECT_EQ(find("x{2}y", "xxxy"), "xxy");
  EXPECT_EQ(find("a{,2}b", "aaab"), "aab");
  EXPECT_EQ(find("q{x", "aq{x"), "q{x");  // not a quantifier: a literal brace
  EXPECT_EQ(find("^b", "a\nb"), "b");
  EXPECT_EQ(find("\\Ab", "a\nb"), "<none>");
  EXPECT_EQ(find("\\p{Lu}\\p{Ll}+", "abcDefg"), "Defg");
  EXPECT_EQ(find(".+", "ab\ncd"), "ab");
  EXPECT_EQ(find("\\x41\\u0042", "zAB"), "AB");
  for (const char* bad : {"(?<=a)b", "a**", "(ab", "[a-", "\\p{Greek}", "\\1", "(?:a*)*"})
    EXPECT_THROW(mt::Regex{bad}, std::invalid_argument) << bad;
}

TEST(Unicode, NfcComposesAndOrdersMarks) {
  using mt::unicode::nfc;
  EXPECT_EQ(nfc("cafe\xCC\x81"), "caf\xC3\xA9");                                   // e + U+0301 -> é
  EXPECT_EQ(nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");          // jamo -> 각
  EXPECT_EQ(nfc("e\xCC\xA3\xCC\x81"), "\xE1\xBA\xB9\xCC\x81");                      // e+dot below+acute: ẹ́
  EXPECT_EQ(nfc("e\xCC\x81\xCC\xA3"), "\xE1\xBA\xB9\xCC\x81");                      // marks reordered first
  EXPECT_EQ(nfc("\xE2\x84\xAB"), "\xC3\x85");                                       // Angstrom sign -> Å
  EXPECT_EQ(nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(nfc("bad \xFF byte"), "bad \xFF byte");
  EXPECT_EQ(mt::utf8_lossy("a\xE0\xA0z\xFF"), "a\xEF\xBF\xBDz\xEF\xBF\xBD");      // one U+FFFD per maximal subpart
}
