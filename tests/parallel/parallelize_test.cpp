// parallelize() on in-process ranks (threads joined by thread-backed process groups) against the
// trainer: the same config, weights and data give the trainer's losses - bit for bit on one rank,
// and to float tolerance with the global batch split over two data-parallel ranks (NO_SHARD,
// FULL_SHARD) - through the ParallelModel's step, loss reduction and global gradient norm.
#include <gtest/gtest.h>
#include <omp.h>

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

}  // namespace
}  // namespace mt
