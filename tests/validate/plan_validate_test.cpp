// `meshtrain plan --validate` (validate/plan_validate.h): the layout vocabulary, and reduced validations
// that run the meshtrain binary - dry runs and real one-step jobs whose memory by category and bytes
// by group must be equal, and the planner compared with dry runs of large layouts. Step time is not
// measured here (a shared, noisy CI machine); `meshtrain plan --validate` measures and checks it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "plan/planner.h"
#include "validate/plan_validate.h"

namespace mt::validate {
namespace {

using plan::Layout;
using plan::Strategy;

EngineLayout layout(const std::string& strategy, int ranks, int rep = 1) {
  EngineLayout e;
  e.strategy = parse_sharding_strategy(strategy);
  e.ranks = ranks;
  e.dp_replicate = rep;
  return e;
}

EngineLayout tp_layout(const std::string& strategy, int ranks, int tp, const std::string& model = "gpt2-mini") {
  EngineLayout e = layout(strategy, ranks);
  e.tp = tp;
  e.model = model;
  return e;
}

TEST(ValidateLayout, PlannerLayoutMapping) {
  Layout l = planner_layout(layout("NO_SHARD", 4));
  EXPECT_EQ(l.strategy, Strategy::NoShard);
  EXPECT_EQ(l.dp_replicate, 4);
  l = planner_layout(layout("HYBRID_SHARD", 4, 2));
  EXPECT_EQ(l.strategy, Strategy::HybridShard);
  EXPECT_EQ(l.dp_replicate * l.dp_shard, 4);
  EXPECT_THROW(check_engine_layout(layout("HYBRID_SHARD", 4, 3)), std::invalid_argument);
  EXPECT_THROW(check_engine_layout(layout("FULL_SHARD", 4, 2)), std::invalid_argument);
  EXPECT_THROW(layout("TP", 2), std::invalid_argument);  // not a parallel.strategy
  // Tensor parallelism: the planner sees dp = ranks / tp and tp; the engine is told --parallel.tp.
  const EngineLayout t = tp_layout("FULL_SHARD", 4, 2);
  l = planner_layout(t);
  EXPECT_EQ(l.strategy, Strategy::FullShard);
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.dp_shard, 2);
  EXPECT_EQ(l.world(), 4);
  const ModelConfig m = model_preset("gpt2-mini");
  EXPECT_EQ(planner_setup(m, t).global_batch, 2 * t.micro_batch);
  EXPECT_FALSE(planner_setup(m, t).sequence_parallel);
  l = planner_layout(tp_layout("NO_SHARD", 2, 2));
  EXPECT_EQ(l.dp(), 1);
  EXPECT_EQ(l.tp, 2);
  const auto args = t.train_args();
  bool saw_tp = false;
  for (size_t i = 0; i + 1 < args.size(); ++i) saw_tp |= args[i] == "--parallel.tp" && args[i + 1] == "2";
  EXPECT_TRUE(saw_tp);
  EXPECT_NE(t.label().find("tp2"), std::string::npos);
  EXPECT_THROW(check_engine_layout(tp_layout("NO_SHARD", 4, 3)), std::invalid_argument);                // 3 does not divide 4
  EXPECT_THROW(check_engine_layout(tp_layout("NO_SHARD", 4, 4, "llama-mini")), std::invalid_argument);  // 2 kv heads
  EngineLayout h = tp_layout("HYBRID_SHARD", 4, 2);
  h.dp_replicate = 4;  // more replicas than the 2 data-parallel ranks
  EXPECT_THROW(check_engine_layout(h), std::invalid_argument);
  EXPECT_EQ(default_validation_layouts().size(), validation_layout_names().size());
  EXPECT_EQ(default_scale_layouts().size(), scale_layout_names().size());
  for (const EngineLayout& e : default_scale_layouts()) EXPECT_NO_THROW(check_engine_layout(e)) << e.label();
}

std::string binary() {
  const std::string bin = MT_BINARY;
  EXPECT_EQ(access(bin.c_str(), X_OK), 0) << "build the meshtrain binary first: " << bin;
  return bin;
}

// The layouts as dry runs and real one-step jobs: every rank's resident memory by category, rank 0's
// bytes per group, the flat size, the stage cut and the activation slots equal; `must_see` groups
// must carry bytes; the planner's figures are there next to the engine's.
ValidationReport run_and_check(const std::vector<EngineLayout>& layouts, const std::vector<std::string>& must_see) {
  ValidateOptions o;
  o.binary = binary();
  o.measure_time = false;
  o.run_scale = false;
  o.layouts = layouts;
  const ValidationReport rep = run_validation(o);
  EXPECT_EQ(rep.results.size(), layouts.size());
  for (const LayoutResult& r : rep.results) {
    const std::string what = r.layout.label();
    if (!r.error.empty()) {
      ADD_FAILURE() << what << ": " << r.error;
      continue;
    }
    EXPECT_GT(r.flat_dry, 0) << what;
    EXPECT_EQ(r.flat_dry, r.flat_measured) << what;
    EXPECT_FALSE(r.mem.empty()) << what;
    for (const MemRow& m : r.mem) {
      if (m.check == MemCheck::Exact) {
        EXPECT_TRUE(m.ok) << what << " " << m.category << ": dry run " << m.dry << ", real " << m.measured;
      }
      if (m.category == "optimizer") {
        EXPECT_GT(m.dry, 0) << what;
      }
    }
    if (r.layout.pp > 1) {
      EXPECT_EQ(r.stages_dry, r.stages_measured) << what;
      EXPECT_EQ(r.slots_dry, r.slots_measured) << what;
      EXPECT_GT(r.slots_measured, 0) << what;
    }
    for (const std::string& g : must_see) {
      if (g == "dp" && r.layout.dp_ranks() == 1) continue;  // tp alone: one data-parallel rank
      if (g == "grad_norm" && r.layout.strategy == ShardingStrategy::NoShard) continue;  // sharded strategies only
      if ((g == "tp" || g == "tp_aux") && r.layout.tp == 1) continue;
      if ((g == "pp" || g == "pp_aux") && r.layout.pp == 1) continue;
      bool saw = false;
      for (const CommRow& c : r.comm) saw |= c.group == g && c.measured > 0;
      EXPECT_TRUE(saw) << what << ": no bytes on " << g;
    }
    for (const CommRow& c : r.comm)
      EXPECT_TRUE(c.ok) << what << " group " << c.group << ": dry run " << c.dry << ", real " << c.measured;
    bool planner_params = false;
    for (const GapRow& g : r.gaps.rows) planner_params |= g.what == "params" && g.modelled && g.planner > 0 && g.engine > 0;
    EXPECT_TRUE(planner_params) << what;
    EXPECT_EQ(r.attempts, 0) << what;  // no timed job
    EXPECT_TRUE(r.ok) << what;
  }
  EXPECT_TRUE(rep.ok);
  return rep;
}

// DDP (with its one-off weight broadcast) and ZeRO-3 in bf16 on an untied Llama with selective
// recomputation.
TEST(ValidateAgainstEngine, DryRunsEqualRealRuns) {
  EngineLayout ddp = layout("NO_SHARD", 2);
  EngineLayout z3 = layout("FULL_SHARD", 2);
  z3.model = "llama-mini";
  z3.bf16 = true;
  z3.checkpointing = Checkpointing::Selective;
  const ValidationReport rep = run_and_check({ddp, z3}, {"dp", "grad_norm"});
  const std::string table = format_validation(rep);
  EXPECT_NE(table.find("dry run"), std::string::npos);
  EXPECT_NE(table.find("not modelled"), std::string::npos);  // workspace, scratch, grad_norm ...
  EXPECT_NE(table.find("Step time: (not measured)"), std::string::npos);
}

// Tensor parallelism inside ZeRO-3 (4 ranks), and a pipeline (pp = 2, 1F1B, 4 micro-batches, GPT-2's
// tied embedding cut apart) next to tp = 2 with sequence parallelism.
TEST(ValidateAgainstEngine, TensorPipelineAndSequenceParallelDryRunsEqualRealRuns) {
  EngineLayout tz3 = tp_layout("FULL_SHARD", 4, 2, "llama-mini");
  tz3.bf16 = true;
  EngineLayout pp2 = layout("NO_SHARD", 2);
  pp2.pp = 2;
  pp2.grad_accum = 4;
  EngineLayout sp = tp_layout("NO_SHARD", 2, 2);
  sp.sequence_parallel = true;
  const ValidationReport rep = run_and_check({tz3, pp2, sp}, {"tp", "tp_aux", "dp", "pp", "pp_aux"});
  int stage_rows = 0;
  for (const LayoutResult& r : rep.results)
    for (const MemRow& m : r.mem) stage_rows += m.pp_rank == 1;
  EXPECT_GT(stage_rows, 0);  // the second stage's categories are checked on their own
  EXPECT_NE(format_validation(rep).find("stage 1: params"), std::string::npos);
  // The planner's tp bytes are the engine's, to the byte: in bf16 without SP (activations and
  // input-gradient sums in bf16) and under SP (the gathers and reduce-scatters and the norms' small
  // gradient all-reduces).
  ASSERT_EQ(rep.results.size(), 3u);
  for (size_t i : {size_t{0}, size_t{2}}) {
    bool exact = false;
    for (const GapRow& g : rep.results[i].gaps.rows)
      exact |= g.what == "bytes tp" && g.modelled && std::abs(g.planner - g.engine) < 0.5;
    EXPECT_TRUE(exact) << "layout " << i << "\n" << format_validation(rep);
  }
}

// Expert parallelism (llama-mini with 4 experts, top-2, ep = 2 over DDP x2): the model state and the
// dp / ep_aux / metrics bytes are exact; the routed rows (activations, workspace, the ep group's
// all-to-all bytes) depend on the routing, which the dry run cannot see, and are shown as info.
TEST(ValidateAgainstEngine, ExpertParallelModelStateIsExact) {
  EngineLayout moe = layout("NO_SHARD", 2);
  moe.model = "llama-mini";
  moe.moe_experts = 4;
  moe.ep = 2;
  const ValidationReport rep = run_and_check({moe}, {"dp", "ep", "ep_aux"});
  ASSERT_EQ(rep.results.size(), 1u);
  int exact = 0, info = 0;
  for (const MemRow& m : rep.results[0].mem) {
    if (m.category == "params" || m.category == "grads" || m.category == "optimizer") {
      EXPECT_EQ(m.check, MemCheck::Exact) << m.category;
      ++exact;
    }
    if (m.category == "activations") {
      EXPECT_EQ(m.check, MemCheck::Info);
    }
    info += m.check == MemCheck::Info;
  }
  EXPECT_EQ(exact, 3);
  EXPECT_GE(info, 2);
  bool ep_info = false;
  for (const CommRow& c : rep.results[0].comm) ep_info |= c.group == "ep" && c.info;
  EXPECT_TRUE(ep_info);
  EXPECT_NE(rep.results[0].layout.label().find("ep2"), std::string::npos);
}

// The same padded to a capacity (factor 1.25, model.moe_pad_to_capacity): every expert receives
// exactly its capacity of rows from each rank whatever the routing, so every category but the CPU
// kernels' scratch and every group's bytes, the ep group's all-to-all included, are checked exactly.
TEST(ValidateAgainstEngine, ExpertParallelPaddedToCapacityIsExact) {
  EngineLayout moe = layout("NO_SHARD", 2);
  moe.model = "llama-mini";
  moe.moe_experts = 4;
  moe.ep = 2;
  moe.moe_capacity_factor = 1.25;
  moe.moe_pad_to_capacity = true;
  EXPECT_FALSE(moe.routing_dependent());
  const ValidationReport rep = run_and_check({moe}, {"dp", "ep", "ep_aux"});
  ASSERT_EQ(rep.results.size(), 1u);
  int exact = 0;
  for (const MemRow& m : rep.results[0].mem) {
    EXPECT_EQ(m.check, m.category == "scratch" ? MemCheck::Info : MemCheck::Exact) << m.category;
    exact += m.check == MemCheck::Exact;
  }
  EXPECT_GE(exact, 5);  // params, grads, optimizer, activations, workspace (and comm buffers)
  bool ep_exact = false;
  for (const CommRow& c : rep.results[0].comm) {
    EXPECT_FALSE(c.info) << c.group;
    ep_exact |= c.group == "ep" && c.measured > 0 && c.ok;
  }
  EXPECT_TRUE(ep_exact);
  EXPECT_NE(rep.results[0].layout.label().find("cap1.25 padded"), std::string::npos);
  EngineLayout bad = moe;
  bad.moe_capacity_factor = 0;
  EXPECT_THROW(check_engine_layout(bad), std::invalid_argument);
}

// Context parallelism (ring attention) alone and inside ZeRO-3 over dp_shard x cp: dry runs equal the
// real jobs on every rank, bytes on the cp ring and the dp_cp / dp_shard_cp reductions.
TEST(ValidateAgainstEngine, ContextParallelDryRunsEqualRealRuns) {
  EngineLayout cp2 = layout("NO_SHARD", 2);
  cp2.model = "llama-mini";
  cp2.cp = 2;
  EngineLayout cpz3 = layout("FULL_SHARD", 4);
  cpz3.model = "llama-mini";
  cpz3.cp = 2;
  const ValidationReport rep = run_and_check({cp2, cpz3}, {"cp"});
  bool ring_modelled = false;
  for (const LayoutResult& r : rep.results)
    for (const GapRow& g : r.gaps.rows) ring_modelled |= g.what == "bytes cp" && g.modelled && g.planner == g.engine;
  EXPECT_TRUE(ring_modelled) << format_validation(rep);  // the planner's ring bytes are the engine's
}

// The planner against dry runs of a layout no machine here can run (Llama 3 70B, ZeRO-3 x tp 8 x pp 4
// on 512 ranks): both stages dry-run, every planner category next to the engine's, bytes on dp, tp
// and pp from the engine.
TEST(ValidateAgainstEngine, PlannerAgainstDryRunsAtScale) {
  const std::vector<EngineLayout> all = default_scale_layouts();
  const std::vector<std::string> names = scale_layout_names();
  EngineLayout e;
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == "70b-zero3-tp8-pp4") e = all[i];
  ASSERT_EQ(e.ranks, 512);
  std::vector<EngineFigures> dry;
  const std::string dir = testing::TempDir() + "plan_validate_scale";
  for (int rank : {0, (e.pp - 1) * (e.ranks / e.pp)}) dry.push_back(dry_run(binary(), e, rank, dir));
  EXPECT_GT(dry[0].flat_size, 0);
  EXPECT_GT(dry[1].resident.at("optimizer"), 0);
  EXPECT_GT(dry[0].comm.at("tp"), 0u);
  EXPECT_GT(dry[0].comm.at("pp"), 0u);
  EXPECT_GT(dry[0].comm.at("dp"), 0u);
  const PlannerGaps g = compare_with_planner(model_preset(e.model), e, dry);
  for (const char* what : {"params", "grads", "optimizer", "activations", "comm", "bytes dp", "bytes tp", "bytes pp"}) {
    bool found = false;
    for (const GapRow& r : g.rows)
      if (r.what == what) {
        found = true;
        EXPECT_TRUE(r.modelled) << what;
        EXPECT_GT(r.planner, 0) << what;
        EXPECT_GT(r.engine, 0) << what;
      }
    EXPECT_TRUE(found) << what;
  }
  EXPECT_GT(g.psi_planner, 0);
  EXPECT_GT(g.flat_engine, 0);
}

}  // namespace
}  // namespace mt::validate
