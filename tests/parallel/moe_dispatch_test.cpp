// Expert parallelism's dispatch, checked directly: two ranks (threads of this process over a
// thread process group) each hold 2 of 4 experts of a GPT-2 MoE block whose experts are made to
// announce themselves: expert e ignores its input (c_fc is zero) and outputs (e + 1) in coordinate
// e (its c_proj bias). With the attention's output projection zero, the block's output minus its
// input is the MoE layer's output, sum_j w_j (e_j + 1) onehot(e_j): it shows which experts served
// each token and with which weight. Both must be the token's top-2 experts under the router,
// computed here in double precision from the same weights: every token reached exactly its k
// experts (dropless), half of them on the other rank. Also: ep 2 x tp 2 on four thread ranks, one
// training forward and backward against the unsplit model (losses and every gradient).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "comm/process_group.h"
#include "model/rng.h"
#include "model/transformer.h"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"

namespace mt {
namespace {

TEST(MoeDispatch, EveryTokenReachesItsTopKExpertsAcrossRanks) {
  ModelConfig c = model_preset("gpt2-tiny");
  c.n_layer = 1;
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.resolve();
  const int R = 2;
  const int64_t B = 2, T = 16, N = B * T, C = c.n_embd, E = 4, K = 2;
  Transformer ref(c, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
  std::vector<float> init(static_cast<size_t>(ref.flat_size()));
  ref.init_weights_into(77, init.data());
  Rng g(5);
  for (float& v : init) v += static_cast<float>(g.normal() * 0.3);  // a router with clear preferences
  auto group = comm::make_thread_group("ep", R);
  std::vector<int> failures(R, 0), remote(R, 0);
  std::vector<std::thread> ts;
  for (int r = 0; r < R; ++r)
    ts.emplace_back([&, r] {
      omp_set_num_threads(1);
      parallel::ProcessGroupExpertComm comm(group[r]);
      Transformer m(c, ModelOptions{.ep = R, .ep_rank = r, .ep_comm = &comm});
      auto put = [&](float* dst, const ParamInfo& p) {
        std::memcpy(dst + p.offset, init.data() + ref.param(p.name).offset, static_cast<size_t>(p.numel) * 4);
      };
      for (const ParamInfo& p : m.params()) put(m.weights().f32(), p);
      for (const ParamInfo& p : m.expert_params()) put(m.expert_weights().f32(), p);
      for (const ParamInfo& p : m.params())
        if (p.name.find("attn.c_proj") != std::string::npos)
          std::fill(m.weights().f32() + p.offset, m.weights().f32() + p.offset + p.numel, 0.0f);
      for (const ParamInfo& p : m.expert_params()) {
        float* w = m.expert_weights().f32() + p.offset;
        if (p.name.find("c_fc") != std::string::npos) std::fill(w, w + p.numel, 0.0f);
        if (p.name.find("c_proj.bias") != std::string::npos) {
          const int e = std::stoi(p.name.substr(p.name.find("experts.") + 8));
          std::fill(w, w + p.numel, 0.0f);
          w[e] = static_cast<float>(e + 1);
        }
      }
      EXPECT_EQ(m.expert_params().size(), 2u * 4u);  // 2 local experts x (c_fc w b, c_proj w b)
      Rng tr(100 + r);
      std::vector<int32_t> ids(static_cast<size_t>(N)), tg(static_cast<size_t>(N));
      for (auto& t : ids) t = static_cast<int32_t>(tr.next_u64() % 256);
      for (auto& t : tg) t = static_cast<int32_t>(tr.next_u64() % 256);
      m.forward(ids.data(), tg.data(), B, T, false);
      const float* x = m.unit_output(0);
      const float* y = m.unit_output(1);
      const float* lw = m.weights().f32() + m.param("h.0.ln_2.weight").offset;
      const float* lb = m.weights().f32() + m.param("h.0.ln_2.bias").offset;
      const float* wg = m.weights().f32() + m.param("h.0.mlp.gate.weight").offset;
      for (int64_t t = 0; t < N; ++t) {
        // The router in double: layernorm, logits, softmax, top-2, normalised weights.
        double mean = 0, var = 0;
        for (int64_t i = 0; i < C; ++i) mean += x[t * C + i] / C;
        for (int64_t i = 0; i < C; ++i) var += (x[t * C + i] - mean) * (x[t * C + i] - mean) / C;
        std::vector<double> h(static_cast<size_t>(C)), p(static_cast<size_t>(E));
        for (int64_t i = 0; i < C; ++i) h[i] = (x[t * C + i] - mean) / std::sqrt(var + c.norm_eps) * lw[i] + lb[i];
        for (int64_t e = 0; e < E; ++e) {
          p[e] = 0;
          for (int64_t i = 0; i < C; ++i) p[e] += wg[e * C + i] * h[i];
        }
        std::vector<int> o(E);
        std::iota(o.begin(), o.end(), 0);
        std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return p[a] > p[b]; });
        const double e0 = std::exp(p[o[0]]), e1 = std::exp(p[o[1]]);
        std::vector<double> want(static_cast<size_t>(C), 0.0);
        want[o[0]] = (o[0] + 1) * e0 / (e0 + e1);
        want[o[1]] = (o[1] + 1) * e1 / (e0 + e1);
        for (int j = 0; j < K; ++j) remote[r] += (o[j] / 2 != r) ? 1 : 0;
        for (int64_t i = 0; i < C; ++i) {
          const double got = y[t * C + i] - x[t * C + i];
          if (std::fabs(got - want[i]) > 1e-4) {
            ++failures[r];
            ADD_FAILURE() << "rank " << r << " token " << t << " coordinate " << i << ": MoE output " << got << ", want "
                          << want[i] << " (top-2 experts " << o[0] << ", " << o[1] << ")";
          }
        }
      }
      const auto s = m.take_moe_stats();
      EXPECT_EQ(s.dropped, 0);
      EXPECT_EQ(std::accumulate(s.tokens[0].begin(), s.tokens[0].end(), int64_t{0}), N * K);
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(failures[r], 0);
    EXPECT_GT(remote[r], 0) << "rank " << r << ": no token needed the other rank's experts (the test would prove nothing)";
  }
}

// Expert parallelism with tensor parallelism, one forward and backward on four thread ranks: dp
// rank d and tp rank t at (d, t), the tp group of d = {(d, 0), (d, 1)}, the ep group of t =
// {(0, t), (1, t)} (what ParallelGroups builds for ep 2 x tp 2). Each dp rank feeds its own tokens.
// Against the unsplit model (tp 1, every expert) run on each dp rank's tokens alone: the loss and
// the aux / z losses; every dense parameter's gradient is this tp rank's slice of dp rank d's; every
// local expert's gradient is this tp rank's slice of the sum over both dp ranks' (its experts
// served both ranks' tokens).
void expect_ep_tp_matches_unsplit(const std::string& preset) {
  ModelConfig c = model_preset(preset);
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_shared_experts = 1;
  c.moe_aux_loss_coef = 0.02f;
  c.moe_z_loss_coef = 0.001f;
  c.resolve();
  const int D = 2, TP = 2;
  const int64_t B = 2, T = 16, N = B * T;
  const float dloss = 1.0f / static_cast<float>(N);
  Transformer ref(c, DType::F32, Recompute::None);
  std::vector<float> init(static_cast<size_t>(ref.flat_size()));
  ref.init_weights_into(77, init.data());
  Rng g(5);
  for (float& v : init) v += static_cast<float>(g.normal() * 0.05);  // routers with preferences
  std::memcpy(ref.weights().f32(), init.data(), init.size() * sizeof(float));
  std::vector<std::vector<int32_t>> ids(D), tg(D);
  std::vector<double> loss(D), aux(D), z(D);
  std::vector<std::vector<float>> grad(D);
  for (int d = 0; d < D; ++d) {
    Rng tr(100 + d);
    for (int64_t i = 0; i < N; ++i) ids[d].push_back(static_cast<int32_t>(tr.next_u64() % 256));
    for (int64_t i = 0; i < N; ++i) tg[d].push_back(static_cast<int32_t>(tr.next_u64() % 256));
    ref.zero_grads();
    loss[d] = ref.forward(ids[d].data(), tg[d].data(), B, T, true, dloss);
    ref.backward();
    const auto st = ref.take_moe_stats();
    aux[d] = st.aux_loss;
    z[d] = st.z_loss;
    grad[d].assign(ref.grads().f32(), ref.grads().f32() + ref.flat_size());
  }
  std::vector<float> both(grad[0]);
  for (size_t i = 0; i < both.size(); ++i) both[i] += grad[1][i];
  std::vector<std::vector<std::shared_ptr<comm::ProcessGroup>>> tpg, epg;
  for (int d = 0; d < D; ++d) tpg.push_back(comm::make_thread_group("tp", TP));
  for (int t = 0; t < TP; ++t) epg.push_back(comm::make_thread_group("ep", D));
  std::vector<int64_t> sent(static_cast<size_t>(D * TP), 0);
  std::vector<std::thread> ts;
  for (int d = 0; d < D; ++d)
    for (int t = 0; t < TP; ++t)
      ts.emplace_back([&, d, t] {
        omp_set_num_threads(1);
        const std::string at = preset + " rank (dp " + std::to_string(d) + ", tp " + std::to_string(t) + ")";
        parallel::ProcessGroupTpComm tpc(tpg[d][t]);
        parallel::ProcessGroupExpertComm ec(epg[t][d]);
        Transformer m(c, ModelOptions{.tp = &tpc, .ep = D, .ep_rank = d, .ep_comm = &ec});
        for (int u = 0; u < m.num_units(); ++u)
          m.shard_unit_from_full(ref, u, init.data() + ref.unit(u).offset, m.weights().f32() + m.unit(u).offset);
        for (const ParamInfo& p : m.expert_params()) {
          const ParamInfo& f = ref.param(p.name);
          m.shard_param_from_full(p, f, init.data() + f.offset, m.expert_weights().f32() + p.offset);
        }
        EXPECT_EQ(m.expert_params().size(), static_cast<size_t>(c.n_layer * 2 * (c.arch == Arch::GPT2 ? 4 : 3))) << at;
        m.zero_grads();
        const double l = m.forward(ids[d].data(), tg[d].data(), B, T, true, dloss);
        m.backward();
        EXPECT_NEAR(l, loss[d], 1e-5) << at;
        const auto ms = m.take_moe_stats();
        EXPECT_NEAR(ms.aux_loss, aux[d], 1e-5) << at;
        EXPECT_NEAR(ms.z_loss, z[d], 1e-5) << at;
        double ms_ep = 0;
        ec.take(&ms_ep, &sent[static_cast<size_t>(d * TP + t)]);
        // Dense parameters: this tp rank's slice of dp rank d's gradient.
        std::vector<float> want(static_cast<size_t>(m.flat_size()), 0.0f);
        for (int u = 0; u < m.num_units(); ++u)
          m.shard_unit_from_full(ref, u, grad[d].data() + ref.unit(u).offset, want.data() + m.unit(u).offset);
        double expert_scale = 0;
        auto compare = [&](const ParamInfo& p, const float* got, const float* w, bool expert) {
          double worst = 0, scale = 0;
          for (int64_t i = 0; i < p.numel; ++i) {
            worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - w[i]));
            scale = std::max(scale, std::fabs(static_cast<double>(w[i])));
          }
          EXPECT_LE(worst, 1e-4 * scale + 1e-7) << at << ": gradient of " << p.name << " off by " << worst
                                                << " (largest " << scale << ")";
          if (expert) {  // an expert no token chose has none
            expert_scale = std::max(expert_scale, scale);
          } else {
            EXPECT_GT(scale, 0.0) << at << ": " << p.name << " has no gradient (the check would prove nothing)";
          }
        };
        for (const ParamInfo& p : m.params()) compare(p, m.grads().f32() + p.offset, want.data() + p.offset, false);
        // Local experts: this tp rank's slice of both dp ranks' gradients.
        std::vector<float> we(static_cast<size_t>(m.expert_size()), 0.0f);
        for (const ParamInfo& p : m.expert_params()) {
          const ParamInfo& f = ref.param(p.name);
          m.shard_param_from_full(p, f, both.data() + f.offset, we.data() + p.offset);
          compare(p, m.expert_grads().f32() + p.offset, we.data() + p.offset, true);
        }
        EXPECT_GT(expert_scale, 0.0) << at << ": no local expert has a gradient";
      });
  for (auto& th : ts) th.join();
  for (size_t i = 0; i < sent.size(); ++i)
    EXPECT_GT(sent[i], 0) << preset << ": rank " << i << " sent no token to its ep peer (the test would prove nothing)";
}

TEST(MoeDispatch, ExpertAndTensorParallelGradientsMatchUnsplit) {
  expect_ep_tp_matches_unsplit("llama-tiny");
  expect_ep_tp_matches_unsplit("gpt2-tiny");
}

}  // namespace
}  // namespace mt
