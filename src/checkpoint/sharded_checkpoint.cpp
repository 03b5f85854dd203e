#include "checkpoint/sharded_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "checkpoint/safetensors.h"
#include "runtime/crc32c.h"
#include "runtime/memory.h"
#include "runtime/strings.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

const char* kKindPrefix[3] = {"", "exp_avg.", "exp_avg_sq."};

bool is_vocab_table(const ParamInfo& p) {
  return p.name == "wte.weight" || p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight";
}

int64_t real_rows(const ParamInfo& p, const ModelConfig& c) { return is_vocab_table(p) ? c.vocab_size : p.shape[0]; }

std::string box_str(const Box& b) {
  return "rows [" + std::to_string(b.row0) + ", " + std::to_string(b.row0 + b.rows) + ") cols [" +
         std::to_string(b.col0) + ", " + std::to_string(b.col0 + b.cols) + ")";
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

std::string entry_name(const std::string& tensor, const Box& b) {
  return tensor + "@" + std::to_string(b.row0) + "," + std::to_string(b.col0);
}

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "%08x", v);
  return b;
}

// Integers only: nlohmann converts a floating-point value to an integer type with a cast that is
// undefined out of range.
int64_t json_int(const nlohmann::json& v, const std::string& what) {
  if (!v.is_number_integer()) throw std::runtime_error(what + " must be an integer");
  return v.get<int64_t>();
}

// A CRC32C as the index records it: 1 to 8 hex digits.
uint32_t parse_hex32(const std::string& s) {
  if (s.empty() || s.size() > 8 || s.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
    throw std::runtime_error("crc32c \"" + s + "\" is not a 32-bit hex number");
  return static_cast<uint32_t>(std::stoul(s, nullptr, 16));
}

bool intersect(const Box& a, const Box& b, Box* out) {
  const int64_t r0 = std::max(a.row0, b.row0), r1 = std::min(a.row0 + a.rows, b.row0 + b.rows);
  const int64_t c0 = std::max(a.col0, b.col0), c1 = std::min(a.col0 + a.cols, b.col0 + b.cols);
  if (r0 >= r1 || c0 >= c1) return false;
  *out = {r0, r1 - r0, c0, c1 - c0};
  return true;
}

}  // namespace

HostBuffer::~HostBuffer() {
  if (p_) mem_free(p_, bytes_, MemCategory::Workspace);
}

float* HostBuffer::reserve(size_t floats) {
  const size_t need = floats * sizeof(float);
  if (need > bytes_) {
    if (p_) mem_free(p_, bytes_, MemCategory::Workspace);
    p_ = static_cast<float*>(mem_alloc(need, MemCategory::Workspace));
    bytes_ = need;
  }
  return p_;
}

std::string logical_name(const ParamInfo& p, int kind) { return kKindPrefix[kind] + p.name; }

int64_t logical_cols(const ParamInfo& p) { return p.shape.size() > 1 ? p.numel / p.shape[0] : 1; }

std::vector<int64_t> logical_shape(const ParamInfo& p, const ModelConfig& c) {
  std::vector<int64_t> s = p.shape;
  s[0] = real_rows(p, c);
  return s;
}

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

// ---- what a rank holds, as boxes ------------------------------------------------------------------

namespace {
// The elements [begin, end) of unit u's parameters among `params` (offsets relative to `uo`) as
// boxes of ref's parameters.
std::vector<LocalPiece> pieces_of(const Transformer& model, const std::vector<ParamInfo>& params, int64_t uo,
                                  const Transformer& ref, int u, int64_t begin, int64_t end, bool dedup) {
  std::vector<LocalPiece> out;
  const std::vector<ParamInfo>& rps = ref.params();
  for (const ParamInfo& lp : params) {
    if (lp.unit != u) continue;
    if (dedup && lp.tp_split == TpSplit::None && model.tp_rank() != 0) continue;  // tp rank 0 writes replicated parameters
    const int64_t pb = lp.offset - uo;  // the parameter's range in the unit
    const int64_t s = std::max(begin, pb), e = std::min(end, pb + lp.numel);
    if (s >= e) continue;
    int ri = -1;
    for (size_t i = 0; i < rps.size(); ++i)
      if (rps[i].name == lp.name) ri = static_cast<int>(i);
    if (ri < 0) throw std::logic_error("unit_pieces: no parameter " + lp.name + " in the unsplit layout");
    const ParamInfo& fp = rps[static_cast<size_t>(ri)];
    const int64_t lcols = logical_cols(lp), frows = real_rows(fp, ref.config());
    int64_t col0 = 0;
    const std::vector<Transformer::TpRows> runs = model.tp_row_runs(lp, &col0);
    // [s, e) as up to three local boxes, each contiguous: a partial first row, whole rows, a
    // partial last row.
    struct LBox {
      int64_t row0, rows, c0, cols, local;
    };
    std::vector<LBox> lb;
    int64_t x = s - pb;
    const int64_t xe = e - pb;
    if (x % lcols != 0) {
      const int64_t n = std::min(lcols - x % lcols, xe - x);
      lb.push_back({x / lcols, 1, x % lcols, n, x});
      x += n;
    }
    if (xe - x >= lcols) {
      const int64_t k = (xe - x) / lcols;
      lb.push_back({x / lcols, k, 0, lcols, x});
      x += k * lcols;
    }
    if (x < xe) lb.push_back({x / lcols, 1, 0, xe - x, x});
    for (const LBox& b : lb) {
      for (const auto& run : runs) {  // cut at the tp row runs, then drop padded vocabulary rows
        const int64_t r0 = std::max(b.row0, run.local_row), r1 = std::min(b.row0 + b.rows, run.local_row + run.rows);
        if (r0 >= r1) continue;
        int64_t f0 = run.full_row + (r0 - run.local_row), f1 = f0 + (r1 - r0);
        f1 = std::min(f1, frows);
        if (f0 >= f1) continue;
        LocalPiece p;
        p.param = ri;
        p.local = (s - begin) + (b.local - (s - pb)) + (r0 - b.row0) * b.cols;
        p.box = {f0, f1 - f0, col0 + b.c0, b.cols};
        out.push_back(p);
      }
    }
  }
  return out;
}
}  // namespace

std::vector<LocalPiece> unit_pieces(const Transformer& model, const Transformer& ref, int u, int64_t begin,
                                    int64_t end, bool dedup) {
  return pieces_of(model, model.params(), model.unit(u).offset, ref, u, begin, end, dedup);
}

std::vector<LocalPiece> expert_unit_pieces(const Transformer& model, const Transformer& ref, int u, bool dedup) {
  int64_t lo = -1, hi = 0;
  for (const ParamInfo& p : model.expert_params())
    if (p.unit == u) {
      if (lo < 0) lo = p.offset;
      hi = p.offset + p.numel;
    }
  if (lo < 0) return {};
  return pieces_of(model, model.expert_params(), lo, ref, u, 0, hi - lo, dedup);
}

// ---- writing one rank's file ----------------------------------------------------------------------

RankFileWriter::RankFileWriter(const std::string& path, const Transformer& ref,
                               const std::vector<std::vector<LocalPiece>>& pieces,
                               const std::map<std::string, std::string>& metadata)
    : ref_(ref), pieces_(pieces) {
  std::vector<std::pair<std::string, SafeTensorInfo>> h;
  for (const auto& unit : pieces_)
    for (int k = 0; k < 3; ++k)
      for (const LocalPiece& p : unit) {
        SafeTensorInfo i;
        const ParamInfo& fp = ref_.params()[static_cast<size_t>(p.param)];
        i.shape = fp.shape.size() > 1 ? std::vector<int64_t>{p.box.rows, p.box.cols} : std::vector<int64_t>{p.box.rows};
        h.emplace_back(entry_name(logical_name(fp, k), p.box), i);
      }
  out_ = std::make_unique<SafetensorsWriter>(path, h, metadata);
  res_.pieces = nlohmann::json::array();
}

RankFileWriter::~RankFileWriter() = default;

void RankFileWriter::write_unit(int u, const float* w, const float* m, const float* v) {
  const float* src[3] = {w, m, v};
  for (int k = 0; k < 3; ++k)
    for (const LocalPiece& p : pieces_[static_cast<size_t>(u)]) {
      const ParamInfo& fp = ref_.params()[static_cast<size_t>(p.param)];
      const std::string t = logical_name(fp, k), e = entry_name(t, p.box);
      const float* d = src[k] + p.local;
      const uint64_t n = static_cast<uint64_t>(p.box.numel()) * sizeof(float);
      out_->write(e, d, n);
      res_.pieces.push_back({t, out_->data_start() + out_->info(e).begin, p.box.row0, p.box.rows, p.box.col0,
                             p.box.cols, hex32(crc32c(0, d, n))});
    }
}

RankFileResult RankFileWriter::finish() {
  out_->finish();
  if (!out_->file_crc_valid()) throw std::logic_error("RankFileWriter: units written out of order");
  res_.bytes = out_->file_bytes();
  res_.crc = out_->file_crc32c();
  return res_;
}

// ---- collectives ----------------------------------------------------------------------------------

std::vector<std::string> all_gather_strings(comm::ProcessGroup& g, const std::string& mine) {
  const int n = g.size();
  if (n == 1) return {mine};
  // Lengths, then the strings padded to the longest, as 32-bit words (all_gather only copies).
  std::vector<int64_t> len(static_cast<size_t>(n));
  int64_t my = static_cast<int64_t>(mine.size());
  g.all_gather(&my, len.data(), 1, DType::I64)->wait();
  int64_t mx = 0;
  for (int64_t l : len) mx = std::max(mx, l);
  const size_t slots = static_cast<size_t>((mx + 3) / 4);
  if (slots == 0) return std::vector<std::string>(static_cast<size_t>(n));
  std::vector<char> send(slots * 4, 0), recv(slots * 4 * static_cast<size_t>(n));
  std::memcpy(send.data(), mine.data(), mine.size());  // host bytes, not tensor memory
  g.all_gather(send.data(), recv.data(), slots, DType::I32)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(recv.data() + static_cast<size_t>(r) * slots * 4, static_cast<size_t>(len[static_cast<size_t>(r)]));
  return out;
}

std::string agree_on_error(comm::ProcessGroup& g, const std::string& mine) {
  if (g.size() == 1) return mine;
  // One small all-reduce when all is well; the messages only when some rank failed.
  float bad = mine.empty() ? 0.0f : 1.0f;
  g.all_reduce(&bad, 1, DType::F32, comm::ReduceOp::Max)->wait();
  if (bad == 0.0f) return "";
  const std::vector<std::string> all = all_gather_strings(g, mine);
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) return "rank " + std::to_string(r) + ": " + all[r];
  return "";
}

// ---- commit ---------------------------------------------------------------------------------------

void commit_sharded(const std::string& root, const std::string& tmp_dir, int64_t step, const Transformer& ref,
                    const std::vector<nlohmann::json>& files, const nlohmann::json& layout, const TrainerState& st,
                    const RunRecord& run) {
  if (ref.config().lora() && st.lora_base.is_null())
    throw std::logic_error("commit_sharded: a LoRA checkpoint (adapters only) needs its base's record");
  nlohmann::json tensors = nlohmann::json::object();
  for (const ParamInfo& p : ref.params())
    if (checkpoint_stores(p, ref.config()))
    for (int k = 0; k < 3; ++k)
      tensors[logical_name(p, k)] = {{"dtype", "F32"},
                                     {"shape", logical_shape(p, ref.config())},
                                     {"hf_transposed", p.hf_transposed},
                                     {"pieces", nlohmann::json::array()}};
  nlohmann::json fl = nlohmann::json::array();
  for (size_t f = 0; f < files.size(); ++f) {
    const nlohmann::json& j = files[f];
    for (const auto& p : j.at("pieces")) {
      const std::string t = p.at(0).get<std::string>();
      if (!tensors.contains(t)) throw std::logic_error("commit_sharded: rank " + std::to_string(f) + " wrote unknown tensor " + t);
      tensors[t]["pieces"].push_back({f, p.at(1), p.at(2), p.at(3), p.at(4), p.at(5), p.at(6)});
    }
    fl.push_back({{"name", j.at("name")}, {"rank", f}, {"bytes", j.at("bytes")}, {"crc32c", j.at("crc32c")}});
  }
  nlohmann::json meta = {{"format", "meshtrain-sharded"},
                         {"format_version", 2},
                         {"step", st.step},
                         {"adam_steps", st.adam_steps},
                         {"micro_batches", st.micro_batches},
                         {"num_params", ref.num_params()},
                         {"model",
                          {{"arch", arch_name(ref.config().arch)},
                           {"n_layer", ref.config().n_layer},
                           {"n_embd", ref.config().n_embd},
                           {"vocab_size", ref.config().vocab_size}}},
                         {"layout", layout},
                         {"piece_columns", {"file", "offset", "row0", "rows", "col0", "cols", "crc32c"}},
                         {"files", fl},
                         {"tensors", tensors}};
  if (ref.config().lora()) meta["adapters_only"] = true;  // the frozen base is not stored
  write_text_file_atomic((fs::path(tmp_dir) / "metadata.json").string(), meta.dump(1) + "\n");
  finish_checkpoint_dir(root, tmp_dir, step_dir_name(step), checkpoint_trainer_json(st, ref.num_params(), true, "sharded"),
                        run);
}

// ---- reading --------------------------------------------------------------------------------------

bool ShardedCheckpoint::is_sharded(const std::string& dir) { return fs::exists(fs::path(dir) / "metadata.json"); }

ShardedCheckpoint::ShardedCheckpoint(const std::string& dir) : dir_(dir) {
  const std::string mpath = (fs::path(dir) / "metadata.json").string();
  std::ifstream f(mpath);
  if (!f) throw std::runtime_error(mpath + ": cannot read");
  try {
    std::stringstream ss;
    ss << f.rdbuf();
    meta_ = nlohmann::json::parse(ss.str());
    if (meta_.at("format").get<std::string>() != "meshtrain-sharded")
      throw std::runtime_error("format is not meshtrain-sharded");
    for (const auto& fj : meta_.at("files")) {
      File fi;
      fi.name = fj.at("name").get<std::string>();
      if (!fj.at("bytes").is_number_unsigned()) throw std::runtime_error("a file's bytes must be a non-negative integer");
      fi.bytes = fj.at("bytes").get<uint64_t>();
      fi.crc = parse_hex32(fj.at("crc32c").get<std::string>());
      if (fi.name.find('/') != std::string::npos) throw std::runtime_error("file name " + fi.name + " has a '/'");
      files_.push_back(fi);
    }
    for (auto it = meta_.at("tensors").begin(); it != meta_.at("tensors").end(); ++it) {
      Tensor_ t;
      if (!it->at("shape").is_array()) throw std::runtime_error("tensor " + it.key() + ": shape must be a list");
      for (const auto& d : it->at("shape")) t.shape.push_back(json_int(d, "tensor " + it.key() + ": shape"));
      if (it->at("dtype").get<std::string>() != "F32")
        throw std::runtime_error("tensor " + it.key() + " has dtype " + it->at("dtype").get<std::string>() + ", expected F32");
      for (int64_t d : t.shape)
        if (d < 0) throw std::runtime_error("tensor " + it.key() + " " + shape_str(t.shape) + " has a negative dimension");
      const int64_t rows = t.shape.empty() ? 0 : t.shape[0], cols = t.shape.size() > 1 ? t.shape[1] : 1;
      for (const auto& pj : it->at("pieces")) {
        Piece p;
        const std::string what = "tensor " + it.key() + ": a piece";
        const int64_t file = json_int(pj.at(0), what + "'s file");
        p.file = file < 0 || file > INT_MAX ? -1 : static_cast<int>(file);
        if (!pj.at(1).is_number_unsigned()) throw std::runtime_error(what + "'s offset must be a non-negative integer");
        p.offset = pj.at(1).get<uint64_t>();
        p.box = {json_int(pj.at(2), what + "'s row0"), json_int(pj.at(3), what + "'s rows"),
                 json_int(pj.at(4), what + "'s col0"), json_int(pj.at(5), what + "'s cols")};
        p.crc = parse_hex32(pj.at(6).get<std::string>());
        if (p.file < 0 || p.file >= static_cast<int>(files_.size()))
          throw std::runtime_error("tensor " + it.key() + ": a piece names file " + std::to_string(p.file) + " of " +
                                   std::to_string(files_.size()));
        if (p.box.row0 < 0 || p.box.col0 < 0 || p.box.rows <= 0 || p.box.cols <= 0 || p.box.rows > rows - p.box.row0 ||
            p.box.cols > cols - p.box.col0)
          throw std::runtime_error("tensor " + it.key() + " " + shape_str(t.shape) + ": piece " + box_str(p.box) +
                                   " in " + files_[static_cast<size_t>(p.file)].name + " lies outside it");
        t.pieces.push_back(p);
      }
      tensors_.emplace(it.key(), std::move(t));
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(mpath + ": " + json_error_text(e.what()));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(mpath + ": " + e.what());
  }
}

ShardedCheckpoint::~ShardedCheckpoint() {
  for (auto& [i, d] : fds_)
    if (d >= 0) ::close(d);
}

void ShardedCheckpoint::check_model(const Transformer& ref, bool moments, bool adapters_only) const {
  const std::string mpath = (fs::path(dir_) / "metadata.json").string();
  for (const ParamInfo& p : ref.params())
    if (!adapters_only || p.trainable)
    for (int k = 0; k < (moments ? 3 : 1); ++k) {
      const std::string n = logical_name(p, k);
      auto it = tensors_.find(n);
      if (it == tensors_.end())
        throw CheckpointModelMismatch(mpath + ": no tensor " + n + " (a checkpoint of another model?)");
      const std::vector<int64_t> want = logical_shape(p, ref.config());
      if (it->second.shape != want)
        throw CheckpointModelMismatch(mpath + ": tensor " + n + " has shape " + shape_str(it->second.shape) +
                                      ", the configured model expects " + shape_str(want) +
                                      " (a checkpoint of another model?)");
      int64_t covered = 0;
      for (const Piece& pc : it->second.pieces) covered += pc.box.numel();
      int64_t numel = 1;
      for (int64_t d : want) numel *= d;
      if (covered != numel)
        throw std::runtime_error(mpath + ": the pieces of tensor " + n + " hold " + std::to_string(covered) + " of its " +
                                 std::to_string(numel) + " elements");
    }
  const int64_t np = meta_.value("num_params", int64_t{-1});
  if (np != ref.num_params())
    throw CheckpointModelMismatch(mpath + ": checkpoint has " + std::to_string(np) +
                                  " parameters, the configured model has " + std::to_string(ref.num_params()));
}

int ShardedCheckpoint::fd(int file) const {
  auto it = fds_.find(file);
  if (it != fds_.end()) return it->second;
  const std::string path = (fs::path(dir_) / files_[static_cast<size_t>(file)].name).string();
  const int d = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (d < 0) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  fds_[file] = d;
  return d;
}

std::string ShardedCheckpoint::check_files(int first, int stride, bool verify) const {
  // Per file: its pieces (tensor name, piece).
  std::vector<std::vector<std::pair<const std::string*, const Piece*>>> by_file(files_.size());
  for (const auto& [name, t] : tensors_)
    for (const Piece& p : t.pieces) by_file[static_cast<size_t>(p.file)].push_back({&name, &p});
  const int64_t step = meta_.value("step", int64_t{-1});
  for (int f = first; f < static_cast<int>(files_.size()); f += stride) {
    const File& fi = files_[static_cast<size_t>(f)];
    const std::string path = (fs::path(dir_) / fi.name).string();
    const auto& mine = by_file[static_cast<size_t>(f)];
    const std::string some = mine.empty() ? std::string("no tensor") : "tensor " + *mine.front().first;
    struct stat sb;
    if (::stat(path.c_str(), &sb) != 0)
      return path + ": missing (metadata.json lists it for " + std::to_string(mine.size()) + " pieces, e.g. " + some + ")";
    if (static_cast<uint64_t>(sb.st_size) != fi.bytes)
      return path + ": " + std::to_string(sb.st_size) + " bytes, metadata.json records " + std::to_string(fi.bytes) +
             (static_cast<uint64_t>(sb.st_size) < fi.bytes ? " (truncated; it holds " : " (it holds ") +
             std::to_string(mine.size()) + " pieces, e.g. " + some + ")";
    std::unique_ptr<SafetensorsReader> r;
    try {
      r = std::make_unique<SafetensorsReader>(path);
    } catch (const std::exception& e) {
      return e.what();
    }
    auto mit = r->metadata().find("step");
    if (mit == r->metadata().end() || mit->second != std::to_string(step))
      return path + ": holds step " + (mit == r->metadata().end() ? std::string("?") : mit->second) +
             ", metadata.json is of step " + std::to_string(step) + " (a file of another checkpoint?)";
    if (r->tensors().size() != mine.size())
      return path + ": " + std::to_string(r->tensors().size()) + " tensors in its header, metadata.json lists " +
             std::to_string(mine.size()) + " pieces in it";
    for (const auto& [name, p] : mine) {
      const std::string e = entry_name(*name, p->box);
      const SafeTensorInfo* t = r->find(e);
      const uint64_t n = static_cast<uint64_t>(p->box.numel()) * sizeof(float);
      if (!t || t->dtype != "F32" || t->nbytes() != n || r->data_start() + t->begin != p->offset)
        return path + ": tensor " + *name + " " + box_str(p->box) + ": " +
               (t ? "its header entry disagrees with metadata.json (offset, size or dtype)" : "not in the file's header");
    }
    if (!verify) continue;
    // The whole file in order: its CRC and every piece's.
    std::vector<std::pair<uint64_t, std::pair<const std::string*, const Piece*>>> order;
    for (const auto& x : mine) order.push_back({x.second->offset, x});
    std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    uint32_t crc = 0;
    std::vector<char> buf;
    uint64_t pos = 0;
    auto feed = [&](uint64_t upto) {  // CRC of the bytes [pos, upto) that belong to no piece (the header)
      while (pos < upto) {
        const uint64_t n = std::min<uint64_t>(upto - pos, 1 << 20);
        buf.resize(n);
        r->read_at(pos, buf.data(), n, path);
        crc = crc32c(crc, buf.data(), n);
        pos += n;
      }
    };
    for (const auto& [off, x] : order) {
      feed(off);
      const uint64_t n = static_cast<uint64_t>(x.second->box.numel()) * sizeof(float);
      uint32_t c = 0;  // the piece's CRC, and the file's, 1 MiB at a time
      for (uint64_t done = 0; done < n;) {
        const uint64_t k = std::min<uint64_t>(n - done, 1 << 20);
        buf.resize(k);
        r->read_at(off + done, buf.data(), k, path);
        c = crc32c(c, buf.data(), k);
        crc = crc32c(crc, buf.data(), k);
        done += k;
      }
      if (c != x.second->crc)
        return path + ": tensor " + *x.first + " " + box_str(x.second->box) + " at byte " + std::to_string(off) +
               ": CRC32C " + hex32(c) + ", metadata.json records " + hex32(x.second->crc) +
               " (corrupted data; --train.verify_checkpoint false skips this check)";
      pos = off + n;
    }
    feed(fi.bytes);
    if (crc != fi.crc)
      return path + ": file CRC32C " + hex32(crc) + ", metadata.json records " + hex32(fi.crc) + " (corrupted header?)";
  }
  return "";
}

void ShardedCheckpoint::read_box(const std::string& name, const Box& box, float* dst) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::runtime_error(dir_ + "/metadata.json: no tensor " + name);
  int64_t covered = 0;
  for (const Piece& p : it->second.pieces) {
    Box x;
    if (!intersect(box, p.box, &x)) continue;
    covered += x.numel();
    const int d = fd(p.file);
    const std::string& fname = files_[static_cast<size_t>(p.file)].name;
    auto pread_all = [&](uint64_t off, void* out, uint64_t n) {
      char* o = static_cast<char*>(out);
      while (n > 0) {
        const ssize_t r = ::pread(d, o, n, static_cast<off_t>(off));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
          throw std::runtime_error(dir_ + "/" + fname + ": tensor " + name + " " + box_str(p.box) +
                                   (r == 0 ? ": truncated" : std::string(": read error: ") + std::strerror(errno)));
        o += r;
        n -= static_cast<uint64_t>(r);
        off += static_cast<uint64_t>(r);
      }
    };
    const bool whole_rows = x.cols == p.box.cols && x.cols == box.cols;
    const uint64_t src0 = p.offset + static_cast<uint64_t>((x.row0 - p.box.row0) * p.box.cols + (x.col0 - p.box.col0)) * 4;
    float* out0 = dst + (x.row0 - box.row0) * box.cols + (x.col0 - box.col0);
    if (whole_rows) {
      pread_all(src0, out0, static_cast<uint64_t>(x.numel()) * 4);
      bytes_read_ += x.numel() * 4;
    } else {
      for (int64_t i = 0; i < x.rows; ++i) {
        pread_all(src0 + static_cast<uint64_t>(i * p.box.cols) * 4, out0 + i * box.cols, static_cast<uint64_t>(x.cols) * 4);
        bytes_read_ += x.cols * 4;
      }
    }
  }
  if (covered != box.numel())
    throw std::runtime_error(dir_ + "/metadata.json: tensor " + name + " " + box_str(box) + ": the pieces hold " +
                             std::to_string(covered) + " of its " + std::to_string(box.numel()) + " elements");
}

}  // namespace mt
