// The planner against this engine (issue 7 part 5): the exact accounting, and a reduced
// `plan --validate` that runs real jobs of the meshtrain binary and compares memory and bytes.
// Step time is not asserted here (a shared, noisy CI machine); `meshtrain plan --validate` checks it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <string>

#include "plan/planner.h"
#include "plan/validate.h"

namespace mt::plan {
namespace {

EngineLayout layout(const std::string& strategy, int ranks, int rep = 1) {
  EngineLayout e;
  e.strategy = strategy;
  e.ranks = ranks;
  e.dp_replicate = rep;
  return e;
}

TEST(ValidateAccounting, CollectiveVolumesAreTheTextbookOnes) {
  // all-reduce 2(n-1)/n x buffer; all-gather / reduce-scatter (n-1)/n x the full buffer (n x count).
  EXPECT_EQ(collective_bytes(Collective::AllReduce, 1000, 4, 2), 4000u);
  EXPECT_EQ(collective_bytes(Collective::AllReduce, 1000, 4, 4), 6000u);
  EXPECT_EQ(collective_bytes(Collective::AllGather, 250, 4, 4), 3000u);      // full buffer 4000 bytes
  EXPECT_EQ(collective_bytes(Collective::ReduceScatter, 500, 2, 2), 1000u);  // bf16
  EXPECT_EQ(collective_bytes(Collective::AllReduce, 1, 4, 3), 5u);           // integer bytes, as counted
  EXPECT_EQ(collective_bytes(Collective::AllReduce, 1000, 4, 1), 0u);
  EXPECT_EQ(broadcast_bytes(10, 4, 2), 40u);
}

TEST(ValidateAccounting, UnitsAddUpToTheParameterCount) {
  for (const char* name : {"gpt2-mini", "llama-mini", "gpt2-124m", "llama-tiny"}) {
    const ModelConfig m = model_preset(name);
    int64_t s = 0;
    for (int64_t n : engine_unit_sizes(m, 1)) s += n;
    EXPECT_EQ(s, m.num_params()) << name;
    EXPECT_EQ(engine_unit_sizes(m, 1).size(), static_cast<size_t>(m.n_layer + 2)) << name;
    for (int64_t n : engine_unit_sizes(m, 64)) EXPECT_EQ(n % 64, 0) << name;
  }
}

TEST(ValidateAccounting, ModelStateIsTheZeroTableWithFp32Gradients) {
  const ModelConfig m = model_preset("gpt2-mini");
  EngineLayout e = layout("NO_SHARD", 2);
  const double P = static_cast<double>(engine_flat_size(m, e));
  EngineMemory mem = engine_memory(m, e);
  EXPECT_DOUBLE_EQ(mem.params + mem.grads + mem.optimizer, 16 * P);  // fp32: 4 + 4 + 8
  e.bf16 = true;
  mem = engine_memory(m, e);
  EXPECT_DOUBLE_EQ(mem.params, 2 * P);
  EXPECT_DOUBLE_EQ(mem.grads, 4 * P);  // fp32 gradients: 18 bytes per parameter, not 16
  EXPECT_DOUBLE_EQ(mem.optimizer, 12 * P);
  e = layout("ZERO1", 4);
  e.bf16 = true;
  const double Q = static_cast<double>(engine_flat_size(m, e));
  mem = engine_memory(m, e);
  EXPECT_DOUBLE_EQ(mem.params + mem.grads + mem.optimizer, 2 * Q + 4 * Q + 12 * Q / 4);
  e.strategy = "FULL_SHARD";
  mem = engine_memory(m, e);
  EXPECT_DOUBLE_EQ(mem.params, 0);  // no bf16 shard: cast from the fp32 master when gathered
  EXPECT_DOUBLE_EQ(mem.grads + mem.optimizer, 16 * Q / 4);
  e.bf16 = false;
  mem = engine_memory(m, e);
  EXPECT_DOUBLE_EQ(mem.params + mem.grads + mem.optimizer, 16 * Q / 4);
}

TEST(ValidateAccounting, RecomputationKeepsFewerBlocks) {
  const ModelConfig m = model_preset("gpt2-mini");
  EngineLayout e = layout("NO_SHARD", 1);
  const double none = engine_activation_bytes(m, e);
  e.checkpointing = Checkpointing::Selective;
  const double sel = engine_activation_bytes(m, e);
  e.checkpointing = Checkpointing::Full;
  const double full = engine_activation_bytes(m, e);
  EXPECT_LT(sel, none);
  EXPECT_LT(full, sel);
  // 4 blocks: none stores 4, selective 2 (every second one recomputed) + a scratch block, full
  // only the scratch block.
  EXPECT_DOUBLE_EQ(sel - full, 2 * (none - sel));
}

TEST(ValidateAccounting, FullShardGathersBlocksTwiceAndRootsOnce) {
  const ModelConfig m = model_preset("gpt2-mini");  // tied: embedding and head stay gathered
  const EngineLayout e = layout("FULL_SHARD", 2);
  const auto u = engine_unit_sizes(m, engine_unit_align(e));
  uint64_t flat = 0, blocks = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    flat += static_cast<uint64_t>(u[i]);
    if (i > 0 && i + 1 < u.size()) blocks += static_cast<uint64_t>(u[i]);
  }
  const EngineComm c = engine_comm(m, e);
  // fp32, n = 2: each gather / reduce-scatter moves half of the unit's bytes.
  EXPECT_EQ(c.per_step.at("dp"), (flat + blocks) * 4 / 2 + flat * 4 / 2);
  EXPECT_EQ(c.per_step.at("grad_norm"), 4u);
  EXPECT_EQ(c.per_step.at("metrics"), 4u);
  EXPECT_EQ(c.setup.at("dp"), 4u + 4u * 3 * (2 + u.size()));  // the model fingerprint
  // Llama's embedding is not tied to the head: backward gathers it again.
  const ModelConfig l = model_preset("llama-mini");
  const auto lu = engine_unit_sizes(l, engine_unit_align(e));
  const EngineComm lc = engine_comm(l, e);
  uint64_t lflat = 0;
  for (int64_t n : lu) lflat += static_cast<uint64_t>(n);
  const uint64_t head = static_cast<uint64_t>(lu.back());
  EXPECT_EQ(lc.per_step.at("dp"), (2 * lflat - head) * 4 / 2 + lflat * 4 / 2);
}

TEST(ValidateAccounting, AccumulationAndHybrid) {
  const ModelConfig m = model_preset("gpt2-mini");
  EngineLayout z2 = layout("SHARD_GRAD_OP", 2);
  const uint64_t one = engine_comm(m, z2).dp_per_step();
  z2.grad_accum = 3;
  const uint64_t three = engine_comm(m, z2).dp_per_step();
  z2.reduce_every_microbatch = false;
  const uint64_t once = engine_comm(m, z2).dp_per_step();
  const uint64_t rs = static_cast<uint64_t>(engine_flat_size(m, z2)) * 4 / 2;
  EXPECT_EQ(three - one, 2 * rs);  // two more reduce-scatters of the fp32 gradients
  EXPECT_EQ(once, one);
  // DDP and ZeRO-1 reduce once whatever the accumulation.
  EngineLayout ddp = layout("NO_SHARD", 2);
  const uint64_t d1 = engine_comm(m, ddp).dp_per_step();
  ddp.grad_accum = 4;
  EXPECT_EQ(engine_comm(m, ddp).dp_per_step(), d1);
  // HSDP 2 x 2: the shard group carries ZeRO-3's traffic, the replicas all-reduce the fp32 shards.
  const EngineLayout h = layout("HYBRID_SHARD", 4, 2);
  const EngineComm hc = engine_comm(m, h);
  EXPECT_EQ(hc.per_step.at("dp_replicate"), static_cast<uint64_t>(engine_flat_size(m, h)) / 2 * 4);
  EXPECT_EQ(hc.per_step.at("dp_shard"), engine_comm(m, layout("FULL_SHARD", 2)).per_step.at("dp"));
  EXPECT_EQ(hc.per_step.count("dp"), 0u);
}

TEST(ValidateAccounting, PlannerLayoutMapping) {
  Layout l = planner_layout(layout("NO_SHARD", 4));
  EXPECT_EQ(l.strategy, Strategy::DDP);
  EXPECT_EQ(l.dp_replicate, 4);
  l = planner_layout(layout("HYBRID_SHARD", 4, 2));
  EXPECT_EQ(l.strategy, Strategy::HSDP);
  EXPECT_EQ(l.dp_replicate * l.dp_shard, 4);
  EXPECT_THROW(check_engine_layout(layout("HYBRID_SHARD", 4, 3)), std::invalid_argument);
  EXPECT_THROW(check_engine_layout(layout("FULL_SHARD", 4, 2)), std::invalid_argument);
  EXPECT_THROW(check_engine_layout(layout("TP", 2)), std::invalid_argument);
}

// Real jobs: DDP (with its one-off weight broadcast) and ZeRO-3 in bf16 on an untied Llama with
// selective recomputation — memory by category on every rank and bytes per group, exactly.
TEST(ValidateAgainstEngine, MemoryAndBytesMatchRealRuns) {
  const std::string bin = MT_BINARY;
  ASSERT_EQ(access(bin.c_str(), X_OK), 0) << "build the meshtrain binary first: " << bin;
  ValidateOptions o;
  o.binary = bin;
  o.steps = 3;
  o.check_time = false;
  o.probe_seconds = 0.1;
  EngineLayout ddp = layout("NO_SHARD", 2);
  EngineLayout z3 = layout("FULL_SHARD", 2);
  z3.model = "llama-mini";
  z3.bf16 = true;
  z3.checkpointing = Checkpointing::Selective;
  o.layouts = {ddp, z3};
  const ValidationReport rep = run_validation(o);
  ASSERT_EQ(rep.results.size(), 2u);
  for (const LayoutResult& r : rep.results) {
    const std::string what = r.layout.label();
    ASSERT_TRUE(r.error.empty()) << what << ": " << r.error;
    EXPECT_EQ(r.flat_predicted, r.flat_measured) << what;
    ASSERT_FALSE(r.mem.empty());
    for (const MemRow& m : r.mem) {
      EXPECT_TRUE(m.ok) << what << " " << m.category << ": predicted " << m.predicted << ", measured " << m.measured;
      if (m.check == MemCheck::Exact) {
        EXPECT_EQ(std::llround(m.predicted), std::llround(m.measured)) << what << " " << m.category;
      }
      if (m.check == MemCheck::Within) {
        EXPECT_NEAR(m.measured, m.predicted, 0.10 * m.predicted) << what << " " << m.category;
      }
    }
    bool saw_dp = false;
    for (const CommRow& c : r.comm) {
      EXPECT_TRUE(c.ok) << what << " group " << c.group << ": predicted " << c.setup << " + " << o.steps << " x "
                        << c.per_step << ", measured " << c.measured_total;
      if (c.group == "dp") {
        saw_dp = true;
        EXPECT_GT(c.per_step, 0u);
        EXPECT_EQ(c.measured_total, c.setup + static_cast<uint64_t>(o.steps) * c.per_step);
      }
    }
    EXPECT_TRUE(saw_dp) << what;
    EXPECT_GT(r.time.measured_s, 0) << what;
    EXPECT_GT(r.time.predicted_s, 0) << what;
    EXPECT_TRUE(r.ok) << what;
  }
  EXPECT_TRUE(rep.ok);
  const std::string table = format_validation(rep);
  EXPECT_NE(table.find("model state"), std::string::npos);
  EXPECT_NE(table.find("(not checked)"), std::string::npos);
}

}  // namespace
}  // namespace mt::plan
