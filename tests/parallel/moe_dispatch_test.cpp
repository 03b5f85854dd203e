// Expert parallelism's dispatch, checked directly: two ranks (threads of this process over a
// thread process group) each hold 2 of 4 experts of a GPT-2 MoE block whose experts are made to
// announce themselves: expert e ignores its input (c_fc is zero) and outputs (e + 1) in coordinate
// e (its c_proj bias). With the attention's output projection zero, the block's output minus its
// input is the MoE layer's output, sum_j w_j (e_j + 1) onehot(e_j): it shows which experts served
// each token and with which weight. Both must be the token's top-2 experts under the router,
// computed here in double precision from the same weights: every token reached exactly its k
// experts (dropless), half of them on the other rank.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "comm/process_group.h"
#include "model/rng.h"
#include "model/transformer.h"
#include "parallel/expert_parallel.h"

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
  Transformer ref(c, DType::F32, Recompute::None, ModelStorage{false, false, false, 1});
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
      ModelStorage st;
      st.ep = R;
      st.ep_rank = r;
      Transformer m(c, DType::F32, Recompute::None, st);
      parallel::ProcessGroupExpertComm comm(group[r]);
      m.set_expert_comm(&comm);
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

}  // namespace
}  // namespace mt
