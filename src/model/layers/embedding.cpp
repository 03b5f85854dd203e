#include "model/layers/embedding.h"

#include "kernels/backend.h"

namespace mt {

Embedding::Embedding(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt,
                     TpContext& tpc, int64_t vocab_rows, int64_t vocab_lo)
    : cfg_(cfg), compute_(compute), dev_(dev), kt_(kt), tpc_(tpc), vocab_rows_(vocab_rows), vocab_lo_(vocab_lo) {}

void Embedding::forward(float* x, const int32_t* ids, const void* wte, const float* wpe, TokenShape ts) {
  const int64_t B = ts.B, T = ts.T, C = cfg_.n_embd, R = tpc_.rows(B * T);
  VocabParallelEmbedding(tpc_, C, vocab_lo_, vocab_rows_).forward(x, ids, wte);
  if (!wpe) return;
  if (ts.pos)  // original positions of this cp rank's tokens (and SP: rows r*R ..)
    kt_->position_add_pos(x, wpe, ts.pos, R, ts.pos_per_token ? B * T : T, tpc_.sp ? tpc_.rank * R : 0, C);
  else if (tpc_.sp)  // this rank's rows are tokens r*R .. r*R + R-1 of the flattened [B, T]
    kt_->position_add_rows(x, wpe, R, T, tpc_.rank * R, C);
  else
    kt_->position_add_forward(x, wpe, B, T, C);
}

void Embedding::backward(const float* dx, const int32_t* ids, float* dwte, float* dwpe, const float* extra,
                         bool sparse, TokenShape ts) {
  const int64_t B = ts.B, T = ts.T, N = B * T, C = cfg_.n_embd;
  // Every token's gradient (any may index this rank's vocabulary rows).
  VocabParallelEmbedding embedding(tpc_, C, vocab_lo_, vocab_rows_);
  const float* dall = embedding.grad_rows(dx);
  if (sparse) {
    if (!sparse_rows_.defined() || sparse_rows_.numel() != N * C) {
      sparse_rows_ = Tensor::empty({N, C}, DType::F32, MemCategory::Workspace);
      sparse_ids_ = Tensor::empty({N}, DType::I32, MemCategory::Workspace);
    }
    dev::copy(dev_, sparse_rows_.f32(), dall, static_cast<size_t>(N * C) * sizeof(float));
    dev::copy(dev_, sparse_ids_.raw(), ids, static_cast<size_t>(N) * sizeof(int32_t));
  } else {
    embedding.backward(dwte, dall, ids);
  }
  if (extra) kt_->accumulate(dwte, extra, vocab_rows_ * C);
  if (dwpe && ts.pos && ts.pos_per_token) {
    // One call per run of consecutive positions (a document, or under context parallelism the part
    // of one in a chunk): its positions are distinct, so no two of a call's tokens add into the
    // same table row at once.
    for (int64_t i = 0; i < N;) {
      int64_t j = i + 1;
      while (j < N && j % T != 0 && ts.pos[j] == ts.pos[j - 1] + 1) ++j;
      kt_->position_backward_pos(dwpe, dall + i * C, ts.pos + i, 1, j - i, C);
      i = j;
    }
  } else if (dwpe && ts.pos) {
    kt_->position_backward_pos(dwpe, dall, ts.pos, B, T, C);
  } else if (dwpe) {
    kt_->position_add_backward(dwpe, dall, B, T, C);
  }
}

}  // namespace mt
