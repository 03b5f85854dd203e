#include "model/tp_layers.h"

#include <algorithm>
#include <stdexcept>

#include "kernels/backend.h"
#include "runtime/device.h"

namespace mt {

void TpComm::all_gather(const float* in, float* out, int64_t n) {
  const Device d = current_device();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  dev::zero(d, out, bytes * static_cast<size_t>(size()));
  dev::copy(d, out + rank() * n, in, bytes);
  all_reduce_sum(out, n * size());
}

void TpComm::reduce_scatter_sum(const float* in, float* out, int64_t n) {
  const Device d = current_device();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  Tensor all = Tensor::empty({n * size()}, DType::F32, MemCategory::Workspace);
  dev::copy(d, all.f32(), in, bytes * static_cast<size_t>(size()));
  all_reduce_sum(all.f32(), n * size());
  dev::copy(d, out, all.f32() + rank() * n, bytes);
}

int TpComm::start_all_gather_bf16(const bf16* in, bf16* out, int64_t n) {
  const kernels::KernelTable& k = kernels::table(current_device());
  Tensor mine = Tensor::empty({n}, DType::F32, MemCategory::Workspace);
  Tensor all = Tensor::empty({n * size()}, DType::F32, MemCategory::Workspace);
  k.cast_bf16_to_f32(mine.f32(), in, n);
  all_gather(mine.f32(), all.f32(), n);
  k.cast_f32_to_bf16(out, all.f32(), n * size());
  return -1;
}

// ---- TpContext ----

TpContext::TpContext(const kernels::KernelTable* k, DType cd, TpComm* c) : kt(k), compute(cd), comm(c) {
  if (comm) {
    size = comm->size();
    rank = comm->rank();
  }
}

void TpContext::allocate(int64_t N, int64_t C) {
  N_ = N;
  C_ = C;
  if (!sp) return;
  auto W = MemCategory::Workspace;
  if (compute == DType::F32)
    full_ = Tensor::empty({N, C}, DType::F32, W);
  else
    full_bf_ = Tensor::empty({N, C}, DType::BF16, W);
  dfull_ = Tensor::empty({N, C}, DType::F32, W);
  part_ = Tensor::empty({N, C}, DType::F32, W);
  pgrad_ = Tensor::empty({std::max<int64_t>(4 * C, 16)}, DType::F32, W);  // a block's two norms, weight + bias
}

// The full [N, C] rows from this rank's R = N / t in the compute dtype. In bf16 `saved` holds the
// rounded `rows_f32`, which is what the matmuls read: gathered as bf16, nothing is cast (before,
// the rows were rounded into staging, gathered, widened into fp32 and rounded again, four passes
// over the rows with the same result).
const Tensor& TpContext::gather(const Tensor& saved, const float* rows_f32) {
  if (saved.dtype() != compute) throw std::logic_error("TpContext::gather: saved rows are not in the compute dtype");
  if (compute == DType::BF16) {
    comm->all_gather_bf16(saved.bf(), full_bf_.bf(), rows(N_) * C_);
    return full_bf_;
  }
  comm->all_gather_activations(rows_f32, full_.f32(), rows(N_) * C_);
  return full_;
}

int TpContext::start_regather(const Tensor& x) {
  const int64_t n = rows(N_) * C_;
  if (x.dtype() != compute)
    throw std::logic_error("TpContext::start_regather: saved rows are not in the compute dtype");
  if (x.dtype() == DType::F32) return comm->start_all_gather_activations(x.f32(), full_.f32(), n);
  return comm->start_all_gather_bf16(x.bf(), full_bf_.bf(), n);
}

void TpContext::gather_into(const float* rows_f32, float* out) {
  comm->all_gather_activations(rows_f32, out, rows(N_) * C_);
}

const float* TpContext::gather_grad(const float* g) {
  if (!sp) return g;
  // fp32 on the wire: besides the matmuls (bf16 inputs) this gradient feeds bias and embedding
  // gradients, which tensor parallelism without SP computes from the fp32 rows.
  comm->all_gather(g, dfull_.f32(), rows(N_) * C_);
  return dfull_.f32();
}

// Started as soon as the input-gradient matmul is done so that it overlaps the weight-gradient
// matmul (Megatron's async tensor-parallel all-reduce) unless `overlap` is off.
int TpContext::start_input_grad_sum(float* partial) {
  if (!tp()) return -1;
  const int h = sp ? comm->start_reduce_scatter_activations(partial, part_.f32(), rows(N_) * C_)
                   : comm->start_all_reduce_activations(partial, N_ * C_);
  if (overlap) return h;
  comm->wait(h);
  return -1;
}

float* TpContext::input_grad_sum(float* partial, int handle) {
  if (!tp()) return partial;
  comm->wait(handle);
  return sp ? part_.f32() : partial;
}

float* TpContext::reduce_partial(float* partial, float* out) {
  if (sp)
    comm->reduce_scatter_activations(partial, out, rows(N_) * C_);
  else if (tp())
    comm->all_reduce_activations(out, N_ * C_);
  return out;
}

// ---- split backward ----

void DeferredGrads::add(std::vector<Tensor> held, Work work) { pieces_.push_back({std::move(held), std::move(work)}); }

Tensor& DeferredGrads::next(DType dt, int64_t n) {
  if (next_ == pool_.size()) pool_.emplace_back();
  Tensor& buf = pool_[next_++];
  if (!buf.defined() || buf.dtype() != dt || buf.numel() < n) buf = Tensor::empty({n}, dt, MemCategory::Activations);
  return buf;
}

Tensor DeferredGrads::hold(const void* src, DType dt, int64_t n, Device dev) {
  for (const Tensor& t : lent_)
    if (t.raw() == src && t.dtype() == dt && t.numel() >= n) return t.numel() == n ? t : t.view(0, {n});
  Tensor& buf = next(dt, n);
  dev::copy(dev, buf.raw(), src, static_cast<size_t>(n) * (dt == DType::F32 ? sizeof(float) : sizeof(bf16)));
  return buf.numel() == n ? buf : buf.view(0, {n});
}

Tensor DeferredGrads::lend(const Tensor& like) {
  Tensor& buf = next(like.dtype(), like.numel());
  lent_.push_back(buf.numel() == like.numel() ? buf.reshape(like.shape()) : buf.view(0, like.shape()));
  return lent_.back();
}

void DeferredGrads::run() {
  for (Piece& p : pieces_) p.work(p.held);
  pieces_.clear();
  lent_.clear();
  next_ = 0;
}

int64_t DeferredGrads::bytes() const {
  int64_t b = 0;
  for (const Piece& p : pieces_)
    for (const Tensor& t : p.held) b += static_cast<int64_t>(t.nbytes());
  return b;
}

int64_t DeferredGrads::pool_bytes() const {
  int64_t b = 0;
  for (const Tensor& t : pool_)
    if (t.defined()) b += static_cast<int64_t>(t.nbytes());
  return b;
}

void TpContext::defer_weight_grad(const Weight& w, const float* dy, const void* x, int64_t N, int64_t in,
                                  bool x_kept) {
  const Device dev = kt->device;
  const kernels::KernelTable* k = kt;
  const DType cd = compute;
  float *dw = w.dw, *db = w.db;
  const int64_t out = w.out;
  std::vector<Tensor> held{defer->hold(dy, DType::F32, N * out, dev)};
  if (!x_kept) held.push_back(defer->hold(x, cd, N * in, dev));
  const void* xref = x_kept ? x : nullptr;
  defer->add(std::move(held), [k, cd, dw, db, N, in, out, xref](const std::vector<Tensor>& h) {
    // The same kernels as the unsplit backward with no input gradient: the same GEMM.
    const void* xs = xref ? xref : h[1].raw();
    if (cd == DType::F32)
      k->linear_backward(nullptr, dw, db, h[0].f32(), static_cast<const float*>(xs), nullptr, N, in, out);
    else
      k->linear_backward_bf16(nullptr, dw, db, h[0].f32(), static_cast<const bf16*>(xs), nullptr, N, in, out);
  });
}

// ---- Linear ----

namespace {

// One matmul y = x @ W^T of the compute dtype with W given as fp32 / bf16 pointers.
void lora_matmul(const Linear& lin, float* y, const Tensor& x, const float* wf, const bf16* wb, int64_t N, int64_t in,
                 int64_t out) {
  if (lin.compute == DType::F32)
    lin.kt->linear_forward(y, x.f32(), wf, nullptr, N, in, out);
  else
    lin.kt->linear_forward_bf16(y, x.bf(), wb, nullptr, N, in, out);
}

// h = scale (x A^T) in the compute dtype ([N, rank]); `hf` is its fp32 workspace.
Tensor lora_hidden(const Linear& lin, const LoraPart& a, const Tensor& x, Tensor& hf, int64_t N, int64_t in) {
  hf = Tensor::empty({N, a.rank}, DType::F32, MemCategory::Workspace);
  lora_matmul(lin, hf.f32(), x, a.af, a.ab, N, in, a.rank);
  lin.kt->scale(hf.f32(), a.scale, N * a.rank);
  if (lin.compute == DType::F32) return hf;
  Tensor hc = Tensor::empty({N, a.rank}, DType::BF16, MemCategory::Workspace);
  lin.kt->cast_f32_to_bf16(hc.bf(), hf.f32(), N * a.rank);
  return hc;
}

uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The adapter's dropout multipliers [N, in]: 0 (dropped) or 1 / (1 - p) (kept), on the host.
std::vector<float> lora_dropout_mask(const LoraPart& a, int64_t N, int64_t in) {
  std::vector<float> m(static_cast<size_t>(N * in));
  const uint64_t threshold = static_cast<uint64_t>(static_cast<double>(a.dropout) * 16777216.0);
  const float keep = 1.0f / (1.0f - a.dropout);
  for (int64_t n = 0; n < N; ++n) {
    const uint64_t tok = mix64(a.dropout_key ^ mix64(static_cast<uint64_t>(a.sample0 + n / a.T) * 0x100000001B3ull +
                                                     static_cast<uint64_t>(n % a.T)));
    float* row = m.data() + n * in;
    for (int64_t j = 0; j < in; ++j)
      row[j] = (mix64(tok + static_cast<uint64_t>(a.col0 + j)) >> 40) < threshold ? 0.0f : keep;
  }
  return m;
}

// x with the adapter's dropout applied (compute dtype, like x): x * mask, rounded once in bf16.
Tensor lora_dropped(const Tensor& x, const std::vector<float>& m, int64_t N, int64_t in) {
  Tensor d = Tensor::empty({N, in}, x.dtype(), MemCategory::Workspace);
  const int64_t n = N * in;
  if (x.dtype() == DType::F32) {
    const float* xs = x.f32();
    float* ds = d.f32();
    for (int64_t i = 0; i < n; ++i) ds[i] = xs[i] * m[static_cast<size_t>(i)];
  } else {
    const bf16* xs = x.bf();
    bf16* ds = d.bf();
    for (int64_t i = 0; i < n; ++i) ds[i] = float_to_bf16(bf16_to_float(xs[i]) * m[static_cast<size_t>(i)]);
  }
  return d;
}

// Whether the adapter drops out (not on the count-only Meta device).
bool drops(const Linear& lin, const LoraPart& a) {
  if (a.dropout <= 0 || lin.kt->device == Device::Meta) return false;
  if (lin.kt->device != Device::CPU)
    throw std::logic_error("LoRA dropout runs on the CPU only (lora.dropout > 0 is refused on other devices)");
  return true;
}

void lora_forward(const Linear& lin, float* y, const Tensor& x0, const Weight& w, int64_t N, int64_t in) {
  for (int i = 0; i < w.nlora; ++i) {
    const LoraPart& a = w.lora[i];
    const Tensor x = drops(lin, a) ? lora_dropped(x0, lora_dropout_mask(a, N, in), N, in) : x0;
    Tensor hf;
    const Tensor h = lora_hidden(lin, a, x, hf, N, in);
    Tensor t = Tensor::empty({N, a.rows}, DType::F32, MemCategory::Workspace);
    lora_matmul(lin, t.f32(), h, a.bf, a.bb, N, a.rank, a.rows);
    if (a.rows == w.out) {
      lin.kt->accumulate(y, t.f32(), N * w.out);
    } else {
      for (int64_t n = 0; n < N; ++n) lin.kt->accumulate(y + n * w.out + a.row0, t.f32() + n * a.rows, a.rows);
    }
  }
}

// dx += the adapters' input gradient; dA, dB += their gradients (dy: [N, out] fp32).
void lora_backward(const Linear& lin, float* dx, const float* dy, const Tensor& x0, const Weight& w, int64_t N,
                   int64_t in) {
  for (int i = 0; i < w.nlora; ++i) {
    const LoraPart& a = w.lora[i];
    const bool drop = drops(lin, a);
    std::vector<float> mask;  // dropout: the forward's mask again (a hash, not stored)
    if (drop) mask = lora_dropout_mask(a, N, in);
    const Tensor x = drop ? lora_dropped(x0, mask, N, in) : x0;
    const float* dyp = dy;
    Tensor cols;
    if (a.rows != w.out) {
      cols = Tensor::empty({N, a.rows}, DType::F32, MemCategory::Workspace);
      lin.kt->copy_columns(cols.f32(), dy, N, w.out, a.row0, a.rows);
      dyp = cols.f32();
    }
    Tensor hf;
    const Tensor h = lora_hidden(lin, a, x, hf, N, in);
    // y = h B^T: dB += dy^T h, dh = dy B (then scaled: h = scale (x A^T))
    Weight bw;
    bw.wf = a.bf;
    bw.wb = a.bb;
    bw.out = a.rows;
    Tensor dh = Tensor::zeros({N, a.rank}, DType::F32, MemCategory::Workspace);
    lin.backward(dh.f32(), a.db, nullptr, dyp, h, bw, N, a.rank);
    lin.kt->scale(dh.f32(), a.scale, N * a.rank);
    Weight aw;
    aw.wf = a.af;
    aw.wb = a.ab;
    aw.out = a.rank;
    if (!drop) {
      lin.backward(dx, a.da, nullptr, dh.f32(), x, aw, N, in);
      continue;
    }
    // dx += mask * (dh A): the gradient passes the kept elements, scaled as they were
    Tensor dxd = Tensor::zeros({N, in}, DType::F32, MemCategory::Workspace);
    lin.backward(dxd.f32(), a.da, nullptr, dh.f32(), x, aw, N, in);
    const float* d = dxd.f32();
    for (int64_t k = 0; k < N * in; ++k) dx[k] += d[k] * mask[static_cast<size_t>(k)];
  }
}

// Tensor parallelism: the adapters' gradients that are partial sums over the tp ranks (LoraPart::
// tp_partial) go to a zeroed buffer instead of their gradients; sum() adds them over tp in one
// all-reduce for the layer's weights, then to the gradients, so every rank adds the same full
// gradient of its replicated matrix (as a norm's parameter gradients under SP).
class LoraTpGrads {
 public:
  explicit LoraTpGrads(size_t weights) { parts_.reserve(weights); }
  // w with its adapters' partial gradients pointed into this buffer (w itself when it has none).
  Weight redirect(const Weight& w, int64_t in) {
    if (w.nlora == 0) return w;
    int64_t need = 0;
    for (int i = 0; i < w.nlora; ++i) need += count(w.lora[i], in);
    if (need == 0) return w;
    parts_.emplace_back(w.lora, w.lora + w.nlora);
    Tensor t = Tensor::zeros({need}, DType::F32, MemCategory::Workspace);
    int64_t off = 0;
    for (LoraPart& p : parts_.back()) {
      const int64_t n = count(p, in);
      if (n == 0) continue;
      float*& g = p.tp_partial == 'A' ? p.da : p.db;
      dst_.push_back({g, t.f32() + off, n});
      g = t.f32() + off;
      off += n;
    }
    bufs_.push_back(std::move(t));
    Weight r = w;
    r.lora = parts_.back().data();
    return r;
  }
  void sum(TpContext& ctx) {
    for (const Tensor& t : bufs_) ctx.comm->all_reduce_sum(t.f32(), t.numel());
    for (const Dst& d : dst_) ctx.kt->accumulate(d.grad, d.partial, d.n);
  }

 private:
  static int64_t count(const LoraPart& p, int64_t in) {
    if (p.tp_partial == 'A' && p.da) return p.rank * in;
    if (p.tp_partial == 'B' && p.db) return p.rows * p.rank;
    return 0;
  }
  struct Dst {
    float* grad;
    const float* partial;
    int64_t n;
  };
  std::vector<std::vector<LoraPart>> parts_;
  std::vector<Tensor> bufs_;
  std::vector<Dst> dst_;
};

}  // namespace

void Linear::forward(float* y, const Tensor& x, const Weight& w, const float* bias, int64_t N, int64_t in) const {
  if (compute == DType::F32)
    kt->linear_forward(y, x.f32(), w.wf, bias, N, in, w.out);
  else
    kt->linear_forward_bf16(y, x.bf(), w.wb, bias, N, in, w.out);
  if (w.nlora > 0) lora_forward(*this, y, x, w, N, in);
}

void Linear::backward(float* dx, float* dw, float* db, const float* dy, const Tensor& x, const Weight& w, int64_t N,
                      int64_t in) const {
  if (dx || dw || db) {
    if (compute == DType::F32)
      kt->linear_backward(dx, dw, db, dy, x.f32(), w.wf, N, in, w.out);
    else
      kt->linear_backward_bf16(dx, dw, db, dy, x.bf(), w.wb, N, in, w.out);
  }
  if (w.nlora > 0 && dx) lora_backward(*this, dx, dy, x, w, N, in);
}

void store_compute(const kernels::KernelTable* kt, const Tensor& dst, const float* src, int64_t n) {
  if (dst.dtype() == DType::F32)
    dev::copy(kt->device, dst.f32(), src, static_cast<size_t>(n) * sizeof(float));
  else
    kt->cast_f32_to_bf16(dst.bf(), src, n);
}

// ---- ColumnParallelLinear ----

void ColumnParallelLinear::forward(const Tensor& x, const float* x_rows, std::initializer_list<Out> outs) {
  const Tensor& in = ctx_.sp ? ctx_.gather(x, x_rows) : x;
  const Linear lin{ctx_.kt, ctx_.compute};
  for (const Out& o : outs) lin.forward(o.y, in, o.w, o.w.b, ctx_.tokens(), in_);
}

float* ColumnParallelLinear::backward(const Tensor& x, std::initializer_list<Grad> grads, float* dx, bool rows_saved) {
  const int64_t N = ctx_.tokens();
  const bool regather = ctx_.sp && rows_saved;
  const Linear lin{ctx_.kt, ctx_.compute};
  dev::zero(ctx_.kt->device, dx, static_cast<size_t>(N * in_) * sizeof(float));
  // Under SP the weight gradient needs every row of the input: re-gathered from the saved rows,
  // started before the input-gradient matmul (which does not need it) so that they overlap.
  const int hin = regather ? ctx_.start_regather(x) : -1;
  if (!ctx_.tp() && ctx_.defer) {  // split backward: the input gradient now, the weights' later
    for (const Grad& g : grads) lin.backward(dx, nullptr, nullptr, g.dy, x, g.w, N, in_);
    for (const Grad& g : grads) ctx_.defer_weight_grad(g.w, g.dy, x.raw(), N, in_, ctx_.inputs_kept);
    return dx;
  }
  if (!ctx_.tp()) {
    // Nothing to overlap: both gradients in one call per weight, so a bf16 backward casts the
    // output gradient once (the LM head's is [tokens, vocabulary]). Same GEMMs in the same order.
    for (const Grad& g : grads) lin.backward(dx, g.w.dw, g.w.db, g.dy, x, g.w, N, in_);
    return dx;
  }
  // LoRA: the adapters' gradients come with the input gradient and need every row of the input, so
  // under SP the re-gather is waited for first (no overlap for adapted weights); A's gradient is a
  // partial sum over tp (LoraTpGrads), summed before the input gradient's reduction starts.
  bool lora = false;
  for (const Grad& g : grads) lora = lora || g.w.nlora > 0;
  const Tensor* xin = &x;
  if (regather && lora) {
    ctx_.comm->wait(hin);
    xin = &ctx_.full_compute();
  }
  LoraTpGrads partial(grads.size());
  for (const Grad& g : grads)
    lin.backward(dx, nullptr, nullptr, g.dy, *xin, partial.redirect(g.w, in_), N, in_);  // input gradient first
  if (lora) partial.sum(ctx_);
  const int hsum = ctx_.start_input_grad_sum(dx);
  if (regather && !lora) {
    ctx_.comm->wait(hin);
    xin = &ctx_.full_compute();
  }
  for (const Grad& g : grads) {
    if (ctx_.defer)
      ctx_.defer_weight_grad(g.w, g.dy, xin->raw(), N, in_, ctx_.inputs_kept && xin == &x);
    else
      lin.backward(nullptr, g.w.dw, g.w.db, g.dy, *xin, g.w, N, in_);
  }
  return ctx_.input_grad_sum(dx, hsum);
}

// ---- RowParallelLinear ----

void RowParallelLinear::forward(float* y, const Tensor& x) {
  const bool tp = ctx_.tp();
  float* part = ctx_.partial_buffer(y);
  Linear{ctx_.kt, ctx_.compute}.forward(part, x, w_, tp ? nullptr : w_.b, ctx_.tokens(), in_);
  if (!tp) return;
  ctx_.reduce_partial(part, y);
  if (w_.b) ctx_.kt->add_bias(y, w_.b, ctx_.rows(ctx_.tokens()), w_.out);
}

void RowParallelLinear::backward(float* dx, const float* dy, const Tensor& x) {
  const int64_t N = ctx_.tokens();
  dev::zero(ctx_.kt->device, dx, static_cast<size_t>(N * in_) * sizeof(float));
  const float* dy_all = ctx_.gather_grad(dy);  // SP: the conjugate of the forward's reduce-scatter
  // LoRA under tp: B's gradient is a partial sum over tp (LoraTpGrads), summed here.
  LoraTpGrads partial(1);
  const Weight w = ctx_.tp() ? partial.redirect(w_, in_) : w_;
  if (ctx_.defer) {  // split backward
    Linear{ctx_.kt, ctx_.compute}.backward(dx, nullptr, nullptr, dy_all, x, w, N, in_);
    ctx_.defer_weight_grad(w_, dy_all, x.raw(), N, in_, ctx_.inputs_kept);
  } else {
    Linear{ctx_.kt, ctx_.compute}.backward(dx, w_.dw, w_.db, dy_all, x, w, N, in_);
  }
  if (ctx_.tp() && w_.nlora > 0) partial.sum(ctx_);
}

// ---- Norm ----

void Norm::forward(float* y, const Tensor& mean, const Tensor& rstd, const float* x, int64_t R) const {
  if (ln_)
    ctx_.kt->layernorm_forward(y, mean.f32(), rstd.f32(), x, w_, b_, R, C_, eps_);
  else
    ctx_.kt->rmsnorm_forward(y, rstd.f32(), x, w_, R, C_, eps_);
}

const float* Norm::forward_saved(const Tensor& saved, const Tensor& mean, const Tensor& rstd, const float* x,
                                 int64_t R) const {
  // Staged in fp32 when the saved copy is bf16, or when the gather of SP needs fp32 rows apart
  // from the saved ones.
  const bool staged = saved.dtype() != DType::F32 || ctx_.sp;
  float* y = staged ? ctx_.stage : saved.f32();
  forward(y, mean, rstd, x, R);
  if (staged) store_compute(ctx_.kt, saved, y, R * C_);
  return y;
}

const float* Norm::forward_saved_residual(const Tensor& saved, const Tensor& mean, const Tensor& rstd, float* res,
                                          const float* add, int64_t R) const {
  const bool staged = saved.dtype() != DType::F32 || ctx_.sp;
  float* y = staged ? ctx_.stage : saved.f32();
  if (ln_)
    ctx_.kt->residual_layernorm_forward(y, mean.f32(), rstd.f32(), res, add, w_, b_, R, C_, eps_);
  else
    ctx_.kt->residual_rmsnorm_forward(y, rstd.f32(), res, add, w_, R, C_, eps_);
  if (staged) store_compute(ctx_.kt, saved, y, R * C_);
  return y;
}

void Norm::forward_bf16(float* y, const Tensor& mean, const Tensor& rstd, bf16* res_out, const bf16* res,
                        const float* add, int64_t R) const {
  if (ln_)
    ctx_.kt->residual_layernorm_forward_bf16(y, mean.f32(), rstd.f32(), res_out, res, add, w_, b_, R, C_, eps_);
  else
    ctx_.kt->residual_rmsnorm_forward_bf16(y, rstd.f32(), res_out, res, add, w_, R, C_, eps_);
}

const float* Norm::forward_saved_bf16(const Tensor& saved, const Tensor& mean, const Tensor& rstd, bf16* res_out,
                                      const bf16* res, const float* add, int64_t R) const {
  const bool staged = saved.dtype() != DType::F32 || ctx_.sp;
  float* y = staged ? ctx_.stage : saved.f32();
  forward_bf16(y, mean, rstd, res_out, res, add, R);
  if (staged) store_compute(ctx_.kt, saved, y, R * C_);
  return y;
}

float* TpContext::norm_grad_slot(float* dw, float* db, int64_t C, int64_t n) {
  if (pgrad_used_ + n > pgrad_.numel()) sum_pending_norms();  // full: sum what is there, keep deferring
  if (n > pgrad_.numel()) throw std::logic_error("TpContext::norm_grad_slot: norm wider than its workspace");
  float* t = pgrad_.f32() + pgrad_used_;
  dev::zero(kt->device, t, static_cast<size_t>(n) * sizeof(float));
  pending_norms_.push_back({dw, db, C, pgrad_used_});
  pgrad_used_ += n;
  return t;
}

void TpContext::flush_norm_grads() {
  defer_norms_ = false;
  sum_pending_norms();
}

void TpContext::sum_pending_norms() {
  if (pgrad_used_ == 0) return;
  float* t = pgrad_.f32();
  comm->all_reduce_sum(t, pgrad_used_);
  for (const PendingNorm& p : pending_norms_) {
    kt->accumulate(p.dw, t + p.off, p.C);
    if (p.db) kt->accumulate(p.db, t + p.off + p.C, p.C);
  }
  pending_norms_.clear();
  pgrad_used_ = 0;
}

// Under SP each rank saw only its rows, so the parameters' contribution is computed into a zeroed
// slot and summed over the tp ranks first: every rank adds the same full value (at once, or with
// the other norm of its block at the block's end).
template <class Run>
void Norm::backward_params(const Run& run) const {
  if (!ctx_.sp || (!dw_ && !db_)) return run(dw_, db_);  // frozen (LoRA): no parameter gradient to sum
  float* t = ctx_.norm_grad_slot(dw_, db_, C_, ln_ ? 2 * C_ : C_);
  run(t, ln_ ? t + C_ : nullptr);
  if (!ctx_.norm_grads_deferred()) ctx_.flush_norm_grads();
}

void Norm::backward(float* dx, const float* dy, const float* x, const Tensor& mean, const Tensor& rstd,
                    int64_t R) const {
  backward_params([&](float* dw, float* db) {
    if (ln_)
      ctx_.kt->layernorm_backward(dx, dw, db, dy, x, w_, mean.f32(), rstd.f32(), R, C_);
    else
      ctx_.kt->rmsnorm_backward(dx, dw, dy, x, w_, rstd.f32(), R, C_);
  });
}

void Norm::backward_bf16(float* dx, const float* dy, const bf16* x, const Tensor& mean, const Tensor& rstd,
                         int64_t R) const {
  backward_params([&](float* dw, float* db) {
    if (ln_)
      ctx_.kt->layernorm_backward_bf16(dx, dw, db, dy, x, w_, mean.f32(), rstd.f32(), R, C_);
    else
      ctx_.kt->rmsnorm_backward_bf16(dx, dw, dy, x, w_, rstd.f32(), R, C_);
  });
}

// ---- VocabParallelEmbedding ----

void VocabParallelEmbedding::forward(float* out, const int32_t* ids, const void* table) {
  const int64_t N = ctx_.tokens();
  if (!ctx_.tp() && ctx_.compute == DType::F32) {
    ctx_.kt->embedding_forward(out, ids, static_cast<const float*>(table), N, C_);
    return;
  }
  // Rows this rank holds, zero elsewhere (bf16 rows widened); under SP the partial rows of all N
  // tokens are built in workspace and reduce-scattered to this rank's rows.
  float* part = ctx_.partial_buffer(out);
  ctx_.kt->vocab_embedding_forward(part, ids, table, ctx_.compute, lo_, rows_, N, C_);
  if (ctx_.tp()) ctx_.reduce_partial(part, out);
}

void VocabParallelEmbedding::backward(float* dw, const float* dout_all, const int32_t* ids) {
  const int64_t N = ctx_.tokens();
  if (ctx_.tp())  // only the rows this rank holds
    ctx_.kt->vocab_embedding_backward(dw, dout_all, ids, lo_, rows_, N, C_);
  else
    ctx_.kt->embedding_backward(dw, dout_all, ids, N, C_);
}

// ---- VocabParallelCrossEntropy ----

void VocabParallelCrossEntropy::forward(float* lg, const int32_t* tg, float* losses, int64_t N, bool train,
                                        float dloss) const {
  const kernels::KernelTable* kt = ctx_.kt;
  if (!ctx_.tp()) {
    if (train)
      kt->softmax_cross_entropy(lg, losses, tg, N, V_, cols_, dloss);
    else
      kt->softmax_cross_entropy_forward(lg, losses, tg, N, V_, cols_);
    return;
  }
  const int64_t valid = std::clamp<int64_t>(V_ - lo_, 0, cols_);  // real vocabulary columns on this rank
  Tensor mx = Tensor::empty({N}, DType::F32, MemCategory::Workspace);
  Tensor red = Tensor::empty({2 * N}, DType::F32, MemCategory::Workspace);  // [sum of exp | target logit]
  kt->vp_ce_rowmax(mx.f32(), lg, N, cols_, valid);
  ctx_.comm->all_reduce_max(mx.f32(), N);
  kt->vp_ce_stats(red.f32(), lg, mx.f32(), tg, N, cols_, valid, lo_);
  ctx_.comm->all_reduce_sum(red.f32(), 2 * N);
  kt->vp_ce_finish(lg, losses, mx.f32(), red.f32(), tg, N, cols_, valid, lo_, train, dloss);
}

}  // namespace mt
