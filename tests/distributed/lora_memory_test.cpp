// LoRA's model state as real processes: with the base frozen, gradients, the fp32 master copy and
// the optimizer's moments exist for the adapters only - under DDP, ZeRO-1, ZeRO-2, ZeRO-3 and the
// hybrid - and the base is kept in the compute dtype alone (bf16 in bf16 runs, sharded by ZeRO-3).
// The adapters' count comes from a full fine-tuning run of the same model (the parameter counts'
// difference); the state layout (`state_size`: the adapters, each unit's run padded to 16 x the
// shard group) must be that count up to its padding, and the resident bytes by category what it
// implies. A sharded-checkpoint resume under ZeRO-3 in bf16 continues the uninterrupted run
// bit for bit (the adapters' fp32 master and moments are split differently from the weights).
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace mt {
namespace {

const std::string kLora = " --lora.rank 4 --lora.alpha 8 --lora.targets c_attn,o,up,down --train.lr 1e-2 ";

class LoraMemory : public ParityFixture {};

struct MemCase {
  const char* what;
  int np, shard;
  std::string args;
  bool bf16, grads_sharded, params_sharded, ddp;
};

TEST_F(LoraMemory, GradientsAndOptimizerStateAreTheAdaptersUnderEveryStrategy) {
  const RunResult full = train(1, 4, 1, "full", "--train.steps 2");
  ASSERT_FALSE(full.final.is_null());
  const std::vector<MemCase> cases = {
      {"1 rank fp32", 1, 1, "", false, false, false, true},
      {"1 rank bf16", 1, 1, "--train.dtype bf16", true, false, false, true},
      {"ZERO1 2 bf16", 2, 2, "--parallel.strategy ZERO1 --train.dtype bf16", true, false, false, false},
      {"SHARD_GRAD_OP 2", 2, 2, "--parallel.strategy SHARD_GRAD_OP", false, true, false, false},
      {"FULL_SHARD 2 bf16", 2, 2, "--parallel.strategy FULL_SHARD --train.dtype bf16", true, true, true, false},
      {"HYBRID_SHARD 2x2 bf16", 4, 2,
       "--parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2 --train.dtype bf16", true, true, true, false},
  };
  for (const MemCase& c : cases) {
    const RunResult r = train(c.np, 2, 1, std::string("m") + std::to_string(&c - cases.data()),
                              kLora + "--train.steps 2 " + c.args);
    ASSERT_FALSE(r.final.is_null()) << c.what;
    const int64_t adapters = r.final["num_params"].get<int64_t>() - full.final["num_params"].get<int64_t>();
    const int64_t S = r.final["state_size"].get<int64_t>(), F = r.final["flat_size"].get<int64_t>();
    const int64_t N = c.shard;
    ASSERT_GT(adapters, 0) << c.what;
    EXPECT_GE(S, adapters) << c.what;
    EXPECT_LE(S - adapters, 16 * N * 8) << c.what << ": the state is the adapters (and padding to whole shards)";
    for (int rank = 0; rank < c.np; ++rank) {
      const nlohmann::json& res =
          c.np > 1 ? r.final["mem_resident_by_category_per_rank"][rank] : r.final["mem_resident_by_category"];
      const int64_t params = res["params"].get<int64_t>(), grads = res["grads"].get<int64_t>(),
                    opt = res["optimizer"].get<int64_t>();
      const int64_t pb = c.bf16 ? 2 : 4;
      // The base (and the adapters' compute copy) in the compute dtype; no fp32 master of the base.
      EXPECT_EQ(params, c.params_sharded ? pb * F / N : pb * F) << c.what << " rank " << rank;
      EXPECT_EQ(grads, c.grads_sharded ? 4 * S / N : 4 * S) << c.what << " rank " << rank;
      // Moments (and the fp32 master of the adapters where it is not the weights themselves).
      EXPECT_EQ(opt, c.ddp ? (c.bf16 ? 12 : 8) * S : 12 * S / N) << c.what << " rank " << rank;
      std::printf("%s rank %d: adapters %lld of %lld parameters; params %lld, grads %lld, optimizer %lld bytes\n",
                  c.what, rank, static_cast<long long>(adapters), static_cast<long long>(r.final["num_params"].get<int64_t>()),
                  static_cast<long long>(params), static_cast<long long>(grads), static_cast<long long>(opt));
    }
  }
}

TEST_F(LoraMemory, Bf16FullShardResumesFromAShardedCheckpointBitForBit) {
  const std::string a = kLora + "--model.preset llama-tiny --lora.targets q,k,v,o,gate,up,down --train.dtype bf16 "
                                "--parallel.strategy FULL_SHARD --train.checkpoint_every 4 --train.lr_schedule constant ";
  const RunResult whole = train(2, 2, 1, "whole", a);
  ASSERT_EQ(whole.losses.size(), 8u);
  // The same run (constant learning rate: the schedule does not depend on train.steps) stopped at
  // step 4, then resumed from its checkpoint (sharded format) on the same layout.
  const RunResult first = train(2, 2, 1, "part", a + "--train.steps 4");
  ASSERT_EQ(first.losses.size(), 4u);
  const std::string ck = (dir_ / "ck_part").string();
  const RunResult rest = train(2, 2, 1, "rest", a + "--train.resume " + ck);
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(first.losses[i], whole.losses[i]) << "step " << i + 1;
    EXPECT_EQ(rest.losses[i], whole.losses[4 + i]) << "resumed step " << 5 + i;
  }
}

}  // namespace
}  // namespace mt
