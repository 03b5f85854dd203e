// Training data: a set of token shards, and the batch loader that cuts them into (inputs, targets).
//
// Batching follows llm.c. With W = dp_world data-parallel ranks, global batch k of a shard is the
// contiguous run of W*B*T + 1 tokens starting at k*W*B*T; rank r takes the B*T + 1 tokens at offset
// r*B*T of that run (inputs = the first B*T, targets = the same shifted by one). A shard yields
// floor((tokens - 1) / (W*B*T)) global batches; after the last one the loader moves to the next
// shard, and after the last shard wraps to the first. Hence ranks read disjoint token ranges, and one
// process with B' = W*B reads exactly their union (row r*B + b of its batch is row b of rank r).
//
// With shuffling (data.shuffle) a shard is cut into samples of T + 1 tokens at multiples of T
// (sample j = tokens j*T .. j*T + T; the same rows the contiguous order reads), and every epoch
// visits the shards in a permuted order and each shard's samples in a permuted order: global batch
// k is samples perm[k*W*B .. (k+1)*W*B), of which rank r takes the B at r*B. The permutations
// depend only on (seed, epoch, shard), so every rank draws the same ones, one process with
// B' = W*B still reads exactly the ranks' union, and a resumed run (which replays the position by
// calling next()) continues the same order.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/token_shards.h"

namespace mt {

// True when `pattern` contains a glob character (* ? [).
bool is_glob_pattern(const std::string& pattern);
// The files `pattern` names: the pattern itself when it has no glob character, otherwise the sorted
// matches. Throws std::runtime_error naming the pattern when a glob matches nothing.
std::vector<std::string> expand_file_pattern(const std::string& pattern);

// A data.train / data.val value (`key`) before it is loaded: when it names one file (not a glob,
// not a blend) the file exists and is not a directory, and a shard whose header records a larger
// tokenizer vocabulary than `vocab_size` is refused. Throws std::invalid_argument: one line
// naming the key and the path, and what to do.
void check_data_spec(const std::string& spec, const std::string& key, int64_t vocab_size);

class TokenDataset {
 public:
  // `pattern`: one shard file or a glob of shards (sorted by name). Every shard is validated (header,
  // size, and ids < vocab_size when vocab_size > 0). Throws std::runtime_error naming the pattern
  // (nothing matched) or the file (see TokenShard).
  explicit TokenDataset(const std::string& pattern, int64_t vocab_size = 0);

  const std::string& pattern() const { return pattern_; }
  size_t num_shards() const { return shards_.size(); }
  const TokenShard& shard(size_t i) const { return shards_.at(i); }
  int64_t total_tokens() const { return total_tokens_; }
  // True when some shard has a loss mask (its untrained targets come out as -1).
  bool has_masks() const { return has_masks_; }
  // Bytes of text per token over all shards (bits per byte = nats per token / ln 2 / this), or 0
  // when a shard does not record its text's bytes (see token_shards.h).
  double bytes_per_token() const;

 private:
  std::string pattern_;
  std::vector<TokenShard> shards_;
  int64_t total_tokens_ = 0;
  bool has_masks_ = false;
};

class BatchLoader {
 public:
  // `dataset` must outlive the loader. Throws std::invalid_argument for bad B, T, dp_rank, dp_world
  // and std::runtime_error naming the file when a shard is too short for one global batch
  // (dp_world*B*T + 1 tokens; in particular when T is longer than the data).
  BatchLoader(const TokenDataset& dataset, int B, int T, int dp_rank = 0, int dp_world = 1);
  // Shuffled order (see above), drawn from `seed`. Call before the first next().
  void set_shuffle(uint64_t seed);

  // Fills inputs[B*T] and targets[B*T] (row-major B x T) and advances. A target whose token the
  // shard's loss mask does not train is -1 (see token_shards.h).
  void next(int32_t* inputs, int32_t* targets);
  // Back to the first batch of the first shard.
  void reset();

  // Position, for checkpoint / resume: the shard (its place in this epoch's order) and the global
  // batch index within it that the next call to next() reads. seek() throws std::out_of_range for a
  // position outside the data.
  size_t shard_index() const { return shard_; }
  int64_t batch_index() const { return batch_; }
  void seek(size_t shard_index, int64_t batch_index);

  int B() const { return B_; }
  int T() const { return T_; }
  // Global batches one pass over all shards yields (the same on every rank).
  int64_t batches_per_epoch() const;

 private:
  const TokenDataset& data_;
  int B_, T_, rank_, world_;
  std::vector<int64_t> batches_per_shard_;
  size_t shard_ = 0;
  int64_t batch_ = 0;
  // Shuffling: this epoch's shard order and the current shard's sample order.
  bool shuffle_ = false;
  uint64_t seed_ = 0;
  int64_t epoch_ = 0;
  std::vector<size_t> shard_order_;
  std::vector<int64_t> sample_order_;
  void start_epoch();
  void start_shard();
  size_t current_shard() const { return shuffle_ ? shard_order_[shard_] : shard_; }
};

}  // namespace mt

namespace mt {

// ---- blends: several datasets sampled by weight (data.train = "0.7:web/*.bin,0.3:books/*.bin") ----
//
// A blend string is a comma-separated list of WEIGHT:PATTERN entries (weights positive, relative:
// they are normalised to sum to 1; each pattern a shard file or a glob). A string whose entries carry
// no WEIGHT: prefix is not a blend but one plain file or glob, read by BatchLoader exactly as before.
//
// The blended stream is a sequence of T+1-token samples g = 0, 1, 2, ... Sample g comes from dataset
// d(g), drawn independently with probability weight(d) from a hash of (seed, g), so the mixture
// depends on nothing but the seed and g. Within a dataset the samples it is asked for are taken in
// its own order: its shards' T-token samples (token j*T .. j*T + T of a shard, as the shuffled
// BatchLoader cuts them) one after another, wrapping after the last; with shuffling, in a fresh
// seeded permutation of all of the dataset's samples every time it wraps (an epoch of that dataset).
// Global batch k is samples k*W*B .. (k+1)*W*B - 1, of which data-parallel rank r takes the B at
// r*B: ranks read disjoint samples and one process with B' = W*B reads exactly their union. Every
// rank follows the whole global stream (cheap: one hash per sample), so every rank holds the same
// state: the samples drawn so far in total and from each dataset. That state is what a checkpoint
// stores (BlendLoader::State) and what a resumed run restores, continuing the same batches.
struct BlendEntry {
  double weight = 0;     // as written (relative)
  std::string pattern;   // file or glob
};

// True when `spec` is a blend (some entry starts with a number followed by ':').
bool is_blend_spec(const std::string& spec);
// Parses a blend; errors (std::invalid_argument) start with `key` and name the entry: an entry without
// WEIGHT:, a weight that is not a positive finite number, an empty pattern, a pattern given twice.
std::vector<BlendEntry> parse_blend(const std::string& spec, const std::string& key);

class BlendLoader {
 public:
  struct State {
    int64_t samples = 0;                  // samples of the global stream drawn so far
    std::vector<std::string> patterns;    // per dataset
    std::vector<int64_t> dataset_samples; // samples drawn from each dataset so far
  };
  // Opens every entry's shards (validated against vocab_size as TokenDataset does). Throws
  // std::invalid_argument starting with `key` for a bad blend string, std::runtime_error starting
  // with `key` and naming the entry when a pattern matches no file, a shard is bad, or a dataset
  // holds no sample of T + 1 tokens.
  BlendLoader(const std::string& spec, const std::string& key, int B, int T, int dp_rank, int dp_world,
              uint64_t seed, bool shuffle, int64_t vocab_size = 0);

  void next(int32_t* inputs, int32_t* targets);
  void reset();  // back to sample 0 (every dataset at its first sample)

  State state() const;
  // Restores a state. Datasets are matched by pattern: one absent from `s` starts at its first
  // sample (the blend changed between runs). Returns true when `s` names exactly this blend's
  // patterns in this order, false when the blend changed (the caller reports it).
  bool set_state(const State& s);

  size_t num_datasets() const { return entries_.size(); }
  const std::string& pattern(size_t d) const { return entries_.at(d).pattern; }
  double weight(size_t d) const { return weights_.at(d); }  // normalised
  int64_t dataset_samples(size_t d) const { return counts_.at(d); }
  // Input tokens of dataset d in the global stream so far (samples x T).
  int64_t dataset_tokens(size_t d) const { return counts_.at(d) * T_; }
  int64_t samples_per_epoch(size_t d) const { return sets_.at(d).cum.back(); }
  int64_t total_tokens() const;
  bool has_masks() const;  // some dataset has loss masks
  int B() const { return B_; }
  int T() const { return T_; }
  // The dataset of global sample g (a pure function of seed, g and the weights).
  size_t dataset_of(int64_t g) const;

 private:
  struct Set {
    std::unique_ptr<TokenDataset> data;
    std::vector<int64_t> cum;        // cum[i] = samples in shards [0, i); cum.back() = all
    int64_t perm_epoch = -1;         // epoch whose permutation `perm` holds (shuffle)
    std::vector<int64_t> perm;
  };
  std::vector<BlendEntry> entries_;
  std::vector<double> weights_, cum_weights_;
  std::vector<Set> sets_;
  int B_, T_, rank_, world_;
  uint64_t seed_;
  bool shuffle_;
  int64_t samples_ = 0;
  std::vector<int64_t> counts_;
  void read_sample(size_t d, int64_t k, int32_t* x, int32_t* y);
};

}  // namespace mt
