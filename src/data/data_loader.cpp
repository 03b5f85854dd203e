#include "data/data_loader.h"

#include <glob.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <stdexcept>

#include "model/rng.h"

namespace mt {

bool is_glob_pattern(const std::string& pattern) {
  return pattern.find_first_of("*?[") != std::string::npos;
}

std::vector<std::string> expand_file_pattern(const std::string& pattern) {
  if (pattern.empty()) throw std::runtime_error("empty data path (give a file or a glob of shards)");
  if (!is_glob_pattern(pattern)) return {pattern};
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && files.empty()))
    throw std::runtime_error("no file matches the pattern '" + pattern + "'");
  if (rc != 0) throw std::runtime_error("cannot expand the pattern '" + pattern + "' (read error)");
  std::sort(files.begin(), files.end());  // byte order, independent of the locale
  return files;
}

TokenDataset::TokenDataset(const std::string& pattern, int64_t vocab_size) : pattern_(pattern) {
  for (const std::string& f : expand_file_pattern(pattern)) {
    shards_.emplace_back(f, vocab_size);
    total_tokens_ += static_cast<int64_t>(shards_.back().size());
    has_masks_ = has_masks_ || shards_.back().has_mask();
  }
}

void check_data_spec(const std::string& spec, const std::string& key, int64_t vocab_size) {
  namespace fs = std::filesystem;
  if (spec.empty() || is_blend_spec(spec) || is_glob_pattern(spec)) return;
  const std::string stem = key == "data.val" ? "val" : "train";
  std::error_code ec;
  if (!fs::exists(spec, ec))
    throw std::invalid_argument(key + ": " + spec +
                                " does not exist; make token shards with `meshtrain prepare --input TEXT --out DIR "
                                "--tokenizer gpt2` and set " + key + " to DIR/" + stem + ".bin");
  if (fs::is_directory(spec, ec))
    throw std::invalid_argument(key + ": " + spec + " is a directory; give a shard file (" + spec + "/" + stem +
                                ".bin) or a quoted glob ('" + spec + "/" + stem + "_*.bin')");
  TokenShardInfo info;
  try {
    info = read_token_shard_info(spec);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(key + ": " + e.what());
  }
  if (vocab_size > 0 && info.vocab_size > vocab_size)
    throw std::invalid_argument(key + ": " + spec + " was prepared with a tokenizer of " +
                                std::to_string(info.vocab_size) + " tokens, more than the model's vocab_size " +
                                std::to_string(vocab_size) + ": set [model] vocab_size = " +
                                std::to_string(info.vocab_size) +
                                " and [data] tokenizer to the one it was prepared with, or prepare it again");
}

double TokenDataset::bytes_per_token() const {
  int64_t bytes = 0;
  for (const TokenShard& s : shards_) {
    if (s.size() > 0 && s.text_bytes() <= 0) return 0.0;
    bytes += s.text_bytes();
  }
  return total_tokens_ > 0 ? static_cast<double>(bytes) / static_cast<double>(total_tokens_) : 0.0;
}

// Both loaders' arguments: a positive B x T and a rank of the data-parallel world.
static void check_batch_shape(int B, int T, int dp_rank, int dp_world) {
  if (B <= 0 || T <= 0)
    throw std::invalid_argument("batch loader: B and T must be positive (got B=" + std::to_string(B) +
                                ", T=" + std::to_string(T) + ")");
  if (dp_world <= 0 || dp_rank < 0 || dp_rank >= dp_world)
    throw std::invalid_argument("batch loader: need 0 <= dp_rank < dp_world (got dp_rank=" +
                                std::to_string(dp_rank) + ", dp_world=" + std::to_string(dp_world) + ")");
}

BatchLoader::BatchLoader(const TokenDataset& dataset, int B, int T, int dp_rank, int dp_world)
    : data_(dataset), B_(B), T_(T), rank_(dp_rank), world_(dp_world) {
  check_batch_shape(B, T, dp_rank, dp_world);
  if (dataset.num_shards() == 0) throw std::runtime_error("batch loader: '" + dataset.pattern() + "' holds no shard");
  const int64_t local = int64_t{B} * T, global = local * dp_world;
  for (size_t i = 0; i < dataset.num_shards(); ++i) {
    const auto& s = dataset.shard(i);
    const auto n = static_cast<int64_t>(s.size());
    if (n < local + 1)
      throw std::runtime_error("token shard " + s.path() + " has " + std::to_string(n) +
                               " tokens, too few for one batch of B=" + std::to_string(B) + " sequences of T=" +
                               std::to_string(T) + " (needs B*T+1 = " + std::to_string(local + 1) +
                               "); the sequence length is longer than the data: lower seq_len or micro_batch, or add data");
    if (n < global + 1)
      throw std::runtime_error("token shard " + s.path() + " has " + std::to_string(n) +
                               " tokens, too few for one global batch of dp_world=" + std::to_string(dp_world) +
                               " ranks x B=" + std::to_string(B) + " x T=" + std::to_string(T) +
                               " (needs dp_world*B*T+1 = " + std::to_string(global + 1) +
                               "); lower seq_len or micro_batch, or add data");
    batches_per_shard_.push_back((n - 1) / global);
  }
}

namespace {
uint64_t mix(uint64_t seed, uint64_t epoch, uint64_t what) {
  return seed ^ (0x9E3779B97F4A7C15ull * (epoch + 1)) ^ (0xC2B2AE3D27D4EB4Full * (what + 1));
}
}  // namespace

void BatchLoader::set_shuffle(uint64_t seed) {
  shuffle_ = true;
  seed_ = seed;
  reset();
}

void BatchLoader::start_epoch() {
  shard_order_.resize(batches_per_shard_.size());
  std::iota(shard_order_.begin(), shard_order_.end(), size_t{0});
  shuffle_with_seed(shard_order_, mix(seed_, static_cast<uint64_t>(epoch_), ~0ull));
}

void BatchLoader::start_shard() {
  const size_t s = current_shard();
  const int64_t samples = (static_cast<int64_t>(data_.shard(s).size()) - 1) / T_;
  sample_order_.resize(static_cast<size_t>(samples));
  std::iota(sample_order_.begin(), sample_order_.end(), int64_t{0});
  shuffle_with_seed(sample_order_, mix(seed_, static_cast<uint64_t>(epoch_), s));
}

void BatchLoader::next(int32_t* inputs, int32_t* targets) {
  const int64_t local = int64_t{B_} * T_;
  const size_t s = current_shard();
  const TokenShard& shard = data_.shard(s);
  if (!shuffle_) {
    // The B*T inputs and, shifted by one, the targets of this rank's contiguous run.
    const size_t at = static_cast<size_t>((batch_ * world_ + rank_) * local);
    shard.copy(at, static_cast<size_t>(local), inputs);
    shard.copy_targets(at + 1, static_cast<size_t>(local), targets);
  } else {
    for (int64_t b = 0; b < B_; ++b) {
      const int64_t j = sample_order_[static_cast<size_t>((batch_ * world_ + rank_) * B_ + b)];
      shard.copy(static_cast<size_t>(j * T_), static_cast<size_t>(T_), inputs + b * T_);
      shard.copy_targets(static_cast<size_t>(j * T_ + 1), static_cast<size_t>(T_), targets + b * T_);
    }
  }
  if (++batch_ >= batches_per_shard_[s]) {
    batch_ = 0;
    if (++shard_ == batches_per_shard_.size()) {
      shard_ = 0;
      ++epoch_;
      if (shuffle_) start_epoch();
    }
    if (shuffle_) start_shard();
  }
}

void BatchLoader::reset() {
  shard_ = 0;
  batch_ = 0;
  epoch_ = 0;
  if (shuffle_) {
    start_epoch();
    start_shard();
  }
}

void BatchLoader::seek(size_t shard_index, int64_t batch_index) {
  if (shard_index >= batches_per_shard_.size() || batch_index < 0 ||
      batch_index >= batches_per_shard_[shuffle_ ? shard_order_[shard_index] : shard_index])
    throw std::out_of_range("batch loader: position (shard " + std::to_string(shard_index) + ", batch " +
                            std::to_string(batch_index) + ") is outside the data '" + data_.pattern() + "'");
  shard_ = shard_index;
  batch_ = batch_index;
  if (shuffle_) start_shard();
}

int64_t BatchLoader::batches_per_epoch() const {
  int64_t n = 0;
  for (int64_t b : batches_per_shard_) n += b;
  return n;
}

}  // namespace mt

// ---- blends ---------------------------------------------------------------------------------------

namespace mt {

namespace {

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> parts;
  size_t at = 0;
  for (;;) {
    const size_t c = s.find(',', at);
    parts.push_back(trim(s.substr(at, c == std::string::npos ? std::string::npos : c - at)));
    if (c == std::string::npos) break;
    at = c + 1;
  }
  return parts;
}

// "0.7:web/*.bin" -> weight text "0.7"; false when the entry has no number before its first ':'.
bool weight_prefix(const std::string& entry, std::string* weight, std::string* pattern) {
  const size_t c = entry.find(':');
  if (c == std::string::npos || c == 0) return false;
  const std::string w = trim(entry.substr(0, c));
  if (w.empty() || w.find_first_not_of("0123456789.eE+-") != std::string::npos) return false;
  if (w.find_first_of("0123456789") == std::string::npos) return false;
  *weight = w;
  *pattern = trim(entry.substr(c + 1));
  return true;
}

}  // namespace

bool is_blend_spec(const std::string& spec) {
  std::string w, p;
  for (const std::string& e : split_commas(spec))
    if (weight_prefix(e, &w, &p)) return true;
  return false;
}

std::vector<BlendEntry> parse_blend(const std::string& spec, const std::string& key) {
  std::vector<BlendEntry> out;
  const std::vector<std::string> parts = split_commas(spec);
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string where = key + ": blend entry " + std::to_string(i + 1) + " ('" + parts[i] + "')";
    std::string w, p;
    if (!weight_prefix(parts[i], &w, &p))
      throw std::invalid_argument(where + " needs the form WEIGHT:PATTERN (e.g. 0.3:data/books/*.bin)");
    double x = 0;
    size_t used = 0;
    try {
      x = std::stod(w, &used);
    } catch (...) {
      used = 0;
    }
    if (used != w.size() || !std::isfinite(x) || x <= 0)
      throw std::invalid_argument(where + ": the weight '" + w + "' must be a positive number");
    if (p.empty()) throw std::invalid_argument(where + ": no file or glob after the weight");
    for (const BlendEntry& e : out)
      if (e.pattern == p) throw std::invalid_argument(where + ": the pattern '" + p + "' is given twice");
    out.push_back({x, p});
  }
  return out;
}

BlendLoader::BlendLoader(const std::string& spec, const std::string& key, int B, int T, int dp_rank, int dp_world,
                         uint64_t seed, bool shuffle, int64_t vocab_size)
    : entries_(parse_blend(spec, key)), B_(B), T_(T), rank_(dp_rank), world_(dp_world), seed_(seed),
      shuffle_(shuffle) {
  check_batch_shape(B, T, dp_rank, dp_world);
  double sum = 0;
  for (const BlendEntry& e : entries_) sum += e.weight;
  double acc = 0;
  for (size_t d = 0; d < entries_.size(); ++d) {
    const std::string where = key + ": blend entry " + std::to_string(d + 1) + " ('" +
                              std::to_string(entries_[d].weight) + ":" + entries_[d].pattern + "')";
    weights_.push_back(entries_[d].weight / sum);
    acc += weights_.back();
    cum_weights_.push_back(d + 1 == entries_.size() ? 1.0 : acc);
    Set s;
    try {
      s.data = std::make_unique<TokenDataset>(entries_[d].pattern, vocab_size);
    } catch (const std::exception& e) {
      throw std::runtime_error(where + ": " + e.what());
    }
    s.cum.push_back(0);
    for (size_t i = 0; i < s.data->num_shards(); ++i) {
      const auto n = static_cast<int64_t>(s.data->shard(i).size());
      s.cum.push_back(s.cum.back() + (n > T ? (n - 1) / T : 0));
    }
    if (s.cum.back() == 0)
      throw std::runtime_error(where + ": no shard holds one sample of seq_len + 1 = " + std::to_string(T + 1) +
                               " tokens (" + std::to_string(s.data->total_tokens()) +
                               " tokens in all); lower seq_len or add data");
    sets_.push_back(std::move(s));
  }
  counts_.assign(entries_.size(), 0);
}

size_t BlendLoader::dataset_of(int64_t g) const {
  const uint64_t h = splitmix64(splitmix64(seed_ ^ 0xB1E5D0C0FFEEull) ^ static_cast<uint64_t>(g));
  const double u = static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
  for (size_t d = 0; d + 1 < cum_weights_.size(); ++d)
    if (u < cum_weights_[d]) return d;
  return cum_weights_.size() - 1;
}

void BlendLoader::read_sample(size_t d, int64_t k, int32_t* x, int32_t* y) {
  Set& s = sets_[d];
  const int64_t n = s.cum.back(), epoch = k / n;
  int64_t idx = k % n;
  if (shuffle_) {
    if (s.perm_epoch != epoch) {
      s.perm.resize(static_cast<size_t>(n));
      std::iota(s.perm.begin(), s.perm.end(), int64_t{0});
      shuffle_with_seed(s.perm, mix(seed_ ^ 0xB1E5Dull, static_cast<uint64_t>(epoch), d));
      s.perm_epoch = epoch;
    }
    idx = s.perm[static_cast<size_t>(idx)];
  }
  const size_t shard = static_cast<size_t>(std::upper_bound(s.cum.begin(), s.cum.end(), idx) - s.cum.begin() - 1);
  const int64_t j = idx - s.cum[shard];
  const TokenShard& t = s.data->shard(shard);
  t.copy(static_cast<size_t>(j * T_), static_cast<size_t>(T_), x);
  t.copy_targets(static_cast<size_t>(j * T_ + 1), static_cast<size_t>(T_), y);
}

void BlendLoader::next(int32_t* inputs, int32_t* targets) {
  // Walk the whole global batch (every rank keeps the same counters); read this rank's rows.
  const int64_t global = int64_t{B_} * world_, mine = int64_t{B_} * rank_;
  for (int64_t i = 0; i < global; ++i) {
    const size_t d = dataset_of(samples_ + i);
    const int64_t k = counts_[d]++;
    if (i >= mine && i < mine + B_) {
      const int64_t row = i - mine;
      read_sample(d, k, inputs + row * T_, targets + row * T_);
    }
  }
  samples_ += global;
}

void BlendLoader::reset() {
  samples_ = 0;
  std::fill(counts_.begin(), counts_.end(), 0);
}

BlendLoader::State BlendLoader::state() const {
  State s;
  s.samples = samples_;
  for (const BlendEntry& e : entries_) s.patterns.push_back(e.pattern);
  s.dataset_samples = counts_;
  return s;
}

bool BlendLoader::set_state(const State& s) {
  if (s.samples < 0 || s.patterns.size() != s.dataset_samples.size())
    throw std::invalid_argument("blend loader: malformed saved state");
  samples_ = s.samples;
  bool same = s.patterns.size() == entries_.size();
  for (size_t d = 0; d < entries_.size(); ++d) {
    counts_[d] = 0;
    for (size_t i = 0; i < s.patterns.size(); ++i)
      if (s.patterns[i] == entries_[d].pattern) {
        if (s.dataset_samples[i] < 0) throw std::invalid_argument("blend loader: malformed saved state");
        counts_[d] = s.dataset_samples[i];
        same &= i == d;
      }
    same &= d < s.patterns.size() && s.patterns[d] == entries_[d].pattern;
  }
  return same;
}

bool BlendLoader::has_masks() const {
  for (const Set& s : sets_)
    if (s.data->has_masks()) return true;
  return false;
}

int64_t BlendLoader::total_tokens() const {
  int64_t n = 0;
  for (const Set& s : sets_) n += s.data->total_tokens();
  return n;
}

}  // namespace mt
