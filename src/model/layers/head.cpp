#include "model/layers/head.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "model/unit_hooks.h"

namespace mt {

int64_t HeadActivations::bytes() const {
  int64_t b = 0;
  for (const Tensor* t : {&targets, &in, &in_bf, &mean, &rstd, &logits, &losses, &dx})
    if (t->defined()) b += static_cast<int64_t>(t->nbytes());
  return b;
}

LmHead::LmHead(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
               int64_t vocab_rows, int64_t vocab_lo, int64_t loss_chunk, bool logits_bf16)
    : cfg_(cfg),
      compute_(compute),
      dev_(dev),
      kt_(kt),
      tpc_(tpc),
      vocab_rows_(vocab_rows),
      vocab_lo_(vocab_lo),
      loss_chunk_(loss_chunk),
      logits_bf16_(logits_bf16) {
  if (logits_bf16_ && (compute_ != DType::BF16 || tpc_.tp() || loss_chunk_ > 0))
    throw std::invalid_argument("bf16 logits need bf16 compute, the whole vocabulary on one rank and no chunked head");
}

void LmHead::allocate(HeadActivations& h, int64_t N, int64_t R) const {
  const int64_t C = cfg_.n_embd;
  auto A = MemCategory::Activations;
  h.targets = Tensor::empty({N}, DType::I32, A);
  h.in = Tensor::empty({N, C}, DType::F32, A);
  if (compute_ == DType::BF16) h.in_bf = Tensor::empty({N, C}, DType::BF16, A);
  h.rstd = Tensor::empty({R}, DType::F32, A);
  h.mean = Tensor::empty({R}, DType::F32, A);
  if (loss_chunk_ > 0)  // the logits only exist a chunk at a time (and whole for sampling, on demand)
    h.dx = Tensor::empty({N, C}, DType::F32, A);
  else
    h.logits = Tensor::empty({N, vocab_rows_}, logits_bf16_ ? DType::BF16 : DType::F32, A);
  h.losses = Tensor::empty({N}, DType::F32, A);
}

double LmHead::forward(const HeadWeight& w, HeadActivations& h, const int32_t* targets, int64_t N, bool train,
                       float dloss, const HeadGradReady& ready, const HeadLossIo& io) {
  const int64_t C = cfg_.n_embd, V = cfg_.vocab_size, Vp = vocab_rows_;
  const bool bf = compute_ == DType::BF16;
  h.chunked = loss_chunk_ > 0 && targets;
  if (!h.chunked) {
    if (!h.logits.defined())  // chunked-head model asked for whole logits (sampling)
      h.logits = Tensor::empty({N, Vp}, DType::F32, MemCategory::Activations);
    if (h.logits.dtype() == DType::BF16)
      kt_->linear_forward_bf16_out16(h.logits.bf(), h.in_bf.bf(), w.wb, nullptr, N, C, Vp);
    else if (bf)
      kt_->linear_forward_bf16(h.logits.f32(), h.in_bf.bf(), w.wb, nullptr, N, C, Vp);
    else
      kt_->linear_forward(h.logits.f32(), h.in.f32(), w.wf, nullptr, N, C, Vp);
  }
  if (!targets) return 0.0;
  if (io.device_targets) {
    dev::copy(dev_, h.targets.raw(), targets, static_cast<size_t>(N) * sizeof(int32_t));
  } else {
    for (int64_t i = 0; i < N; ++i)
      if (targets[i] >= V) throw std::out_of_range("target id " + std::to_string(targets[i]) + " is outside the vocabulary");
    dev::copy_from_host(dev_, h.targets.raw(), targets, static_cast<size_t>(N) * sizeof(int32_t));
  }
  // In bf16 the head's backward multiplies the logits' gradient in bf16: with the whole vocabulary
  // here (tp = 1) the loss rounds it as it writes it, saving the fp32 gradient and a cast pass.
  // bf16 logits: the loss writes their bf16 gradient over them whatever the backward's rows.
  const bool l16 = !h.chunked && h.logits.dtype() == DType::BF16;
  h.grad_bf16 = train && (l16 || (bf && !h.chunked && !tpc_.tp() && ready.rows == 0));
  if (h.chunked)
    chunked_forward(w, h, N, train, dloss);
  else if (l16)
    kt_->softmax_cross_entropy_from_bf16(h.logits.bf(), h.losses.f32(), h.targets.i32(), N, V, Vp, train, dloss);
  else if (h.grad_bf16)
    kt_->softmax_cross_entropy_bf16(h.logits.f32(), h.losses.f32(), h.targets.i32(), N, V, Vp, dloss);
  else
    VocabParallelCrossEntropy(tpc_, V, vocab_lo_, Vp).forward(h.logits.f32(), h.targets.i32(), h.losses.f32(), N, train,
                                                              dloss);
  if (io.sink && train) {
    kt_->accumulate(io.sink, h.losses.f32(), N);
    return 0.0;
  }
  return kt_->sum(h.losses.f32(), N) / static_cast<double>(N);
}

// The head of a forward with targets, loss_chunk_ tokens at a time: logits of the chunk, its
// softmax cross-entropy (with train: turned into the logits' gradient in place), then right away
// the chunk's rows of the input's gradient (h.dx) and its contribution to the pending weight
// gradient. The per-token losses go to h.losses.
void LmHead::chunked_forward(const HeadWeight& w, HeadActivations& h, int64_t N, bool train, float dloss) {
  const int64_t C = cfg_.n_embd, V = cfg_.vocab_size, Vp = vocab_rows_;
  const int64_t rows = std::min(loss_chunk_, N);
  const bool bf = compute_ == DType::BF16;
  if (chunk_logits_.numel() < rows * Vp) chunk_logits_ = Tensor::empty({rows, Vp}, DType::F32, MemCategory::Workspace);
  if (train) {
    if (!pending_dw_.defined()) pending_dw_ = Tensor::empty({Vp, C}, DType::F32, MemCategory::Workspace);
    if (!dw_pending_) pending_dw_.zero_();
    dw_pending_ = true;
    h.dx.zero_();
  }
  float* lg = chunk_logits_.f32();
  const int32_t* tg = h.targets.i32();
  const float* hin = h.in.f32();
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t nr = std::min(rows, N - r0);
    if (bf)
      kt_->linear_forward_bf16(lg, h.in_bf.bf() + r0 * C, w.wb, nullptr, nr, C, Vp);
    else
      kt_->linear_forward(lg, hin + r0 * C, w.wf, nullptr, nr, C, Vp);
    // vocab-parallel: this rank's columns, row statistics reduced over the tp ranks
    VocabParallelCrossEntropy(tpc_, V, vocab_lo_, Vp).forward(lg, tg + r0, h.losses.f32() + r0, nr, train, dloss);
    if (!train) continue;
    // With tp these input-gradient rows are this rank's partial sums; the backward reduces them.
    if (bf)
      kt_->linear_backward_bf16(h.dx.f32() + r0 * C, pending_dw_.f32(), nullptr, lg, h.in_bf.bf() + r0 * C, w.wb, nr,
                                C, Vp);
    else
      kt_->linear_backward(h.dx.f32() + r0 * C, pending_dw_.f32(), nullptr, lg, hin + r0 * C, w.wf, nr, C, Vp);
  }
}

const float* LmHead::backward(const HeadWeight& w, HeadActivations& h, int64_t N, float* dnorm,
                              const HeadGradReady& ready) {
  const int64_t C = cfg_.n_embd, Vp = vocab_rows_;
  const bool bf = compute_ == DType::BF16;
  // The input's gradient (with a vocab-parallel head: this rank's partial sums): computed by the
  // forward when the head is chunked, else here.
  float* dhin = h.chunked ? h.dx.f32() : dnorm;
  if (h.chunked) {
    // The weight gradient the forwards accumulated is added while the input gradient's sum over
    // the tp ranks runs (in vocabulary-row chunks, each reported when asked for).
    const int hd = tpc_.start_input_grad_sum(dhin);
    const int64_t rows = ready.rows > 0 ? ready.rows : Vp;
    for (int64_t r0 = 0; r0 < Vp; r0 += rows) {
      const int64_t cv = std::min(rows, Vp - r0);
      if (dw_pending_ && w.grad) kt_->accumulate(w.grad + r0 * C, pending_dw_.f32() + r0 * C, cv * C);
      if (ready.rows > 0) ready.hooks->grad_ready(ready.param, r0, r0 + cv);
    }
    dw_pending_ = false;
    return tpc_.input_grad_sum(dhin, hd);
  }
  if (ready.rows > 0) {  // tp = 1
    backward_by_rows(w, h, N, dhin, ready);
    return dhin;
  }
  const bf16* g16 = static_cast<const bf16*>(h.logits.raw());  // the loss's bf16 gradient (grad_bf16)
  if (h.grad_bf16) {
    dev::zero(dev_, dhin, static_cast<size_t>(N * C) * sizeof(float));
    kt_->linear_backward_bf16_dy(dhin, w.grad, g16, h.in_bf.bf(), w.wb, N, C, Vp);
    return dhin;
  }
  // Column-parallel over the vocabulary; the input was kept with every row.
  Weight cw;
  cw.wf = w.wf;
  cw.wb = w.wb;
  cw.dw = w.grad;
  cw.out = Vp;
  if (tpc_.defer) tpc_.defer->keep(h.logits);  // the logits' gradient stays in the slot until W: not copied
  return ColumnParallelLinear(tpc_, C).backward(bf ? h.in_bf : h.in, {{h.logits.f32(), cw}}, dhin, false);
}

// tp = 1, the weight gradient in vocabulary-row chunks, each chunk's rows reported when complete.
void LmHead::backward_by_rows(const HeadWeight& w, HeadActivations& h, int64_t N, float* dhin,
                              const HeadGradReady& ready) {
  const int64_t C = cfg_.n_embd, Vp = vocab_rows_, rows = ready.rows;
  const bool bf = compute_ == DType::BF16;
  const bf16* g16 = static_cast<const bf16*>(h.logits.raw());  // grad_bf16
  dev::zero(dev_, dhin, static_cast<size_t>(N * C) * sizeof(float));
  if (rows < Vp && chunk_grad_.numel() != N * rows) chunk_grad_ = Tensor::empty({N, rows}, DType::F32, MemCategory::Workspace);
  for (int64_t r0 = 0; r0 < Vp; r0 += rows) {
    const int64_t cv = std::min(rows, Vp - r0);
    const float* dl = static_cast<const float*>(h.logits.raw());  // fp32 unless grad_bf16
    if (h.grad_bf16 && cv == Vp) {
      kt_->linear_backward_bf16_dy(dhin, w.grad, g16, h.in_bf.bf(), w.wb, N, C, Vp);
      ready.hooks->grad_ready(ready.param, r0, r0 + cv);
      continue;
    }
    if (h.grad_bf16) {
      // The forward chose the bf16 gradient before the rows were asked for (a schedule that
      // interleaves micro-batches): the chunk's columns, widened exactly (cast back unchanged).
      for (int64_t n = 0; n < N; ++n) kt_->cast_bf16_to_f32(chunk_grad_.f32() + n * cv, g16 + n * Vp + r0, cv);
      dl = chunk_grad_.f32();
    } else if (cv < Vp) {  // the chunk's columns of the logits' gradient, contiguous
      kt_->copy_columns(chunk_grad_.f32(), dl, N, Vp, r0, cv);
      dl = chunk_grad_.f32();
    }
    float* dw = w.grad ? w.grad + r0 * C : nullptr;  // null: frozen (LoRA)
    if (bf)
      kt_->linear_backward_bf16(dhin, dw, nullptr, dl, h.in_bf.bf(), w.wb + r0 * C, N, C, cv);
    else
      kt_->linear_backward(dhin, dw, nullptr, dl, h.in.f32(), w.wf + r0 * C, N, C, cv);
    ready.hooks->grad_ready(ready.param, r0, r0 + cv);
  }
}

}  // namespace mt
