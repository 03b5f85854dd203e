// The token embedding (vocab-parallel: this tp rank's rows of the table) and GPT-2's learned
// position embedding: x = wte[ids] + wpe[position] over this rank's rows of the residual stream
// (positions: the original token indices under context parallelism). Its backward adds the lookup's
// rows into the token table's gradient - or keeps them apart (ids and rows) for a caller that
// reduces them itself - and the positions' into the position table's.
#pragma once
#include <cstdint>

#include "model/layers/attention.h"  // TokenShape
#include "model/layers/block.h"
#include "runtime/tensor.h"

namespace mt {

namespace kernels {
struct KernelTable;
}

class Embedding {
 public:
  // vocab_rows, vocab_lo: this tp rank's rows of the (padded) vocabulary and the first of them.
  Embedding(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
            int64_t vocab_rows, int64_t vocab_lo);

  // wte: the token table in the compute dtype; wpe: the position table (fp32; null without).
  void forward(float* x, const int32_t* ids, const void* wte, const float* wpe, TokenShape ts);
  // dx: the gradient of x (this rank's rows); ids: the forward's (device). Adds into dwte (unless
  // `sparse`: then sparse_ids() / sparse_rows() hold the lookup's N ids and [N, C] gradient rows
  // until the next backward), `extra` (a [Vp/t, C] contribution, or null) into dwte, and the
  // positions' gradient into dwpe (null without).
  void backward(const float* dx, const int32_t* ids, float* dwte, float* dwpe, const float* extra, bool sparse,
                TokenShape ts);
  const int32_t* sparse_ids() const { return sparse_ids_.i32(); }
  const float* sparse_rows() const { return sparse_rows_.f32(); }

 private:
  const ModelConfig& cfg_;
  DType compute_;
  Device dev_;
  const kernels::KernelTable* kt_;
  TpContext& tpc_;
  int64_t vocab_rows_, vocab_lo_;
  Tensor sparse_ids_, sparse_rows_;  // [N] int32, [N, C]: the lookup's gradient kept apart
};

}  // namespace mt
