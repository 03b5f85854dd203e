// Data parallelism with full replicas (DDP, strategy NO_SHARD).
//
// The gradient buffer is flat in unit order (embedding, blocks, head). Buckets are contiguous
// ranges of it made of whole units, filled in reverse unit order (the order backward produces
// them); the first bucket is capped small (first_bucket_mb) so communication starts early. A
// bucket's gradients are views of the flat buffer, so the all-reduce runs in place on them with no
// copy. When backward has finished every unit of a bucket (UnitHooks::post_backward), that bucket's
// all-reduce (average over the data-parallel group) starts on the group's communication thread and
// backward continues; finish() waits only for what is still in flight and reports that wait as
// exposed communication.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "model/transformer.h"
#include "runtime/tensor.h"

namespace mt::parallel {

struct Bucket {
  int first_unit = 0, last_unit = 0;  // inclusive unit range
  int64_t offset = 0, numel = 0;      // range of the flat gradient buffer
  int units = 0;                      // units this rank owns in the range
  int pending = 0;                    // of them, not yet finished in this backward
  comm::WorkHandle work;
  // LoRA: only the trainable ranges (the adapters) are reduced, one all-reduce each; the frozen
  // base's gradient is zero everywhere and stays so.
  std::vector<std::pair<int64_t, int64_t>> trainable;  // (offset, numel)
  std::vector<comm::WorkHandle> works;
};

struct DdpStepStats {
  double comm_ms = 0;     // time the all-reduces ran (on the communication thread)
  double exposed_ms = 0;  // time the step waited for them after backward
  int buckets = 0;
};

class DataParallel : public UnitHooks {
 public:
  // sparse_embedding = false: a tied token embedding's gradient is reduced densely with its unit
  // (the lookup's rows are gathered only when every rank looks up the same number of tokens).
  DataParallel(Transformer& model, std::shared_ptr<comm::ProcessGroup> dp, double bucket_mb,
               double first_bucket_mb = 1.0, bool sparse_embedding = true);

  // With sync = false (accumulation micro-batches) backward does not communicate.
  void set_sync(bool sync);
  void post_backward(int unit) override;
  // Tied embedding: the head's dense gradient rows as they are final, and the lookup's rows.
  bool takes_sparse_grad(int param) override;
  void sparse_grad(int param, const int32_t* ids, const float* rows, int64_t n) override;
  int64_t grad_ready_rows(int param) override;
  void grad_ready(int param, int64_t first_row, int64_t end_row) override;
  // Waits for the all-reduces of this step (nothing to do after a no_sync micro-batch). Throws
  // naming the units that produced no gradient when the synchronising backward did not finish
  // every unit this rank owns (instead of hanging like the classic DDP bug).
  DdpStepStats finish();
  // Tied embedding (GPT-2 in one model): the token embedding's gradient is reduced in two parts,
  // the head's dense part as its own bucket right after the head's backward, and the embedding
  // lookup's rows (all-gathered: ids and B*T gradient rows per rank) added after it.
  bool splits_tied_gradient() const { return tied_; }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  comm::ProcessGroup& group() { return *dp_; }

 private:
  void launch(Bucket& b);
  void reset();  // before the next synchronising backward
  bool tied_ = false;
  int64_t tied_offset_ = 0;                     // the token embedding's offset in the gradients
  int64_t tied_rows_ = 0;                       // vocabulary rows per all-reduce of its dense part
  int64_t sparse_n_ = 0;                        // lookup rows per rank (B*T of the last backward)
  std::vector<comm::WorkHandle> tied_works_;    // its all-reduces, one per chunk of vocabulary rows
  Tensor gathered_ids_, gathered_rows_;         // every rank's deferred lookup gradient
  comm::WorkHandle ids_work_, rows_work_;
  Transformer& model_;
  std::shared_ptr<comm::ProcessGroup> dp_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_unit_;
  std::vector<char> unit_done_;
  bool sync_ = true;
};

}  // namespace mt::parallel
