#include "train/data_loader.h"

#include <glob.h>

#include <algorithm>
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
  }
}

BatchLoader::BatchLoader(const TokenDataset& dataset, int B, int T, int dp_rank, int dp_world)
    : data_(dataset), B_(B), T_(T), rank_(dp_rank), world_(dp_world) {
  if (B <= 0 || T <= 0)
    throw std::invalid_argument("batch loader: B and T must be positive (got B=" + std::to_string(B) +
                                ", T=" + std::to_string(T) + ")");
  if (dp_world <= 0 || dp_rank < 0 || dp_rank >= dp_world)
    throw std::invalid_argument("batch loader: need 0 <= dp_rank < dp_world (got dp_rank=" +
                                std::to_string(dp_rank) + ", dp_world=" + std::to_string(dp_world) + ")");
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
// Fisher-Yates with the platform-independent generator (std::shuffle's algorithm is not specified).
template <class T>
void permute(std::vector<T>& v, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(rng.next_u64() % i)]);
}
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
  permute(shard_order_, mix(seed_, static_cast<uint64_t>(epoch_), ~0ull));
}

void BatchLoader::start_shard() {
  const size_t s = current_shard();
  const int64_t samples = (static_cast<int64_t>(data_.shard(s).size()) - 1) / T_;
  sample_order_.resize(static_cast<size_t>(samples));
  std::iota(sample_order_.begin(), sample_order_.end(), int64_t{0});
  permute(sample_order_, mix(seed_, static_cast<uint64_t>(epoch_), s));
}

void BatchLoader::next(int32_t* inputs, int32_t* targets) {
  const int64_t local = int64_t{B_} * T_;
  const size_t s = current_shard();
  const TokenShard& shard = data_.shard(s);
  if (!shuffle_) {
    // The B*T inputs and, shifted by one, the targets of this rank's contiguous run.
    const size_t at = static_cast<size_t>((batch_ * world_ + rank_) * local);
    shard.copy(at, static_cast<size_t>(local), inputs);
    shard.copy(at + 1, static_cast<size_t>(local), targets);
  } else {
    for (int64_t b = 0; b < B_; ++b) {
      const int64_t j = sample_order_[static_cast<size_t>((batch_ * world_ + rank_) * B_ + b)];
      shard.copy(static_cast<size_t>(j * T_), static_cast<size_t>(T_), inputs + b * T_);
      shard.copy(static_cast<size_t>(j * T_ + 1), static_cast<size_t>(T_), targets + b * T_);
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
