// Reading a Hugging Face tokenizer.json (hf_tokenizer.h): the BPE model, added tokens, normalizer,
// pre-tokenizer, decoder and post-processor, each checked to be of the byte-level BPE family.
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "data/hf_tokenizer_impl.h"
#include "runtime/strings.h"

namespace mt {

using namespace hf;
using json = nlohmann::json;

uint64_t hf::next_serial() {
  static std::atomic<uint64_t> serial{1};
  return serial.fetch_add(1);
}

namespace {

[[noreturn]] void refuse(const std::string& where, const std::string& what) {
  throw std::runtime_error("hf tokenizer " + where + ": " + what);
}

std::string type_of(const json& j) { return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : ""; }

// An integer: nlohmann converts a floating-point value to an integer type with a cast that is
// undefined out of range, so only integers are read as ids.
int64_t int_id(const std::string& where, const json& v, const std::string& what) {
  if (!v.is_number_integer()) refuse(where, what + " must be an integer");
  return v.get<int64_t>();
}

bool get_bool(const json& j, const char* key, bool dflt) {
  if (!j.contains(key) || j[key].is_null()) return dflt;
  return j[key].get<bool>();
}

Behavior parse_behavior(const std::string& where, const json& j) {
  const std::string b = j.value("behavior", std::string("Isolated"));
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  refuse(where, "pre_tokenizer Split: unknown behavior '" + b + "'");
}

void parse_pre_tokenizer(const std::string& where, const json& j, std::vector<PreStep>& steps) {
  if (j.is_null()) return;
  const std::string t = type_of(j);
  if (t == "Sequence") {
    for (const auto& s : j.at("pretokenizers")) parse_pre_tokenizer(where, s, steps);
    return;
  }
  PreStep s;
  if (t == "Split") {
    s.kind = PreStep::Split;
    const json& p = j.at("pattern");
    if (p.contains("Regex")) {
      try {
        s.regex = std::make_unique<Regex>(p["Regex"].get<std::string>());
      } catch (const std::invalid_argument& e) {
        refuse(where, std::string("pre_tokenizer Split: ") + e.what());
      }
    } else if (p.contains("String")) {
      s.literal = p["String"].get<std::string>();
      if (s.literal.empty()) refuse(where, "pre_tokenizer Split: empty String pattern");
    } else {
      refuse(where, "pre_tokenizer Split: pattern must hold Regex or String");
    }
    s.behavior = parse_behavior(where, j);
    s.invert = get_bool(j, "invert", false);
  } else if (t == "Digits") {
    s.kind = PreStep::Digits;
    s.individual_digits = get_bool(j, "individual_digits", false);
  } else if (t == "ByteLevel") {
    s.kind = PreStep::ByteLevel;
    s.add_prefix_space = get_bool(j, "add_prefix_space", true);
    s.use_regex = get_bool(j, "use_regex", true);
  } else {
    refuse(where, "pre_tokenizer type '" + t +
                      "' is not supported (supported: Split, Digits, ByteLevel and a Sequence of them: the byte-level "
                      "BPE family)");
  }
  steps.push_back(std::move(s));
}

void parse_normalizer(const std::string& where, const json& j, bool& nfc) {
  if (j.is_null()) return;
  const std::string t = type_of(j);
  if (t == "Sequence") {
    for (const auto& n : j.at("normalizers")) parse_normalizer(where, n, nfc);
    return;
  }
  if (t == "NFC") {
    nfc = true;
    return;
  }
  refuse(where, "normalizer type '" + t + "' is not supported (supported: none, NFC)");
}

using Impl = HfTokenizer::Impl;

json read_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("hf tokenizer: cannot open " + path + " (pass the tokenizer.json of the model)");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    refuse(path, "not valid JSON: " + json_error_text(e.what()));
  }
  if (!j.is_object() || !j.contains("model")) refuse(path, "no \"model\" object (is this a Hugging Face tokenizer.json?)");
  return j;
}

// Refuses every model but byte-level BPE.
void check_model_kind(const std::string& path, const json& model) {
  std::string mt = type_of(model);
  if (mt.empty() && model.contains("merges")) mt = "BPE";  // old files omit the type
  if (mt != "BPE")
    refuse(path, "model type '" + mt + "' is not supported (only byte-level BPE; Unigram/SentencePiece, WordPiece "
                 "and WordLevel models are not)");
  if (get_bool(model, "byte_fallback", false))
    refuse(path, "model BPE with byte_fallback (SentencePiece-style BPE, as Llama 2 and Mistral v1 use) is not "
                 "supported; only byte-level BPE");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(k) && !model[k].is_null() && !model[k].get<std::string>().empty())
      refuse(path, std::string("model BPE with ") + k + " is not supported (not a byte-level BPE)");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0)
    refuse(path, "model BPE with dropout > 0 (training-time randomness) is not supported");
}

// model.vocab and model.unk_token; returns the largest id.
int64_t load_vocab(const std::string& path, const json& model, Impl& m) {
  const json& vocab = model.at("vocab");
  if (!vocab.is_object() || vocab.empty()) refuse(path, "model.vocab must be a non-empty object");
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= (1 << 26))
      refuse(path, "model.vocab: token \"" + it.key() + "\" must map to a non-negative id");
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  m.id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
  const ByteAlphabet& ab = alphabet();
  std::string bytes;
  m.bytes_to_id.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    m.id_to_token[static_cast<size_t>(id)] = it.key();
    if (ab.to_bytes(it.key(), bytes)) m.bytes_to_id[bytes] = id;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = m.bytes_to_id.find(std::string(1, static_cast<char>(b)));
    m.byte_id[b] = it == m.bytes_to_id.end() ? -1 : it->second;
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const std::string u = model["unk_token"].get<std::string>();
    auto it = vocab.find(u);
    if (it == vocab.end()) refuse(path, "model.unk_token \"" + u + "\" is not in model.vocab");
    m.unk = static_cast<int32_t>(it->get<int64_t>());
  }
  return max_id;
}

// model.merges, in either serialisation ("a b" or ["a", "b"]).
void load_merges(const std::string& path, const json& model, Impl& m) {
  const json& vocab = model.at("vocab");
  const json& merges = model.at("merges");
  m.merges.reserve(merges.size());
  int32_t rank = 0;
  for (const auto& mg : merges) {
    std::string l, r;
    if (mg.is_string()) {
      const std::string s = mg.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        refuse(path, "model.merges[" + std::to_string(rank) + "]: \"" + s + "\" is not two tokens separated by a space");
      l = s.substr(0, sp);
      r = s.substr(sp + 1);
    } else if (mg.is_array() && mg.size() == 2) {
      l = mg[0].get<std::string>();
      r = mg[1].get<std::string>();
    } else {
      refuse(path, "model.merges[" + std::to_string(rank) + "] must be \"a b\" or [\"a\", \"b\"]");
    }
    auto li = vocab.find(l), ri = vocab.find(r), mi = vocab.find(l + r);
    if (li == vocab.end() || ri == vocab.end() || mi == vocab.end())
      refuse(path, "model.merges[" + std::to_string(rank) + "]: \"" + l + "\" + \"" + r +
                       "\" or their merge is not in model.vocab");
    const uint64_t key = bpe_pair(static_cast<int32_t>(li->get<int64_t>()), static_cast<int32_t>(ri->get<int64_t>()));
    m.merges[key] = {rank, static_cast<int32_t>(mi->get<int64_t>())};  // a repeated pair: the last wins, as in the library
    ++rank;
  }
}

// added_tokens; *max_id grows to the largest id among them.
void load_added_tokens(const std::string& path, const json& j, Impl& m, int64_t* max_id) {
  if (!j.contains("added_tokens") || !j["added_tokens"].is_array()) return;
  const json& vocab = j["model"].at("vocab");
  m.added.reserve(j["added_tokens"].size());
  for (const auto& a : j["added_tokens"]) {
    Added t;
    t.id = static_cast<int32_t>(int_id(path, a.at("id"), "an added token's id"));
    t.content = a.at("content").get<std::string>();
    t.single_word = get_bool(a, "single_word", false);
    t.lstrip = get_bool(a, "lstrip", false);
    t.rstrip = get_bool(a, "rstrip", false);
    t.normalized = get_bool(a, "normalized", false);
    t.special = get_bool(a, "special", false);
    if (t.id < 0) refuse(path, "added token \"" + t.content + "\" has a negative id");
    // A token the model's vocabulary already holds keeps the model's id (the library resolves
    // added tokens through the model first).
    if (auto mv = vocab.find(t.content); mv != vocab.end()) t.id = static_cast<int32_t>(mv->get<int64_t>());
    *max_id = std::max<int64_t>(*max_id, t.id);
    m.added.push_back(std::move(t));
  }
  for (const Added& a : m.added) {
    m.added_by_id[a.id] = &a;
    (a.normalized && !a.special ? m.normalized_matcher : m.raw_matcher).add(&a);
  }
  m.raw_matcher.finish();
  m.normalized_matcher.finish();
}

// The normalizer and the pre-tokenizer (ending in its one ByteLevel step); the decoder must be
// ByteLevel.
void load_text_steps(const std::string& path, const json& j, Impl& m) {
  if (j.contains("normalizer")) parse_normalizer(path, j["normalizer"], m.nfc);
  if (j.contains("pre_tokenizer")) parse_pre_tokenizer(path, j["pre_tokenizer"], m.steps);
  size_t byte_level = m.steps.size();
  for (size_t i = 0; i < m.steps.size(); ++i)
    if (m.steps[i].kind == PreStep::ByteLevel) byte_level = i;
  if (byte_level == m.steps.size())
    refuse(path, "pre_tokenizer has no ByteLevel step: not a byte-level BPE tokenizer (not supported)");
  if (byte_level + 1 != m.steps.size())
    refuse(path, "pre_tokenizer: a step after ByteLevel is not supported (ByteLevel must come last)");
  for (size_t i = 0; i < byte_level; ++i)
    if (m.steps[i].kind == PreStep::ByteLevel) refuse(path, "pre_tokenizer: more than one ByteLevel step");
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    const json& d = j["decoder"];
    std::string t = type_of(d);
    if (t == "Sequence" && d.contains("decoders") && d["decoders"].size() == 1) t = type_of(d["decoders"][0]);
    if (t != "ByteLevel") refuse(path, "decoder type '" + t + "' is not supported (only ByteLevel)");
  } else {
    refuse(path, "no decoder (a byte-level BPE tokenizer.json has a ByteLevel decoder)");
  }
}

// The post-processor: what encode_with_special puts before and after the text.
void load_post_processor(const std::string& path, const json& j, std::vector<int32_t>& prefix,
                         std::vector<int32_t>& suffix) {
  std::vector<const json*> procs;
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    const json& p = j["post_processor"];
    if (type_of(p) == "Sequence")
      for (const auto& q : p.at("processors")) procs.push_back(&q);
    else
      procs.push_back(&p);
  }
  for (const json* pp : procs) {
    const std::string t = type_of(*pp);
    if (t == "ByteLevel") continue;
    if (t == "TemplateProcessing") {
      bool seen_a = false;
      for (const auto& item : pp->at("single")) {
        if (item.contains("Sequence")) {
          seen_a = true;
          continue;
        }
        const std::string name = item.at("SpecialToken").at("id").get<std::string>();
        const json& st = pp->at("special_tokens").at(name);
        for (const auto& id : st.at("ids")) (seen_a ? suffix : prefix).push_back(static_cast<int32_t>(int_id(path, id, "post_processor ids")));
      }
    } else if (t == "RobertaProcessing" || t == "BertProcessing") {
      prefix.push_back(static_cast<int32_t>(int_id(path, pp->at("cls").at(1), "post_processor cls id")));
      suffix.push_back(static_cast<int32_t>(int_id(path, pp->at("sep").at(1), "post_processor sep id")));
    } else {
      refuse(path, "post_processor type '" + t + "' is not supported");
    }
  }
}

// The end of text when the post-processor adds none: tokenizer_config.json's eos_token beside
// `path`, else the first added special token among the usual names; -1 when none.
int32_t configured_eos(const std::string& path, const HfTokenizer& tok, const Impl& m) {
  int32_t eos = -1;
  const std::filesystem::path cfg = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (std::filesystem::is_regular_file(cfg)) {
    std::ifstream cf(cfg);
    try {
      const json c = json::parse(cf);
      if (c.contains("eos_token")) {
        const json& e = c["eos_token"];
        const std::string s = e.is_string() ? e.get<std::string>() : e.is_object() ? e.value("content", "") : "";
        if (!s.empty()) eos = tok.token_id(s);
      }
    } catch (const json::exception& e) {
      refuse(cfg.string(), "not valid JSON: " + json_error_text(e.what()));
    }
  }
  if (eos < 0)
    for (const char* n : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
      for (const Added& a : m.added)
        if (a.special && a.content == n) eos = a.id;
      if (eos >= 0) break;
    }
  return eos;
}

}  // namespace

HfTokenizer::HfTokenizer(const std::string& path) : path_(path), impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.where = path;
  const json j = read_json(path);
  try {
    const json& model = j["model"];
    check_model_kind(path, model);
    m.ignore_merges = get_bool(model, "ignore_merges", false);
    m.fuse_unk = get_bool(model, "fuse_unk", false);
    int64_t max_id = load_vocab(path, model, m);
    load_merges(path, model, m);
    load_added_tokens(path, j, m, &max_id);
    vocab_size_ = static_cast<int32_t>(max_id + 1);
    load_text_steps(path, j, m);
    load_post_processor(path, j, prefix_, suffix_);
  } catch (const json::exception& e) {
    refuse(path, "unexpected layout: " + json_error_text(e.what()));
  }
  if (!suffix_.empty()) eos_ = suffix_.back();
  if (eos_ < 0) eos_ = configured_eos(path, *this, m);
}

HfTokenizer::~HfTokenizer() = default;

int32_t HfTokenizer::token_id(std::string_view content) const {
  for (const Added& a : impl_->added)
    if (a.content == content) return a.id;
  for (size_t i = 0; i < impl_->id_to_token.size(); ++i)
    if (impl_->id_to_token[i] == content) return static_cast<int32_t>(i);
  return -1;
}

}  // namespace mt
