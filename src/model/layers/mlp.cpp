#include "model/layers/mlp.h"

#include <stdexcept>

#include "kernels/backend.h"

namespace mt {

Mlp::Mlp(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
         int64_t width, bool gelu_epilogue)
    : cfg_(cfg),
      compute_(compute),
      dev_(dev),
      kt_(kt),
      tpc_(tpc),
      width_(width),
      fused_(gelu_epilogue && compute == DType::BF16) {}

void Mlp::release() { ws_ = Workspace{}; }

void Mlp::allocate(int64_t N) {
  auto W = MemCategory::Workspace;
  if (fused_) {  // the GELU input's gradient, in bf16, straight from the down projection's epilogue
    ws_.dfc = Tensor::empty({N, width_}, DType::BF16, W);
    if (cfg_.arch == Arch::GPT2) return;
    // Llama: the activation's fp32 gradient (the down projection's input gradient), then the
    // gate's and up's in bf16 (the projections' output gradients)
    ws_.dup = Tensor::empty({N, width_}, DType::BF16, W);
    ws_.dact = Tensor::empty({N, width_}, DType::F32, W);
    return;
  }
  ws_.dfc = Tensor::empty({N, width_}, DType::F32, W);
  ws_.dup = Tensor::empty({N, width_}, DType::F32, W);
  ws_.dact = Tensor::empty({N, width_}, DType::F32, W);
}

void Mlp::forward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* ln2, float* out, int64_t N,
                  float* stage) {
  const int64_t C = cfg_.n_embd, F = width_;
  const bool bf = compute_ == DType::BF16;
  if (fused_ && cfg_.arch == Arch::Llama) {  // gate and up kept in bf16 (bf16 GEMM outputs), act = silu(gate) up
    const Weight wg = P.weight(p.fc_w, -1, F, false), wu = P.weight(p.up_w, -1, F, false);
    if (wg.nlora > 0 || wu.nlora > 0) throw std::logic_error("the bf16 SwiGLU MLP takes no LoRA adapters");
    kt_->linear_forward_bf16_out16(a.fc.bf(), a.ln2.bf(), wg.wb, nullptr, N, C, F);
    kt_->linear_forward_bf16_out16(a.up.bf(), a.ln2.bf(), wu.wb, nullptr, N, C, F);
    kt_->swiglu_forward_bf16(a.act.bf(), a.fc.bf(), a.up.bf(), N * F);
    RowParallelLinear(tpc_, F, P.weight(p.down_w, p.down_b, C, false)).forward(out, a.act);
    return;
  }
  if (fused_) {  // act = gelu(fc), fc = ln2 W^T + b kept in bf16: one GEMM with the GELU_AUX epilogue
    const Weight w = P.weight(p.fc_w, p.fc_b, F, false);
    if (w.nlora > 0) throw std::logic_error("the fused GELU epilogue takes no LoRA adapters");
    kt_->linear_gelu_forward_bf16(a.act.bf(), a.fc.bf(), a.ln2.bf(), w.wb, w.b, N, C, F);
    RowParallelLinear(tpc_, F, P.weight(p.down_w, p.down_b, C, false)).forward(out, a.act);
    return;
  }
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
  if (fused_ && cfg_.arch == Arch::Llama) {
    // The down projection's backward (its input gradient fp32), SwiGLU's backward from the bf16 gate
    // and up into their bf16 output gradients, then the gate and up projections' backward from those.
    const Weight wg = P.weight(p.fc_w, -1, F, true), wu = P.weight(p.up_w, -1, F, true);
    if (wg.nlora > 0 || wu.nlora > 0) throw std::logic_error("the bf16 SwiGLU MLP takes no LoRA adapters");
    float* dact = ws_.dact.f32();  // overwritten by the down projection's backward
    RowParallelLinear(tpc_, F, P.weight(p.down_w, p.down_b, C, true)).backward(dact, dout, a.act);
    bf16 *dg = ws_.dfc.bf(), *du = ws_.dup.bf();
    kt_->swiglu_backward_bf16(dg, du, dact, a.fc.bf(), a.up.bf(), N * F);
    dev::zero(dev_, dnorm, static_cast<size_t>(N * C) * sizeof(float));
    kt_->linear_backward_bf16_dy(dnorm, wg.dw, dg, a.ln2.bf(), wg.wb, N, C, F);
    kt_->linear_backward_bf16_dy(dnorm, wu.dw, du, a.ln2.bf(), wu.wb, N, C, F);
    return dnorm;
  }
  if (fused_) {
    // The down projection's weight and bias gradients, and the GELU input's gradient from its
    // input-gradient GEMM (DGELU epilogue, bf16); then fc's backward from that bf16 gradient, its
    // bias gradient in the weight-gradient GEMM (BGRADB).
    const Weight wd = P.weight(p.down_w, p.down_b, C, true), wf = P.weight(p.fc_w, p.fc_b, F, true);
    if (wd.nlora > 0 || wf.nlora > 0) throw std::logic_error("the fused GELU epilogue takes no LoRA adapters");
    bf16* dpre = ws_.dfc.bf();
    kt_->linear_backward_dgelu_bf16(dpre, wd.dw, wd.db, dout, a.act.bf(), wd.wb, a.fc.bf(), N, F, C);
    dev::zero(dev_, dnorm, static_cast<size_t>(N * C) * sizeof(float));
    kt_->linear_backward_bf16_dy_bias(dnorm, wf.dw, wf.db, dpre, a.ln2.bf(), wf.wb, N, C, F);
    return dnorm;
  }
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
