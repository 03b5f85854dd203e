#include "train/data_loader.h"

#include <glob.h>

#include <algorithm>
#include <stdexcept>

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

void BatchLoader::next(int32_t* inputs, int32_t* targets) {
  const int64_t local = int64_t{B_} * T_;
  const uint16_t* src = data_.shard(shard_).data() + (batch_ * world_ + rank_) * local;
  for (int64_t i = 0; i < local; ++i) {
    inputs[i] = src[i];
    targets[i] = src[i + 1];
  }
  if (++batch_ >= batches_per_shard_[shard_]) {
    batch_ = 0;
    shard_ = (shard_ + 1) % batches_per_shard_.size();
  }
}

void BatchLoader::reset() {
  shard_ = 0;
  batch_ = 0;
}

void BatchLoader::seek(size_t shard_index, int64_t batch_index) {
  if (shard_index >= batches_per_shard_.size() || batch_index < 0 || batch_index >= batches_per_shard_[shard_index])
    throw std::out_of_range("batch loader: position (shard " + std::to_string(shard_index) + ", batch " +
                            std::to_string(batch_index) + ") is outside the data '" + data_.pattern() + "'");
  shard_ = shard_index;
  batch_ = batch_index;
}

int64_t BatchLoader::batches_per_epoch() const {
  int64_t n = 0;
  for (int64_t b : batches_per_shard_) n += b;
  return n;
}

}  // namespace mt
