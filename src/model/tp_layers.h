// Tensor and sequence parallelism as layer types (Megatron's ColumnParallelLinear,
// RowParallelLinear, VocabParallelEmbedding, vocab-parallel cross-entropy): each layer places its
// forward collective and the conjugate one in its backward, and dispatches on the compute dtype,
// so the transformer's blocks read as a plain sequence of layers. With tp = 1 every collective
// disappears and the layers are the ordinary ones.
//
//   layer                   forward                                backward
//   ColumnParallelLinear    input replicated (SP: all-gather)      input gradient all-reduced (SP: reduce-scattered),
//                                                                  overlapping the weight-gradient matmuls
//   RowParallelLinear       partial sums all-reduced (SP: reduce-  output gradient all-gathered (SP)
//                           scattered), replicated bias once
//   Norm                    this rank's rows                       SP: parameter gradients summed over tp
//   VocabParallelEmbedding  rows this rank holds, summed over tp   SP: output gradient all-gathered
//   VocabParallelCrossEntropy  row max / sum of exp / target logit all-reduced
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "runtime/tensor.h"

namespace mt {

namespace kernels {
struct KernelTable;
}

// The collectives tensor parallelism needs inside units (implemented over the tp process group by
// the parallel layer; the model layer does not depend on the comm layer). Blocking.
class TpComm {
 public:
  virtual ~TpComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_reduce_sum(float* x, int64_t n) = 0;
  virtual void all_reduce_max(float* x, int64_t n) = 0;
  // Sequence parallelism. `out` receives size() x n elements in rank order; `in` is this rank's n.
  // The defaults express both through all_reduce_sum (exact: the other ranks add zeros); a real
  // implementation uses the all-gather / reduce-scatter collectives at 1/2 the traffic.
  virtual void all_gather(const float* in, float* out, int64_t n);
  // out (n elements) = the sum over ranks of segment rank() of `in` (size() x n elements).
  virtual void reduce_scatter_sum(const float* in, float* out, int64_t n);
  // The same three for activations and activation gradients (the Megatron collectives around the
  // parallel matmuls and the vocab-parallel embedding / head). An implementation may move them in
  // the compute dtype (bf16 in bf16 runs, as Megatron does); loss statistics and parameter
  // gradients always go through the fp32 calls above.
  virtual void all_reduce_activations(float* x, int64_t n) { all_reduce_sum(x, n); }
  virtual void all_gather_activations(const float* in, float* out, int64_t n) { all_gather(in, out, n); }
  virtual void reduce_scatter_activations(const float* in, float* out, int64_t n) { reduce_scatter_sum(in, out, n); }
  // Asynchronous forms: start_* begins the collective and returns a handle; the output (and the
  // input buffer) belong to the collective until wait(handle). Used to overlap the input-gradient
  // reductions with the weight-gradient matmuls. The defaults complete before returning (-1).
  virtual int start_all_reduce_activations(float* x, int64_t n) {
    all_reduce_activations(x, n);
    return -1;
  }
  virtual int start_all_gather_activations(const float* in, float* out, int64_t n) {
    all_gather_activations(in, out, n);
    return -1;
  }
  virtual int start_reduce_scatter_activations(const float* in, float* out, int64_t n) {
    reduce_scatter_activations(in, out, n);
    return -1;
  }
  virtual void wait(int handle) { (void)handle; }
  // bf16 rows gathered as they are (sequence parallelism in bf16 runs: the rows a layer saved are
  // already the rounded values its matmuls read, so they travel without a cast either side). `out`
  // receives size() x n values in rank order. The default widens, gathers in fp32 and rounds back
  // (exact); handles as above.
  virtual int start_all_gather_bf16(const bf16* in, bf16* out, int64_t n);
  virtual void all_gather_bf16(const bf16* in, bf16* out, int64_t n) { wait(start_all_gather_bf16(in, out, n)); }
};

struct Weight;

// Split backward (zero-bubble pipeline schedules): a backward that computes only the input
// gradients (B) queues its weight-gradient work (W) here, each piece with the tensors it reads (the
// output gradient, the layer's input as its matmul used it), until run() computes the weight
// gradients with the same kernels, in queue order. What would be overwritten before W (output
// gradients in the layers' workspaces, inputs recomputed or re-gathered into scratch) is copied into
// this queue's pool of buffers - category Activations, allocated on first use and reused by the
// same piece of the next micro-batch on the slot (run() rewinds the pool; a buffer grows when a
// piece needs more). Inputs that stay in the slot until W are held by reference, and output
// gradients computed straight into a lent pool buffer are held where they are (no copies).
class DeferredGrads {
 public:
  using Work = std::function<void(const std::vector<Tensor>&)>;
  void add(std::vector<Tensor> held, Work work);
  // A copy of n elements of `src` (fp32 or bf16) in the pool's next buffer, kept until run();
  // `src` itself, uncopied, when it is a buffer lend() handed out since the last run().
  Tensor hold(const void* src, DType dt, int64_t n, Device dev);
  // The pool's next buffer, shaped and typed like `like` (contents unspecified): a layer computes
  // an output gradient straight into it instead of into its workspace, and W reads it there.
  Tensor lend(const Tensor& like);
  // Marks `t` (which stays unchanged until run()) as held where it is: hold() of it copies nothing.
  void keep(const Tensor& t) { lent_.push_back(t); }
  void run();  // every piece in order, then rewinds the pool
  bool empty() const { return pieces_.empty(); }
  int64_t bytes() const;       // held by the queued pieces (copies, not references)
  int64_t pool_bytes() const;  // the pool's buffers (alive from first use on)

 private:
  struct Piece {
    std::vector<Tensor> held;
    Work work;
  };
  std::vector<Piece> pieces_;
  Tensor& next(DType dt, int64_t n);  // the pool's next buffer, (re)allocated to hold n elements
  std::vector<Tensor> pool_;
  std::vector<Tensor> lent_;  // handed out by lend() since the last run()
  size_t next_ = 0;
};

// What the layers share: kernels, compute dtype, the tp communicator (null for tp = 1), the
// sequence-parallel switch, the overlap switch and the sequence-parallel workspace, sized for N
// tokens of width C by allocate().
class TpContext {
 public:
  TpContext(const kernels::KernelTable* kt, DType compute, TpComm* comm);
  const kernels::KernelTable* kt;
  DType compute;
  TpComm* comm;
  int size = 1, rank = 0;
  bool sp = false;       // sequence parallelism (only with size > 1)
  bool overlap = true;   // input-gradient reductions overlap the weight-gradient matmuls
  // fp32 scratch of at least [N, C] owned by the caller (staging for casts to the compute dtype).
  float* stage = nullptr;
  // Split backward: while set, layers queue their weight gradients here (DeferredGrads) instead
  // of computing them; null: the ordinary backward.
  DeferredGrads* defer = nullptr;
  // Split backward: set by the model for a unit whose saved activations (the layers' inputs) stay
  // in the slot until its W; the layers then defer with their inputs by reference.
  bool inputs_kept = false;
  // Queues the weight and bias gradients (w.dw, w.db) of y = x W^T + b from dy ([N, w.out] fp32)
  // and x ([N, in] in the compute dtype), computed when defer runs. dy is copied; x too unless
  // `x_kept` (it is not written before the work runs).
  void defer_weight_grad(const Weight& w, const float* dy, const void* x, int64_t N, int64_t in, bool x_kept = false);

  bool tp() const { return size > 1; }
  // Rows of the residual stream this rank holds for n tokens (n, or n / size under SP).
  int64_t rows(int64_t n) const { return sp ? n / size : n; }
  int64_t tokens() const { return N_; }
  void allocate(int64_t N, int64_t C);

  // SP: every row in the compute dtype, from this rank's rows: `saved` (compute dtype) and, for
  // fp32, the same values `rows`. In bf16 the saved rows themselves are gathered (no casts).
  const Tensor& gather(const Tensor& saved, const float* rows);
  // SP: starts gathering every row of an input saved as this rank's rows ([rows(N), C], compute
  // dtype); after comm->wait(handle), full_compute() holds them (what gather() returned in the
  // forward).
  int start_regather(const Tensor& saved_rows);
  // SP: every row of a gradient from this rank's rows (fp32 on the wire); else g itself.
  const float* gather_grad(const float* g);
  // The sum over tp of a layer's input gradient `partial` ([N, C]; reduce-scattered to this rank's
  // rows under SP), started right away; input_grad_sum waits and returns where the sum is.
  int start_input_grad_sum(float* partial);
  float* input_grad_sum(float* partial, int handle);
  // SP: every row (fp32, activation collective) of this rank's rows into `out` ([N, C]).
  void gather_into(const float* rows, float* out);
  // Reduce-scatter (SP) or all-reduce of N rows of partial sums (`partial`, [N, C]) into `out`
  // (this rank's rows); `partial` may be `out` without SP. Returns out.
  float* reduce_partial(float* partial, float* out);
  // Workspace for partial sums that are reduce-scattered ([N, C]); `out` itself without SP.
  float* partial_buffer(float* out) { return sp ? part_.f32() : out; }

  // SP: every row ([N, C]) as the last gather() / re-gather left them, in the compute dtype.
  const Tensor& full_compute() const { return compute == DType::F32 ? full_ : full_bf_; }

  // Under SP a norm's parameter-gradient contribution (from its rank's rows) is summed over the tp
  // ranks. norm_grad_slot hands out a zeroed slot of n floats for the norm whose gradients are dw
  // (C) and db (C, or null) and records them; flush_norm_grads sums every recorded slot in one
  // all-reduce and adds each to its gradients. While a block defers (defer_norm_grads, until its
  // flush at the block's end) its two norms share that one all-reduce; otherwise every norm
  // flushes at once. The sums are the same either way.
  float* norm_grad_slot(float* dw, float* db, int64_t C, int64_t n);
  void defer_norm_grads() { defer_norms_ = true; }
  bool norm_grads_deferred() const { return defer_norms_; }
  void flush_norm_grads();  // also ends the deferral

 private:
  void sum_pending_norms();  // the recorded slots in one all-reduce, added to their gradients
  struct PendingNorm {
    float *dw, *db;
    int64_t C, off;
  };
  int64_t N_ = 0, C_ = 0;
  Tensor full_, full_bf_, dfull_, part_, pgrad_;
  std::vector<PendingNorm> pending_norms_;
  int64_t pgrad_used_ = 0;
  bool defer_norms_ = false;
};

// A LoRA adapter on a weight: y[:, row0 : row0 + rows] += scale (x A^T) B^T with A [rank, in] and
// B [rows, rank] in the compute dtype (fp32 or bf16 pointers, the other null) and their fp32
// gradients (null: not wanted).
struct LoraPart {
  const float *af = nullptr, *bf = nullptr;
  const bf16 *ab = nullptr, *bb = nullptr;
  float *da = nullptr, *db = nullptr;
  int64_t rank = 0, row0 = 0, rows = 0;
  float scale = 1.0f;
  // Tensor parallelism: 'A' (column-parallel base: A replicated, B split by rows) or 'B' (row-parallel
  // base: A split by columns, B replicated) names the gradient that each rank computes as a partial
  // sum over the tp ranks; the parallel layers sum it over tp before adding it. 0 without tp.
  char tp_partial = 0;
  // Dropout on the adapter's input x ([N, in] rows of T tokens; PEFT's lora_dropout): element
  // (n, j) is kept, scaled by 1 / (1 - dropout), when a hash of (dropout_key, sample0 + n / T,
  // n % T, col0 + j) says so: the mask depends on the global sample, the token and the input
  // column only, so every layout and a recompute draw the same one. dropout 0: none.
  float dropout = 0.0f;
  uint64_t dropout_key = 0;
  int64_t T = 1, sample0 = 0, col0 = 0;
};

// One weight matrix [out, in] (fp32 or bf16 by the compute dtype, the other null), its fp32 bias
// (or null) and their gradients (null: not wanted), and its LoRA adapters (nlora of them at lora).
struct Weight {
  const float* wf = nullptr;
  const bf16* wb = nullptr;
  const float* b = nullptr;
  float* dw = nullptr;
  float* db = nullptr;
  int64_t out = 0;
  const LoraPart* lora = nullptr;
  int nlora = 0;
};

// y = x @ W^T (+ b) with x in the compute dtype, and its backward. A weight's LoRA adapters add
// their output in forward; in backward they add to dx and, with it, accumulate their own
// gradients (a call without dx leaves them alone: the tensor-parallel split calls it twice).
struct Linear {
  const kernels::KernelTable* kt;
  DType compute;
  void forward(float* y, const Tensor& x, const Weight& w, const float* bias, int64_t N, int64_t in) const;
  void backward(float* dx, float* dw, float* db, const float* dy, const Tensor& x, const Weight& w, int64_t N,
                int64_t in) const;
};

// Writes an fp32 result into a compute-dtype tensor (a cast in bf16 mode, a copy in fp32).
void store_compute(const kernels::KernelTable* kt, const Tensor& dst, const float* src, int64_t n);

// Column-parallel linear layer(s) on one input of width `in`: this rank holds output columns of
// every weight. Several weights may share the input (SwiGLU's gate and up): one gather, one
// input-gradient reduction.
class ColumnParallelLinear {
 public:
  ColumnParallelLinear(TpContext& ctx, int64_t in) : ctx_(ctx), in_(in) {}
  struct Out {
    float* y;
    Weight w;
  };
  // x: the input as saved (compute dtype; this rank's rows under SP, then gathered from its fp32
  // values `x_rows`).
  void forward(const Tensor& x, const float* x_rows, std::initializer_list<Out> outs);
  struct Grad {
    const float* dy;
    Weight w;
  };
  // Adds every weight's gradients and returns the input gradient summed over tp (this rank's rows
  // under SP) from `dx` ([N, in] workspace, overwritten). `rows_saved`: x holds this rank's rows
  // only (SP, re-gathered here); false: x holds every row.
  float* backward(const Tensor& x, std::initializer_list<Grad> grads, float* dx, bool rows_saved = true);

 private:
  TpContext& ctx_;
  int64_t in_;
};

// Row-parallel linear layer: this rank holds input columns; the output's partial sums are reduced
// over tp, then the (replicated) bias is added once.
class RowParallelLinear {
 public:
  RowParallelLinear(TpContext& ctx, int64_t in, Weight w) : ctx_(ctx), in_(in), w_(w) {}
  // y: this rank's rows of the output (R rows; [N, out] without SP).
  void forward(float* y, const Tensor& x);
  // dy: this rank's rows of the output gradient; dx ([N, in]) receives the input gradient.
  void backward(float* dx, const float* dy, const Tensor& x);

 private:
  TpContext& ctx_;
  int64_t in_;
  Weight w_;
};

// LayerNorm (bias non-null) or RMSNorm over R rows of width C, on this rank's rows; under SP the
// parameter gradients (computed from those rows) are summed over tp so every rank adds the same.
class Norm {
 public:
  Norm(TpContext& ctx, int64_t C, float eps, const float* w, const float* b, float* dw, float* db, bool layernorm)
      : ctx_(ctx), C_(C), eps_(eps), w_(w), b_(b), dw_(dw), db_(db), ln_(layernorm) {}
  void forward(float* y, const Tensor& mean, const Tensor& rstd, const float* x, int64_t R) const;
  // Forward into `saved` (compute dtype); returns the fp32 output (saved itself, or `ctx.stage`).
  const float* forward_saved(const Tensor& saved, const Tensor& mean, const Tensor& rstd, const float* x,
                             int64_t R) const;
  // The same after the residual add, in one kernel: res += add (the residual stream, updated in
  // place), then the norm of res. Its backward is backward() with x = res.
  const float* forward_saved_residual(const Tensor& saved, const Tensor& mean, const Tensor& rstd, float* res,
                                      const float* add, int64_t R) const;
  // dx += d(input) from dy; the parameter gradients accumulate.
  void backward(float* dx, const float* dy, const float* x, const Tensor& mean, const Tensor& rstd, int64_t R) const;
  // The bf16 residual stream (residual_*_forward_bf16): with add, res_out = bf16(res + add) and the
  // norm of res_out; without (add and res_out null), the norm of res. Its backward reads the bf16
  // input the forward normed.
  void forward_bf16(float* y, const Tensor& mean, const Tensor& rstd, bf16* res_out, const bf16* res, const float* add,
                    int64_t R) const;
  const float* forward_saved_bf16(const Tensor& saved, const Tensor& mean, const Tensor& rstd, bf16* res_out,
                                  const bf16* res, const float* add, int64_t R) const;
  void backward_bf16(float* dx, const float* dy, const bf16* x, const Tensor& mean, const Tensor& rstd,
                     int64_t R) const;

 private:
  // The parameter-gradient handling both backwards share: run(dw, db) computes the input gradient
  // and the parameter gradients into the pointers it is given (below).
  template <class Run>
  void backward_params(const Run& run) const;
  TpContext& ctx_;
  int64_t C_;
  float eps_;
  const float *w_, *b_;
  float *dw_, *db_;
  bool ln_;
};

// Token embedding split by vocabulary rows [lo, lo + rows): each rank looks up the tokens it holds
// (zero elsewhere) and the rows are summed over tp (reduce-scattered under SP).
class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(TpContext& ctx, int64_t C, int64_t lo, int64_t rows) : ctx_(ctx), C_(C), lo_(lo), rows_(rows) {}
  // table: fp32 or bf16 by the compute dtype. out: this rank's rows of the result.
  void forward(float* out, const int32_t* ids, const void* table);
  // Every token's output gradient from this rank's rows (all-gathered under SP, fp32).
  const float* grad_rows(const float* dout) { return ctx_.gather_grad(dout); }
  // dw += the gradient of the rows this rank holds, from every token's output gradient.
  void backward(float* dw, const float* dout_all, const int32_t* ids);

 private:
  TpContext& ctx_;
  int64_t C_, lo_, rows_;
};

// Softmax cross-entropy of logits whose vocabulary columns [lo, lo + cols) are on this rank: the
// row max, then the sum of exponentials and the target's logit are reduced across tp, so the full
// logits are never gathered. With train the logits become their gradient (scaled by dloss).
class VocabParallelCrossEntropy {
 public:
  VocabParallelCrossEntropy(TpContext& ctx, int64_t vocab, int64_t lo, int64_t cols)
      : ctx_(ctx), V_(vocab), lo_(lo), cols_(cols) {}
  void forward(float* logits, const int32_t* targets, float* losses, int64_t N, bool train, float dloss) const;

 private:
  TpContext& ctx_;
  int64_t V_, lo_, cols_;
};

}  // namespace mt
