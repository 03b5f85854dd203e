// A block's causal self-attention, from its normalised input to the output projection:
//   q|k|v    column-parallel projection (this tp rank's heads)
//   RoPE     Llama: rotary positions (the original token indices under context parallelism)
//   attend   dense causal attention, or context-parallel: the other cp ranks' keys and values
//            passed around the ring (or all-gathered), partial results merged by log-sum-exp
//   proj     row-parallel output projection (partial sums reduced over tp)
// One Attention serves every block of a model: it holds the backward and context-parallel
// workspace they share.
#pragma once
#include <cstdint>
#include <vector>

#include "model/context_parallel.h"
#include "model/layers/block.h"
#include "runtime/tensor.h"

namespace mt {

namespace kernels {
struct KernelTable;
}

// The tokens of one micro-batch: B sequences of T (local) tokens, and with context parallelism the
// original positions of the T local tokens (null without).
struct TokenShape {
  int64_t B = 0, T = 0;
  // Host positions: pos[T] shared by the B rows (context parallelism), or with pos_per_token one per
  // token, pos[B*T] (document masking: t - doc_start[t]). Null: 0..T-1.
  const int32_t* pos = nullptr;
  bool pos_per_token = false;
  // Document masking (device, [B*T]): query t of a row sees keys doc_start[t] .. t only; null = causal.
  // Under context parallelism the starts are global positions in the full sequence (the local
  // tokens' documents may begin on another cp rank); doc_start_host is the same on the host.
  const int32_t* doc_start = nullptr;
  const int32_t* doc_start_host = nullptr;
};

class Attention {
 public:
  // heads, kv_heads: this tp rank's query and key/value heads.
  Attention(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
            int64_t heads, int64_t kv_heads, CpComm* cp, bool cp_allgather, bool flash = false);
  // flash: bf16 q, k, v in the bf16 attention ops (ModelOptions::flash_attention); the fp32
  // projection output is then workspace and a.qkv_bf the saved activation.
  // Workspace for N = B*T tokens: the backward's, and context parallelism's key / value blocks;
  // release() frees both (before a new shape's).
  void allocate(int64_t N);
  void allocate_cp(int64_t N);
  void release();

  // out = proj(attend(rope(qkv(ln1)))), this rank's residual rows, fp32 (a.res2, or workspace with a
  // bf16 residual stream; the caller adds the residual). ln1: the normalised input's rows (fp32, or
  // the staging of a.ln1 in bf16 runs).
  void forward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* ln1, TokenShape s, float* out);
  // dres: the gradient of the layer's output (this rank's rows). Returns the gradient of ln1 (the
  // column-parallel layer's input gradient, summed over tp) in dnorm ([N, C] workspace).
  const float* backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dres, float* dnorm,
                        TokenShape s);

 private:
  void rope(float* x, TokenShape s, bool backward);
  void cp_forward(BlockActivations& a, TokenShape s);
  void cp_backward(BlockActivations& a, const float* datty, float* dqkv, TokenShape s);
  void cp_backward_allgather(BlockActivations& a, const float* datty, float* dqkv, TokenShape s);
  // The chunk pair modes of this rank's queries against rank src's keys, and (document masking)
  // the global positions of src's two key chunks; pairs whose keys all lie before every query's
  // document are skipped (mode 0).
  void cp_modes(int src, TokenShape s, int8_t modes[4], int32_t key_start[2]) const;

  const ModelConfig& cfg_;
  DType compute_;
  Device dev_;
  const kernels::KernelTable* kt_;
  TpContext& tpc_;
  int64_t heads_, kv_heads_;
  CpComm* cp_;
  bool cp_allgather_;
  bool flash_;
  std::vector<float> rope_inv_freq_;  // scaled rotary frequencies (Llama 3.1, host); empty = from rope_theta
  struct Workspace {
    Tensor dqkv;   // the q|k|v projection's output gradient [N, QKV]
    Tensor datty;  // the attention output's gradient [N, C]
    Tensor qkv32;  // flash: the projection's fp32 output [N, QKV], rounded into a.qkv_bf
    // Context parallelism, ring: the key / value block held and the one arriving; the gradient of
    // the block held (accumulated along the ring), the next block's arriving and this step's.
    Tensor kv_cur, kv_next, dkv_acc, dkv_in, dkv_step;
    // Context parallelism, all-gather: every rank's blocks, their gradients and this rank's sum.
    Tensor kv_all, dkv_all, dkv_mine;
  } ws_;
};

}  // namespace mt
