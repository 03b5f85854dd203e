// parallelize() on in-process ranks (threads joined by thread-backed process groups) against the
// trainer: the same config, weights and data give the trainer's losses - bit for bit on one rank,
// and to float tolerance with the global batch split over two data-parallel ranks (NO_SHARD,
// FULL_SHARD) - through the ParallelModel's step, loss reduction and global gradient norm.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../test_files.h"
#include "checkpoint/model_state.h"
#include "comm/process_group.h"
#include "data/data_loader.h"
#include "data/token_shards.h"
#include "parallel/parallelize.h"
#include "parallel/pipeline_executor.h"
#include "train/config.h"
#include "train/trainer.h"
#include "thread_ranks.h"

namespace mt {
namespace {

using test::on_ranks;

// The groups of `n` data-parallel ranks with no tensor, pipeline, context or expert parallelism.
std::vector<ParallelGroups> dp_groups(const ParallelPlan& plan, int n) {
  auto dp = comm::make_thread_group("dp", n), metrics = comm::make_thread_group("metrics", n),
       norm = comm::make_thread_group("grad_norm", n);
  std::vector<ParallelGroups> g(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    ParallelGroups& x = g[static_cast<size_t>(r)];
    x.dp = x.shard = dp[static_cast<size_t>(r)];
    x.metrics = metrics[static_cast<size_t>(r)];
    x.replicate = comm::make_thread_group("replicate_none", 1)[0];
    x.tp = comm::make_thread_group("tp", 1)[0];
    x.tp_aux = comm::make_thread_group("tp_aux", 1)[0];
    x.pp = comm::make_thread_group("pp", 1)[0];
    if (is_sharded(plan.strategy)) x.grad_norm = norm[static_cast<size_t>(r)];
    x.data_rank = r;
    x.data_world = n;
  }
  return g;
}

class ParallelizeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string text;
    for (int i = 0; i < 300; ++i) text += "pack my box with five dozen liquor jugs " + std::to_string(i % 5) + "\n";
    write_token_shard(data(), std::vector<int32_t>(text.begin(), text.end()));
  }
  std::string data() const { return (tmp_.path / "train.bin").string(); }
  RunConfig config(const std::string& strategy) const {
    return RunConfig::load("", {{"model.preset", "gpt2-tiny"}, {"data.train", data()}, {"train.steps", "5"},
                                {"train.micro_batch", "4"}, {"train.warmup_steps", "2"}, {"train.lr", "3e-3"},
                                {"train.eval_every", "0"}, {"train.threads", "1"}, {"train.grad_clip", "0.5"},
                                {"log.print_every", "100"}, {"parallel.strategy", strategy}});
  }

  // The trainer's job on `ranks` thread ranks through parallelize(): each data-parallel rank takes
  // micro_batch / ranks sequences of the same global batch.
  std::vector<double> parallelized(const RunConfig& cfg0, int ranks) {
    RunConfig cfg = cfg0;
    cfg.train.micro_batch /= ranks;
    const ModelConfig mc = cfg.model_config();
    const ParallelPlan plan = cfg.parallel_plan(mc, ranks);
    std::vector<ParallelGroups> groups = dp_groups(plan, ranks);
    const auto& tc = cfg.train;
    std::vector<std::vector<double>> losses(static_cast<size_t>(ranks));
    on_ranks(ranks, [&](int r) {
      parallel::ParallelizeOptions o;
      o.spec.adam = AdamWConfig{tc.lr, tc.beta1, tc.beta2, tc.eps, tc.weight_decay};
      auto pm = parallel::parallelize(mc, plan, groups[static_cast<size_t>(r)], o);
      Transformer ref(mc, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
      ModelState state(pm->model(), ref, pm->strategy(), *groups[static_cast<size_t>(r)].tp_aux, nullptr);
      state.load(nullptr, static_cast<uint64_t>(tc.seed));
      pm->strategy().end_load(0);
      TokenDataset ds(cfg.data.train, mc.vocab_size);
      const int B = static_cast<int>(tc.micro_batch), T = static_cast<int>(mc.seq_len);
      BatchLoader loader(ds, B, T, r, ranks);
      std::vector<int32_t> x(static_cast<size_t>(B * T)), y(x.size());
      for (int64_t step = 0; step < tc.steps; ++step) {
        loader.next(x.data(), y.data());
        parallel::StepComm cs;
        const parallel::StepResult res = pm->forward_backward({x.data()}, {y.data()}, B, T, &cs);
        float scale = 1.0f;
        if (res.grad_norm > tc.grad_clip) scale = static_cast<float>(tc.grad_clip / (res.grad_norm + 1e-6));
        pm->optimizer_step(lr_at(step, tc.steps, tc.warmup_steps, tc.lr, tc.min_lr_ratio, tc.lr_schedule), scale, &cs);
        losses[static_cast<size_t>(r)].push_back(res.loss);
      }
      pm->model().set_hooks(nullptr);
    });
    for (int r = 1; r < ranks; ++r) EXPECT_EQ(losses[static_cast<size_t>(r)], losses[0]) << "rank " << r;
    return losses[0];
  }

  test::TestDir tmp_;
};

// The pipeline's step window is the longest span over the ranks, on every rank, and its idle time
// the mean over the ranks of window - compute: here the last rank's span is the longer one (the
// ranks' compute 8 and 9 ms, mean 8.5).
TEST(PipelineWindow, IsTheLongestSpanOnEveryRankWithTheMeanIdleInIt) {
  auto pp = comm::make_thread_group("pp", 2);
  const double span[2] = {10.0, 12.5};
  parallel::PipelineWindow got[2];
  on_ranks(2, [&](int r) { got[r] = parallel::pipeline_window(pp[static_cast<size_t>(r)].get(), span[r], 8.5); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(got[r].window_ms, 12.5) << "rank " << r;
    EXPECT_DOUBLE_EQ(got[r].idle_ms, 12.5 - 8.5) << "rank " << r;
  }
  const parallel::PipelineWindow alone = parallel::pipeline_window(nullptr, 7.0, 5.0);
  EXPECT_DOUBLE_EQ(alone.window_ms, 7.0);
  EXPECT_DOUBLE_EQ(alone.idle_ms, 2.0);
}

TEST_F(ParallelizeTest, OneRankGivesTheTrainersLossesExactly) {
  const RunConfig cfg = config("NO_SHARD");
  const std::vector<double> trainer = train(cfg).losses;
  ASSERT_EQ(trainer.size(), 5u);
  EXPECT_EQ(parallelized(cfg, 1), trainer);
}

TEST_F(ParallelizeTest, TwoDataParallelRanksGiveTheTrainersLosses) {
  for (const char* strategy : {"NO_SHARD", "FULL_SHARD"}) {
    const RunConfig cfg = config(strategy);
    const std::vector<double> trainer = train(cfg).losses, two = parallelized(cfg, 2);
    ASSERT_EQ(two.size(), trainer.size());
    for (size_t i = 0; i < two.size(); ++i) EXPECT_NEAR(two[i], trainer[i], 2e-5) << strategy << " step " << i + 1;
    EXPECT_LT(trainer.back(), trainer.front()) << strategy;
  }
}

// Loss masks weight the cross-entropy's gradient by (B T n / trained targets); the MoE routers'
// load-balancing and z-losses are means over every routed token and keep their own weight. The
// router gradient is the cross-entropy's plus coef x the auxiliary one, so the change that the
// coefficients make to it must be the same with half of the targets masked as with none.
TEST_F(ParallelizeTest, LossMasksDoNotRescaleTheRoutersAuxiliaryLosses) {
  auto router_grads = [&](const char* aux, const char* z, bool masked) {
    RunConfig cfg = RunConfig::load("", {{"model.preset", "llama-tiny"}, {"model.moe_experts", "4"},
                                         {"model.moe_top_k", "2"}, {"model.moe_aux_loss_coef", aux},
                                         {"model.moe_z_loss_coef", z}, {"data.train", data()},
                                         {"train.micro_batch", "2"}, {"train.threads", "1"}});
    const ModelConfig mc = cfg.model_config();
    const ParallelPlan plan = cfg.parallel_plan(mc, 1);
    std::vector<ParallelGroups> groups = dp_groups(plan, 1);
    std::vector<float> out;
    on_ranks(1, [&](int) {
      parallel::ParallelizeOptions o;
      auto pm = parallel::parallelize(mc, plan, groups[0], o);
      Transformer ref(mc, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
      ModelState state(pm->model(), ref, pm->strategy(), *groups[0].tp_aux, nullptr);
      state.load(nullptr, 7);
      pm->strategy().end_load(0);
      TokenDataset ds(cfg.data.train, mc.vocab_size);
      const int B = 2, T = static_cast<int>(mc.seq_len);
      BatchLoader loader(ds, B, T, 0, 1);
      std::vector<int32_t> x(static_cast<size_t>(B * T)), y(x.size());
      loader.next(x.data(), y.data());
      int64_t trained = B * T;
      if (masked)
        for (size_t i = 0; i < y.size(); i += 2, --trained) y[i] = -1;
      parallel::StepComm cs;
      pm->forward_backward({x.data()}, {y.data()}, B, T, &cs, static_cast<double>(B * T) / static_cast<double>(trained));
      const float* g = pm->model().grads().f32();
      for (const auto& p : pm->model().params())
        if (p.name.find("block_sparse_moe.gate.") != std::string::npos) out.insert(out.end(), g + p.offset, g + p.offset + p.numel);
      pm->model().set_hooks(nullptr);
    });
    return out;
  };
  const std::vector<float> full0 = router_grads("0", "0", false), full1 = router_grads("0.5", "0.05", false),
                           masked0 = router_grads("0", "0", true), masked1 = router_grads("0.5", "0.05", true);
  ASSERT_FALSE(full0.empty());
  ASSERT_EQ(full0.size(), masked0.size());
  double top = 0, worst = 0, ce_change = 0;
  for (size_t i = 0; i < full0.size(); ++i) {
    const double aux_full = double(full1[i]) - full0[i], aux_masked = double(masked1[i]) - masked0[i];
    top = std::max(top, std::fabs(aux_full));
    worst = std::max(worst, std::fabs(aux_masked - aux_full));
    ce_change = std::max(ce_change, std::fabs(double(masked0[i]) - full0[i]));
  }
  EXPECT_GT(top, 1e-4);        // the auxiliary losses reach the router
  EXPECT_GT(ce_change, 1e-5);  // and masking changes the cross-entropy's part
  EXPECT_LT(worst, 1e-3 * top) << "largest auxiliary-gradient change " << top;
}

}  // namespace
}  // namespace mt
