// The parallel building blocks in one process: ranks are threads joined by thread-backed process
// groups (comm::make_thread_group), so a failure points at one strategy step instead of a whole
// mpirun training run. Each data-parallel layout trains two steps on 2 ranks and is compared with
// one rank training on the same global batch; the tensor-parallel communicator is checked against
// its definition.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "comm/process_group.h"
#include "kernels/backend.h"
#include "model/transformer.h"
#include "parallel/strategy.h"
#include "parallel/tensor_parallel.h"
#include "thread_ranks.h"

namespace mt {
namespace {

using test::on_ranks;

ModelConfig tiny() {
  ModelConfig c = model_preset("gpt2-tiny");
  c.resolve();
  return c;
}

// Token ids of sequences first_seq .. first_seq + B - 1 of a global batch (T tokens each).
std::vector<int32_t> tokens(int64_t first_seq, int64_t B, int64_t T, int64_t V, int shift) {
  std::vector<int32_t> v(static_cast<size_t>(B * T));
  for (int64_t i = 0; i < B * T; ++i)
    v[static_cast<size_t>(i)] = static_cast<int32_t>(((first_seq * T + i) * 7 + shift * 3 + ((first_seq * T + i) / 5) % 3) % V);
  return v;
}

struct Trained {
  std::vector<double> losses;
  std::vector<float> weights;  // full fp32 weights in model layout, gathered
};

// `ranks` data-parallel ranks train 2 steps with `strategy` on a global batch of 4 sequences.
Trained train(const std::string& strategy, int ranks) {
  const ModelConfig c = tiny();
  const int64_t T = c.seq_len, B = 4 / ranks;
  auto dp = comm::make_thread_group("dp", ranks);
  auto norm = comm::make_thread_group("grad_norm", ranks);
  auto one = [](int) { return comm::make_thread_group("replicate_none", 1)[0]; };
  std::vector<Trained> out(static_cast<size_t>(ranks));
  on_ranks(ranks, [&](int r) {
    parallel::StrategySpec spec;
    spec.strategy = parse_sharding_strategy(strategy);
    spec.bucket_mb = 0.01;
    spec.adam = AdamWConfig{3e-3, 0.9, 0.95, 1e-8, 0.1};
    Transformer model(c, ModelOptions{.storage = parallel::model_storage(spec, DType::F32, ranks)});
    auto s = parallel::make_strategy(spec, model, dp[r], dp[r], one(r), strategy == "NO_SHARD" ? nullptr : norm[r]);
    model.set_hooks(s->hooks());
    Transformer ref(c, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
    std::vector<float> init(static_cast<size_t>(ref.flat_size()));
    ref.init_weights_into(1234, init.data());
    s->begin_load();
    for (int u = 0; u < model.num_units(); ++u) {
      std::vector<float> w(static_cast<size_t>(model.unit(u).numel));
      model.shard_unit_from_full(ref, u, init.data() + ref.unit(u).offset, w.data());
      s->load_unit(u, w.data(), nullptr, nullptr);
    }
    s->end_load(0);
    for (int step = 0; step < 2; ++step) {
      model.zero_grads();
      std::vector<int32_t> x = tokens(r * B, B, T, c.vocab_size, step), y = tokens(r * B, B, T, c.vocab_size, step + 1);
      s->begin_microbatch(true);
      double loss = model.forward(x.data(), y.data(), B, T, true, static_cast<float>(1.0 / static_cast<double>(B * T)));
      model.backward();
      parallel::StepComm cs;
      s->finish_backward(&cs);
      float f = static_cast<float>(loss);
      dp[r]->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Avg)->wait();
      (void)s->grad_norm_sq({});
      s->optimizer_step(3e-3, 1.0f, &cs);
      out[static_cast<size_t>(r)].losses.push_back(f);
    }
    std::vector<float>& w = out[static_cast<size_t>(r)].weights;
    w.assign(static_cast<size_t>(model.flat_size()), 0.0f);
    for (int u = 0; u < model.num_units(); ++u) s->gather_unit(u, w.data() + model.unit(u).offset, nullptr, nullptr);
    model.set_hooks(nullptr);
  });
  return out[0];
}

class InProcessDataParallel : public ::testing::TestWithParam<const char*> {};

TEST_P(InProcessDataParallel, TwoThreadRanksEqualOneRank) {
  const Trained one = train("NO_SHARD", 1), two = train(GetParam(), 2);
  ASSERT_EQ(one.losses.size(), two.losses.size());
  for (size_t i = 0; i < one.losses.size(); ++i) EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5) << "step " << i + 1;
  ASSERT_EQ(one.weights.size(), two.weights.size());
  double worst = 0;
  for (size_t i = 0; i < one.weights.size(); ++i) worst = std::max(worst, std::fabs(double(one.weights[i]) - two.weights[i]));
  EXPECT_LT(worst, 2e-5) << GetParam();
  std::printf("%s on 2 thread ranks vs 1 rank: losses %.7f %.7f vs %.7f %.7f, largest weight difference %.2e\n",
              GetParam(), two.losses[0], two.losses[1], one.losses[0], one.losses[1], worst);
}

INSTANTIATE_TEST_SUITE_P(Strategies, InProcessDataParallel,
                         ::testing::Values("NO_SHARD", "ZERO1", "SHARD_GRAD_OP", "FULL_SHARD"),
                         [](const ::testing::TestParamInfo<const char*>& i) { return std::string(i.param); });

// The data-parallel ranks' check that they built the same model exchanges int64 values: their
// count, then the parameter count, the unit count and every unit's size (8 bytes a value; before
// the engine had integer dtypes each value travelled as three 16-bit pieces in f32 slots, 12
// bytes, and the count as one f32). A difference is named.
TEST(SameModelCheck, ExchangesInt64ValuesAndNamesTheDifference) {
  const ModelConfig c = tiny();
  ModelConfig deeper = c, wider = c;
  deeper.n_layer += 1;
  wider.ffn_hidden *= 2;
  const ModelStorage none{.weights = false, .master = false, .grads = false};
  for (int n : {2, 3}) {
    auto g = comm::make_thread_group("same" + std::to_string(n), n);
    on_ranks(n, [&](int r) {
      const Transformer m(c, ModelOptions{.storage = none});
      parallel::verify_same_model(m, *g[r]);
      const uint64_t values = 2 + static_cast<uint64_t>(m.num_units());
      EXPECT_EQ(g[r]->stats()[comm::OpKind::AllGather].bytes, static_cast<uint64_t>(n - 1) * 8 * (1 + values));
    });
  }
  auto g = comm::make_thread_group("differ", 2);
  for (const auto& [other, what] : {std::pair{deeper, "units"}, std::pair{wider, "differs"}}) {
    on_ranks(2, [&, &other = other, what = what](int r) {
      const Transformer m(r == 1 ? other : c, ModelOptions{.storage = none});
      try {
        parallel::verify_same_model(m, *g[r]);
        ADD_FAILURE() << "different models passed the check";
      } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      }
    });
  }
}

// ProcessGroupTpComm: fp32 calls are exact sums; in bf16 mode activations travel in bf16 (the sum
// of the bf16-rounded inputs, accumulated in fp32, rounded once, widened back), and the async
// forms complete at wait().
TEST(InProcessTensorParallel, CommunicatorMatchesItsDefinition) {
  auto g = comm::make_thread_group("tp", 2);
  on_ranks(2, [&](int r) {
    parallel::ProcessGroupTpComm tp(g[r]);
    const int64_t n = 64;
    std::vector<float> x(n), part(n / 2), gathered(n);
    for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = 0.1f * static_cast<float>(i) + static_cast<float>(r);
    std::vector<float> a = x;
    tp.all_reduce_sum(a.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(a[static_cast<size_t>(i)], 0.2f * static_cast<float>(i) + 1.0f);
    tp.reduce_scatter_sum(x.data(), part.data(), n / 2);
    EXPECT_FLOAT_EQ(part[0], x[static_cast<size_t>(r * n / 2)] * 2 - static_cast<float>(r) * 2 + 1.0f);
    tp.all_gather(part.data(), gathered.data(), n / 2);
    EXPECT_FLOAT_EQ(gathered[0], 1.0f);                                             // rank 0's first sum
    EXPECT_FLOAT_EQ(gathered[static_cast<size_t>(n / 2)], 0.2f * (n / 2) + 1.0f);  // rank 1's
    tp.set_activation_dtype(DType::BF16);
    std::vector<float> b = x;
    const int h = tp.start_all_reduce_activations(b.data(), n);
    tp.wait(h);
    for (int64_t i = 0; i < n; ++i) {
      const float v0 = round_to_bf16(0.1f * static_cast<float>(i)), v1 = round_to_bf16(0.1f * static_cast<float>(i) + 1.0f);
      EXPECT_EQ(b[static_cast<size_t>(i)], round_to_bf16(v0 + v1)) << i;
    }
    double comm_ms = -1, exposed_ms = -1;
    tp.take_times(&comm_ms, &exposed_ms);
    EXPECT_GE(comm_ms, 0.0);
    EXPECT_GE(exposed_ms, 0.0);
  });
}

}  // namespace
}  // namespace mt
