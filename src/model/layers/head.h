// The LM head's output projection and loss (after the final norm): logits = x W^T over this tp
// rank's vocabulary rows (column-parallel over the vocabulary, W the token embedding when tied),
// the softmax cross-entropy (row statistics reduced over tp) and its backward. Chunked (loss_chunk
// > 0): a forward with targets computes the logits, the loss and - when training - the input and
// weight gradients `loss_chunk` tokens at a time, so the [tokens, vocab] logits are never held.
// bf16 logits (logits_bf16): the GEMM writes the logits in bf16, the loss reads them and, when
// training, writes their bf16 gradient over them in place (whole head, tp = 1, bf16 compute).
#pragma once
#include <cstdint>

#include "model/layers/block.h"
#include "runtime/tensor.h"

namespace mt {

namespace kernels {
struct KernelTable;
}

class UnitHooks;

// What one micro-batch keeps between the head's forward and backward.
struct HeadActivations {
  // in: the final norm's output, every row; logits: fp32, or bf16 for an LmHead with bf16 logits
  Tensor targets, in, in_bf, mean, rstd, logits, losses;
  Tensor dx;               // chunked head: the input's gradient, computed by the forward
  bool chunked = false;    // the last forward used the chunked head
  // The training forward left the logits' gradient in bf16, a dense [N, Vp] matrix over the first
  // half of the logits' storage: bf16 compute, whole head, tp = 1, no chunked head-weight gradient;
  // or, with bf16 logits, over the logits themselves.
  bool grad_bf16 = false;
  int64_t bytes() const;
};

// The head's weight ([Vp/t, C]): fp32 or bf16 values (the compute dtype's) and, in backward, its
// fp32 gradient.
struct HeadWeight {
  const float* wf = nullptr;
  const bf16* wb = nullptr;
  float* grad = nullptr;
};

// Where the weight gradient's rows are reported as they become final (UnitHooks::grad_ready of
// parameter `param`, `rows` at a time; rows = 0: not reported).
struct HeadGradReady {
  UnitHooks* hooks = nullptr;
  int param = -1;
  int64_t rows = 0;
};

// Where the targets are and where the loss goes. device_targets: the targets pointer is already on
// the model's device (checked and uploaded by the caller). sink (training forwards only): the
// per-token losses are added into these N device floats and forward returns 0, so that a step reads
// its loss once (train/device_batches.h).
struct HeadLossIo {
  bool device_targets = false;
  float* sink = nullptr;
};

class LmHead {
 public:
  // vocab_rows, vocab_lo: this tp rank's rows of the (padded) vocabulary and the first of them.
  // logits_bf16: the logits kept in bf16 (needs bf16 compute, tp = 1 and no loss_chunk).
  LmHead(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
         int64_t vocab_rows, int64_t vocab_lo, int64_t loss_chunk, bool logits_bf16 = false);
  bool logits_bf16() const { return logits_bf16_; }
  int64_t loss_chunk() const { return loss_chunk_; }
  // The activations for N tokens (R: this rank's residual rows, which the final norm keeps).
  void allocate(HeadActivations& h, int64_t N, int64_t R) const;

  // h.in (and h.in_bf in bf16 runs) hold the normalised input's N rows. Returns the mean loss over
  // the N tokens when `targets` are given (on the host unless io.device_targets); with train the
  // logits become their gradient scaled by dloss per token. `ready.rows` > 0 rules out the bf16
  // logits' gradient.
  double forward(const HeadWeight& w, HeadActivations& h, const int32_t* targets, int64_t N, bool train, float dloss,
                 const HeadGradReady& ready, const HeadLossIo& io = {});
  // Accumulates the weight gradient into w.grad and returns the gradient of the head's input
  // (summed over tp; dnorm: [N, C] workspace when not chunked).
  const float* backward(const HeadWeight& w, HeadActivations& h, int64_t N, float* dnorm, const HeadGradReady& ready);

 private:
  void chunked_forward(const HeadWeight& w, HeadActivations& h, int64_t N, bool train, float dloss);
  void backward_by_rows(const HeadWeight& w, HeadActivations& h, int64_t N, float* dhin, const HeadGradReady& ready);

  const ModelConfig& cfg_;
  DType compute_;
  Device dev_;
  const kernels::KernelTable* kt_;
  TpContext& tpc_;
  int64_t vocab_rows_, vocab_lo_, loss_chunk_;
  bool logits_bf16_ = false;
  // Chunked head: the logits of one chunk, and the weight gradient forwards have accumulated that
  // no backward has added to the head's gradient yet. Rows: one chunk's columns of the logits'
  // gradient (a weight gradient reported by rows).
  Tensor chunk_logits_, pending_dw_, chunk_grad_;
  bool dw_pending_ = false;
};

}  // namespace mt
