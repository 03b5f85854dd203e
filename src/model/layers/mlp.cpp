#include "model/layers/mlp.h"

#include "kernels/backend.h"

namespace mt {

Mlp::Mlp(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
         int64_t width)
    : cfg_(cfg), compute_(compute), dev_(dev), kt_(kt), tpc_(tpc), width_(width) {}

void Mlp::release() { ws_ = Workspace{}; }

void Mlp::allocate(int64_t N) {
  auto W = MemCategory::Workspace;
  ws_.dfc = Tensor::empty({N, width_}, DType::F32, W);
  ws_.dup = Tensor::empty({N, width_}, DType::F32, W);
  ws_.dact = Tensor::empty({N, width_}, DType::F32, W);
}

void Mlp::forward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* ln2, float* out, int64_t N,
                  float* stage) {
  const int64_t C = cfg_.n_embd, F = width_;
  const bool bf = compute_ == DType::BF16;
  float* act_out = bf ? stage : a.act.f32();
  if (cfg_.arch == Arch::GPT2) {
    ColumnParallelLinear(tpc_, C).forward(a.ln2, ln2, {{a.fc.f32(), P.weight(p.fc_w, p.fc_b, F, false)}});
    kt_->gelu_forward(act_out, a.fc.f32(), N * F);
  } else {
    ColumnParallelLinear(tpc_, C).forward(
        a.ln2, ln2, {{a.fc.f32(), P.weight(p.fc_w, -1, F, false)}, {a.up.f32(), P.weight(p.up_w, -1, F, false)}});
    kt_->swiglu_forward(act_out, a.fc.f32(), a.up.f32(), N * F);
  }
  if (bf) store_compute(kt_, a.act, act_out, N * F);
  RowParallelLinear(tpc_, F, P.weight(p.down_w, p.down_b, C, false)).forward(out, a.act);
}

const float* Mlp::backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dout, float* dnorm,
                           int64_t N) {
  const int64_t C = cfg_.n_embd, F = width_;
  // Split backward: the output gradients W reads go straight into the slot's held buffers.
  float* dfc = (tpc_.defer ? tpc_.defer->lend(ws_.dfc) : ws_.dfc).f32();
  float* dact = ws_.dact.f32();
  RowParallelLinear(tpc_, F, P.weight(p.down_w, p.down_b, C, true)).backward(dact, dout, a.act);
  dev::zero(dev_, dfc, static_cast<size_t>(N * F) * sizeof(float));
  if (cfg_.arch == Arch::GPT2) {
    kt_->gelu_backward(dfc, a.fc.f32(), dact, N * F);
    return ColumnParallelLinear(tpc_, C).backward(a.ln2, {{dfc, P.weight(p.fc_w, p.fc_b, F, true)}}, dnorm);
  }
  float* dup = (tpc_.defer ? tpc_.defer->lend(ws_.dup) : ws_.dup).f32();
  dev::zero(dev_, dup, static_cast<size_t>(N * F) * sizeof(float));
  kt_->swiglu_backward(dfc, dup, dact, a.fc.f32(), a.up.f32(), N * F);
  return ColumnParallelLinear(tpc_, C).backward(
      a.ln2, {{dfc, P.weight(p.fc_w, -1, F, true)}, {dup, P.weight(p.up_w, -1, F, true)}}, dnorm);
}

}  // namespace mt
