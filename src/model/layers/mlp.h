// A block's dense MLP, from its normalised input to the down projection:
//   GPT-2  down(gelu(fc(x)))            fc column-parallel, down row-parallel (with biases)
//   Llama  down(silu(gate(x)) * up(x))  gate and up column-parallel, down row-parallel
// One Mlp serves every dense block of a model: it holds the backward workspace they share.
#pragma once
#include <cstdint>

#include "model/layers/block.h"
#include "runtime/tensor.h"

namespace mt {

namespace kernels {
struct KernelTable;
}

class Mlp {
 public:
  // width: this tp rank's hidden width. gelu_epilogue: the bf16 MLP with bf16 pre-activations
  // (ModelOptions::gelu_epilogue; the blocks' `fc`, and Llama's `up`, are then bf16): GPT-2 through
  // the fused GEMM-epilogue ops, Llama through bf16-output GEMMs and the bf16 SwiGLU ops.
  Mlp(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
      int64_t width, bool gelu_epilogue = false);
  // Workspace for N tokens; release() frees it (before a new shape's).
  void allocate(int64_t N);
  void release();

  // out = down(act(ln2)): this rank's residual rows (the caller adds the residual). ln2: the
  // normalised input's rows; stage: fp32 staging of at least [N, width] for bf16 runs.
  void forward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* ln2, float* out, int64_t N,
               float* stage);
  // dout: the gradient of out (this rank's rows). Returns the gradient of ln2 (summed over tp) in
  // dnorm ([N, C] workspace).
  const float* backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dout, float* dnorm,
                        int64_t N);

 private:
  const ModelConfig& cfg_;
  DType compute_;
  Device dev_;
  const kernels::KernelTable* kt_;
  TpContext& tpc_;
  int64_t width_;
  bool fused_;
  struct Workspace {
    Tensor dfc;   // the gradient of fc (GPT-2) or gate (Llama) [N, F] (bf16 when fused_)
    Tensor dup;   // Llama: the gradient of up [N, F] (bf16 when fused_)
    Tensor dact;  // the gradient of the activation [N, F] (fp32; not allocated for GPT-2 when fused_)
  } ws_;
};

}  // namespace mt
