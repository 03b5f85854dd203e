#include "data/corpus.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <nlohmann/json.hpp>

#include "data/data_loader.h"
#include "data/hf_tokenizer.h"
#include "data/token_shards.h"
#include "data/unicode_data.h"
#include "runtime/strings.h"

namespace mt {

namespace fs = std::filesystem;

std::vector<std::string> expand_inputs(const std::vector<std::string>& patterns) {
  std::vector<std::string> files;
  for (const std::string& p : patterns) {
    std::error_code ec;
    if (!is_glob_pattern(p) && fs::is_directory(p, ec)) {
      std::vector<std::string> found;
      for (fs::recursive_directory_iterator it(p, fs::directory_options::follow_directory_symlink, ec), end;
           !ec && it != end; it.increment(ec))
        if (it->is_regular_file(ec)) found.push_back(it->path().string());
      if (ec) throw std::runtime_error("cannot list directory " + p + ": " + ec.message());
      if (found.empty()) throw std::runtime_error("directory " + p + " holds no file");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
      continue;
    }
    for (const std::string& f : expand_file_pattern(p)) {
      if (fs::is_directory(f, ec)) continue;  // a glob that also matched directories
      if (!fs::exists(f, ec)) throw std::runtime_error("input file " + f + " does not exist");
      files.push_back(f);
    }
  }
  return files;
}

namespace {

bool is_jsonl_name(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  return ext == ".jsonl" || ext == ".ndjson" || ext == ".json";
}

bool jsonl_format(const std::string& path, InputFormat f) {
  return f == InputFormat::Jsonl || f == InputFormat::Chat || (f == InputFormat::Auto && is_jsonl_name(path));
}

std::string read_whole(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw std::runtime_error("input " + path + " is a directory, not a text file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open input file " + path + ": " + std::strerror(errno));
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw std::runtime_error("cannot read input file " + path);
  return s;
}

// A BadInputError naming file and line.
BadInputError bad_line(const std::string& path, int64_t lineno, const std::string& why) {
  return BadInputError(path + " line " + std::to_string(lineno) + ": " + why);
}

// One JSON-lines record: a JSON object, or a BadInputError naming file and line.
nlohmann::json json_object_line(const std::string& line, const std::string& path, int64_t lineno) {
  size_t at = 0;
  if (!unicode::utf8_valid(line, &at))
    throw bad_line(path, lineno, "invalid UTF-8 at byte " + std::to_string(at) + " of the line");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for a number like 1e99999
    throw bad_line(path, lineno, "not JSON (" + json_error_text(e.what()) + ")");
  }
  if (!j.is_object()) throw bad_line(path, lineno, "not a JSON object");
  return j;
}

// The document of one JSON line, or a BadInputError naming file and line.
std::string jsonl_text(const std::string& line, const std::string& field, const std::string& path, int64_t lineno) {
  auto bad = [&](const std::string& why) { return bad_line(path, lineno, why); };
  const nlohmann::json j = json_object_line(line, path, lineno);
  auto it = j.find(field);
  if (it == j.end()) throw bad("no field \"" + field + "\" (choose the field with --jsonl-field)");
  if (!it->is_string()) throw bad("field \"" + field + "\" is not a string");
  return it->get<std::string>();
}

struct Doc {
  std::string text;
  std::vector<ChatMessage> chat;  // InputFormat::Chat
  int64_t bytes = 0;  // input bytes it stands for (progress)
};

// Streams the documents of a list of files.
class DocReader {
 public:
  DocReader(const PrepareOptions& o, PrepareResult& r) : o_(o), r_(r) {}
  // The next document; false at the end. Bad JSON lines are skipped (counted) or thrown.
  bool next(Doc& d) {
    for (;;) {
      if (!open_) {
        if (file_ >= o_.inputs.size()) return false;
        const std::string& path = o_.inputs[file_];
        if (!jsonl_format(path, o_.format)) {
          d.text = read_whole(path);
          d.bytes = static_cast<int64_t>(d.text.size());
          ++file_;
          return true;
        }
        in_.close();
        in_.clear();
        in_.open(path, std::ios::binary);
        if (!in_) throw std::runtime_error("cannot open input file " + path + ": " + std::strerror(errno));
        lineno_ = 0;
        open_ = true;
      }
      const std::string& path = o_.inputs[file_];
      if (!std::getline(in_, line_)) {
        if (in_.bad()) throw std::runtime_error("cannot read input file " + path);
        open_ = false;
        ++file_;
        continue;
      }
      ++lineno_;
      const int64_t consumed = static_cast<int64_t>(line_.size()) + 1;
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      if (line_.find_first_not_of(" \t") == std::string::npos) {  // blank line
        pending_bytes_ += consumed;
        continue;
      }
      try {
        if (o_.format == InputFormat::Chat) {
          d.chat = parse_chat_record(line_, path, lineno_);
          d.text.clear();
        } else {
          d.text = jsonl_text(line_, o_.jsonl_field, path, lineno_);
        }
      } catch (const BadInputError& e) {
        if (!o_.skip_bad) throw;
        ++r_.bad;
        if (r_.warnings.size() < 10) r_.warnings.emplace_back(e.what());
        pending_bytes_ += consumed;
        continue;
      }
      d.bytes = consumed + pending_bytes_;
      pending_bytes_ = 0;
      return true;
    }
  }

 private:
  const PrepareOptions& o_;
  PrepareResult& r_;
  size_t file_ = 0;
  bool open_ = false;
  std::ifstream in_;
  std::string line_;
  int64_t lineno_ = 0, pending_bytes_ = 0;
};

// Removes shards a previous run left in `dir` (a stale train_000007.bin would join a glob).
void remove_old_shards(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const std::string ext = e.path().extension().string();
    const std::string stem = ext == ".mask" ? e.path().stem().string() : n;  // a loss mask: train.bin.mask
    const bool shard = (n.rfind("train", 0) == 0 || n.rfind("val", 0) == 0) &&
                       (ext == ".bin" || (ext == ".mask" && fs::path(stem).extension() == ".bin"));
    if (shard && (stem == "train.bin" || stem == "val.bin" || n.find('_') != std::string::npos))
      fs::remove(e.path(), ec);
  }
}

}  // namespace

std::vector<ChatMessage> parse_chat_record(const std::string& line, const std::string& path, int64_t lineno) {
  auto bad = [&](const std::string& why) { return bad_line(path, lineno, why); };
  const nlohmann::json j = json_object_line(line, path, lineno);
  std::vector<ChatMessage> out;
  if (auto m = j.find("messages"); m != j.end()) {
    if (!m->is_array() || m->empty()) throw bad("\"messages\" is not a non-empty list");
    for (size_t i = 0; i < m->size(); ++i) {
      const auto& msg = (*m)[i];
      const std::string where = "message " + std::to_string(i + 1) + " of \"messages\"";
      if (!msg.is_object()) throw bad(where + " is not an object with \"role\" and \"content\"");
      auto r = msg.find("role"), c = msg.find("content");
      if (r == msg.end() || !r->is_string()) throw bad(where + " has no string \"role\"");
      if (c == msg.end() || !c->is_string()) throw bad(where + " has no string \"content\"");
      out.push_back({r->get<std::string>(), c->get<std::string>()});
    }
    return out;
  }
  auto p = j.find("prompt"), c = j.find("completion");
  if (p == j.end() && c == j.end())
    throw bad("needs \"messages\" (a list of {\"role\", \"content\"}) or \"prompt\" and \"completion\"");
  if (p == j.end() || !p->is_string()) throw bad("no string \"prompt\" beside \"completion\"");
  if (c == j.end() || !c->is_string()) throw bad("no string \"completion\" beside \"prompt\"");
  out.push_back({"user", p->get<std::string>()});
  out.push_back({"assistant", c->get<std::string>()});
  return out;
}

ChatTemplate::ChatTemplate(const std::string& name, const Tokenizer& tok) : name_(name), tok_(tok) {
  if (name != "chatml" && name != "llama3")
    throw std::invalid_argument("--template must be chatml or llama3, got '" + name + "'");
  const auto* hf = dynamic_cast<const HfTokenizer*>(&tok);
  auto need = [&](const char* t) {
    const int32_t id = hf ? hf->token_id(t) : -1;
    if (id < 0)
      throw std::invalid_argument("chat template " + name + " needs the special token " + t + ", which tokenizer " +
                                  tok.name() + (hf ? " (" + hf->path() + ")" : std::string()) +
                                  " does not have: use the model's own tokenizer.json (--tokenizer hf "
                                  "--tokenizer-file) or a template whose tokens it has");
    return id;
  };
  if (name == "chatml") {
    open_ = need("<|im_start|>");
    close_ = need("<|im_end|>");
  } else {
    bos_ = need("<|begin_of_text|>");
    open_ = need("<|start_header_id|>");
    header_end_ = need("<|end_header_id|>");
    close_ = need("<|eot_id|>");
  }
}

void ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool train_all, std::vector<int32_t>& ids,
                         std::vector<uint8_t>& mask) const {
  const uint8_t all = train_all ? 1 : 0;
  auto put = [&](int32_t id, uint8_t m) {
    ids.push_back(id);
    mask.push_back(m);
  };
  auto text = [&](const std::string& s, uint8_t m) {
    for (int32_t id : tok_.encode(s)) put(id, m);
  };
  // `head` + `body` encoded as one text (as the template renders it), the tokens that hold the
  // body trained when `train`: those after the longest run the text shares with `head` alone.
  auto head_body = [&](const std::string& head, const std::string& body, bool train) {
    const std::vector<int32_t> whole = tok_.encode(head + body);
    const std::vector<int32_t> h = tok_.encode(head);
    size_t k = 0;
    while (k < h.size() && k < whole.size() && whole[k] == h[k]) ++k;
    // (When they part inside the head, whole[k] straddles the head's end: it holds body bytes and is trained.)
    for (size_t i = 0; i < whole.size(); ++i) put(whole[i], static_cast<uint8_t>(all | (train && i >= k ? 1 : 0)));
  };
  auto trim = [](const std::string& s) {
    const char* ws = " \t\n\r\f\v";
    const size_t a = s.find_first_not_of(ws);
    if (a == std::string::npos) return std::string();
    return s.substr(a, s.find_last_not_of(ws) - a + 1);
  };
  if (bos_ >= 0) put(bos_, all);
  for (const ChatMessage& m : messages) {
    const bool asst = m.role == "assistant";
    put(open_, all);
    if (name_ == "chatml") {
      head_body(m.role + "\n", m.content, asst);
      put(close_, static_cast<uint8_t>(all | (asst ? 1 : 0)));
      text("\n", all);
    } else {
      text(m.role, all);
      put(header_end_, all);
      head_body("\n\n", trim(m.content), asst);
      put(close_, static_cast<uint8_t>(all | (asst ? 1 : 0)));
    }
  }
}

int64_t for_each_document(const std::string& path, InputFormat format, const std::string& jsonl_field, bool skip_bad,
                          const std::function<void(std::string_view, int64_t)>& fn, std::vector<std::string>* warnings) {
  if (!jsonl_format(path, format)) {
    fn(read_whole(path), 0);
    return 0;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open input file " + path + ": " + std::strerror(errno));
  std::string line;
  int64_t lineno = 0, bad = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    std::string text;
    try {
      text = jsonl_text(line, jsonl_field, path, lineno);
    } catch (const BadInputError& e) {
      if (!skip_bad) throw;
      ++bad;
      if (warnings && warnings->size() < 10) warnings->emplace_back(e.what());
      continue;
    }
    fn(text, lineno);
  }
  if (in.bad()) throw std::runtime_error("cannot read input file " + path);
  return bad;
}

PrepareResult prepare_corpus(const PrepareOptions& o, const Tokenizer& tok,
                             const std::function<void(const PrepareProgress&)>& progress) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0))
    throw std::invalid_argument("val_fraction must be in [0, 1), got " + std::to_string(o.val_fraction));
  if (o.shard_tokens < 0) throw std::invalid_argument("shard_tokens must be >= 0");
  PrepareResult r;
  PrepareProgress pg;
  std::error_code ec;
  for (const auto& f : o.inputs) pg.bytes_total += static_cast<int64_t>(fs::file_size(f, ec));
  fs::create_directories(o.out_dir, ec);
  if (!fs::is_directory(o.out_dir))
    throw std::runtime_error("cannot create output directory " + o.out_dir + (ec ? ": " + ec.message() : ""));
  const fs::path tmp_path = fs::path(o.out_dir) / (".prepare-" + std::to_string(::getpid()) + ".tokens");
  struct TmpFile {
    fs::path p;
    ~TmpFile() {
      std::error_code e;
      fs::remove(p, e);
    }
  } tmp_guard{tmp_path};
  std::FILE* tmp = std::fopen(tmp_path.c_str(), "w+b");
  if (!tmp) throw std::runtime_error("cannot create " + tmp_path.string() + ": " + std::strerror(errno));
  struct Closer {
    std::FILE* f;
    ~Closer() { std::fclose(f); }
  } closer{tmp};

  const int32_t sep = tok.document_separator();
  const bool chat = o.format == InputFormat::Chat;
  std::optional<ChatTemplate> tmpl;
  if (chat) tmpl.emplace(o.chat_template, tok);  // refuses a tokenizer without the template's tokens
  // Chat: the temporary stream holds id | trained << 31 (ids are below 2^31).
  const uint32_t sep_word = static_cast<uint32_t>(sep) | (chat && o.train_on_all ? 0x80000000u : 0u);
  std::vector<std::vector<uint8_t>> masks;
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  DocReader reader(o, r);
  std::vector<Doc> docs;
  std::vector<std::vector<int32_t>> ids;
  std::vector<uint32_t> buf;
  int64_t max_id = -1;
  bool more = true;
  while (more) {
    docs.clear();
    size_t bytes = 0;
    while (bytes < o.batch_bytes) {
      Doc d;
      if (!reader.next(d)) {
        more = false;
        break;
      }
      bytes += chat ? static_cast<size_t>(d.bytes) : d.text.size();
      docs.push_back(std::move(d));
    }
    ids.resize(docs.size());
    masks.resize(docs.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (size_t i = 0; i < docs.size(); ++i) {
      ids[i].clear();
      masks[i].clear();
      if (chat)
        tmpl->apply(docs[i].chat, o.train_on_all, ids[i], masks[i]);
      else
        tok.encode_document(docs[i].text, ids[i]);
    }
    buf.clear();
    for (size_t i = 0; i < docs.size(); ++i) {
      if (r.documents > 0 && sep >= 0) buf.push_back(sep_word);
      for (size_t k = 0; k < ids[i].size(); ++k) {
        const int32_t t = ids[i][k];
        if (t < 0) throw std::logic_error("tokenizer produced a negative id");
        buf.push_back(static_cast<uint32_t>(t) | (chat && masks[i][k] ? 0x80000000u : 0u));
        max_id = std::max<int64_t>(max_id, t);
      }
      if (sep >= 0 && r.documents > 0) max_id = std::max<int64_t>(max_id, sep);
      ++r.documents;
      pg.bytes_done += docs[i].bytes;
      r.bytes += chat ? docs[i].bytes : static_cast<int64_t>(docs[i].text.size());
    }
    if (!buf.empty() && std::fwrite(buf.data(), sizeof(uint32_t), buf.size(), tmp) != buf.size())
      throw std::runtime_error("cannot write " + tmp_path.string() + " (disk full?)");
    r.tokens += static_cast<int64_t>(buf.size());
    pg.tokens = r.tokens;
    pg.documents = r.documents;
    pg.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (progress) progress(pg);
  }
  const int64_t n = r.tokens;
  r.val_tokens = static_cast<int64_t>(static_cast<double>(n) * o.val_fraction);
  r.train_tokens = n - r.val_tokens;
  if (r.train_tokens <= 0)
    throw std::runtime_error("the input holds " + std::to_string(n) + " tokens, leaving none for the training shards");
  r.token_bytes = max_id > 65535 ? 4 : 2;

  // Bytes of text per id, recorded with the shards' token counts (bits per byte).
  std::vector<uint16_t> text_bytes_of_id(static_cast<size_t>(std::max(tok.vocab_size(), 0)));
  for (size_t id = 0; id < text_bytes_of_id.size(); ++id)
    text_bytes_of_id[id] = static_cast<uint16_t>(std::min<size_t>(tok.token_text_bytes(static_cast<int32_t>(id)), 65535));

  // Cut the token stream into shards.
  remove_old_shards(o.out_dir);
  if (std::fseek(tmp, 0, SEEK_SET) != 0) throw std::runtime_error("cannot rewind " + tmp_path.string());
  auto write_split = [&](const std::string& stem, int64_t count, std::vector<std::string>& files) {
    const bool many = o.shard_tokens > 0 && count > o.shard_tokens;
    const int64_t per = many ? o.shard_tokens : std::max<int64_t>(count, 0);
    int64_t left = count, k = 0;
    do {
      const int64_t this_count = std::min(per, left);
      char name[64];
      if (many)
        std::snprintf(name, sizeof name, "%s_%06lld.bin", stem.c_str(), static_cast<long long>(k));
      else
        std::snprintf(name, sizeof name, "%s.bin", stem.c_str());
      const std::string path = (fs::path(o.out_dir) / name).string();
      TokenShardWriter w(path, this_count, r.token_bytes);
      w.describe_text(tok.vocab_size(), text_bytes_of_id);
      std::vector<uint32_t> chunk;
      std::vector<uint8_t> mask;
      for (int64_t done = 0; done < this_count;) {
        const size_t m = static_cast<size_t>(std::min<int64_t>(this_count - done, int64_t{1} << 20));
        chunk.resize(m);
        if (std::fread(chunk.data(), sizeof(uint32_t), m, tmp) != m)
          throw std::runtime_error("cannot read back " + tmp_path.string());
        if (chat) {
          for (uint32_t& t : chunk) {
            mask.push_back(t >> 31 ? 1 : 0);
            r.trained_tokens += t >> 31;
            t &= 0x7fffffffu;
          }
        }
        w.write(chunk);
        done += static_cast<int64_t>(m);
      }
      w.close();
      if (chat) write_mask_shard(mask_shard_path(path), mask);
      files.push_back(path);
      left -= this_count;
      ++k;
    } while (left > 0);
  };
  write_split("train", r.train_tokens, r.train_files);
  write_split("val", r.val_tokens, r.val_files);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace mt
