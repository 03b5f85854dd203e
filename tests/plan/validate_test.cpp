// The planner against this engine (issue 7 part 5): the exact accounting, and a reduced
// `plan --validate` that runs real jobs of the meshtrain binary and compares memory and bytes.
// Step time is not asserted here (a shared, noisy CI machine); `meshtrain plan --validate` checks it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "model/transformer.h"
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

EngineLayout tp_layout(const std::string& strategy, int ranks, int tp, const std::string& model = "gpt2-mini") {
  EngineLayout e = layout(strategy, ranks);
  e.tp = tp;
  e.model = model;
  return e;
}

// Only what the model's constructor asks for (its tp rank and size, to lay out its share); a
// collective would mean the layout depends on communication.
class LayoutOnlyTp final : public TpComm {
 public:
  LayoutOnlyTp(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(float*, int64_t) override { throw std::logic_error("no collectives here"); }
  void all_reduce_max(float*, int64_t) override { throw std::logic_error("no collectives here"); }

 private:
  int rank_, size_;
};

uint64_t sum(const std::vector<int64_t>& v) {
  uint64_t s = 0;
  for (int64_t n : v) s += static_cast<uint64_t>(n);
  return s;
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

// ---- tensor parallelism ---------------------------------------------------------------------------

TEST(ValidateTensorParallel, UnitSizesAreTheModelsShare) {
  // The planner's unit sizes from the dimensions against the engine's own model built for each tp
  // rank (no weights allocated, no collective called), with and without shard padding.
  for (const char* name : {"gpt2-mini", "llama-mini", "llama-tiny"}) {
    for (int tp : {1, 2, 4}) {
      const ModelConfig base = model_preset(name);
      if (base.n_head % tp || base.n_kv_head % tp || base.ffn_hidden % tp) continue;
      const EngineLayout e = tp_layout("NO_SHARD", tp, tp, name);
      const ModelConfig m = engine_model(base, e);
      EXPECT_EQ(m.padded_vocab % (64 * tp), 0) << name;
      for (int64_t align : {1, 32, 64}) {
        const std::vector<int64_t> u = engine_unit_sizes(m, align, tp);
        for (int r = 0; r < tp; ++r) {
          LayoutOnlyTp comm(r, tp);
          const Transformer model(m, DType::F32, Recompute::None, ModelStorage{false, false, false, align},
                                  tp > 1 ? &comm : nullptr);
          ASSERT_EQ(u.size(), static_cast<size_t>(model.num_units())) << name;
          for (int k = 0; k < model.num_units(); ++k)
            EXPECT_EQ(u[k], model.unit(k).numel) << name << " tp " << tp << " rank " << r << " unit " << k;
          EXPECT_EQ(static_cast<int64_t>(sum(u)), model.flat_size()) << name << " tp " << tp;
        }
      }
    }
  }
}

TEST(ValidateTensorParallel, SplitAndReplicatedParameters) {
  // t ranks together hold every split parameter once and every replicated one t times: for GPT-2
  // the position table, per block ln_1, ln_2 (2C each) and the two row-parallel biases (C each),
  // and ln_f (2C) are replicated.
  const ModelConfig m = model_preset("gpt2-mini");
  const int64_t C = m.n_embd, L = m.n_layer;
  const int64_t replicated = m.seq_len * C + L * (2 * C + 2 * C + C + C) + 2 * C;
  const int64_t P1 = static_cast<int64_t>(sum(engine_unit_sizes(engine_model(m, tp_layout("NO_SHARD", 1, 1)), 1, 1)));
  for (int t : {2, 4}) {
    const int64_t Pt = static_cast<int64_t>(sum(engine_unit_sizes(engine_model(m, tp_layout("NO_SHARD", t, t)), 1, t)));
    EXPECT_EQ(t * Pt - (t - 1) * replicated, P1) << "tp " << t;
  }
  // Model state per rank: the ZeRO table over one tp rank's share (fp32: 16 bytes per element).
  const EngineLayout tp2 = tp_layout("NO_SHARD", 2, 2), tp2z3 = tp_layout("FULL_SHARD", 4, 2);
  EXPECT_EQ(tp2z3.shard_size(), 2);
  const double P2 = static_cast<double>(engine_flat_size(m, tp2)), Q2 = static_cast<double>(engine_flat_size(m, tp2z3));
  EngineMemory mem = engine_memory(m, tp2);
  EXPECT_DOUBLE_EQ(mem.params + mem.grads + mem.optimizer, 16 * P2);
  mem = engine_memory(m, tp2z3);
  EXPECT_DOUBLE_EQ(mem.params, 4 * Q2 / 2);
  EXPECT_DOUBLE_EQ(mem.params + mem.grads + mem.optimizer, 16 * Q2 / 2);
  // Activations: the split per-token terms halve (fused qkv, attention output, log-sum-exp, FFN
  // pre-activation and activation, the logits), the rest (norm inputs, residuals) stays.
  const double F = static_cast<double>(m.ffn_hidden), V = static_cast<double>(m.padded_vocab);
  const double nh = static_cast<double>(m.n_head), Cd = static_cast<double>(C);
  const double tokens = 4.0 * static_cast<double>(m.seq_len);
  const double split = static_cast<double>(L) * (4 * 3 * Cd + 4 * Cd + 4 * nh + 4 * F + 4 * F) + 4 * V;
  EXPECT_DOUBLE_EQ(engine_activation_bytes(m, layout("NO_SHARD", 1)) - engine_activation_bytes(m, tp2),
                   tokens * split / 2);
}

TEST(ValidateTensorParallel, TpBytesAreTheEnginesAllReduces) {
  const ModelConfig m = model_preset("gpt2-mini");
  const uint64_t L = static_cast<uint64_t>(m.n_layer), C = static_cast<uint64_t>(m.n_embd);
  EngineLayout e = tp_layout("NO_SHARD", 2, 2);
  const uint64_t N = static_cast<uint64_t>(e.micro_batch * m.seq_len);
  // Per micro-batch: embedding + 2 per block forward, head + 2 per block backward (N x C fp32 each),
  // the loss's maxima (N) and sums | target logits (2N). n = 2: an all-reduce moves its buffer once.
  const uint64_t per_mb = ((1 + 2 * L) + (1 + 2 * L)) * N * C * 4 + 3 * N * 4;
  EngineComm c = engine_comm(m, e);
  EXPECT_EQ(c.per_step.at("tp"), per_mb);
  EXPECT_EQ(c.tp_per_step(), per_mb);
  EXPECT_EQ(engine_tp_allreduces(m, e).size(), 4 * L + 4);
  EXPECT_EQ(c.per_step.at("tp_aux"), 4u);  // the gradient norm summed over the tp ranks
  EXPECT_EQ(c.per_step.count("metrics"), 0u);  // one data-parallel rank: no loss all-reduce
  EXPECT_EQ(c.dp_per_step(), 0u);              // nothing to reduce over one data-parallel rank
  EXPECT_EQ(c.total("dp", 8), 0u);
  EXPECT_EQ(c.setup.at("metrics"), 4u * 4 * kNumMemCategories);  // the memory table, every rank
  // Gradient accumulation repeats it per micro-batch; four tp ranks move 2(n-1)/n of each buffer.
  e.grad_accum = 3;
  EXPECT_EQ(engine_comm(m, e).per_step.at("tp"), 3 * per_mb);
  const EngineLayout t4 = tp_layout("NO_SHARD", 4, 4);
  EXPECT_EQ(engine_comm(m, t4).per_step.at("tp"), per_mb * 3 / 2);
  EXPECT_EQ(engine_comm(m, t4).per_step.at("tp_aux"), 6u);
  // Recomputed blocks issue their forward all-reduces again in backward (selective: every second).
  EngineLayout sel = tp_layout("NO_SHARD", 2, 2, "llama-mini");
  const ModelConfig l = model_preset("llama-mini");
  const uint64_t lNC = static_cast<uint64_t>(sel.micro_batch * l.seq_len * l.n_embd);
  const uint64_t none = engine_comm(l, sel).tp_per_step();
  sel.checkpointing = Checkpointing::Selective;
  EXPECT_EQ(engine_comm(l, sel).tp_per_step() - none, static_cast<uint64_t>(l.n_layer / 2) * 2 * lNC * 4);
  sel.checkpointing = Checkpointing::Full;
  EXPECT_EQ(engine_comm(l, sel).tp_per_step() - none, static_cast<uint64_t>(l.n_layer) * 2 * lNC * 4);
  // tp = 1: no tp traffic at all.
  EXPECT_TRUE(engine_tp_allreduces(m, layout("NO_SHARD", 2)).empty());
  EXPECT_EQ(engine_comm(m, layout("NO_SHARD", 2)).per_step.count("tp"), 0u);
}

TEST(ValidateTensorParallel, DataParallelTrafficIsOneTpRanksShare) {
  // tp 2 x ZeRO-3 dp_shard 2: the dp group carries ZeRO-3's traffic for the tp share over 2 ranks.
  const ModelConfig m = model_preset("gpt2-mini");
  const EngineLayout e = tp_layout("FULL_SHARD", 4, 2);
  const auto u = engine_unit_sizes(engine_model(m, e), engine_unit_align(e), 2);
  uint64_t blocks = 0;
  for (size_t i = 1; i + 1 < u.size(); ++i) blocks += static_cast<uint64_t>(u[i]);
  const uint64_t flat = sum(u);
  EXPECT_EQ(static_cast<int64_t>(flat), engine_flat_size(m, e));
  const EngineComm c = engine_comm(m, e);
  EXPECT_EQ(c.per_step.at("dp"), (flat + blocks) * 4 / 2 + flat * 4 / 2);  // gathers + reduce-scatters
  EXPECT_EQ(c.per_step.at("grad_norm"), 4u);
  EXPECT_EQ(c.per_step.at("metrics"), 6u);  // the mean loss over all 4 ranks: 2 x 3/4 x 4 bytes
  EXPECT_EQ(c.per_step.at("tp"), engine_comm(m, tp_layout("NO_SHARD", 2, 2)).per_step.at("tp"));
  EXPECT_EQ(c.setup.at("dp"), 4u + 4u * 3 * (2 + u.size()));  // the fingerprint over the dp group
  // DDP with tp: the buckets of one tp rank's share over the dp ranks (n = 2: the buffer once).
  const EngineLayout d = tp_layout("NO_SHARD", 4, 2);
  const uint64_t dflat = static_cast<uint64_t>(engine_flat_size(m, d));
  EXPECT_EQ(engine_comm(m, d).dp_per_step(), dflat * 4);
  EXPECT_EQ(engine_comm(m, d).setup.at("dp"), 4u + 4u * 3 * (2 + u.size()) + dflat * 4);  // + the broadcast
}

TEST(ValidateTensorParallel, TpTimeIsEveryAllReduceExposed) {
  const ModelConfig m = model_preset("gpt2-mini");
  EngineLayout e = tp_layout("NO_SHARD", 2, 2);
  e.grad_accum = 2;
  const Cluster c = cluster_preset("this-cpu");
  const GroupShape g = group_shape(2, 1, c.gpus_per_node);
  const double NC4 = 4.0 * static_cast<double>(e.micro_batch * m.seq_len * m.n_embd);
  const double N4 = 4.0 * static_cast<double>(e.micro_batch * m.seq_len);
  const double per_mb = static_cast<double>(4 * m.n_layer + 2) * collective(Collective::AllReduce, NC4, g, c).time +
                        collective(Collective::AllReduce, N4, g, c).time +
                        collective(Collective::AllReduce, 2 * N4, g, c).time;
  EXPECT_NEAR(engine_tp_seconds(m, e, c), 2 * per_mb, 1e-12);
  EXPECT_EQ(engine_tp_seconds(m, layout("NO_SHARD", 2), c), 0.0);
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
  // Tensor parallelism: the planner sees dp = ranks / tp and tp; the engine is told --parallel.tp.
  const EngineLayout t = tp_layout("FULL_SHARD", 4, 2);
  l = planner_layout(t);
  EXPECT_EQ(l.strategy, Strategy::ZeRO3);
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
}

// Runs the layouts as real jobs (3 steps, no step-time check) and expects memory by category on
// every rank and bytes per group to match exactly; `must_see` groups must carry bytes every step.
ValidationReport run_and_check(const std::vector<EngineLayout>& layouts, const std::vector<std::string>& must_see) {
  const std::string bin = MT_BINARY;
  EXPECT_EQ(access(bin.c_str(), X_OK), 0) << "build the meshtrain binary first: " << bin;
  ValidateOptions o;
  o.binary = bin;
  o.steps = 3;
  o.check_time = false;
  o.probe_seconds = 0.1;
  o.layouts = layouts;
  const ValidationReport rep = run_validation(o);
  EXPECT_EQ(rep.results.size(), layouts.size());
  for (const LayoutResult& r : rep.results) {
    const std::string what = r.layout.label();
    if (!r.error.empty()) {
      ADD_FAILURE() << what << ": " << r.error;
      continue;
    }
    EXPECT_EQ(r.flat_predicted, r.flat_measured) << what;
    EXPECT_FALSE(r.mem.empty()) << what;
    for (const MemRow& m : r.mem) {
      EXPECT_TRUE(m.ok) << what << " " << m.category << ": predicted " << m.predicted << ", measured " << m.measured;
      if (m.check == MemCheck::Exact) {
        EXPECT_EQ(std::llround(m.predicted), std::llround(m.measured)) << what << " " << m.category;
      }
      if (m.check == MemCheck::Within) {
        EXPECT_NEAR(m.measured, m.predicted, 0.10 * m.predicted) << what << " " << m.category;
      }
    }
    for (const std::string& g : must_see) {
      if (g == "dp" && r.layout.dp_ranks() == 1) continue;  // tp alone: one data-parallel rank
      if (g == "tp" && r.layout.tp == 1) continue;
      bool saw = false;
      for (const CommRow& c : r.comm)
        if (c.group == g) {
          saw = true;
          EXPECT_GT(c.per_step, 0u) << what << " " << g;
          EXPECT_EQ(c.measured_total, c.setup + static_cast<uint64_t>(o.steps) * c.per_step) << what << " " << g;
        }
      EXPECT_TRUE(saw) << what << ": no bytes on " << g;
    }
    for (const CommRow& c : r.comm)
      EXPECT_TRUE(c.ok) << what << " group " << c.group << ": predicted " << c.setup << " + " << o.steps << " x "
                        << c.per_step << ", measured " << c.measured_total;
    EXPECT_GT(r.time.measured_s, 0) << what;
    EXPECT_GT(r.time.predicted_s, 0) << what;
    EXPECT_TRUE(r.ok) << what;
  }
  EXPECT_TRUE(rep.ok);
  return rep;
}

// Real jobs: DDP (with its one-off weight broadcast) and ZeRO-3 in bf16 on an untied Llama with
// selective recomputation — memory by category on every rank and bytes per group, exactly.
TEST(ValidateAgainstEngine, MemoryAndBytesMatchRealRuns) {
  EngineLayout ddp = layout("NO_SHARD", 2);
  EngineLayout z3 = layout("FULL_SHARD", 2);
  z3.model = "llama-mini";
  z3.bf16 = true;
  z3.checkpointing = Checkpointing::Selective;
  const ValidationReport rep = run_and_check({ddp, z3}, {"dp"});
  const std::string table = format_validation(rep);
  EXPECT_NE(table.find("model state"), std::string::npos);
  EXPECT_NE(table.find("(not checked)"), std::string::npos);
}

// Real jobs with tensor parallelism: tp = 2 alone on GPT-2 (tied head, fp32), and tp = 2 inside
// ZeRO-3 over 2 data-parallel ranks on an untied Llama in bf16 with selective recomputation (the
// recomputed blocks' forward all-reduces) — every rank's memory and the tp, tp_aux, dp, grad_norm
// and metrics counters exactly.
TEST(ValidateAgainstEngine, TensorParallelMemoryAndBytesMatchRealRuns) {
  EngineLayout tp2 = tp_layout("NO_SHARD", 2, 2);
  EngineLayout tz3 = tp_layout("FULL_SHARD", 4, 2, "llama-mini");
  tz3.bf16 = true;
  tz3.checkpointing = Checkpointing::Selective;
  const ValidationReport rep = run_and_check({tp2, tz3}, {"tp", "tp_aux", "dp"});
  const std::string table = format_validation(rep);
  EXPECT_NE(table.find("tp2"), std::string::npos);
  EXPECT_NE(table.find("(textbook dp+tp/step)"), std::string::npos);
}

}  // namespace
}  // namespace mt::plan
