// Unpacked training data (data.packing = false): one document per sample, padded, with
// optional length grouping (data.group_by_length).
//
// Documents. In a token shard a document starts at the shard's first token and at every token equal
// to the document separator (as data.document_masking reads packed rows: `prepare` puts the
// tokenizer's separator before every document after the first). Document i of a shard holds the
// tokens [s_i, s_{i+1}) up to the next separator; as a sample its inputs are those tokens and its
// targets the same shifted by one, so the last target is the next separator (the document's end is
// predicted inside it). The shard's last document ends one token before the shard does (its last
// token is only a target). A document longer than T = model.seq_len is truncated to its first T
// tokens; its length is then T. Loss masks (PATH.mask) apply to the targets as in packed mode.
//
// Batches. Let G = dp_world x accum x B samples be a global batch (a step). An epoch visits the
// documents in an order - their index order, or with data.shuffle a permutation drawn from (seed,
// epoch) - and cuts its first floor(N / G) x G samples into global batches (the rest waits for a
// later epoch's order). With grouping, the order is first cut into megabatches of window x G
// samples; each megabatch is sorted by length (longest first, ties by position) and cut into its
// global batches, whose order within the megabatch is then permuted from (seed, epoch, megabatch):
// a global batch holds similar lengths, and the steps still mix short and long batches.
//
// A global batch is cut into dp_world x accum chunks of B consecutive samples. Without grouping,
// data-parallel rank r's micro-batch m is chunk r x accum + m; with grouping chunk m x dp_world + r'
// where r' = r on even m and dp_world - 1 - r on odd m (the ranks take turns at the longer chunk).
// Either way the ranks read disjoint samples, and one process with accum' = dp_world x accum reads
// every chunk of the same global batch, each chunk as one micro-batch: the same padded micro-batches.
//
// Padding. A micro-batch is B rows of length L = its longest sample rounded up to `multiple` (at most
// T; multiple = 0: L = T). Row b holds its sample, then pad id 0 with target -1 (no loss, not
// trained). The micro-batch is written B x L row-major at the start of the caller's B x T buffers;
// the rest of the buffers is pad (ids 0, targets -1), so a count of trained targets over the whole
// buffer is the micro-batch's.
#pragma once
#include <cstdint>
#include <vector>

#include "data/data_loader.h"

namespace mt {

struct DocumentBatching {
  int B = 1;             // samples per micro-batch
  int T = 1;             // the model's seq_len: documents are truncated to it
  int accum = 1;         // micro-batches per step and rank
  int dp_rank = 0, dp_world = 1;
  int64_t multiple = 16; // a micro-batch's length is rounded up to this (0: always T)
  int32_t separator = -1;  // the token that starts a document (>= 0)
  bool shuffle = false;
  uint64_t seed = 0;
  bool group_by_length = false;
  int64_t window = 50;   // grouping: a megabatch is window global batches
};

class DocumentLoader {
 public:
  // Indexes the documents of every shard of `dataset` (which must outlive the loader). Throws
  // std::invalid_argument for a bad option and std::runtime_error when the data holds fewer
  // documents than one global batch.
  DocumentLoader(const TokenDataset& dataset, const DocumentBatching& opt);

  // This rank's next micro-batch into inputs[B*T] / targets[B*T] (see above); returns its length L.
  // `real_tokens` (optional): the samples' tokens (B x L minus the padding).
  int64_t next(int32_t* inputs, int32_t* targets, int64_t* real_tokens = nullptr);
  // Back to the first micro-batch of the first epoch.
  void reset();

  int64_t num_documents() const { return static_cast<int64_t>(docs_.size()); }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // Length (inputs, after truncation to T) of document d (index order).
  int64_t length(int64_t d) const { return docs_.at(static_cast<size_t>(d)).len; }
  // The documents of rank `rank`'s micro-batch m of step k of `epoch` (inspection and tests).
  std::vector<int64_t> micro_batch(int64_t epoch, int64_t k, int rank, int m) const;
  // The length a micro-batch of these documents is padded to.
  int64_t padded_length(const std::vector<int64_t>& docs) const;

 private:
  struct Doc {
    uint32_t shard;
    int64_t start;
    int64_t len;
  };
  const TokenDataset& data_;
  DocumentBatching o_;
  std::vector<Doc> docs_;
  int64_t steps_per_epoch_ = 0;
  int64_t epoch_ = 0, step_ = 0, m_ = 0;
  std::vector<int64_t> order_;  // this epoch's samples, steps_per_epoch x G
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  int64_t chunk(int rank, int m) const;
};

}  // namespace mt
