// The decoder-only transformer (GPT-2 or Llama style) as an ordered list of units:
// unit 0 = token (and position) embedding, units 1..L = blocks, unit L+1 = final norm + LM head.
//
// Each unit has an explicit forward and backward that save exactly the activations they need, and
// owns a contiguous range of the flat parameter and gradient buffers. Parallel strategies hook in
// around units (UnitHooks) and may redirect where a unit reads its weights from (set_unit_weights),
// which is how sharded data parallel substitutes gathered parameters.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/expert_comm.h"
#include "model/context_parallel.h"
#include "model/config/model_config.h"
#include "model/layers/block.h"
#include "model/layers/attention.h"
#include "model/layers/embedding.h"
#include "model/layers/head.h"
#include "model/layers/mlp.h"
#include "model/layers/moe.h"
#include "parallel/layout/parallel_config.h"  // Recompute
#include "model/parameters.h"
#include "model/tp_layers.h"
#include "model/unit_hooks.h"
#include "runtime/tensor.h"

namespace mt {

namespace kernels {
struct KernelTable;
}

// Which flat buffers the model allocates itself. Sharded strategies allocate less and point units
// at their own buffers instead (set_unit_weights / set_unit_grads). A layout-only model (parameter
// names, shapes and offsets, no buffers) is {.weights = false, .master = false, .grads = false}.
struct ModelStorage {
  bool weights = true;   // full weights in the compute dtype (fp32, or the bf16 compute copy)
  bool master = true;    // bf16 mode only: full fp32 master weights (weights())
  bool grads = true;     // full fp32 gradients
  int64_t unit_align = 1;  // each unit's range is padded to a multiple of this (for even shards)
  // LoRA: the gradients and (bf16 mode) the fp32 master weights hold only the trainable parameters
  // (the state layout, state_range()); the frozen base exists only in the compute dtype. Without
  // LoRA (or with this off) the state layout is the flat layout.
  bool compact_state = false;
};

// Everything a model is built with besides its architecture: it is complete after construction.
struct ModelOptions {
  // F32, or BF16 (bf16 weights and matmul inputs, fp32 accumulation, fp32 master weights).
  DType compute = DType::F32;
  Recompute recompute = Recompute::None;
  ModelStorage storage{};
  // Tensor parallelism (null: tp = 1): the model holds this rank's Megatron shard of every split
  // parameter: heads, MLP hidden and vocabulary divided by t (cfg.padded_vocab a multiple of t).
  TpComm* tp = nullptr;
  // Sequence parallelism (Megatron, with tp > 1): between the tensor-parallel regions (norms,
  // residual adds, the pipeline's stage boundaries) each tp rank holds only its 1/t of the B*T
  // rows; all-gathers before the column-parallel matmuls and reduce-scatters after the row-parallel
  // ones replace the all-reduces. Needs B*T divisible by t.
  bool sequence_parallel = false;
  // The column-parallel layers' (and the head's) input-gradient reductions run while the weight
  // gradients are computed (off: each one completes first).
  bool tp_overlap = true;
  // Chunked LM head and loss (0 = off): a forward with targets computes the logits, the loss and -
  // when training - the head's input and weight gradients `loss_chunk` tokens at a time, so the
  // [tokens, vocab] logits are never held: the head keeps its input gradient per micro-batch
  // ([tokens, width]) and one pending weight gradient ([vocab, width], shared, added to the real
  // gradient by the head's next backward). Forwards without targets (sampling) still produce the
  // whole logits. With tensor parallelism each chunk's row statistics are reduced over the tp ranks
  // (two small all-reduces per chunk) and the input gradient is reduced by the backward.
  int64_t loss_chunk = 0;
  // Attention on bf16 q, k and v (bf16 compute only): the q|k|v projection's output (after RoPE)
  // is rounded to bf16 and kept for the backward in place of the fp32 one, and attended by
  // attention_forward_bf16 / attention_backward_bf16 (on CUDA the flash-attention kernels; the
  // output is kept in bf16 only, the lse in fp32, no T x T buffer). Not with context parallelism.
  bool flash_attention = false;
  // The dense MLP in bf16 with its pre-activations kept in bf16 (model.mlp_kernel = fused). GPT-2:
  // the fused GEMM-epilogue ops (linear_gelu_forward_bf16, linear_backward_dgelu_bf16,
  // linear_backward_bf16_dy_bias): the GELU's input written by the up projection's epilogue, its
  // gradient out of the down projection's input-gradient GEMM in bf16. Llama: gate and up written
  // by bf16-output GEMMs (linear_forward_bf16_out16), SwiGLU on them (swiglu_forward_bf16) and its
  // backward into bf16 gradients (swiglu_backward_bf16, linear_backward_bf16_dy); a Llama MoE layer's
  // routed experts likewise (MoeShape::bf16_pre). bf16 compute, no tensor parallelism, no split
  // backward, no LoRA adapters on the MLP.
  bool gelu_epilogue = false;
  // The residual stream in bf16 (model.residual_dtype): every unit's output (the stream between
  // blocks) and the residual after attention (res2) are kept in bf16, each add rounding once
  // (residual_add_bf16, the norms' fused add), and the norms read the bf16 values; gradients stay
  // fp32. bf16 compute, one model-parallel rank (no tensor, sequence, pipeline or context
  // parallelism, no split backward).
  bool residual_bf16 = false;
  // The LM head's logits in bf16 (model.logits_dtype): the head GEMM writes them in bf16, the loss
  // reads them in fp32 arithmetic and, when training, writes their bf16 gradient over them in place
  // (softmax_cross_entropy_from_bf16). bf16 compute, no tensor parallelism, no chunked head.
  bool logits_bf16 = false;
  // Context parallelism (see model/context_parallel.h; null or size 1: off): every forward's B x T
  // tokens are this cp rank's T = seq / cp tokens of each sequence (chunks rank and 2 cp - 1 -
  // rank); positions follow the original indices and attention runs over every cp rank's keys and
  // values - passed around the ring, or all-gathered (cp_allgather).
  CpComm* cp = nullptr;
  bool cp_allgather = false;
  // Expert parallelism (MoE, ep > 1): this rank holds routed experts [ep_rank * E / ep,
  // (ep_rank + 1) * E / ep) of every MoE layer (with tp, its tp slice of each) and exchanges tokens
  // with the other ep ranks (those of its tp rank) through `ep_comm`.
  int ep = 1, ep_rank = 0;
  ExpertComm* ep_comm = nullptr;
  // Pipeline parallelism: one flag per unit (empty = all). Units the model does not own hold no
  // parameters (numel 0) and are never run. A part that owns the head of a tied-embedding model
  // but not the embedding keeps a replica of the token embedding outside the flat buffers (see
  // tied_replica()).
  std::vector<char> owned_units{};
  // The pipeline schedule splits the backward (zb1p, zbv: weight gradients run after later
  // micro-batches' backwards): a tied embedding's gradient is then never handed to the hooks in
  // parts (can_hand_sparse_grad is false); it is reduced with its unit.
  bool split_backward = false;
};

class Transformer final : private LayerParams {
 public:
  Transformer(const ModelConfig& cfg, ModelOptions options);
  // A whole model in one process (no parallelism).
  explicit Transformer(const ModelConfig& cfg, DType compute = DType::F32, Recompute recompute = Recompute::None);
  ~Transformer();
  Transformer(const Transformer&) = delete;  // its layers refer to its configuration and tp context
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }
  DType compute_dtype() const { return compute_; }
  // The device the model's tensors live on (the current device when it was built) and its kernels.
  Device device() const { return dev_; }
  const kernels::KernelTable& kernels() const { return *kt_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  const ParamInfo& param(const std::string& name) const;
  int num_units() const { return static_cast<int>(units_.size()); }
  const UnitRange& unit(int u) const { return units_[u]; }
  bool owns_unit(int u) const { return owned_[u] != 0; }
  int64_t num_params() const { return total_; }
  // Elements of a full flat buffer: parameters plus per-unit padding (always zero).
  int64_t flat_size() const { return flat_size_; }

  // The state layout: where gradients (and in bf16 mode the fp32 master weights) live. Unit u's
  // state is the flat range [begin, begin + numel) stored at `pos` of the state buffers. Without a
  // compact state (ModelStorage::compact_state with LoRA) it is the whole unit at its flat offset;
  // with one, only the unit's trainable parameters (a contiguous run; numel 0 when all are frozen),
  // units packed one after the other.
  // `run`: the trainable elements from `begin` (numel = run rounded up to unit_align, the rest
  // padding that no parameter maps to).
  struct StateRange {
    int64_t begin = 0, numel = 0, pos = 0, run = 0;
  };
  const StateRange& state_range(int u) const { return state_[u]; }
  int64_t state_size() const { return state_size_; }
  bool compact_state() const { return compact_; }
  // Where a trainable parameter's first element lies in the state buffers.
  int64_t state_offset(const ParamInfo& p) const {
    return state_[p.unit].pos + (p.offset - state_[p.unit].begin);
  }

  // fp32 weights and gradients; undefined when not allocated. fp32 mode: weights() are the full
  // flat weights (category Params). bf16 mode: weights() are the fp32 master weights in the state
  // layout (category Optimizer; the bf16 compute_weights() are what Params holds). grads() are in
  // the state layout (state_size() elements).
  Tensor& weights() { return weights_; }
  Tensor& grads() { return grads_; }
  Tensor& compute_weights() { return compute_ == DType::F32 ? weights_ : weights_bf16_; }
  // Unit u's range of compute_weights() (fp32 or bf16 elements).
  const void* unit_compute_weights(int u) {
    Tensor& w = compute_weights();
    const int64_t off = units_[u].offset;
    return compute_ == DType::F32 ? static_cast<const void*>(w.f32() + off) : static_cast<const void*>(w.bf() + off);
  }
  void zero_grads();
  // GPT-2 initialisation: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), norms 1, biases 0.
  void init_weights(uint64_t seed);
  // The same values written into any full fp32 flat buffer (flat_size() elements).
  void init_weights_into(uint64_t seed, float* flat) const;
  // LoRA: unit u's adapters as init_weights_into initialises them, written into the unit's range
  // `unit_w` (its first element); nothing else there is touched.
  void init_lora_unit(uint64_t seed, int u, float* unit_w) const;
  // bf16 mode: refresh the bf16 copy from the fp32 master weights (after every optimizer step).
  void sync_compute_weights();

  // Redirect unit u's weights (fp32 pointer in fp32 mode, bf16 pointer in bf16 mode) and/or
  // gradients; nullptr restores the flat buffers.
  void set_unit_weights(int u, const void* w);
  void set_unit_grads(int u, float* g);
  void set_hooks(UnitHooks* h) { hooks_ = h; }
  // Built for a split backward (ModelOptions::split_backward: zero-bubble pipeline schedules).
  bool split_backward() const { return split_backward_; }
  // The gradient scale per routed token of the MoE routers' auxiliary losses (load balancing and
  // z-loss) in the forwards that follow. Those losses cover every routed token, trained or not, so
  // a loss-mask weight that rescales the cross-entropy's dloss_scale must not rescale them; unset,
  // they take the forward's dloss_scale.
  void set_router_loss_scale(float s) { router_dloss_ = s; }

  // ---- expert parallelism (ModelOptions::ep > 1) ----
  // The local routed experts then live outside the flat buffers, in expert buffers of their own
  // (their gradients are reduced over other ranks than the rest: parallel/expert_parallel.h):
  // expert_params() are their ranges there (names as in the unsplit model, e.g.
  // model.layers.0.block_sparse_moe.experts.5.w1.weight), unit = the block they belong to.
  bool experts_apart() const { return ep_ > 1; }
  int ep_size() const { return ep_; }
  int ep_rank() const { return ep_rank_; }
  const std::vector<ParamInfo>& expert_params() const { return expert_params_; }
  int64_t expert_size() const { return expert_size_; }
  Tensor& expert_weights() { return ew_; }         // fp32 (master in bf16 mode)
  Tensor& expert_grads() { return eg_; }           // fp32
  Tensor& expert_compute_weights() { return compute_ == DType::F32 ? ew_ : ewb_; }

  // One micro-batch of B sequences of T tokens (T <= seq_len). With targets, returns the mean
  // cross-entropy over the B*T positions; with train=true it also keeps what backward needs and
  // turns the logits into their gradient scaled by dloss_scale per token (typically
  // 1 / (tokens in the global batch)).
  double forward(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T, bool train,
                float dloss_scale = 0.0f);
  // Accumulates parameter gradients of the last training forward into grads().
  void backward();
  // Logits of the last forward ([B*T, padded_vocab]); valid after a forward without train.
  const float* logits() const;
  // n values of row `row` of the last forward's logits (this rank's columns) into host memory as
  // fp32, widened when the logits are bf16.
  void logits_row_to_host(int64_t row, int64_t n, float* host) const;

  // ---- pipeline stages ----
  // Activation slots: each holds one micro-batch's saved activations, so several micro-batches can
  // be in flight between their forward and backward (slot 0 is the default). Selecting a slot
  // makes it current for forward_units / backward_units; slots are created on first use and keep
  // their buffers for reuse.
  void select_slot(int slot);
  // LoRA dropout (lora_dropout > 0): the training step's first micro-batch index (micro-batches
  // consumed before it, the same on every rank) and this rank's data-parallel rank, set before
  // the step's forwards. The mask of a token depends on the run seed, that micro-batch index, its
  // global row (dp_rank * B + row, one process with the whole global batch has the same rows), its
  // position and the adapter: every layout and a recompute draw the same mask.
  void set_lora_dropout_step(uint64_t seed, int64_t first_micro, int64_t dp_rank);
  int num_slots() const { return static_cast<int>(slots_.size()); }
  // Runs units first..last of one micro-batch on the current slot. The first unit reads `ids` when
  // it is the embedding, else `input` ([B*T, C], the previous unit's output). With the head as last
  // unit and targets it returns the mean loss (and with train turns the logits into their
  // gradient); otherwise 0 and the output is unit_output(last).
  double forward_units(int first, int last, const int32_t* ids, const int32_t* targets, const float* input, int64_t B,
                       int64_t T, bool train, float dloss_scale = 0.0f);
  const float* unit_output(int u) const;
  // Backward of the current slot's units last..first. `dout` is the gradient of unit last's
  // output (null when last is the head). Afterwards input_grad() holds the gradient of unit first's
  // input (when first > 0) until the next backward. `tied_grad` (a tied model cut by a pipeline,
  // the embedding's part): the head's contribution to the token embedding's gradient ([Vp/t, C]
  // fp32), added by this backward's embedding unit.
  //
  // Split backward (zero-bubble schedules, `split`): the units compute only their input gradients
  // (and the norms' parameter gradients); each unit's weight gradients are queued on the slot with
  // what they read - the slot's own saved inputs by reference, copies of the rest in the slot's
  // reused buffers (tp_layers.h DeferredGrads; the embedding's lookup gradient whole) - and
  // the hooks' post_backward is not called. backward_weights(first, last) on the same slot then
  // computes them - unit by unit, last to first, each followed by its post_backward, so the
  // data-parallel hooks fire when a unit's weight gradients are complete - with the same kernels,
  // giving the same gradients as the unsplit backward. The head's bf16 logit-gradient and chunked
  // paths and every norm compute their weight gradients in the backward itself. `around`, when
  // set, is called with (u, false) before unit u's weight gradients and with (u, true) after them
  // (after its post_backward): the pipeline waits for and sends a tied embedding's gradient there.
  void backward_units(int first, int last, const float* dout, const float* tied_grad = nullptr, bool split = false);
  void backward_weights(int first, int last, const std::function<void(int, bool)>& around = {});
  // Bytes the current slot's queued weight-gradient work holds.
  int64_t deferred_bytes() const;
  const float* input_grad() const;
  // Tied embeddings cut by a pipeline: the head's copy of the token embedding (this tp rank's rows,
  // compute dtype, [Vp/t, C]) and the fp32 gradient the head accumulates into it over a step.
  bool has_tied_replica() const { return tied_w_.defined(); }
  Tensor& tied_replica() { return tied_w_; }
  Tensor& tied_replica_grad() { return tied_g_; }
  // Fills the replica from a full fp32 buffer laid out like `full_layout` (unsplit model); unit 0's
  // range alone is enough (the token embedding is the first parameter of unit 0, at offset 0).
  void load_tied_replica(const Transformer& full_layout, const float* full);
  // Data parallelism with a tied embedding in one model (tp = 1): the token embedding's gradient
  // has a dense part (the head's) complete right after the head's backward and the lookup's rows,
  // which the hooks may take over (UnitHooks::takes_sparse_grad) to reduce apart.
  bool can_hand_sparse_grad() const;

  // Mixture of experts: what the training forwards routed since the last take_moe_stats(), over
  // this rank's tokens (forwards re-run by activation checkpointing are not counted again).
  using MoeStats = mt::MoeStats;
  MoeStats take_moe_stats();

  // Bytes of activations currently held for backward (for reporting).
  int64_t activation_bytes() const;
  // Bytes activation checkpointing saves at the current shape: the blocks it recomputes would
  // otherwise each hold a full set (it keeps one shared scratch set instead).
  int64_t activation_bytes_saved() const;

  int tp_size() const { return tpc_.size; }
  int tp_rank() const { return tpc_.rank; }
  int cp_size() const { return cp_ ? cp_->size() : 1; }
  // On a GPU (train/device_batches.h): the ids and targets forwards receive are already on this
  // model's device, checked and uploaded by the caller; and, with a loss sink (N = B*T floats on
  // the device, or nullptr for none), training forwards add their per-token losses into it and
  // return 0 instead of reading the loss back, so a step waits for the device once.
  void set_device_inputs(bool on) { device_inputs_ = on; }
  // Document masking (packed sequences): with separator >= 0 every input token equal to it starts a
  // new document (so does every row's first token); attention never crosses a document start and
  // positions (learned or rotary) restart at 0 per document. -1 (the default): plain causal.
  // Refused under context parallelism and on pipeline stages without the embedding (throws).
  void set_document_masking(int32_t separator);
  int32_t document_separator() const { return doc_sep_; }
  // doc_start[b*T + t] = the index within row b where token t's document begins.
  static void document_starts(const int32_t* ids, int64_t B, int64_t T, int32_t separator, int32_t* doc_start);
  void set_loss_sink(float* acc) { loss_sink_ = acc; }
  int64_t loss_chunk() const { return head_->loss_chunk(); }
  bool sequence_parallel() const { return tpc_.sp; }
  // Rows of the residual stream this rank holds for N = B*T tokens (N, or N/t with sequence parallelism).
  int64_t residual_rows(int64_t N) const { return tpc_.rows(N); }
  // Tensor parallelism, one unit at a time: this rank's part of unit u's parameters, taken from
  // the unit's values laid out like `full_layout` (an unsplit model of the same config), and the
  // inverse from every tp rank's part (rank order); also maps between two unsplit layouts
  // (padding). `full` points at unit u's first element in `full_layout`, `local` / `locals[r]` at
  // unit u's first element in this (or tp rank r's) layout.
  void shard_unit_from_full(const Transformer& full_layout, int u, const float* full, float* local) const;
  void assemble_unit_full(const Transformer& full_layout, int u, const std::vector<const float*>& locals,
                          float* full) const;
  // The same for one parameter: `lp` one of this model's parameters (params() or, with experts
  // apart, expert_params()), `fp` the same parameter in an unsplit layout; `full` / `locals[r]` /
  // `local` point at the parameter's first element.
  void shard_param_from_full(const ParamInfo& lp, const ParamInfo& fp, const float* full, float* local) const;
  void assemble_param_full(const ParamInfo& lp, const ParamInfo& fp, const std::vector<const float*>& locals,
                           float* full) const;
  // Where this rank's part of parameter `local` (one of params()) lies in the unsplit parameter,
  // both viewed as matrices of [shape[0], numel / shape[0]]: runs of local rows
  // [local_row, local_row + rows) are the full rows [full_row, full_row + rows), all starting at
  // column *col0 (sharded checkpoints describe what a rank holds this way).
  struct TpRows {
    int64_t local_row = 0, rows = 0, full_row = 0;
  };
  std::vector<TpRows> tp_row_runs(const ParamInfo& local, int64_t* col0) const;

 private:
  struct UnitParams;
  struct Slot;
  void build_params();
  void add_param(const std::string& name, std::vector<int64_t> shape, bool decay, bool hf_transposed, TpSplit split,
                 int unit, bool apart, int64_t* pos);
  void add_lora_params(int64_t layer, int unit, int64_t* pos);
  void init_lora_into(uint64_t seed, float* flat) const;
  void attach_lora(int w, bool grads, Weight* r);
  void ensure_buffers(int64_t B, int64_t T, int first, int last);
  Tensor& out_buf(int64_t l);
  // x: the block's input (block_out[layer], fp32 or bf16 by residual_bf16_); out: where its output
  // goes (block_out[layer + 1], or fp32 scratch whose contents are discarded: a recompute).
  void block_forward(int layer, const Tensor& x, BlockActivations& a, void* out, bool discard = false);
  void block_backward(int layer, const Tensor& x, BlockActivations& a, float* dx);
  // The bf16 stream's end-of-block add, left pending by block_forward: out = bf16(res2 + y), y the
  // MLP's fp32 output in dnorm_. The next norm (the next block's first, or the final one) does it
  // fused with itself; flush_residual() does it alone (a forward that stops before them).
  void flush_residual();
  BlockParams block_params_of(int layer) const;
  // The current micro-batch's shape (and its tokens' positions under context parallelism).
  // With document masking: per-token positions and the device doc_start of the current slot.
  TokenShape tokens() const;
  bool recomputes(int layer) const;
  // Parameter idx (an index into params_) as the layers read it: fp32 (in bf16 mode converted
  // from the bf16 weights), bf16, and its gradient.
  const float* param_f32(int idx);
  const bf16* param_bf16(int idx) const;
  float* param_grad(int idx) const;
  // LayerParams: parameters as weights, norms and values for the layer types.
  Weight weight(int w, int b, int64_t out, bool grads) override;
  Weight expert_weight(int w, int b, int64_t out, bool grads) override;
  Norm norm(int w, int b, bool grads) override;
  const float* f32(int idx) override { return param_f32(idx); }
  float* grad(int idx) override { return param_grad(idx); }
  Weight qkv_weight(const BlockParams& p, int64_t out, bool grads) override;
  // The head's output weight (the token embedding when tied; the replica when a pipeline cut them
  // apart) in the compute dtype, with `grads` its gradient too.
  HeadWeight head_weight(bool grads);

  ModelConfig cfg_;
  DType compute_;
  Recompute recompute_;
  Device dev_;
  const kernels::KernelTable* kt_;
  std::vector<ParamInfo> params_;
  std::vector<UnitRange> units_;
  std::vector<std::vector<int>> unit_params_;  // param indices per unit
  int64_t total_ = 0, flat_size_ = 0;
  ModelStorage storage_;
  std::vector<StateRange> state_;
  int64_t state_size_ = 0;
  bool compact_ = false;
  void build_state_layout();
  std::vector<Tensor> upcast_;  // bf16 mode: fp32 copies of small parameters, per param index
  // LoRA: per parameter index, the adapters (their A's indices) of that weight, and the parts the
  // last weight() call handed out for it
  std::vector<std::vector<int>> lora_of_;
  std::vector<std::vector<LoraPart>> lora_parts_;
  uint64_t lora_seed_ = 0;
  int64_t lora_micro0_ = 0, lora_row0_ = 0;
  std::map<int, int64_t> lora_forwards_;  // training forwards this step, by first unit
  // tensor / sequence parallelism: the communicator, switches and workspace the tp layers share
  TpContext tpc_;
  int64_t nh_l_ = 0, nkv_l_ = 0, F_l_ = 0, Vp_l_ = 0, vocab_lo_ = 0;  // this rank's share
  MoeShape moe_shape_;  // MoE: this rank's routed experts and the widths of its slices
  std::vector<ParamInfo> expert_params_;  // experts apart: their ranges of ew_ / eg_
  std::vector<int> expert_base_;          // per layer: index of its first expert parameter (-1: none)
  int64_t expert_size_ = 0;
  Tensor ew_, eg_, ewb_;
  std::vector<Tensor> eupcast_;           // bf16: fp32 copies of expert biases
  int ep_ = 1, ep_rank_ = 0;
  ExpertComm* ep_comm_ = nullptr;
  Tensor weights_, grads_, weights_bf16_;
  std::vector<const void*> unit_w_;
  std::vector<float*> unit_g_;
  UnitHooks* hooks_ = nullptr;

  std::vector<char> owned_;
  bool split_backward_ = false;  // ModelOptions::split_backward
  Tensor tied_w_, tied_g_;  // pipeline replica of a tied embedding (head side)
  Tensor qkv_bias_;                   // bf16 mode: the fused q|k|v bias (qkv_bias) in fp32
  const float* qkv_bias_f32(int first);
  // The hooks take the token embedding's lookup rows over (with can_hand_sparse_grad), and the
  // head's weight-gradient rows per grad_ready call (0: the whole gradient at once).
  bool sparse_embedding_grad();
  HeadGradReady head_grad_ready();

  // activations: per slot; B_, T_ mirror the current slot's shape
  int64_t B_ = 0, T_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;
  Slot* s_ = nullptr;
  std::unique_ptr<BlockActivations> scratch_acts_;        // shared by recomputed blocks
  std::unique_ptr<BlockActivations> scratch_moe_acts_;    // shared by recomputed MoE blocks
  BlockActivations& scratch_for(int layer) { return cfg_.is_moe_layer(layer) ? *scratch_moe_acts_ : *scratch_acts_; }
  // The MLP width block l's activations hold: the dense MLP's, or an MoE layer's shared experts'.
  int64_t mlp_width(int64_t l) const { return cfg_.is_moe_layer(l) ? moe_shape_.shared_width : F_l_; }
  bool recomputing_ = false;  // a backward re-running a block's forward (no statistics counted)
  float cur_dloss_ = 0.0f;    // the loss-gradient scale of the current forward
  std::optional<float> router_dloss_;  // set_router_loss_scale
  // The blocks' layers (each holds the workspace the blocks share): attention, the dense MLP and
  // the MoE layer (null without MoE).
  std::unique_ptr<Embedding> embedding_;
  std::unique_ptr<Attention> attn_;
  std::unique_ptr<Mlp> mlp_;
  std::unique_ptr<MoeLayer> moe_;
  std::unique_ptr<LmHead> head_;  // the LM head's projection and loss
  bool device_inputs_ = false;  // set_device_inputs
  void document_slot(const int32_t* ids, int64_t B, int64_t T);  // the slot's document starts (forward_units)
  int32_t doc_sep_ = -1;        // set_document_masking
  float* loss_sink_ = nullptr;  // set_loss_sink
  int64_t ws_bt_ = 0;  // tokens the shared workspace is sized for
  void ensure_workspace();  // the shared workspace for the current slot's B_ x T_
  // context parallelism: the communicator, mode and the original positions of the local tokens
  CpComm* cp_ = nullptr;
  bool cp_allgather_ = false;
  bool flash_ = false;
  bool gelu_epi_ = false;  // ModelOptions::gelu_epilogue
  bool res_bf16_ = false;  // ModelOptions::residual_bf16
  const bf16* pending_res_ = nullptr;  // the pending add's res2 (null: none)
  bf16* pending_out_ = nullptr;        // and its output, the next unit's input
  std::vector<int32_t> cp_pos_;
  // Workspace: the residual stream's gradient [R, C], a norm's input gradient [N, C] and fp32
  // staging [N, max(C, F)] (values stored as bf16, gathered rows, a recompute's discarded output).
  Tensor dres_, dnorm_, stage_;
};

}  // namespace mt
