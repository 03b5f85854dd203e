// The compute and memory-bandwidth ceilings of this CPU at a model's shapes (see compute_probe.h).
#include "train/compute_probe.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/fma_peak.h"
#include "plan/cost_model.h"
#include "runtime/device.h"
#include "runtime/tensor.h"

namespace mt {

namespace {
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
double secs_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

volatile float g_sink = 0.0f;

}  // namespace

double fma_peak_here(double seconds) { return kernels::cpu::fma_peak(0, seconds / 3, 3); }

plan::CpuMeasurement measure_this_cpu(const ModelConfig& m, int64_t micro_batch, bool bf16, int ranks_per_node,
                                      double seconds) {
  using kernels::cpu::CpuIsa;
  plan::CpuMeasurement r;
  r.ranks_per_node = std::max(1, ranks_per_node);
  const ComputeCeiling cc = measure_compute_here(m, micro_batch, bf16, seconds);
  r.model_flops = cc.flops_per_s;
  r.model_flops_bf16 = bf16;
  r.mem_bw = cc.elem_bw > 0 ? cc.elem_bw : cc.mem_bw;  // what the planner's elementwise model needs
  r.peak_flops_fp32 = fma_peak_here();
  // bf16 arithmetic: AVX512-BF16's dot product does twice the fp32 FMA work per instruction and
  // AMX-BF16 a tile multiply (Intel: 1024 bf16 FLOP per cycle and core, 16x the AVX-512 fp32
  // rate); without either, bf16 is widened to fp32.
  const CpuIsa isa = kernels::cpu::active_isa();
  r.peak_flops_bf16 = r.peak_flops_fp32 * (isa >= CpuIsa::AMX_BF16 ? 16.0 : isa >= CpuIsa::AVX512_BF16 ? 2.0 : 1.0);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  r.node_mem = pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
  r.description = "this machine: " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + " cpus, " +
                  std::to_string(r.ranks_per_node) + " rank(s) x " + std::to_string(omp_get_max_threads()) +
                  " thread(s); " + kernels::describe(Device::CPU);
  return r;
}

namespace {

// The engine's kernels at one tp rank's share of a model's shapes (heads, MLP width, vocabulary
// columns), with the buffers they run on.
class Probe {
 public:
  Probe(const ModelConfig& m, int64_t micro_batch, bool use_bf16, int tp, bool sp);
  // Seconds and the planner's FLOPs of whole steps' matmuls and attention, run for about `seconds`.
  void time_matmuls(double seconds);
  // Seconds per micro-batch of the non-matmul work, run for about `seconds`.
  double time_elementwise(double seconds);

  double t_gemm = 0, t_attn = 0, f_gemm = 0, f_attn = 0;

 private:
  void linear(int64_t in, int64_t o, bool has_bias);
  void attention();
  void norm();
  void tp_bf16_sums(int k);
  void elementwise_step();
  void loss_embedding_optimizer();

  const ModelConfig& m;
  const kernels::KernelTable& K;  // the kernels the engine runs here
  const bool use_bf16, gpt;
  const int64_t t, T, B, N, C, F, hd, nh, nkv, V, qkvw;
  int64_t Rn;  // rows a norm sees: under SP its rank's share of the sequence
  std::vector<std::pair<int64_t, int64_t>> lin;  // (in, out) of every linear of one block
  std::vector<float> x, dx, y, out, w, dw, qkv, att, lse, dqkv, datt, bias, dbias;
  std::vector<bf16> xb, wb;
  // The elementwise step's: rows as wide as any kernel below touches, norm parameters and
  // statistics, losses, the zeroed activation gradients, the optimizer's flat buffers.
  std::vector<float> ea, eb, ec, ed, nw, nb, mean, rstd, ndw, ndb, losses, vstats, zbuf;
  std::vector<bf16> eab;
  std::vector<int32_t> ids;
  int64_t P = 0;
  Tensor pw, pg, pm, pv, pb;
};

size_t sz(int64_t n) { return static_cast<size_t>(n); }

Probe::Probe(const ModelConfig& m_, int64_t micro_batch, bool bf16_, int tp, bool sp)
    : m(m_),
      K(kernels::table(Device::CPU)),
      use_bf16(bf16_),
      gpt(m_.arch == Arch::GPT2),
      t(std::max(1, tp)),
      T(m_.seq_len),
      B(micro_batch),
      N(B * T),
      C(m_.n_embd),
      F(m_.ffn_hidden / t),
      hd(m_.head_dim()),
      nh(m_.n_head / t),
      nkv(m_.n_kv_head / t),
      V((m_.padded_vocab + t - 1) / t),
      qkvw((nh + 2 * nkv) * hd) {
  if (gpt) lin = {{C, 3 * nh * hd}, {nh * hd, C}, {C, F}, {F, C}};
  else lin = {{C, (nh + 2 * nkv) * hd}, {nh * hd, C}, {C, F}, {C, F}, {F, C}};
  int64_t max_in = C, max_out = V, max_w = C * V;  // the head: C -> V
  for (auto [in, o] : lin) max_in = std::max(max_in, in), max_out = std::max(max_out, o), max_w = std::max(max_w, in * o);
  x.assign(sz(N * max_in), 0.01f), dx.resize(sz(N * max_in));     // inputs, their gradient
  y.assign(sz(N * max_out), 0.02f), out.resize(sz(N * max_out));  // output gradient, outputs
  w.assign(sz(max_w), 0.001f), dw.assign(sz(max_w), 0.f);
  xb.resize(x.size()), wb.resize(w.size());
  K.cast_f32_to_bf16(xb.data(), x.data(), static_cast<int64_t>(x.size()));
  K.cast_f32_to_bf16(wb.data(), w.data(), static_cast<int64_t>(w.size()));
  qkv.assign(sz(N * qkvw), 0.01f), att.resize(sz(N * nh * hd)), lse.resize(sz(N * nh)), dqkv.resize(sz(N * qkvw));
  datt.assign(sz(N * nh * hd), 0.01f);
  bias.assign(sz(max_out), 0.01f), dbias.assign(sz(max_out), 0.f);

  P = std::max<int64_t>(1, m.num_params() / t);
  pw = Tensor::zeros({P}, DType::F32, MemCategory::Workspace), pg = Tensor::zeros({P}, DType::F32, MemCategory::Workspace);
  pm = Tensor::zeros({P}, DType::F32, MemCategory::Workspace), pv = Tensor::zeros({P}, DType::F32, MemCategory::Workspace);
  pb = Tensor::zeros({use_bf16 ? P : 1}, DType::BF16, MemCategory::Workspace);
  int64_t widest = std::max(F, C);  // every row width the kernels below touch
  for (auto [in, o] : lin) widest = std::max({widest, in, o});
  const int64_t NF = N * widest;
  ea.assign(sz(NF), 0.01f), eb.assign(sz(NF), 0.02f), ec.resize(sz(NF)), ed.resize(sz(NF));
  nw.assign(sz(C), 1.0f), nb.assign(sz(C), 0.0f), mean.resize(sz(N)), rstd.resize(sz(N)), ndw.resize(sz(C));
  ndb.resize(sz(C)), losses.resize(sz(N)), vstats.resize(sz(2 * N));
  eab.resize(sz(NF));
  ids.resize(sz(N));
  for (int64_t i = 0; i < N; ++i) ids[sz(i)] = static_cast<int32_t>(i % std::min<int64_t>(V, m.vocab_size));
  Rn = sp && t > 1 ? N / t : N;
  // The activation gradients the backward zeroes before accumulating into them (the kernels add,
  // gemm.h): the MLP's input and output side, the attention output, qkv and the two linears' inputs.
  zbuf.resize(sz(N * ((gpt ? 2 : 3) * F + 2 * C + nh * hd + qkvw)));
}

// One linear layer forward and backward exactly as the model calls it (kernels/gemm.h: GPT-2's
// linears have biases, Llama's and the head do not).
void Probe::linear(int64_t in, int64_t o, bool has_bias) {
  const float* b = has_bias ? bias.data() : nullptr;
  float* db = has_bias ? dbias.data() : nullptr;
  if (use_bf16) {
    K.linear_forward_bf16(out.data(), xb.data(), wb.data(), b, N, in, o);
    K.linear_backward_bf16(dx.data(), dw.data(), db, y.data(), xb.data(), wb.data(), N, in, o);
  } else {
    K.linear_forward(out.data(), x.data(), w.data(), b, N, in, o);
    K.linear_backward(dx.data(), dw.data(), db, y.data(), x.data(), w.data(), N, in, o);
  }
}

void Probe::attention() {
  K.attention_forward(att.data(), lse.data(), qkv.data(), B, T, nh, nkv, hd, nullptr);
  K.attention_backward(dqkv.data(), datt.data(), qkv.data(), att.data(), lse.data(), B, T, nh, nkv, hd, nullptr);
}

void Probe::time_matmuls(double seconds) {
  // The planner's FLOP count (plan/estimate.cpp): 2 x weights forward, twice that backward; attention
  // 4 s h per token forward (full, non-causal), twice that backward.
  double gemm_flops_layer = 0;
  for (auto [in, o] : lin) gemm_flops_layer += 6.0 * static_cast<double>(N) * in * o;
  const double head_flops = 6.0 * static_cast<double>(N) * C * V;
  const double attn_flops_layer = 12.0 * static_cast<double>(N) * T * nh * hd;
  // Warm-up (library JIT, page faults): one layer.
  for (auto [in, o] : lin) linear(in, o, gpt);
  attention();
  const auto t0 = Clock::now();
  do {
    for (int64_t l = 0; l < m.n_layer; ++l) {
      auto a = Clock::now();
      for (auto [in, o] : lin) linear(in, o, gpt);
      t_gemm += secs_since(a);
      f_gemm += gemm_flops_layer;
      a = Clock::now();
      attention();
      t_attn += secs_since(a);
      f_attn += attn_flops_layer;
    }
    auto a = Clock::now();
    linear(C, V, false);
    t_gemm += secs_since(a);
    f_gemm += head_flops;
  } while (secs_since(t0) < seconds);
}

void Probe::norm() {
  if (gpt) {
    K.layernorm_forward(ec.data(), mean.data(), rstd.data(), ea.data(), nw.data(), nb.data(), Rn, C, 1e-5f);
    K.layernorm_backward(ed.data(), ndw.data(), ndb.data(), eb.data(), ea.data(), nw.data(), mean.data(), rstd.data(), Rn, C);
  } else {
    K.rmsnorm_forward(ec.data(), rstd.data(), ea.data(), nw.data(), Rn, C, 1e-5f);
    K.rmsnorm_backward(ed.data(), ndw.data(), eb.data(), ea.data(), nw.data(), rstd.data(), Rn, C);
  }
}

// `k` sums over the tp ranks that travel in bf16 (tp > 1 in bf16 runs): each [N, C] partial is
// cast before and its result (the rank's rows under SP) widened after.
void Probe::tp_bf16_sums(int k) {
  if (t == 1 || !use_bf16) return;
  for (int i = 0; i < k; ++i) {
    K.cast_f32_to_bf16(eab.data(), ea.data(), N * C);
    K.cast_bf16_to_f32(ec.data(), eab.data(), Rn * C);
  }
}

// The final norm, the head input's cast and sums, the loss over [tokens, vocabulary / tp], the
// embedding, and the optimizer step over the rank's parameters (zeroed gradients, their norm,
// AdamW writing the bf16 copy).
void Probe::loss_embedding_optimizer() {
  float* logits = out.data();  // [N, max_out], max_out >= V
  float *table = w.data(), *dtable = dw.data();  // [max_w] >= the embedding table
  norm();
  if (use_bf16) K.cast_f32_to_bf16(eab.data(), ea.data(), N * C);
  tp_bf16_sums(2);  // the embedding's partial sums and the head input gradient's
  // (in bf16 without tp the loss leaves the head's gradient in bf16 itself; with tp it is the
  // vocabulary-parallel loss's three passes over this rank's columns)
  const int64_t Vv = std::min<int64_t>(V, m.vocab_size);
  if (t > 1) {
    K.vp_ce_rowmax(mean.data(), logits, N, V, Vv);
    K.vp_ce_stats(vstats.data(), logits, mean.data(), ids.data(), N, V, Vv, 0);
    K.vp_ce_finish(logits, losses.data(), mean.data(), vstats.data(), ids.data(), N, V, Vv, 0, true, 1.0f);
  } else if (use_bf16) {
    K.softmax_cross_entropy_bf16(logits, losses.data(), ids.data(), N, Vv, V, 1.0f);
  } else {
    K.softmax_cross_entropy(logits, losses.data(), ids.data(), N, Vv, V, 1.0f);
  }
  K.embedding_forward(ec.data(), ids.data(), table, N, C);
  K.embedding_backward(dtable, eb.data(), ids.data(), N, C);
  pg.zero_();
  g_sink = static_cast<float>(K.sum_squares(pg.f32(), P));
  K.adamw_update(pw.f32(), pg.f32(), pm.f32(), pv.f32(), P, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f,
                 use_bf16 ? pb.bf() : nullptr);  // the bf16 copy in the same pass
}

// The non-matmul work of one micro-batch as the engine runs it (model/transformer.cpp,
// model/tp_layers.cpp): per block two norms forward and backward, the activation, two residual
// adds each way (under SP on the rank's rows), the activation gradients zeroed before the
// backward accumulates into them, in bf16 the casts of the linears' inputs and output gradients
// and with tp those of the activations that cross in bf16; then loss_embedding_optimizer().
void Probe::elementwise_step() {
  for (int64_t l = 0; l < m.n_layer; ++l) {
    norm();
    norm();
    dev::zero(Device::CPU, zbuf.data(), zbuf.size() * sizeof(float));
    tp_bf16_sums(4);  // the forward's two partial sums, the backward's two input-gradient sums
    if (gpt) {
      K.gelu_forward(ec.data(), ea.data(), N * F);
      K.gelu_backward(ed.data(), ea.data(), eb.data(), N * F);
    } else {
      K.swiglu_forward(ec.data(), ea.data(), eb.data(), N * F);
      K.swiglu_backward(ed.data(), ec.data(), eb.data(), ea.data(), eb.data(), N * F);
    }
    for (int i = 0; i < 4; ++i) K.accumulate(ec.data(), ea.data(), Rn * C);
    if (use_bf16)
      for (auto [in, o] : lin) {
        K.cast_f32_to_bf16(eab.data(), ea.data(), N * in);  // the input
        K.cast_f32_to_bf16(eab.data(), eb.data(), N * o);   // the output gradient
      }
  }
  loss_embedding_optimizer();
}

double Probe::time_elementwise(double seconds) {
  elementwise_step();  // warm-up: first touch of the buffers
  double t_elem = 0;
  int reps = 0;
  const auto e0 = Clock::now();
  do {
    const auto a = Clock::now();
    elementwise_step();
    t_elem += secs_since(a);
    ++reps;
  } while (secs_since(e0) < seconds);
  return t_elem / reps;
}

// Streaming: dst += src over two arrays (12 bytes per element: two reads, one write); bytes/s.
double stream_bandwidth(double stream_bytes, double seconds) {
  const kernels::KernelTable& K = kernels::table(Device::CPU);
  const int64_t n = std::max<int64_t>(1 << 16, static_cast<int64_t>(stream_bytes / 8));
  Tensor a = Tensor::zeros({n}, DType::F32, MemCategory::Workspace);
  Tensor b = Tensor::zeros({n}, DType::F32, MemCategory::Workspace);
  K.accumulate(a.f32(), b.f32(), n);
  double bytes = 0;
  const auto s0 = Clock::now();
  do {
    K.accumulate(a.f32(), b.f32(), n);
    bytes += 12.0 * static_cast<double>(n);
  } while (secs_since(s0) < seconds);
  return bytes / secs_since(s0);
}

}  // namespace

ComputeCeiling measure_compute_here(const ModelConfig& m_in, int64_t micro_batch, bool use_bf16, double seconds,
                                    double stream_bytes, int tp, bool sp) {
  ModelConfig m = m_in;
  m.resolve();
  const int t = std::max(1, tp);
  ComputeCeiling r;
  {
    Probe probe(m, micro_batch, use_bf16, t, sp);
    probe.time_matmuls(seconds);
    r.elem_s = probe.time_elementwise(std::max(0.05, 0.3 * seconds));
    r.gemm_flops_per_s = probe.f_gemm / probe.t_gemm;
    r.flops_per_s = (probe.f_gemm + probe.f_attn) / (probe.t_gemm + probe.t_attn);
  }
  r.elem_bw = plan::elementwise_bytes(m, micro_batch, use_bf16, t, sp && t > 1) / r.elem_s;
  r.threads = omp_get_max_threads();
  r.procs = 1;
  r.mem_bw = stream_bandwidth(stream_bytes, std::max(0.05, 0.25 * seconds));
  return r;
}

std::string compute_probe_json(const ComputeCeiling& c) {
  json j = {{"flops_per_s", c.flops_per_s},
            {"gemm_flops_per_s", c.gemm_flops_per_s},
            {"mem_bw", c.mem_bw},
            {"elem_bw", c.elem_bw},
            {"elem_s", c.elem_s},
            {"threads", c.threads}};
  return j.dump() + "\n";
}

}  // namespace mt
