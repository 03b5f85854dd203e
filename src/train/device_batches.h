// A training step's inputs and loss on a GPU (train.device = cuda).
//
// Token ids and targets come from the data loader in host memory. Each micro-batch is checked on
// the host (ids inside the vocabulary, targets below it: the messages the CPU path gives), copied
// into a page-locked host buffer and uploaded with an asynchronous copy on the compute stream, so
// the host goes on queueing the step's kernels while the copy runs. The model reads them from the
// device (Transformer::set_device_inputs).
//
// The step's loss stays on the device too: every training forward adds its per-token losses into
// one accumulator (Transformer::set_loss_sink). Where the gradient norm stays on the device too
// (ParallelModel::set_device_norm: one GPU, DDP), the loss sum and the squared norm sit side by side
// in two device doubles and read_step() reads both with one copy after the optimizer step, which
// clips from the device's norm: the host waits once per step. Otherwise end_step() reads the loss
// and the strategy reads the norm: twice.
//
// A pinned buffer is refilled only in the next step's upload(), after end_step() or read_step()
// has waited for the stream, so the copy that read it has finished.
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
  ~DeviceBatches();
  DeviceBatches(const DeviceBatches&) = delete;
  DeviceBatches& operator=(const DeviceBatches&) = delete;

  // Checks micro-batch m's host ids and targets and queues their upload.
  void upload(int64_t m, const int32_t* ids, const int32_t* targets);
  // Device pointers of micro-batch m (valid once upload(m, ...) was called).
  const int32_t* ids(int64_t m) const;
  const int32_t* targets(int64_t m) const;

  // Zeroes the loss accumulator and points the model's training forwards at it.
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
  int32_t* pinned_ = nullptr;  // [mb_][2][tokens_]
  Tensor inputs_;              // the same layout on the device
  Tensor loss_acc_;            // [tokens_] per-token loss sums
  Tensor scalars_;             // two doubles: the step's loss sum, the squared gradient norm
};

}  // namespace mt
