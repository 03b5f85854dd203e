#include "model/layers/moe.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kernels/backend.h"

namespace mt {

namespace {
// `t`, grown to at least n elements (one at least) of dtype dt.
Tensor& fit(Tensor& t, int64_t n, DType dt = DType::F32) {
  n = std::max<int64_t>(n, 1);
  if (!t.defined() || t.numel() < n || t.dtype() != dt) t = Tensor::empty({n}, dt, MemCategory::Workspace);
  return t;
}
}  // namespace

MoeLayer::MoeLayer(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt, TpContext& tpc,
                   MoeShape shape, ExpertComm* ep, CpComm* cp)
    : cfg_(cfg), compute_(compute), dev_(dev), kt_(kt), tpc_(tpc), shape_(shape), ep_(ep), cp_(cp) {}

// An expert's capacity for n tokens' choices: ceil(factor x n k / E), or every choice (dropless).
int64_t MoeLayer::capacity(int64_t n) const {
  const int64_t k = cfg_.moe_top_k;
  if (cfg_.moe_capacity_factor <= 0) return n * k;
  return static_cast<int64_t>(std::ceil(static_cast<double>(cfg_.moe_capacity_factor) * static_cast<double>(n * k) /
                                        static_cast<double>(cfg_.moe_experts)));
}

// Routed rows an MoE layer's activations are first sized for: every choice (dropless or with a
// capacity: a rank may receive up to that many with ep), or exactly E x capacity when padded (what
// a rank sends, and with ep receives).
int64_t MoeLayer::rows_hint(int64_t n) const {
  return cfg_.moe_pad_to_capacity ? cfg_.moe_experts * capacity(n) : n * cfg_.moe_top_k;
}

MoeStats MoeLayer::take_stats() {
  MoeStats s = std::move(stats_);
  stats_ = MoeStats{};
  if (s.microbatches > 0) {
    s.aux_loss /= static_cast<double>(s.microbatches);
    s.z_loss /= static_cast<double>(s.microbatches);
  }
  return s;
}

// The MoE layer of block `layer` on the normalised input x ([N, C], compute dtype): out = the
// router-weighted sum of each token's k experts' outputs plus the shared experts' output.
//   router   logits = ln2 @ Wr^T (fp32), scores, top-k and normalised weights (moe_router_forward)
//   dispatch the host reads the choices and orders them expert by expert (token order inside an
//            expert), dropping what exceeds the capacity; the input rows are gathered in that order
//   exchange with expert parallelism, the rows of each rank's experts go there (variable-size
//            all-to-all, counts exchanged first) and are put in expert order there
//   experts  one GEMM per expert over its contiguous rows (grouped: no per-token loop)
//   return   the outputs travel back the same way
//   combine  out[t] = sum_j w[t, j] * y[row of (t, j)]
// The router's fp32 input: the stored normalised input itself, or (bf16 runs) its n values widened
// into the workspace.
const float* MoeLayer::router_input(const Tensor& x, int64_t n) {
  if (compute_ != DType::BF16) return x.f32();
  float* t = fit(ws_.x_f32, n).f32();
  kt_->cast_bf16_to_f32(t, x.bf(), n);
  return t;
}

void MoeLayer::forward(LayerParams& P, int layer, const BlockParams& p, BlockActivations& a, const Tensor& x,
                       float* out, int64_t N, float dloss, bool count) {
  const int64_t C = cfg_.n_embd, E = cfg_.moe_experts, k = cfg_.moe_top_k;
  const int sig = cfg_.moe_sigmoid ? 1 : 0;
  a.dloss = dloss;
  if (shape_.experts_apart && !ep_)
    throw std::logic_error("expert parallelism without an expert communicator (ModelOptions::ep_comm)");
  // Router, in fp32 from the stored (compute-dtype) normalised input.
  const float* xin = router_input(x, N * C);
  kt_->linear_forward(a.r_logits.f32(), xin, P.f32(p.router), nullptr, N, C, E);
  kt_->moe_router_forward(a.r_scores.f32(), a.r_idx.i32(), a.r_w.f32(), a.r_lse.f32(), a.r_logits.f32(), N, E,
                          k, sig);
  int64_t dropped = 0;
  dispatch(a, x, N, &dropped);
  float* y = tpc_.partial_buffer(out);  // every token's output (this tp rank's partial sums)
  experts_forward(P, p, a, y, N);
  shared_forward(P, p, a, x, y, N);
  // Tensor parallelism: every expert's hidden width is split (w1 / w3 / c_fc by rows, w2 / c_proj
  // by columns), so each tp rank holds a partial sum of the layer's output: all-reduced, or under
  // SP reduce-scattered to this rank's rows (the row-parallel layer's reduction).
  tpc_.reduce_partial(y, out);
  if (count) record(layer, a, N, dropped);
}

// The dispatch plan on the host (every choice's row, expert by expert, within the capacity) and
// the routed input rows in expert order (a.xs).
void MoeLayer::dispatch(BlockActivations& a, const Tensor& x, int64_t N, int64_t* dropped) {
  const int64_t C = cfg_.n_embd, E = cfg_.moe_experts, k = cfg_.moe_top_k;
  const int64_t esz = compute_ == DType::BF16 ? 2 : 4;
  std::vector<int32_t> idx(static_cast<size_t>(N * k));
  if (dev_ == Device::Meta) {  // nothing to read: an even spread
    for (int64_t i = 0; i < N * k; ++i) idx[i] = static_cast<int32_t>(i % E);
  } else {
    dev::copy_to_host(dev_, idx.data(), a.r_idx.raw(), idx.size() * sizeof(int32_t));
  }
  a.counts.assign(static_cast<size_t>(E), 0);
  for (int32_t e : idx) ++a.counts[e];
  counts_over_cp(a);
  // With model.moe_pad_to_capacity every expert gets exactly `cap` rows, the kept choices' rows
  // first, then zero rows (order -1); their outputs are never combined and their gradients are zero.
  const bool pad = cfg_.moe_pad_to_capacity;
  const int64_t cap = capacity(N);
  std::vector<int64_t> off(static_cast<size_t>(E) + 1, 0), fill(static_cast<size_t>(E), 0), kept(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    kept[e] = pad ? cap : std::min(a.counts[e], cap);  // rows sent to expert e
    off[e + 1] = off[e] + kept[e];
  }
  const int64_t Ms = off[E];  // rows this rank's tokens send (to every expert)
  std::vector<int32_t> pos(static_cast<size_t>(N * k)), order(static_cast<size_t>(std::max<int64_t>(Ms, 1)), -1);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[t * k + j];
      if (fill[e] < cap) {
        const int64_t r = off[e] + fill[e]++;
        pos[t * k + j] = static_cast<int32_t>(r);
        order[r] = static_cast<int32_t>(t);
      } else {
        pos[t * k + j] = -1;
        ++*dropped;
      }
    }
  dev::copy_from_host(dev_, a.r_pos.raw(), pos.data(), pos.size() * sizeof(int32_t));
  a.Msend = Ms;
  a.kept.assign(static_cast<size_t>(shape_.local_experts), 0);
  if (shape_.experts_apart) {
    dispatch_ep(a, x, kept, order, N, cap);
    return;
  }
  for (int64_t e = 0; e < shape_.local_experts; ++e) a.kept[e] = kept[shape_.first_expert + e];
  a.M = Ms;
  alloc_moe_acts(a, cfg_, compute_, N, Ms, shape_.expert_width, shape_.bf16_pre);
  dev::copy_from_host(dev_, a.order.raw(), order.data(), static_cast<size_t>(Ms) * sizeof(int32_t));
  kt_->moe_gather_rows(a.xs.raw(), x.raw(), a.order.i32(), Ms, C * esz);
}

// Expert parallelism: counts first (every ep rank's rows per expert), then the rows themselves go
// to their experts' ranks; the received rows are put in expert order (a.xs).
void MoeLayer::dispatch_ep(BlockActivations& a, const Tensor& x, const std::vector<int64_t>& kept,
                           const std::vector<int32_t>& order, int64_t N, int64_t cap) {
  const int64_t C = cfg_.n_embd, E = cfg_.moe_experts, El = shape_.local_experts, lo = shape_.first_expert;
  const int64_t esz = compute_ == DType::BF16 ? 2 : 4, Ms = a.Msend;
  const int R = ep_->size();
  std::vector<int64_t> K(static_cast<size_t>(R * E), cap);
  if (!cfg_.moe_pad_to_capacity) ep_->all_gather_counts(kept.data(), K.data(), E);  // padded: every count is cap
  a.send_rows.assign(static_cast<size_t>(R), 0);
  a.recv_rows.assign(static_cast<size_t>(R), 0);
  for (int r = 0; r < R; ++r)
    for (int64_t e = 0; e < El; ++e) {
      a.send_rows[r] += kept[r * El + e];
      a.recv_rows[r] += K[r * E + lo + e];
    }
  int64_t Mr = 0;
  for (int r = 0; r < R; ++r) Mr += a.recv_rows[r];
  // Received rows come by source rank, each source's in expert order; `perm` puts them in
  // expert order (source order inside an expert).
  std::vector<int32_t> perm, inv(static_cast<size_t>(std::max<int64_t>(Mr, 1)));
  perm.reserve(static_cast<size_t>(Mr));
  for (int64_t e = 0; e < El; ++e) {
    int64_t base = 0;
    for (int r = 0; r < R; ++r) {
      int64_t within = 0;
      for (int64_t f = 0; f < e; ++f) within += K[r * E + lo + f];
      for (int64_t i = 0; i < K[r * E + lo + e]; ++i) perm.push_back(static_cast<int32_t>(base + within + i));
      base += a.recv_rows[r];
    }
    for (int r = 0; r < R; ++r) a.kept[e] += K[r * E + lo + e];
  }
  for (int64_t i = 0; i < Mr; ++i) inv[perm[i]] = static_cast<int32_t>(i);
  a.M = Mr;
  alloc_moe_acts(a, cfg_, compute_, N, Mr, shape_.expert_width, shape_.bf16_pre);
  if (!a.inv.defined() || a.inv.numel() < std::max<int64_t>(Mr, 1))
    a.inv = Tensor::empty({std::max<int64_t>(Mr, 1)}, DType::I32, MemCategory::Activations);
  if (!a.ysend.defined() || a.ysend.numel() < std::max<int64_t>(Ms, 1) * C)
    a.ysend = Tensor::empty({std::max<int64_t>(Ms, 1), C}, DType::F32, MemCategory::Activations);
  dev::copy_from_host(dev_, a.order.raw(), perm.data(), static_cast<size_t>(Mr) * sizeof(int32_t));
  dev::copy_from_host(dev_, a.inv.raw(), inv.data(), static_cast<size_t>(Mr) * sizeof(int32_t));
  Tensor& tok = fit(ws_.send_tokens, Ms, DType::I32);
  dev::copy_from_host(dev_, tok.raw(), order.data(), static_cast<size_t>(Ms) * sizeof(int32_t));
  void* xsend = fit(ws_.x_send, Ms * C, compute_).raw();
  void* xrecv = fit(ws_.x_recv, Mr * C, compute_).raw();
  kt_->moe_gather_rows(xsend, x.raw(), tok.i32(), Ms, C * esz);
  ep_->all_to_all_v(xsend, a.send_rows.data(), xrecv, a.recv_rows.data(), C, compute_);
  kt_->moe_gather_rows(a.xs.raw(), xrecv, a.order.i32(), Mr, C * esz);
}

// The routed experts on their rows (each expert's rows contiguous: one GEMM each), the outputs
// returned to the ranks their rows came from (ep), and combined per token into y (zeroed first).
void MoeLayer::experts_forward(LayerParams& P, const BlockParams& p, BlockActivations& a, float* y, int64_t N) {
  const int64_t C = cfg_.n_embd, k = cfg_.moe_top_k, Fe = shape_.expert_width, M = a.M;
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  auto lin = [&](float* out, const Tensor& x, int64_t row0, const Weight& w, int64_t n, int64_t in) {
    if (n == 0) return;
    if (bf)
      kt_->linear_forward_bf16(out, x.bf() + row0 * in, w.wb, w.b, n, in, w.out);
    else
      kt_->linear_forward(out, x.f32() + row0 * in, w.wf, w.b, n, in, w.out);
  };
  const int st = expert_stride(cfg_);
  int64_t r0 = 0;
  if (shape_.bf16_pre) {  // Llama, bf16: h1 (gate) and h3 (up) written in bf16, SwiGLU on them into xact
    for (int64_t e = 0; e < shape_.local_experts; ++e) {
      const int q = p.expert0 + static_cast<int>(e) * st;
      const int64_t n = a.kept[e];
      if (n > 0) {
        const Weight w1 = P.expert_weight(q, -1, Fe, false), w3 = P.expert_weight(q + 2, -1, Fe, false);
        kt_->linear_forward_bf16_out16(a.h1.bf() + r0 * Fe, a.xs.bf() + r0 * C, w1.wb, nullptr, n, C, Fe);
        kt_->linear_forward_bf16_out16(a.h3.bf() + r0 * Fe, a.xs.bf() + r0 * C, w3.wb, nullptr, n, C, Fe);
      }
      r0 += n;
    }
    kt_->swiglu_forward_bf16(a.xact.bf(), a.h1.bf(), a.h3.bf(), M * Fe);
  }
  for (int64_t e = 0; e < shape_.local_experts && !shape_.bf16_pre; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    if (gpt) {
      lin(a.h1.f32() + r0 * Fe, a.xs, r0, P.expert_weight(q, q + 1, Fe, false), n, C);
    } else {
      lin(a.h1.f32() + r0 * Fe, a.xs, r0, P.expert_weight(q, -1, Fe, false), n, C);      // w1: gate
      lin(a.h3.f32() + r0 * Fe, a.xs, r0, P.expert_weight(q + 2, -1, Fe, false), n, C);  // w3: up
    }
    r0 += n;
  }
  if (!shape_.bf16_pre) {
    float* act = bf ? fit(ws_.act_f32, M * Fe).f32() : a.xact.f32();
    if (gpt)
      kt_->gelu_forward(act, a.h1.f32(), M * Fe);
    else
      kt_->swiglu_forward(act, a.h1.f32(), a.h3.f32(), M * Fe);
    if (bf) kt_->cast_f32_to_bf16(a.xact.bf(), act, M * Fe);
  }
  r0 = 0;
  for (int64_t e = 0; e < shape_.local_experts; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    if (gpt)  // row-parallel over tp: the bias is added by one tp rank only (the outputs are summed)
      lin(a.y.f32() + r0 * C, a.xact, r0, P.expert_weight(q + 2, tpc_.rank == 0 ? q + 3 : -1, C, false), n, Fe);
    else
      lin(a.y.f32() + r0 * C, a.xact, r0, P.expert_weight(q + 1, -1, C, false), n, Fe);  // w2: down
    r0 += n;
  }
  const float* yback = a.y.f32();
  if (shape_.experts_apart) {  // back to the ranks the rows came from, in the order they were sent
    float* yrecv = fit(ws_.ep_recv, M * C).f32();
    kt_->moe_gather_rows(yrecv, a.y.raw(), a.inv.i32(), M, C * 4);
    ep_->all_to_all_v(yrecv, a.recv_rows.data(), a.ysend.f32(), a.send_rows.data(), C, DType::F32);
    yback = a.ysend.f32();
  }
  dev::zero(dev_, y, static_cast<size_t>(N * C) * sizeof(float));
  kt_->moe_combine(y, yback, a.r_pos.i32(), a.r_w.f32(), N, k, C);
}

// Shared experts: a dense MLP of width Fs on every token, added to y.
void MoeLayer::shared_forward(LayerParams& P, const BlockParams& p, BlockActivations& a, const Tensor& x, float* y,
                              int64_t N) {
  const int64_t Fs = shape_.shared_width, C = cfg_.n_embd;
  if (Fs == 0) return;
  const bool bf = compute_ == DType::BF16;
  auto lin = [&](float* out, const Tensor& in_rows, const Weight& w, int64_t in) {
    if (bf)
      kt_->linear_forward_bf16(out, in_rows.bf(), w.wb, w.b, N, in, w.out);
    else
      kt_->linear_forward(out, in_rows.f32(), w.wf, w.b, N, in, w.out);
  };
  float* so = fit(ws_.shared_out, N * C).f32();
  float* sact = bf ? fit(ws_.act_f32, std::max(a.M * shape_.expert_width, N * Fs)).f32() : a.act.f32();
  if (cfg_.arch == Arch::GPT2) {
    lin(a.fc.f32(), x, P.weight(p.fc_w, p.fc_b, Fs, false), C);
    kt_->gelu_forward(sact, a.fc.f32(), N * Fs);
  } else {
    lin(a.fc.f32(), x, P.weight(p.fc_w, -1, Fs, false), C);
    lin(a.up.f32(), x, P.weight(p.up_w, -1, Fs, false), C);
    kt_->swiglu_forward(sact, a.fc.f32(), a.up.f32(), N * Fs);
  }
  if (bf) kt_->cast_f32_to_bf16(a.act.bf(), sact, N * Fs);
  lin(so, a.act, P.weight(p.down_w, tpc_.rank == 0 ? p.down_b : -1, C, false), Fs);
  kt_->accumulate(y, so, N * C);
}

// Statistics and the auxiliary losses' values (their gradients are applied in backward).
void MoeLayer::record(int layer, BlockActivations& a, int64_t N, int64_t dropped) {
  const int64_t E = cfg_.moe_experts, k = cfg_.moe_top_k;
  if (stats_.layers.empty() || stats_.layers.front() == layer) ++stats_.microbatches;
  size_t li = 0;
  while (li < stats_.layers.size() && stats_.layers[li] != layer) ++li;
  if (li == stats_.layers.size()) {
    stats_.layers.push_back(layer);
    stats_.tokens.emplace_back(static_cast<size_t>(E), 0);
  }
  for (int64_t e = 0; e < E; ++e) stats_.tokens[li][e] += a.counts[e];
  stats_.dropped += dropped;
  Tensor& Pe = fit(ws_.probs, E);  // before the dry run's return: the same workspace
  if (dev_ == Device::Meta) return;
  kt_->moe_balance_probs(Pe.f32(), a.r_scores.f32(), N, E, cfg_.moe_sigmoid ? 1 : 0);
  std::vector<float> hp(static_cast<size_t>(E)), hl(static_cast<size_t>(N));
  dev::copy_to_host(dev_, hp.data(), Pe.raw(), hp.size() * sizeof(float));
  dev::copy_to_host(dev_, hl.data(), a.r_lse.raw(), hl.size() * sizeof(float));
  // With cp this rank's share of the whole micro-batch's losses (its tokens' part of P_e and of the
  // z-loss's mean, f_e over every cp rank's choices): the shares sum to the micro-batch's losses.
  const double Nall = static_cast<double>(N) * (cp_ ? cp_->size() : 1);
  double aux = 0, z = 0;
  for (int64_t e = 0; e < E; ++e) aux += static_cast<double>(a.counts_all[e]) / (Nall * k) * hp[e];
  for (float v : hl) z += static_cast<double>(v) * v;
  stats_.aux_loss += static_cast<double>(E) * aux * (static_cast<double>(N) / Nall);
  stats_.z_loss += z / Nall;
}

// f_e of the load-balancing loss counts the whole micro-batch's choices: with context parallelism
// every cp rank routes its chunks of the same sequences, so the counts are summed over the cp ranks
// (Megatron-Core reduces them over its tp x cp group; the tp ranks here route the same tokens).
void MoeLayer::counts_over_cp(BlockActivations& a) {
  a.counts_all = a.counts;
  if (!cp_) return;
  const int64_t E = cfg_.moe_experts;
  const int n = cp_->size();
  std::vector<float> mine(a.counts.begin(), a.counts.end()), all(static_cast<size_t>(n * E), 0.0f);
  cp_->all_gather(mine.data(), all.data(), E);  // host counts, as the ep counts' all-gather
  for (int64_t e = 0; e < E; ++e) {
    int64_t c = 0;
    for (int r = 0; r < n; ++r) c += static_cast<int64_t>(all[static_cast<size_t>(r * E + e)]);
    a.counts_all[e] = c;
  }
}

// The exchanges of the forward run in reverse: the output gradients go to the experts' ranks, the
// input gradients come back.
const float* MoeLayer::backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dout_rows,
                                float* dln2, int64_t N) {
  const int64_t C = cfg_.n_embd, k = cfg_.moe_top_k, M = a.M;
  // Under SP every token's output gradient and input (the saved rows gathered again), as the
  // dense MLP's row- and column-parallel layers gather them.
  const float* dout = tpc_.gather_grad(dout_rows);
  if (tpc_.sp) tpc_.comm->wait(tpc_.start_regather(a.ln2));
  const Tensor& x = tpc_.sp ? tpc_.full_compute() : a.ln2;
  dev::zero(dev_, dln2, static_cast<size_t>(N * C) * sizeof(float));
  shared_backward(P, p, a, dout, x, dln2, N);
  const float* dy = combine_backward(a, dout, N);
  experts_backward(P, p, a, dy);
  // Dispatch backward: each token collects its rows' input gradients.
  const float* dxback = ws_.dxs.f32();
  if (shape_.experts_apart) {
    float* dxrecv = fit(ws_.ep_recv, M * C).f32();
    float* dxsend = fit(ws_.ep_send, a.Msend * C).f32();
    kt_->moe_gather_rows(dxrecv, ws_.dxs.f32(), a.inv.i32(), M, C * 4);
    ep_->all_to_all_v(dxrecv, a.recv_rows.data(), dxsend, a.send_rows.data(), C, DType::F32);
    dxback = dxsend;
  }
  kt_->moe_combine(dln2, dxback, a.r_pos.i32(), nullptr, N, k, C);
  router_backward(P, p, a, x, dln2, N);
  return tpc_.input_grad_sum(dln2, router_grad_handle_);
}

void MoeLayer::shared_backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dout,
                               const Tensor& x, float* dln2, int64_t N) {
  const int64_t Fs = shape_.shared_width, C = cfg_.n_embd;
  if (Fs == 0) return;
  const bool bf = compute_ == DType::BF16;
  auto linb = [&](float* dx, const Weight& w, const float* dy, const Tensor& in_rows, int64_t in) {
    if (tpc_.defer) {  // split backward: the weight gradient later, from copies
      if (bf)
        kt_->linear_backward_bf16(dx, nullptr, nullptr, dy, in_rows.bf(), w.wb, N, in, w.out);
      else
        kt_->linear_backward(dx, nullptr, nullptr, dy, in_rows.f32(), w.wf, N, in, w.out);
      tpc_.defer_weight_grad(w, dy, in_rows.raw(), N, in);
      return;
    }
    if (bf)
      kt_->linear_backward_bf16(dx, w.dw, w.db, dy, in_rows.bf(), w.wb, N, in, w.out);
    else
      kt_->linear_backward(dx, w.dw, w.db, dy, in_rows.f32(), w.wf, N, in, w.out);
  };
  float* sdact = fit(ws_.shared_dact, N * Fs).f32();
  float* sdfc = fit(ws_.shared_dfc, N * Fs).f32();
  dev::zero(dev_, sdact, static_cast<size_t>(N * Fs) * sizeof(float));
  dev::zero(dev_, sdfc, static_cast<size_t>(N * Fs) * sizeof(float));
  linb(sdact, P.weight(p.down_w, p.down_b, C, true), dout, a.act, Fs);
  if (cfg_.arch == Arch::GPT2) {
    kt_->gelu_backward(sdfc, a.fc.f32(), sdact, N * Fs);
    linb(dln2, P.weight(p.fc_w, p.fc_b, Fs, true), sdfc, x, C);
  } else {
    float* sdup = fit(ws_.shared_dup, N * Fs).f32();
    dev::zero(dev_, sdup, static_cast<size_t>(N * Fs) * sizeof(float));
    kt_->swiglu_backward(sdfc, sdup, sdact, a.fc.f32(), a.up.f32(), N * Fs);
    linb(dln2, P.weight(p.fc_w, -1, Fs, true), sdfc, x, C);
    linb(dln2, P.weight(p.up_w, -1, Fs, true), sdup, x, C);
  }
}

// Combine backward: the routed rows' output gradients (returned to the experts' ranks with ep, in
// expert order: the result) and the router weights' gradients (ws_.dw).
const float* MoeLayer::combine_backward(BlockActivations& a, const float* dout, int64_t N) {
  const int64_t C = cfg_.n_embd, k = cfg_.moe_top_k, M = a.M, Ms = a.Msend;
  float* dw = fit(ws_.dw, N * k).f32();
  float* dy = fit(ws_.dy, M * C).f32();  // in expert order
  const bool pad = cfg_.moe_pad_to_capacity;  // padding rows get no gradient: zero, not left unwritten
  if (!shape_.experts_apart) {
    if (pad) dev::zero(dev_, dy, static_cast<size_t>(M * C) * sizeof(float));
    kt_->moe_combine_backward(dy, dw, dout, a.y.f32(), a.r_pos.i32(), a.r_w.f32(), N, k, C);
    if (tpc_.tp()) tpc_.comm->all_reduce_sum(dw, N * k);  // <dout, y> over the tp ranks' partial outputs
    return dy;
  }
  float* dysend = fit(ws_.ep_send, Ms * C).f32();
  float* dyrecv = fit(ws_.ep_recv, M * C).f32();
  if (pad) dev::zero(dev_, dysend, static_cast<size_t>(Ms * C) * sizeof(float));
  kt_->moe_combine_backward(dysend, dw, dout, a.ysend.f32(), a.r_pos.i32(), a.r_w.f32(), N, k, C);
  // With tp the returned outputs are this tp rank's partial sums (its slice of every expert, as
  // the ep peers sharing its tp rank computed them): <dout, y> is summed over the tp ranks.
  if (tpc_.tp()) tpc_.comm->all_reduce_sum(dw, N * k);
  ep_->all_to_all_v(dysend, a.send_rows.data(), dyrecv, a.recv_rows.data(), C, DType::F32);
  kt_->moe_gather_rows(dy, dyrecv, a.order.i32(), M, C * 4);
  return dy;
}

// The routed experts' backward, in the forward's row order: the input gradients into ws_.dxs.
void MoeLayer::experts_backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dy) {
  const int64_t C = cfg_.n_embd, Fe = shape_.expert_width, M = a.M;
  const bool gpt = cfg_.arch == Arch::GPT2;
  const bool bf = compute_ == DType::BF16;
  auto linb = [&](float* dx, const Weight& w, const float* g, const Tensor& x, int64_t row0, int64_t n, int64_t in) {
    if (n == 0) return;
    if (tpc_.defer) {  // split backward: the weight gradient later, from copies
      if (bf)
        kt_->linear_backward_bf16(dx, nullptr, nullptr, g, x.bf() + row0 * in, w.wb, n, in, w.out);
      else
        kt_->linear_backward(dx, nullptr, nullptr, g, x.f32() + row0 * in, w.wf, n, in, w.out);
      tpc_.defer_weight_grad(w, g, bf ? static_cast<const void*>(x.bf() + row0 * in) : x.f32() + row0 * in, n, in);
      return;
    }
    if (bf)
      kt_->linear_backward_bf16(dx, w.dw, w.db, g, x.bf() + row0 * in, w.wb, n, in, w.out);
    else
      kt_->linear_backward(dx, w.dw, w.db, g, x.f32() + row0 * in, w.wf, n, in, w.out);
  };
  float* dact = fit(ws_.dact, M * Fe).f32();
  float* dxs = fit(ws_.dxs, M * C).f32();
  dev::zero(dev_, dact, static_cast<size_t>(M * Fe) * sizeof(float));
  dev::zero(dev_, dxs, static_cast<size_t>(M * C) * sizeof(float));
  const int st = expert_stride(cfg_);
  int64_t r0 = 0;
  for (int64_t e = 0; e < shape_.local_experts; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    const Weight w2 = gpt ? P.expert_weight(q + 2, q + 3, C, true) : P.expert_weight(q + 1, -1, C, true);
    linb(dact + r0 * Fe, w2, dy + r0 * C, a.xact, r0, n, Fe);
    r0 += n;
  }
  if (shape_.bf16_pre) {  // Llama, bf16: the gate's and up's gradients in bf16 (written), read by their GEMMs
    bf16* dh1 = fit(ws_.dh1, M * Fe, DType::BF16).bf();
    bf16* dh3 = fit(ws_.dh3, M * Fe, DType::BF16).bf();
    kt_->swiglu_backward_bf16(dh1, dh3, dact, a.h1.bf(), a.h3.bf(), M * Fe);
    r0 = 0;
    for (int64_t e = 0; e < shape_.local_experts; ++e) {
      const int q = p.expert0 + static_cast<int>(e) * st;
      const int64_t n = a.kept[e];
      if (n > 0) {
        const Weight w1 = P.expert_weight(q, -1, Fe, true), w3 = P.expert_weight(q + 2, -1, Fe, true);
        kt_->linear_backward_bf16_dy(dxs + r0 * C, w1.dw, dh1 + r0 * Fe, a.xs.bf() + r0 * C, w1.wb, n, C, Fe);
        kt_->linear_backward_bf16_dy(dxs + r0 * C, w3.dw, dh3 + r0 * Fe, a.xs.bf() + r0 * C, w3.wb, n, C, Fe);
      }
      r0 += n;
    }
    return;
  }
  float* dh1 = fit(ws_.dh1, M * Fe).f32();
  dev::zero(dev_, dh1, static_cast<size_t>(M * Fe) * sizeof(float));
  float* dh3 = nullptr;
  if (gpt) {
    kt_->gelu_backward(dh1, a.h1.f32(), dact, M * Fe);
  } else {
    dh3 = fit(ws_.dh3, M * Fe).f32();
    dev::zero(dev_, dh3, static_cast<size_t>(M * Fe) * sizeof(float));
    kt_->swiglu_backward(dh1, dh3, dact, a.h1.f32(), a.h3.f32(), M * Fe);
  }
  r0 = 0;
  for (int64_t e = 0; e < shape_.local_experts; ++e) {
    const int q = p.expert0 + static_cast<int>(e) * st;
    const int64_t n = a.kept[e];
    if (gpt) {
      linb(dxs + r0 * C, P.expert_weight(q, q + 1, Fe, true), dh1 + r0 * Fe, a.xs, r0, n, C);
    } else {
      linb(dxs + r0 * C, P.expert_weight(q, -1, Fe, true), dh1 + r0 * Fe, a.xs, r0, n, C);
      linb(dxs + r0 * C, P.expert_weight(q + 2, -1, Fe, true), dh3 + r0 * Fe, a.xs, r0, n, C);
    }
    r0 += n;
  }
}

// Router: the weights' gradient, the load-balancing loss (d/dP_e = coef E f_e per unit of the
// micro-batch's mean loss, whose weight is dloss x N) and the z-loss. With cp (N local tokens of
// N cp in the micro-batch, gradients averaged over the cp ranks) each rank differentiates cp
// times its share: the same per-token factor, with f_e over the whole micro-batch. Starts the sum
// of the input gradient over tp (router_grad_handle_).
void MoeLayer::router_backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const Tensor& x,
                               float* dln2, int64_t N) {
  const int64_t C = cfg_.n_embd, E = cfg_.moe_experts, k = cfg_.moe_top_k;
  float* aux = nullptr;
  if (cfg_.moe_aux_loss_coef > 0) {
    const double Nall = static_cast<double>(N) * (cp_ ? cp_->size() : 1);
    std::vector<float> h(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      h[e] = static_cast<float>(static_cast<double>(a.dloss) * N * cfg_.moe_aux_loss_coef * E *
                                (static_cast<double>(a.counts_all[e]) / (Nall * k)) / static_cast<double>(N));
    aux = fit(ws_.aux, E).f32();
    dev::copy_from_host(dev_, aux, h.data(), h.size() * sizeof(float));
  }
  const float z_scale = a.dloss * cfg_.moe_z_loss_coef;  // weight dloss x N on the mean over N tokens
  float* dlogits = fit(ws_.dlogits, N * E).f32();
  kt_->moe_router_backward(dlogits, ws_.dw.f32(), a.r_scores.f32(), a.r_idx.i32(), a.r_w.f32(), a.r_lse.f32(),
                           a.r_logits.f32(), aux, z_scale, N, E, k, cfg_.moe_sigmoid ? 1 : 0);
  const float* xin = router_input(x, N * C);
  // The experts' input gradients are partial sums over the tp ranks, the router's is whole on each:
  // tp rank 0 adds it, then the sum over tp (reduce-scattered under SP) overlaps the router's
  // weight gradient.
  kt_->linear_backward(tpc_.rank == 0 ? dln2 : nullptr, nullptr, nullptr, dlogits, xin, P.f32(p.router), N, C, E);
  router_grad_handle_ = tpc_.start_input_grad_sum(dln2);
  if (tpc_.defer) {  // split backward: the router's weight gradient later, from fp32 copies
    const kernels::KernelTable* kt = kt_;
    float* dw = P.grad(p.router);
    tpc_.defer->add({tpc_.defer->hold(dlogits, DType::F32, N * E, dev_), tpc_.defer->hold(xin, DType::F32, N * C, dev_)},
                    [kt, dw, N, C, E](const std::vector<Tensor>& h) {
                      kt->linear_backward(nullptr, dw, nullptr, h[0].f32(), h[1].f32(), nullptr, N, C, E);
                    });
    return;
  }
  kt_->linear_backward(nullptr, P.grad(p.router), nullptr, dlogits, xin, P.f32(p.router), N, C, E);
}

}  // namespace mt
