// A training step's inputs and loss on a GPU (train.device = cuda).
//
// Token ids and targets come from the data loader in host memory. Each micro-batch is checked on
// the host (ids inside the vocabulary, targets below it: the messages the CPU path gives) and
// copied into a page-locked host buffer. A training step's batches are uploaded one step ahead:
// upload_next() queues them on the device's copy stream while the current step computes, into the
// second of two sets of buffers (pinned and device), and begin_step() makes the compute stream
// wait for them with an event (no host wait) and switches sets. The model reads them from the
// device (Transformer::set_device_inputs). Evaluation uploads with upload() on the compute stream,
// into the set of the step that has just finished.
//
// The step's loss stays on the device too: every training forward adds its per-token losses into
// one accumulator (Transformer::set_loss_sink). Where the gradient norm stays on the device too
// (ParallelModel::set_device_norm: one GPU, DDP or a sharded strategy), the loss sum and the
// squared norm sit side by side in two device doubles and read_step() reads both with one copy
// after the optimizer step, which clips from the device's norm: the host waits once per step. Otherwise end_step() reads the loss
// and the strategy reads the norm: twice.
//
// A set is refilled (upload_next during step k + 1, upload at an evaluation after step k) only
// after end_step() or read_step() of step k has waited for the compute stream: step k's kernels,
// which read its device buffers, have finished, and so has the copy that read its pinned buffer
// (the compute stream waited for it before step k began).
#pragma once
#include <cstdint>
#include <vector>

#include "model/transformer.h"
#include "runtime/tensor.h"

namespace mt {

class DeviceBatches {
 public:
  // Room for `micro_batches` micro-batches of `tokens` ids and targets each, on model's device.
  DeviceBatches(Transformer& model, int64_t micro_batches, int64_t tokens);
  // The device buffers alone (what the constructor allocates on `dev`): a dry run of a GPU job
  // makes them on the meta device, so that its activations count them as the real run's do.
  static std::vector<Tensor> device_buffers(Device dev, int64_t micro_batches, int64_t tokens);
  ~DeviceBatches();
  DeviceBatches(const DeviceBatches&) = delete;
  DeviceBatches& operator=(const DeviceBatches&) = delete;

  // Checks micro-batch m's host ids and targets and queues their upload on the compute stream into
  // the current set (evaluation).
  void upload(int64_t m, const int32_t* ids, const int32_t* targets);
  // Checks micro-batch m's host ids and targets for the next step and queues their upload on the
  // copy stream into the other set, overlapping the work queued for the current step.
  void upload_next(int64_t m, const int32_t* ids, const int32_t* targets);
  // Whether every micro-batch of the next step has been queued by upload_next.
  bool next_ready() const { return next_count_ == mb_; }
  // Device pointers of micro-batch m of the current set (valid once its upload was queued).
  const int32_t* ids(int64_t m) const;
  const int32_t* targets(int64_t m) const;

  // Starts a training step on the batches of upload_next (next_ready() must be true): switches
  // sets and makes the compute stream wait for their uploads; zeroes the loss accumulator and
  // points the model's training forwards at it.
  void begin_step();
  // Detaches the accumulator and returns the sum over the step's micro-batches of each one's mean
  // loss (what the forwards would have returned, summed): one read from the device.
  double end_step();
  // The one-wait form: finish_step() detaches the accumulator and queues its sum into the device
  // slot beside norm_slot(); read_step() then reads both with one copy.
  double* norm_slot();
  void finish_step();
  void read_step(double* loss, double* norm_sq);

 private:
  Transformer& model_;
  Device dev_;
  int64_t mb_, tokens_;
  int32_t* check(int64_t m, int set, const int32_t* ids, const int32_t* targets);  // into the pinned buffer
  int32_t* pinned_ = nullptr;  // [2 sets][mb_][2][tokens_]
  Tensor inputs_;              // the same layout on the device (device_buffers()[0])
  int cur_ = 0;                // the set the current step (and evaluation) reads
  int64_t next_count_ = 0;     // micro-batches queued by upload_next into set 1 - cur_
  Tensor loss_acc_;            // [tokens_] per-token loss sums
  Tensor scalars_;             // two doubles: the step's loss sum, the squared gradient norm
};

}  // namespace mt
