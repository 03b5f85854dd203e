// The planner against this engine (issue 7 part 5): the exact accounting, and a reduced
// `plan --validate` that runs real jobs of the meshtrain binary and compares memory and bytes.
// Step time is not asserted here (a shared, noisy CI machine); `meshtrain plan --validate` checks it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <functional>
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

// Exposed: every all-reduce on the critical path — the forward ones (2 per block, the embedding,
// the loss's two) — and not the backward input-gradient sums (2 per block and the head's), which
// run under the weight-gradient matmuls.
TEST(ValidateTensorParallel, TpTimeIsEveryCriticalPathAllReduce) {
  const ModelConfig m = model_preset("gpt2-mini");
  EngineLayout e = tp_layout("NO_SHARD", 2, 2);
  e.grad_accum = 2;
  const Cluster c = cluster_preset("this-cpu");
  const GroupShape g = group_shape(2, 1, c.gpus_per_node);
  const double NC4 = 4.0 * static_cast<double>(e.micro_batch * m.seq_len * m.n_embd);
  const double N4 = 4.0 * static_cast<double>(e.micro_batch * m.seq_len);
  const double per_mb = static_cast<double>(2 * m.n_layer + 1) * collective(Collective::AllReduce, NC4, g, c).time +
                        collective(Collective::AllReduce, N4, g, c).time +
                        collective(Collective::AllReduce, 2 * N4, g, c).time;
  EXPECT_NEAR(engine_tp_seconds(m, e, c), 2 * per_mb, 1e-12);
  EXPECT_EQ(engine_tp_seconds(m, layout("NO_SHARD", 2), c), 0.0);
  int overlapped = 0;
  for (const TpCollective& x : engine_tp_collectives(m, e)) overlapped += x.overlapped ? 1 : 0;
  EXPECT_EQ(overlapped, 2 * m.n_layer + 1);
}

// ---- sequence parallelism --------------------------------------------------------------------------

EngineLayout sp_layout(int ranks = 2, int tp = 2, const std::string& model = "gpt2-mini") {
  EngineLayout e = tp_layout("NO_SHARD", ranks, tp, model);
  e.sequence_parallel = true;
  return e;
}

TEST(ValidateSequenceParallel, TpBytesAreTheGathersAndScatters) {
  // gpt2-mini, tp = 2, N = 4 x 128 tokens, R = N / 2 rows per rank. Per micro-batch, all-gathers and
  // reduce-scatters of R x C fp32 (each (t-1) x R x C x 4 bytes as the comm layer counts them):
  // forward 1 (embedding) + 4 per block + 1 (head), backward 1 (head) + 6 per block + 1 (embedding);
  // all-reduces (2(t-1)/t x buffer): the loss's N and 2N, the norms' gradient contributions (2C each:
  // ln_f once, ln_1 and ln_2 per block).
  const ModelConfig m = model_preset("gpt2-mini");
  const uint64_t L = static_cast<uint64_t>(m.n_layer), C = static_cast<uint64_t>(m.n_embd);
  EngineLayout e = sp_layout();
  const uint64_t N = static_cast<uint64_t>(e.micro_batch * m.seq_len), R = N / 2;
  const uint64_t per_mb = (4 + 10 * L) * R * C * 4 + (N + 2 * N + 2 * C + L * 2 * 2 * C) * 4;
  EngineComm c = engine_comm(m, e);
  EXPECT_EQ(c.per_step.at("tp"), per_mb);
  EXPECT_EQ(c.per_step.at("tp_aux"), 4u);
  size_t ag = 0, rs = 0, ar = 0;
  for (const TpCollective& x : engine_tp_collectives(m, e)) {
    ag += x.kind == Collective::AllGather;
    rs += x.kind == Collective::ReduceScatter;
    ar += x.kind == Collective::AllReduce;
    if (x.kind != Collective::AllReduce) {
      EXPECT_EQ(x.count, R * C);
    }
  }
  EXPECT_EQ(ag, 2 + 6 * L);  // ln1, ln2 forward; output gradient twice + ln1, ln2 again backward; head, embedding
  EXPECT_EQ(rs, 2 + 4 * L);  // embedding, head; attention, MLP forward; their input gradients backward
  EXPECT_EQ(ar, 3 + 2 * L);
  EXPECT_EQ(engine_tp_allreduces(m, e).size(), ar);
  // The same gathers / scatters of 1/t of the rows move half an all-reduce's volume each (t = 2).
  const uint64_t no_sp = engine_comm(m, tp_layout("NO_SHARD", 2, 2)).per_step.at("tp");
  EXPECT_LT(per_mb, no_sp * 13 / 10);
  // Full recomputation re-issues every block's forward four.
  e.checkpointing = Checkpointing::Full;
  EXPECT_EQ(engine_comm(m, e).per_step.at("tp") - per_mb, L * 4 * R * C * 4);
  // Llama: the RMS norms have no bias (C per norm).
  const ModelConfig l = model_preset("llama-mini");
  const EngineLayout le = sp_layout(2, 2, "llama-mini");
  const uint64_t lL = static_cast<uint64_t>(l.n_layer), lC = static_cast<uint64_t>(l.n_embd);
  const uint64_t lN = static_cast<uint64_t>(le.micro_batch * l.seq_len);
  EXPECT_EQ(engine_comm(l, le).per_step.at("tp"), (4 + 10 * lL) * lN / 2 * lC * 4 + (3 * lN + lC + 2 * lL * lC) * 4);
}

TEST(ValidateSequenceParallel, ResidualRowsAreSplit) {
  // Activations: the norms' outputs and statistics, the second residual and every unit's output keep
  // R = N / t rows; the rest is as without sequence parallelism. Model state is unchanged.
  const ModelConfig m = model_preset("gpt2-mini");
  const EngineLayout tp2 = tp_layout("NO_SHARD", 2, 2), sp = sp_layout();
  const double C = static_cast<double>(m.n_embd), L = static_cast<double>(m.n_layer);
  const double N = 4.0 * static_cast<double>(m.seq_len);
  const double rows = L * (4 * C + 8 + 4 * C + 4 * C + 8) + (L + 1) * 4 * C + 8;  // per row, fp32
  EXPECT_DOUBLE_EQ(engine_activation_bytes(m, tp2) - engine_activation_bytes(m, sp), N / 2 * rows);
  EXPECT_EQ(engine_memory(m, tp2).params, engine_memory(m, sp).params);
  // Workspace: + gathered rows, their gradient, partial sums (N x C fp32 each), norm gradients.
  EXPECT_DOUBLE_EQ(engine_workspace_bytes(m, sp) - engine_workspace_bytes(m, tp2), N * C * 12 + 4 * 2 * C);
  EXPECT_TRUE(planner_setup(m, sp).sequence_parallel);
  EXPECT_THROW(check_engine_layout([] {
                 EngineLayout e;
                 e.sequence_parallel = true;  // tp = 1
                 return e;
               }()),
               std::invalid_argument);
  EXPECT_NE(sp.label().find("tp2 sp"), std::string::npos);
}

// ---- pipeline parallelism ---------------------------------------------------------------------------

EngineLayout pp_layout(int ranks, int pp, const std::string& schedule = "1f1b", int64_t microbatches = 4,
                       const std::string& model = "gpt2-mini") {
  EngineLayout e = layout("NO_SHARD", ranks);
  e.model = model;
  e.pp = pp;
  e.pp_schedule = schedule;
  e.grad_accum = microbatches;
  return e;
}

TEST(ValidatePipeline, PartitionIsContiguousAndMinimisesTheLargestStage) {
  for (const char* name : {"gpt2-mini", "llama-mini", "gpt2-small-cpu"}) {
    const ModelConfig m = engine_model(model_preset(name), layout("NO_SHARD", 1));
    const std::vector<double> cost = engine_unit_costs(m);
    const int U = static_cast<int>(cost.size());
    for (int S : {2, 3}) {
      const auto p = engine_stage_partition(m, S);
      ASSERT_EQ(p.size(), static_cast<size_t>(S)) << name;
      EXPECT_EQ(p.front().first, 0);
      EXPECT_EQ(p.back().second, U - 1);
      double worst = 0;
      for (size_t s = 0; s < p.size(); ++s) {
        if (s) {
          EXPECT_EQ(p[s].first, p[s - 1].second + 1) << name;
        }
        EXPECT_LE(p[s].first, p[s].second) << name;
        double c = 0;
        for (int u = p[s].first; u <= p[s].second; ++u) c += cost[static_cast<size_t>(u)];
        worst = std::max(worst, c);
      }
      // Every other cut into S contiguous stages (brute force) has a stage at least as expensive.
      std::vector<int> cuts(static_cast<size_t>(S - 1));
      std::function<void(int, int)> walk = [&](int k, int from) {
        if (k == S - 1) {
          double w = 0, c = 0;
          int next = 0;
          for (int u = 0; u < U; ++u) {
            if (next < S - 1 && u == cuts[static_cast<size_t>(next)]) w = std::max(w, c), c = 0, ++next;
            c += cost[static_cast<size_t>(u)];
          }
          EXPECT_GE(std::max(w, c) * (1 + 1e-12), worst) << name;
          return;
        }
        for (int u = from; u < U; ++u) cuts[static_cast<size_t>(k)] = u, walk(k + 1, u + 1);
      };
      walk(0, 1);
    }
  }
  EXPECT_EQ(describe_stage_partition({{0, 2}, {3, 5}}), "units 0-2 | units 3-5");
}

TEST(ValidatePipeline, StageSizesAreTheModelsOwnedUnits) {
  // Each pipeline rank's share against mt::Transformer built with that rank's owned units (no
  // weights allocated, no collective called), with and without tp and shard padding; the last stage
  // of a tied model keeps the embedding replica outside the flat buffer.
  for (const char* name : {"gpt2-mini", "llama-mini"}) {
    for (int tp : {1, 2}) {
      for (int pp : {2, 3}) {
        EngineLayout e = pp_layout(pp * tp, pp, "1f1b", 4, name);
        e.tp = tp;
        const ModelConfig base = model_preset(name);
        const ModelConfig m = engine_model(base, e);
        for (int64_t align : {1, 32}) {
          int64_t total = 0;
          for (int r = 0; r < pp; ++r) {
            const std::vector<char> own = engine_owned_units(base, e, r);
            std::vector<int64_t> u = engine_unit_sizes(m, align, tp);
            for (size_t k = 0; k < u.size(); ++k) u[k] = own[k] ? u[k] : 0;
            LayoutOnlyTp comm(0, tp);
            Transformer model(m, DType::F32, Recompute::None, ModelStorage{false, false, false, align},
                              tp > 1 ? &comm : nullptr, own);
            ASSERT_EQ(u.size(), static_cast<size_t>(model.num_units()));
            for (int k = 0; k < model.num_units(); ++k) {
              EXPECT_EQ(u[static_cast<size_t>(k)], model.unit(k).numel) << name << " pp " << pp << " rank " << r;
              EXPECT_EQ(model.owns_unit(k), own[static_cast<size_t>(k)] != 0);
            }
            EXPECT_EQ(static_cast<int64_t>(sum(u)), model.flat_size()) << name << " pp " << pp << " rank " << r;
            total += model.flat_size();
            const bool replica = m.tied_embeddings && r == pp - 1;
            EXPECT_EQ(model.has_tied_replica(), replica) << name << " rank " << r;
            if (replica) {
              EXPECT_EQ(static_cast<uint64_t>(model.tied_replica().numel()), engine_tied_rows_elems(base, e));
            }
          }
          if (align == 1) {  // the stages hold every parameter once
            EngineLayout one = e;
            one.pp = 1;
            EXPECT_EQ(total, engine_flat_size(base, one)) << name;
          }
        }
        // With the default layout's alignment (DDP: none), engine_flat_size is the same sum.
        if (tp == 1) {
          LayoutOnlyTp comm(0, 1);
          const Transformer m0(m, DType::F32, Recompute::None, ModelStorage{false, false, false, 1}, nullptr,
                               engine_owned_units(base, e, 0));
          EXPECT_EQ(engine_flat_size(base, e, 0), m0.flat_size());
        }
      }
    }
  }
}

TEST(ValidatePipeline, MemoryPerStage) {
  const ModelConfig m = model_preset("gpt2-mini");
  const EngineLayout e = pp_layout(2, 2);
  const double rows = static_cast<double>(engine_tied_rows_elems(m, e));
  EXPECT_EQ(engine_tied_rows_elems(m, e), static_cast<uint64_t>(m.vocab_size * m.n_embd));  // 256 x 128
  for (int r = 0; r < 2; ++r) {
    const double P = static_cast<double>(engine_flat_size(m, e, r));
    const EngineMemory mem = engine_memory(m, e, r);
    // fp32 NO_SHARD: 4 / 4 / 8 bytes per element of the stage, + the replica on the last stage
    // (params and its gradient), + the first stage's buffer for the head's gradient.
    EXPECT_DOUBLE_EQ(mem.params, 4 * P + (r == 1 ? 4 * rows : 0));
    EXPECT_DOUBLE_EQ(mem.grads, 4 * P + 4 * rows);
    EXPECT_DOUBLE_EQ(mem.optimizer, 8 * P);
  }
  // Activations: slots x one micro-batch's set of the stage's units. 1F1B keeps min(pp - r, M) slots,
  // GPipe all M.
  const EngineLayout one = pp_layout(2, 2, "gpipe", 1);  // one slot
  EXPECT_EQ(engine_activation_slots(e, 0), 2);
  EXPECT_EQ(engine_activation_slots(e, 1), 1);
  EXPECT_EQ(engine_activation_slots(pp_layout(2, 2, "gpipe", 4), 1), 4);
  EXPECT_EQ(engine_activation_slots(pp_layout(4, 4, "1f1b", 2), 0), 2);  // fewer micro-batches than stages
  EXPECT_EQ(engine_activation_slots(layout("NO_SHARD", 2), 0), 1);
  for (int r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(engine_activation_bytes(m, e, r), engine_activation_slots(e, r) * engine_activation_bytes(m, one, r));
    EXPECT_DOUBLE_EQ(engine_activation_bytes(m, pp_layout(2, 2, "gpipe", 4), r), 4 * engine_activation_bytes(m, one, r));
  }
  // One micro-batch's stages together are the whole model's set plus the boundary's activation,
  // which both sides keep (the sender's output, the receiver's input).
  const double N = 4.0 * static_cast<double>(m.seq_len), C = static_cast<double>(m.n_embd);
  EXPECT_DOUBLE_EQ(engine_activation_bytes(m, one, 0) + engine_activation_bytes(m, one, 1),
                   engine_activation_bytes(m, layout("NO_SHARD", 1)) + N * C * 4);
  EXPECT_EQ(e.pp_rank_of(0), 0);
  EXPECT_EQ(e.pp_rank_of(1), 1);
  EXPECT_EQ(pp_layout(4, 2).pp_rank_of(1), 0);  // pp is the outermost mesh dimension
  EXPECT_EQ(pp_layout(4, 2).pp_rank_of(2), 1);
}

TEST(ValidatePipeline, PpBytesAreTheHandFormula) {
  const ModelConfig m = model_preset("gpt2-mini");
  const uint64_t N = 4 * static_cast<uint64_t>(m.seq_len), C = static_cast<uint64_t>(m.n_embd);
  const uint64_t V = static_cast<uint64_t>(m.vocab_size);  // 256: no padding
  // pp = 2, M = 4 on rank 0 (the first stage, one boundary): per micro-batch its activation out and
  // the gradient back (N x C fp32 each); per step the head's gradient of the tied embedding in (fp32)
  // and the updated embedding out (fp32 here); pp_aux three 1-float all-reduces.
  EngineLayout e = pp_layout(2, 2);
  EngineComm c = engine_comm(m, e);
  EXPECT_EQ(engine_pp_message_bytes(m, e), N * C * 4);
  EXPECT_EQ(c.per_step.at("pp"), 4 * 2 * N * C * 4 + V * C * (4 + 4));
  EXPECT_EQ(c.per_step.at("pp_aux"), 3u * 4);
  EXPECT_EQ(c.dp_per_step(), 0u);  // one data-parallel rank
  EXPECT_EQ(c.per_step.count("metrics"), 0u);
  EXPECT_EQ(c.setup.at("metrics"), 4u * 4 * kNumMemCategories);
  // The schedule does not change the bytes; bf16 sends the updated embedding in bf16.
  EXPECT_EQ(engine_comm(m, pp_layout(2, 2, "gpipe")).per_step.at("pp"), c.per_step.at("pp"));
  EngineLayout bf = e;
  bf.bf16 = true;
  EXPECT_EQ(engine_comm(m, bf).per_step.at("pp"), 4 * 2 * N * C * 4 + V * C * (4 + 2));
  // A middle stage has two boundaries; the first and the last one.
  EXPECT_EQ(engine_pp_boundaries(pp_layout(3, 3), 0), 1);
  EXPECT_EQ(engine_pp_boundaries(pp_layout(3, 3), 1), 2);
  EXPECT_EQ(engine_pp_boundaries(pp_layout(3, 3), 2), 1);
  // Llama's head is untied: no embedding exchange.
  const ModelConfig l = model_preset("llama-mini");
  const EngineLayout le = pp_layout(2, 2, "1f1b", 4, "llama-mini");
  EXPECT_FALSE(engine_tied_split(l, le));
  EXPECT_EQ(engine_comm(l, le).per_step.at("pp"), 4 * 2 * N * static_cast<uint64_t>(l.n_embd) * 4);
  // With sequence parallelism a boundary carries this tp rank's N / tp rows; the embedding exchange
  // is the tp rank's vocabulary rows (padded to 64 x tp).
  EngineLayout sp = pp_layout(4, 2);
  sp.tp = 2;
  sp.sequence_parallel = true;
  const uint64_t Vl = static_cast<uint64_t>(engine_model(m, sp).padded_vocab) / 2;
  EXPECT_EQ(engine_comm(m, sp).per_step.at("pp"), 4 * 2 * N / 2 * C * 4 + Vl * C * 8);
  // pp = 2 x DDP 2: the first stage's units all-reduced over its dp group (n = 2: the buffer once),
  // its weights broadcast at setup; the mean loss over all 4 ranks.
  const EngineLayout pd = pp_layout(4, 2);
  EXPECT_EQ(pd.dp_ranks(), 2);
  const uint64_t F0 = static_cast<uint64_t>(engine_flat_size(m, pd, 0));
  const EngineComm cd = engine_comm(m, pd);
  EXPECT_EQ(cd.per_step.at("dp"), F0 * 4);
  EXPECT_EQ(cd.setup.at("dp"), 4u + 4u * 3 * (2 + static_cast<uint64_t>(m.n_layer + 2)) + F0 * 4);
  EXPECT_EQ(cd.per_step.at("metrics"), 6u);
  EXPECT_EQ(cd.per_step.at("pp"), c.per_step.at("pp"));
}

TEST(ValidatePipeline, TimelineBubbleIsTheFormula) {
  // Equal stages, free messages: both schedules take (M + P - 1) slots of forward + backward and the
  // idle share is (P - 1) / (M + P - 1) — bubble_fraction().
  for (const char* sched : {"gpipe", "1f1b"})
    for (int P : {2, 4})
      for (int M : {1, 4, 8}) {
        const EngineLayout e = pp_layout(P, P, sched, M);
        const std::vector<double> f(static_cast<size_t>(P), 1.0), b(static_cast<size_t>(P), 2.0);
        const PipeTimeline t = engine_pp_timeline(e, f, b, 0.0);
        EXPECT_NEAR(t.makespan, (M + P - 1) * 3.0, 1e-12) << sched << " P " << P << " M " << M;
        EXPECT_NEAR(t.bubble, bubble_fraction(P, M, 1), 1e-12) << sched << " P " << P << " M " << M;
      }
  // A message delays every hand-off: GPipe's first backward waits for the last forward's result.
  const EngineLayout g = pp_layout(2, 2, "gpipe", 1);
  EXPECT_NEAR(engine_pp_timeline(g, {1, 1}, {2, 2}, 0.5).makespan, 1 + 0.5 + 1 + 2 + 0.5 + 2, 1e-12);
  // The slowest stage paces the pipeline.
  const EngineLayout o = pp_layout(2, 2, "1f1b", 8);
  EXPECT_GT(engine_pp_timeline(o, {1, 2}, {2, 4}, 0).makespan, 8 * 6.0);
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
    if (r.layout.pp > 1) {  // the engine's stage cut and rank 0's activation slots
      EXPECT_EQ(r.stages_predicted, r.stages_measured) << what;
      EXPECT_EQ(r.slots_predicted, r.slots_measured) << what;
      EXPECT_GT(r.slots_measured, 0) << what;
    }
    for (const std::string& g : must_see) {
      if (g == "dp" && r.layout.dp_ranks() == 1) continue;  // tp alone: one data-parallel rank
      if ((g == "tp" || g == "tp_aux") && r.layout.tp == 1) continue;
      if ((g == "pp" || g == "pp_aux") && r.layout.pp == 1) continue;
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

// Real jobs: a pipeline (pp = 2, 1F1B, 4 micro-batches, GPT-2's tied embedding cut apart) and tp = 2
// with sequence parallelism — every stage's memory on its ranks, the stage cut, rank 0's activation
// slots and the pp, pp_aux, tp and tp_aux counters exactly.
TEST(ValidateAgainstEngine, PipelineAndSequenceParallelMatchRealRuns) {
  EngineLayout pp2 = layout("NO_SHARD", 2);
  pp2.pp = 2;
  pp2.grad_accum = 4;
  EngineLayout sp = tp_layout("NO_SHARD", 2, 2);
  sp.sequence_parallel = true;
  const ValidationReport rep = run_and_check({pp2, sp}, {"pp", "pp_aux", "tp", "tp_aux"});
  int stage_rows = 0;
  for (const LayoutResult& r : rep.results)
    for (const MemRow& m : r.mem) stage_rows += m.pp_rank == 1;
  EXPECT_EQ(stage_rows, 7);  // the second stage's categories are checked on their own
  const std::string table = format_validation(rep);
  EXPECT_NE(table.find("stage 1: model state"), std::string::npos);
  EXPECT_NE(table.find("(textbook dp+pp/step)"), std::string::npos);
}

}  // namespace
}  // namespace mt::plan
