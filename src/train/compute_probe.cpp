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

ComputeCeiling measure_compute_here(const ModelConfig& m_in, int64_t micro_batch, bool use_bf16, double seconds,
                                    double stream_bytes, int tp, bool sp) {
  ModelConfig m = m_in;
  m.resolve();
  const kernels::KernelTable& K = kernels::table(Device::CPU);  // the kernels the engine runs here
  const int64_t t = std::max(1, tp);  // one tp rank's share: heads, MLP width, vocabulary columns
  const int64_t T = m.seq_len, B = micro_batch, N = B * T, C = m.n_embd, F = m.ffn_hidden / t, hd = m.head_dim();
  const int64_t nh = m.n_head / t, nkv = m.n_kv_head / t, V = (m.padded_vocab + t - 1) / t;
  const bool gpt = m.arch == Arch::GPT2;
  // (in, out) of every linear of one block, and the head.
  std::vector<std::pair<int64_t, int64_t>> lin;
  if (gpt) lin = {{C, 3 * nh * hd}, {nh * hd, C}, {C, F}, {F, C}};
  else lin = {{C, (nh + 2 * nkv) * hd}, {nh * hd, C}, {C, F}, {C, F}, {F, C}};
  const int64_t qkvw = (nh + 2 * nkv) * hd;
  int64_t max_in = C, max_out = V, max_w = C * V;  // the head: C -> V
  for (auto [in, o] : lin) max_in = std::max(max_in, in), max_out = std::max(max_out, o), max_w = std::max(max_w, in * o);
  auto sz = [](int64_t n) { return static_cast<size_t>(n); };
  std::vector<float> x(sz(N * max_in), 0.01f), dx(sz(N * max_in));       // inputs, their gradient
  std::vector<float> y(sz(N * max_out), 0.02f), out(sz(N * max_out));    // output gradient, outputs
  std::vector<float> w(sz(max_w), 0.001f), dw(sz(max_w), 0.f);
  std::vector<bf16> xb(x.size()), wb(w.size());
  K.cast_f32_to_bf16(xb.data(), x.data(), static_cast<int64_t>(x.size()));
  K.cast_f32_to_bf16(wb.data(), w.data(), static_cast<int64_t>(w.size()));
  std::vector<float> qkv(sz(N * qkvw), 0.01f), att(sz(N * nh * hd)), lse(sz(N * nh)), dqkv(sz(N * qkvw)),
      datt(sz(N * nh * hd), 0.01f);
  std::vector<float> bias(sz(max_out), 0.01f), dbias(sz(max_out), 0.f);
  // One linear layer forward and backward exactly as the model calls it (kernels/gemm.h: GPT-2's
  // linears have biases, Llama's and the head do not).
  auto linear = [&](int64_t in, int64_t o, bool has_bias) {
    const float* b = has_bias ? bias.data() : nullptr;
    float* db = has_bias ? dbias.data() : nullptr;
    if (use_bf16) {
      K.linear_forward_bf16(out.data(), xb.data(), wb.data(), b, N, in, o);
      K.linear_backward_bf16(dx.data(), dw.data(), db, y.data(), xb.data(), wb.data(), N, in, o);
    } else {
      K.linear_forward(out.data(), x.data(), w.data(), b, N, in, o);
      K.linear_backward(dx.data(), dw.data(), db, y.data(), x.data(), w.data(), N, in, o);
    }
  };
  auto attention = [&]() {
    K.attention_forward(att.data(), lse.data(), qkv.data(), B, T, nh, nkv, hd);
    K.attention_backward(dqkv.data(), datt.data(), qkv.data(), att.data(), lse.data(), B, T, nh, nkv, hd);
  };
  // The planner's FLOP count (cost_model.cpp): 2 x weights forward, twice that backward; attention
  // 4 s h per token forward (full, non-causal), twice that backward.
  double gemm_flops_layer = 0;
  for (auto [in, o] : lin) gemm_flops_layer += 6.0 * static_cast<double>(N) * in * o;
  const double head_flops = 6.0 * static_cast<double>(N) * C * V;
  const double attn_flops_layer = 12.0 * static_cast<double>(N) * T * nh * hd;

  // Warm-up (library JIT, page faults): one layer.
  for (auto [in, o] : lin) linear(in, o, gpt);
  attention();
  double t_gemm = 0, t_attn = 0, f_gemm = 0, f_attn = 0;
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

  // The non-matmul work of one micro-batch as the engine runs it (model/transformer.cpp,
  // model/tp_layers.cpp): per block two norms forward and backward, the activation, two residual
  // adds each way (under SP on the rank's rows), the activation gradients zeroed before the
  // backward accumulates into them, in bf16 the casts of the linears' inputs and output gradients
  // and with tp those of the activations that cross in bf16; the final norm,
  // the fused cross-entropy over [tokens, vocabulary / tp] and its input cast, the embedding; then
  // the optimizer step over the rank's parameters (zeroed gradients, their norm, AdamW writing the bf16 copy).
  const int64_t P = std::max<int64_t>(1, m.num_params() / t);
  Tensor pw = Tensor::zeros({P}, DType::F32, MemCategory::Workspace), pg = Tensor::zeros({P}, DType::F32, MemCategory::Workspace),
         pm = Tensor::zeros({P}, DType::F32, MemCategory::Workspace), pv = Tensor::zeros({P}, DType::F32, MemCategory::Workspace);
  Tensor pb = Tensor::zeros({use_bf16 ? P : 1}, DType::BF16, MemCategory::Workspace);
  int64_t widest = std::max(F, C);  // every row width the kernels below touch
  for (auto [in, o] : lin) widest = std::max({widest, in, o});
  const int64_t NF = N * widest;
  std::vector<float> ea(sz(NF), 0.01f), eb(sz(NF), 0.02f), ec(sz(NF)), ed(sz(NF)), nw(sz(C), 1.0f), nb(sz(C), 0.0f),
      mean(sz(N)), rstd(sz(N)), ndw(sz(C)), ndb(sz(C)), losses(sz(N)), vstats(sz(2 * N));
  float* logits = out.data();  // [N, max_out], max_out >= V
  std::vector<bf16> eab(sz(NF));
  std::vector<int32_t> ids(sz(N));
  for (int64_t i = 0; i < N; ++i) ids[sz(i)] = static_cast<int32_t>(i % std::min<int64_t>(V, m.vocab_size));
  float *table = w.data(), *dtable = dw.data();  // [max_w] >= the embedding table
  sp = sp && t > 1;
  const int64_t Rn = sp ? N / t : N;  // rows a norm sees: under SP its rank's share of the sequence
  auto norm = [&]() {
    if (gpt) {
      K.layernorm_forward(ec.data(), mean.data(), rstd.data(), ea.data(), nw.data(), nb.data(), Rn, C, 1e-5f);
      K.layernorm_backward(ed.data(), ndw.data(), ndb.data(), eb.data(), ea.data(), nw.data(), mean.data(), rstd.data(), Rn, C);
    } else {
      K.rmsnorm_forward(ec.data(), rstd.data(), ea.data(), nw.data(), Rn, C, 1e-5f);
      K.rmsnorm_backward(ed.data(), ndw.data(), eb.data(), ea.data(), nw.data(), rstd.data(), Rn, C);
    }
  };
  // The activation gradients the backward zeroes before accumulating into them (the kernels add,
  // gemm.h): the MLP's input and output side, the attention output, qkv and the two linears' inputs.
  std::vector<float> zbuf(sz(N * ((gpt ? 2 : 3) * F + 2 * C + nh * hd + qkvw)));
  // `k` sums over the tp ranks that travel in bf16 (tp > 1 in bf16 runs): each [N, C] partial is
  // cast before and its result (the rank's rows under SP) widened after.
  auto tp_bf16_sums = [&](int k) {
    if (t == 1 || !use_bf16) return;
    for (int i = 0; i < k; ++i) {
      K.cast_f32_to_bf16(eab.data(), ea.data(), N * C);
      K.cast_bf16_to_f32(ec.data(), eab.data(), Rn * C);
    }
  };
  auto elementwise_step = [&]() {
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
  };
  elementwise_step();  // warm-up: first touch of the buffers
  double t_elem = 0;
  int reps = 0;
  const auto e0 = Clock::now();
  do {
    const auto a = Clock::now();
    elementwise_step();
    t_elem += secs_since(a);
    ++reps;
  } while (secs_since(e0) < std::max(0.05, 0.3 * seconds));

  ComputeCeiling r;
  r.elem_s = t_elem / reps;
  r.elem_bw = plan::elementwise_bytes(m, micro_batch, use_bf16, static_cast<int>(t), sp) / r.elem_s;
  r.gemm_flops_per_s = f_gemm / t_gemm;
  r.flops_per_s = (f_gemm + f_attn) / (t_gemm + t_attn);
  r.threads = omp_get_max_threads();
  r.procs = 1;
  // Streaming: dst += src over two arrays (12 bytes per element: two reads, one write).
  const int64_t n = std::max<int64_t>(1 << 16, static_cast<int64_t>(stream_bytes / 8));
  Tensor a = Tensor::zeros({n}, DType::F32, MemCategory::Workspace);
  Tensor b = Tensor::zeros({n}, DType::F32, MemCategory::Workspace);
  K.accumulate(a.f32(), b.f32(), n);
  double bytes = 0;
  const auto s0 = Clock::now();
  do {
    K.accumulate(a.f32(), b.f32(), n);
    bytes += 12.0 * static_cast<double>(n);
  } while (secs_since(s0) < std::max(0.05, 0.25 * seconds));
  r.mem_bw = bytes / secs_since(s0);
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
