// The mixture-of-experts layer of an MoE block (in place of its dense MLP): a router picks each
// token's top-k routed experts; the chosen rows are grouped expert by expert (with expert
// parallelism, exchanged with the ranks that hold those experts), each expert runs as one GEMM over
// its rows, and the outputs are combined with the router weights; optional shared experts are a
// dense MLP on every token. One MoeLayer serves every MoE block of a model: it holds the
// workspace they share and the routing statistics.
#pragma once
#include <cstdint>
#include <vector>

#include "model/context_parallel.h"
#include "model/expert_comm.h"
#include "model/layers/block.h"
#include "runtime/tensor.h"

namespace mt {

namespace kernels {
struct KernelTable;
}

// What the training forwards routed since the last take_stats(), over this rank's tokens
// (forwards re-run by activation checkpointing are not counted again).
struct MoeStats {
  std::vector<int> layers;                   // the MoE layers this rank runs, in order
  std::vector<std::vector<int64_t>> tokens;  // per MoE layer: token choices per expert
  int64_t dropped = 0;                       // choices dropped by the capacity factor
  double aux_loss = 0, z_loss = 0;           // summed over layers, averaged over micro-batches
  int64_t microbatches = 0;                  // forwards of the first MoE layer counted
};

// The routed experts this rank holds, and the widths of this tp rank's slices.
struct MoeShape {
  int64_t local_experts = 0, first_expert = 0;  // experts [first_expert, first_expert + local_experts)
  int64_t expert_width = 0;                     // one routed expert's hidden width
  int64_t shared_width = 0;                     // the shared experts' hidden width (0: none)
  bool experts_apart = false;                   // expert parallelism: experts in their own buffers
  // Llama's routed experts with bf16 pre-activations (ModelOptions::gelu_epilogue, bf16): h1 and h3
  // written by bf16-output GEMMs, the bf16 SwiGLU ops, their gradients bf16.
  bool bf16_pre = false;
};

class MoeLayer {
 public:
  MoeLayer(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
           MoeShape shape, ExpertComm* ep, CpComm* cp);

  // x: the normalised input of every token of the micro-batch ([N, C], compute dtype: a.ln2, or
  // under sequence parallelism its rows gathered over tp); out: this rank's rows of the output.
  // `dloss`: the loss-gradient scale of this forward; `count`: record the routing statistics (not
  // for a recomputed forward).
  void forward(LayerParams& P, int layer, const BlockParams& p, BlockActivations& a, const Tensor& x, float* out,
               int64_t N, float dloss, bool count);
  // dout_rows: the gradient of this rank's rows of the layer's output; dln2: [N, C] workspace.
  // Returns the gradient of the layer's input, summed over tp (this rank's rows under sequence
  // parallelism, as the column-parallel layer's backward returns it).
  const float* backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dout_rows,
                        float* dln2, int64_t N);

  MoeStats take_stats();
  // An expert's capacity for n tokens' choices, and the routed rows activations are first sized for.
  int64_t capacity(int64_t n) const;
  int64_t rows_hint(int64_t n) const;

 private:
  const float* router_input(const Tensor& x, int64_t n);
  // Forward steps: the dispatch plan and the routed rows in expert order (a.xs), exchanged with
  // the ep ranks; the experts and the combine into `y`; the shared experts added; the statistics.
  void dispatch(BlockActivations& a, const Tensor& x, int64_t N, int64_t* dropped);
  void dispatch_ep(BlockActivations& a, const Tensor& x, const std::vector<int64_t>& kept,
                   const std::vector<int32_t>& order, int64_t N, int64_t cap);
  void experts_forward(LayerParams& P, const BlockParams& p, BlockActivations& a, float* y, int64_t N);
  void shared_forward(LayerParams& P, const BlockParams& p, BlockActivations& a, const Tensor& x, float* y, int64_t N);
  void record(int layer, BlockActivations& a, int64_t N, int64_t dropped);
  void counts_over_cp(BlockActivations& a);
  // Backward steps (reverse order): shared experts, combine, experts, dispatch, router.
  void shared_backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dout, const Tensor& x,
                       float* dln2, int64_t N);
  const float* combine_backward(BlockActivations& a, const float* dout, int64_t N);
  void experts_backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dy);
  void router_backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const Tensor& x, float* dln2,
                       int64_t N);

  const ModelConfig& cfg_;
  DType compute_;
  Device dev_;
  const kernels::KernelTable* kt_;
  TpContext& tpc_;
  MoeShape shape_;
  ExpertComm* ep_;
  CpComm* cp_;
  MoeStats stats_;
  int router_grad_handle_ = -1;  // the input gradient's sum over tp, started by router_backward
  // Workspace shared by the MoE blocks, each grown on first use to the largest size asked for.
  struct Workspace {
    Tensor x_f32;         // the router's input in fp32 (bf16 runs) [N, C]
    Tensor act_f32;       // fp32 staging of an activation stored in bf16 [max(M Fe, N Fs)]
    Tensor probs;         // P_e of the load-balancing loss [E]
    Tensor dy;            // routed rows' output gradient, expert order [M, C]
    Tensor dact, dh1, dh3;  // routed rows' activation and pre-activation gradients [M, Fe]
    Tensor dxs;           // routed rows' input gradient [M, C]
    Tensor dw;            // router weights' gradient [N, k]
    Tensor dlogits;       // router logits' gradient [N, E]
    Tensor shared_dact, shared_dfc, shared_dup;  // the shared experts' gradients [N, Fs]
    Tensor shared_out;    // the shared experts' output [N, C]
    Tensor aux;           // the load-balancing loss's gradient per expert [E]
    Tensor send_tokens;   // ep: each sent row's token (int32) [Ms]
    Tensor x_send, x_recv;  // ep: input rows sent and received (compute dtype)
    Tensor ep_recv;       // ep: rows in received order (outputs, their gradients, input gradients)
    Tensor ep_send;       // ep: rows in sent order (output gradients, input gradients)
  } ws_;
};

}  // namespace mt
