// The planner's formulas, each against its source (docs/plan.md lists them).
#include <gtest/gtest.h>

#include <cmath>

#include "plan/cost_model.h"

namespace mt::plan {
namespace {

Cluster cluster(const std::string& name, int gpus) {
  Cluster c = cluster_preset(name);
  c.gpus = gpus;
  return c;
}

Layout dp_layout(Strategy s, int dp, int64_t mb = 1, int64_t m = 1, Checkpointing ac = Checkpointing::None) {
  Layout l;
  l.strategy = s;
  if (s == Strategy::NoShard) l.dp_replicate = dp;
  else l.dp_shard = dp;
  l.micro_batch = mb;
  l.microbatches = m;
  l.checkpointing = ac;
  return l;
}

// The planner's names are the engine's enums (parallel/layout/parallel_config.h): labels and aliases parse
// to them, the config spelling prints; HYBRID_SHARD_ZERO2 is the one strategy it does not model.
TEST(Names, StrategyLabelsAliasesAndTheUnmodelledHybridZero2) {
  Strategy s{};
  EXPECT_TRUE(parse_strategy("ZeRO-3", &s));
  EXPECT_EQ(s, Strategy::FullShard);
  EXPECT_TRUE(parse_strategy("fsdp", &s));
  EXPECT_EQ(s, Strategy::FullShard);
  EXPECT_TRUE(parse_strategy("SHARD_GRAD_OP", &s));
  EXPECT_EQ(s, Strategy::ShardGradOp);
  EXPECT_STREQ(to_string(Strategy::HybridShard), "HYBRID_SHARD");
  EXPECT_STREQ(strategy_label(Strategy::HybridShard), "HSDP");
  EXPECT_FALSE(parse_strategy("HYBRID_SHARD_ZERO2", &s));
  Schedule k{};
  EXPECT_TRUE(parse_schedule("none", &k));
  EXPECT_EQ(k, Schedule::None);
  EXPECT_TRUE(parse_schedule("interleaved", &k));
  EXPECT_EQ(k, Schedule::Interleaved);
  Checkpointing ac{};
  EXPECT_TRUE(parse_checkpointing("selective", &ac));
  EXPECT_EQ(ac, Checkpointing::Selective);
  EXPECT_FALSE(parse_checkpointing("some", &ac));
  Layout l = dp_layout(Strategy::HybridShardZero2, 4);
  l.dp_replicate = 2;
  EXPECT_NE(check_layout(model_preset("gpt2-124m"), cluster("h100-80g-ib400", 8), TrainSetup{}, l).find("not modelled"),
            std::string::npos);
}

TEST(ModelState, SixteenBytesPerParamEitherPrecision) {
  EXPECT_EQ(bytes_per_param(false).total(), 16);  // 2 + 2 + 12
  EXPECT_EQ(bytes_per_param(false).optimizer, 12);
  EXPECT_EQ(bytes_per_param(true).total(), 16);   // 4 + 4 + 8
  EXPECT_EQ(bytes_per_param(true).optimizer, 8);
  EXPECT_EQ(bytes_per_param(false, 4).total(), 18);  // fp32 gradient accumulation (Megatron's 18)
}

TEST(ModelState, ZeroPaperFigureOne) {
  // ZeRO (arXiv 1910.02054) Fig. 1: 7.5B parameters, N_d = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
  const double psi = 7.5e9;
  EXPECT_NEAR(zero_model_state(psi, Strategy::NoShard, 64, false).total() / 1e9, 120.0, 0.05);
  EXPECT_NEAR(zero_model_state(psi, Strategy::Zero1, 64, false).total() / 1e9, 31.4, 0.05);
  EXPECT_NEAR(zero_model_state(psi, Strategy::ShardGradOp, 64, false).total() / 1e9, 16.6, 0.05);
  EXPECT_NEAR(zero_model_state(psi, Strategy::FullShard, 64, false).total() / 1e9, 1.875, 0.01);
  // The per-strategy shapes: 4psi + 12psi/N, 2psi + 14psi/N, 16psi/N.
  EXPECT_DOUBLE_EQ(zero_model_state(1.0, Strategy::Zero1, 8, false).total(), 4 + 12.0 / 8);
  EXPECT_DOUBLE_EQ(zero_model_state(1.0, Strategy::ShardGradOp, 8, false).total(), 2 + 14.0 / 8);
  EXPECT_DOUBLE_EQ(zero_model_state(1.0, Strategy::HybridShard, 8, false).total(), 16.0 / 8);
  EXPECT_DOUBLE_EQ(zero_model_state(1.0, Strategy::ShardGradOp, 8, false, true).optimizer, 0.0);  // offloaded
}

TEST(Activations, KorthikantiTableTwo) {
  const double s = 2048, b = 1, h = 12288, a = 96, sbh = s * b * h;
  EXPECT_DOUBLE_EQ(korthikanti_layer_activation_bytes(s, b, h, a, 1, false, Checkpointing::None),
                   sbh * (34 + 5 * a * s / h));
  EXPECT_DOUBLE_EQ(korthikanti_layer_activation_bytes(s, b, h, a, 8, false, Checkpointing::None),
                   sbh * (10 + 24.0 / 8 + 5 * a * s / (h * 8)));
  EXPECT_DOUBLE_EQ(korthikanti_layer_activation_bytes(s, b, h, a, 8, true, Checkpointing::None),
                   sbh / 8 * (34 + 5 * a * s / h));
  EXPECT_DOUBLE_EQ(korthikanti_layer_activation_bytes(s, b, h, a, 8, true, Checkpointing::Selective), 34 * sbh / 8);
  EXPECT_DOUBLE_EQ(korthikanti_layer_activation_bytes(s, b, h, a, 1, false, Checkpointing::Full), 2 * sbh);
  EXPECT_DOUBLE_EQ(korthikanti_layer_activation_bytes(s, b, h, a, 8, true, Checkpointing::Full), 2 * sbh / 8);
}

TEST(Activations, GeneralisedCountReducesToKorthikanti) {
  // GPT-3 175B block (ffn = 4h, kv = heads) with dropout, unfused attention, 2-byte elements.
  const ModelConfig m = model_preset("gpt3-175b");
  TrainSetup st;
  st.seq = 2048;
  st.dropout = true;
  st.attention = AttentionImpl::Unfused;
  for (int t : {1, 2, 8})
    for (bool sp : {false, true}) {
      st.sequence_parallel = sp;
      const double ours = layer_activation_bytes(m, st, 2, t, Checkpointing::None);
      const double theirs = korthikanti_layer_activation_bytes(2048, 2, m.n_embd, m.n_head, t, sp, Checkpointing::None);
      EXPECT_NEAR(ours / theirs, 1.0, 1e-12) << "t=" << t << " sp=" << sp;
      EXPECT_DOUBLE_EQ(layer_activation_bytes(m, st, 2, t, Checkpointing::Full),
                       korthikanti_layer_activation_bytes(2048, 2, m.n_embd, m.n_head, t, sp, Checkpointing::Full));
    }
  // Flash attention keeps no s x s scores: the 5as/h term disappears (only a log-sum-exp per head).
  st.attention = AttentionImpl::Flash;
  st.sequence_parallel = false;
  const double flash = layer_activation_bytes(m, st, 1, 1, Checkpointing::None);
  EXPECT_NEAR(flash, 2048.0 * m.n_embd * 34 + 2048.0 * 4 * m.n_head, 1.0);
  // Selective (every second layer recomputed) is the mean of none and full.
  EXPECT_DOUBLE_EQ(layer_activation_bytes(m, st, 1, 1, Checkpointing::Selective),
                   0.5 * (flash + layer_activation_bytes(m, st, 1, 1, Checkpointing::Full)));
}

// The residual stream's element size (TrainSetup::residual_bytes): an fp32 stream in a bf16 run
// (the engine's model.residual_dtype = fp32) keeps 2 bytes more per element of the two norm inputs
// per layer (2 x 2 x s x h), tp-split only under sequence parallelism, and a fully recomputed layer
// keeps its fp32 input; the default is the activation size.
TEST(Activations, ResidualStreamDtype) {
  const ModelConfig m = model_preset("gpt2-124m");
  TrainSetup st;
  st.seq = 1024;
  const double s = 1024, h = static_cast<double>(m.n_embd);
  for (int t : {1, 4})
    for (bool sp : {false, true}) {
      st.sequence_parallel = sp;
      st.residual_bytes = 0;
      const double bf = layer_activation_bytes(m, st, 1, t, Checkpointing::None);
      const double bf_full = layer_activation_bytes(m, st, 1, t, Checkpointing::Full);
      st.residual_bytes = 2;
      EXPECT_DOUBLE_EQ(layer_activation_bytes(m, st, 1, t, Checkpointing::None), bf);
      st.residual_bytes = 4;
      const double split = sp && t > 1 ? t : 1.0;
      EXPECT_DOUBLE_EQ(layer_activation_bytes(m, st, 1, t, Checkpointing::None) - bf, 2 * 2 * s * h / split);
      EXPECT_DOUBLE_EQ(layer_activation_bytes(m, st, 1, t, Checkpointing::Full), 2 * bf_full);
    }
}

// The LM head's logits' element size (TrainSetup::logits_bytes): bf16 logits (the engine's
// model.logits_dtype = bf16) keep 2 bytes less per element of the [s x b, padded_vocab] logits of
// the one micro-batch whose head is live; nothing else moves.
TEST(Estimate, LogitsDtype) {
  const ModelConfig m = model_preset("gpt2-124m");
  const Cluster c = cluster("h100-80g-ib400", 8);
  TrainSetup st;
  st.seq = 1024;
  const Estimate f32 = estimate(m, c, st, dp_layout(Strategy::NoShard, 8, 4));
  st.logits_bytes = 2;
  const Estimate b16 = estimate(m, c, st, dp_layout(Strategy::NoShard, 8, 4));
  EXPECT_DOUBLE_EQ(f32.mem.activations - b16.mem.activations, 2.0 * 1024 * 4 * static_cast<double>(m.padded_vocab));
  EXPECT_DOUBLE_EQ(f32.mem.params, b16.mem.params);
  EXPECT_DOUBLE_EQ(f32.mem.optimizer, b16.mem.optimizer);
}

TEST(Collectives, RingVolumesAndLinkSplit) {
  Cluster c = cluster_preset("h100-80g-ib400");
  const double S = 1e9;
  // One node of 8: all bytes on NVLink.
  CollCost ar = collective(Collective::AllReduce, S, group_shape(8, 1, 8), c);
  EXPECT_DOUBLE_EQ(ar.intra_bytes, 2.0 * 7 / 8 * S);
  EXPECT_DOUBLE_EQ(ar.inter_bytes, 0.0);
  EXPECT_NEAR(ar.time, 2.0 * 7 / 8 * S / c.intra.bw, 1e-4);
  CollCost ag = collective(Collective::AllGather, S, group_shape(8, 1, 8), c);
  CollCost rs = collective(Collective::ReduceScatter, S, group_shape(8, 1, 8), c);
  EXPECT_DOUBLE_EQ(ag.intra_bytes, 7.0 / 8 * S);
  EXPECT_DOUBLE_EQ(rs.intra_bytes, 7.0 / 8 * S);
  // 4 nodes x 8: 1/8 of each GPU's traffic leaves through its NIC.
  CollCost ar32 = collective(Collective::AllReduce, S, group_shape(32, 1, 8), c);
  EXPECT_DOUBLE_EQ(ar32.intra_bytes + ar32.inter_bytes, 2.0 * 31 / 32 * S);
  EXPECT_DOUBLE_EQ(ar32.inter_bytes, 2.0 * 31 / 32 * S / 8);
  EXPECT_NEAR(ar32.time, std::max(ar32.intra_bytes / c.intra.bw, ar32.inter_bytes / c.inter.bw), 1e-3);
  // A group strided across nodes (one member per node) sends everything over the NIC.
  GroupShape g = group_shape(8, 8, 8);
  EXPECT_EQ(g.local, 1);
  EXPECT_EQ(g.nodes, 8);
  CollCost x = collective(Collective::AllReduce, S, g, c);
  EXPECT_DOUBLE_EQ(x.inter_bytes, 2.0 * 7 / 8 * S);
  EXPECT_EQ(collective(Collective::AllReduce, S, group_shape(1, 1, 8), c).time, 0.0);
}

TEST(Collectives, GroupShapes) {
  GroupShape a = group_shape(16, 2, 8);  // dp group with tp = 2
  EXPECT_EQ(a.local, 4);
  EXPECT_EQ(a.nodes, 4);
  GroupShape b = group_shape(4, 1, 8);
  EXPECT_EQ(b.local, 4);
  EXPECT_EQ(b.nodes, 1);
}

TEST(Pipeline, BubbleFractions) {
  EXPECT_DOUBLE_EQ(bubble_fraction(1, 8, 1), 0.0);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 8, 1), 3.0 / (8 + 3));
  EXPECT_DOUBLE_EQ(bubble_fraction(16, 192, 1), 15.0 / 207);
  // Interleaved: bubble / ideal = (p-1)/(v m).
  const double f = bubble_fraction(4, 8, 2);
  EXPECT_DOUBLE_EQ(f / (1 - f), 3.0 / (2 * 8));
}

TEST(Flops, SixNPlusAttention) {
  const ModelConfig g = model_preset("gpt2-124m");
  EXPECT_DOUBLE_EQ(flops_per_token(g, 1024), g.flops_per_token());  // tied: same convention
  const ModelConfig l = model_preset("llama3-8b");
  const double n = static_cast<double>(l.num_params()) - static_cast<double>(l.padded_vocab * l.n_embd);
  EXPECT_DOUBLE_EQ(flops_per_token(l, 8192), 6 * n + 12.0 * 32 * 4096 * 8192);
  // Megatron: 96 B s L h^2 (1 + s/6h + V/16Lh); 32 s/iter on 1024 GPUs is 138 TFLOP/s per GPU.
  ModelConfig m = model_preset("gpt3-175b");
  m.padded_vocab = 51200;
  EXPECT_NEAR(megatron_flops_per_iteration(m, 1536, 2048) / (32.0 * 1024) / 1e12, 138.0, 0.5);
}

TEST(Estimate, DdpAndZeroCommunicationVolumes) {
  const ModelConfig m = model_preset("gpt2-1.5b");
  const Cluster c = cluster("h100-80g-ib400", 8);
  TrainSetup st;
  st.reduce_bytes = 2;  // same dtype for gathers and reductions
  const Estimate ddp = estimate(m, c, st, dp_layout(Strategy::NoShard, 8));
  const Estimate z1 = estimate(m, c, st, dp_layout(Strategy::Zero1, 8));
  const Estimate z3 = estimate(m, c, st, dp_layout(Strategy::FullShard, 8));
  const double psi = static_cast<double>(m.num_params());
  EXPECT_NEAR(ddp.comm.intra_node, 2.0 * 7 / 8 * psi * 2, 1.0);  // all-reduce: 2(n-1)/n x 2 bytes x psi
  EXPECT_EQ(ddp.comm.inter_node, 0.0);
  EXPECT_NEAR(z1.comm.intra_node / ddp.comm.intra_node, 1.0, 1e-9);  // reduce-scatter + all-gather
  EXPECT_NEAR(z3.comm.intra_node / ddp.comm.intra_node, 1.5, 1e-9);  // 2 all-gathers + reduce-scatter
  // With 4 accumulation micro-batches ZeRO-3 gathers and scatters every micro-batch; DDP once.
  const Estimate z3m = estimate(m, c, st, dp_layout(Strategy::FullShard, 8, 1, 4));
  const Estimate ddpm = estimate(m, c, st, dp_layout(Strategy::NoShard, 8, 1, 4));
  EXPECT_NEAR(z3m.comm.intra_node / ddpm.comm.intra_node, 6.0, 1e-9);
}

TEST(Estimate, ModelStateMemoryMatchesFormulas) {
  const ModelConfig m = model_preset("llama3-8b");
  const Cluster c = cluster("h100-80g-ib400", 16);
  TrainSetup st;
  const double psi = static_cast<double>(m.num_params());
  const Estimate ddp = estimate(m, c, st, dp_layout(Strategy::NoShard, 16));
  EXPECT_NEAR(ddp.mem.params + ddp.mem.grads + ddp.mem.optimizer, 16 * psi, 1.0);
  const Estimate z1 = estimate(m, c, st, dp_layout(Strategy::Zero1, 16));
  EXPECT_NEAR(z1.mem.params + z1.mem.grads + z1.mem.optimizer, 4 * psi + 12 * psi / 16, 1.0);
  const Estimate z2 = estimate(m, c, st, dp_layout(Strategy::ShardGradOp, 16));
  EXPECT_NEAR(z2.mem.params + z2.mem.grads + z2.mem.optimizer, 2 * psi + 14 * psi / 16, 1.0);
  const Estimate z3 = estimate(m, c, st, dp_layout(Strategy::FullShard, 16));
  EXPECT_NEAR(z3.mem.params + z3.mem.grads + z3.mem.optimizer, psi, 1.0);
  EXPECT_FALSE(ddp.fits);  // 128 GB of model state on an 80 GB GPU
  EXPECT_TRUE(z3.fits);
  // Checkpointing shrinks activations: none > selective > full.
  const Estimate sel = estimate(m, c, st, dp_layout(Strategy::FullShard, 16, 1, 1, Checkpointing::Selective));
  const Estimate full = estimate(m, c, st, dp_layout(Strategy::FullShard, 16, 1, 1, Checkpointing::Full));
  EXPECT_GT(z3.mem.activations, sel.mem.activations);
  EXPECT_GT(sel.mem.activations, full.mem.activations);
  // ... and costs recomputation: full recomputes the forward (~1/3 of forward+backward).
  EXPECT_EQ(z3.recompute_s, 0.0);
  EXPECT_NEAR(full.recompute_s / (full.time.compute - full.recompute_s - full.optimizer_s), 1.0 / 3, 0.03);
  EXPECT_NEAR(sel.recompute_s / full.recompute_s, 0.5, 1e-9);
}

TEST(Estimate, OffloadMovesOptimizerToHost) {
  const ModelConfig m = model_preset("llama3-8b");
  const Cluster c = cluster("h100-80g-ib400", 8);
  TrainSetup st;
  Layout l = dp_layout(Strategy::FullShard, 8);
  const Estimate on = estimate(m, c, st, l);
  l.offload = Offload::Optimizer;
  const Estimate off = estimate(m, c, st, l);
  EXPECT_EQ(off.mem.optimizer, 0.0);
  EXPECT_NEAR(off.host_bytes_per_node, 14.0 * static_cast<double>(m.num_params()), 1e3);  // 12 opt + 2 grad
  EXPECT_GT(off.offload_s, 0.0);
  EXPECT_GT(off.time.total(), on.time.total());
  // DDP cannot offload over several GPUs; on one GPU it holds the whole model like every strategy
  // and offloads all of the state, as the engine does (train.offload at one rank); the CPU cluster
  // has nowhere to offload to.
  Layout d = dp_layout(Strategy::NoShard, 8);
  d.offload = Offload::Optimizer;
  EXPECT_FALSE(check_layout(m, c, st, d).empty());
  Layout one = dp_layout(Strategy::NoShard, 1);
  one.offload = Offload::Optimizer;
  const Cluster c1 = cluster("h100-80g-ib400", 1);
  EXPECT_EQ(check_layout(m, c1, st, one), "");
  const Estimate one_off = estimate(m, c1, st, one);
  EXPECT_EQ(one_off.mem.optimizer, 0.0);
  EXPECT_NEAR(one_off.host_bytes_per_node, 14.0 * static_cast<double>(m.num_params()), 1e3);
  Layout z = dp_layout(Strategy::ShardGradOp, 2);
  z.offload = Offload::Optimizer;
  EXPECT_FALSE(check_layout(model_preset("gpt2-124m"), cluster("this-cpu", 2), st, z).empty());
}

TEST(Estimate, TensorAndPipelineParallel) {
  const ModelConfig m = model_preset("gpt3-175b");
  const Cluster c = cluster("a100-80g-ib400", 64);
  TrainSetup st;
  st.seq = 2048;
  Layout l;
  l.strategy = Strategy::NoShard;
  l.dp_replicate = 2;
  l.tp = 8;
  l.pp = 4;
  l.schedule = Schedule::OneFOneB;
  l.micro_batch = 1;
  l.microbatches = 16;
  const Estimate e = estimate(m, c, st, l);
  // Bubble: (p-1) slots of one micro-batch; its share of the step is about (p-1)/(m+p-1).
  EXPECT_NEAR(e.time.bubble / e.time.total(), bubble_fraction(4, 16, 1), 0.02);
  // TP volume per micro-batch (SP, as the engine issues them): per layer 2 all-gathers + 2
  // reduce-scatters of b s h forward, the same backward (the reduce-scatters of input gradients in
  // fp32) plus 2 all-gathers re-gathering the inputs for the weight gradients; embedding / head an
  // all-gather and a reduce-scatter each way (the backward one fp32); the cross-entropy's 3 tiny
  // all-reduces; the norms' fp32 weight and bias gradients all-reduced (a layer's two together, and
  // the final norm). Each all-gather / reduce-scatter of X bytes moves 7/8 X on 8 ranks, an
  // all-reduce 2 x 7/8 X.
  const double act = 2048.0 * m.n_embd * 2, grad = 2048.0 * m.n_embd * 4;
  const double g = 7.0 / 8 * act, g4 = 7.0 / 8 * grad;
  const double layers = m.n_layer / 4.0;
  const double norm = 2 * 7.0 / 8 * 2.0 * m.n_embd * 4;
  const double tp_bytes = 16 * (layers * (4 * g + 2 * g + 2 * g4 + 2 * g + 2 * norm) + (3 * g + g4) + norm +
                                3 * 2 * 7.0 / 8 * 2048 * 4);
  // PP: one send forward and one backward per micro-batch, b s h / t with SP, across nodes here.
  const double pp_bytes = 16 * 2 * act / 8;
  EXPECT_NEAR(e.comm.intra_node, tp_bytes, 1e3);
  EXPECT_GT(e.comm.inter_node, pp_bytes);  // plus the DP all-reduce across the two replicas
  // Interleaving shrinks the bubble by v and multiplies the sends by v.
  l.schedule = Schedule::Interleaved;
  l.virtual_stages = 2;
  const Estimate iv = estimate(m, c, st, l);
  EXPECT_NEAR(iv.time.bubble / e.time.bubble, 0.5, 0.05);
  EXPECT_GT(iv.pp_comm_s, 1.9 * e.pp_comm_s);
  // GPipe: same bubble as 1F1B, m micro-batches of activations in flight instead of p.
  l.schedule = Schedule::GPipe;
  l.virtual_stages = 1;
  const Estimate gp = estimate(m, c, st, l);
  EXPECT_NEAR(gp.time.bubble, e.time.bubble, 1e-9);
  EXPECT_GT(gp.mem.activations, 3.0 * e.mem.activations);
}

// Ranks time-sharing cores (cores_per_rank < 1, per-rank rates measured with all of them busy): a
// rank's waits lend its cores to the others, so compute and bubble shrink by max(cores per rank,
// the compute share of the step); exposed communication does not. One core per rank or more, or
// a device of its own (0), changes nothing.
TEST(Estimate, RanksTimeSharingCoresLendTheirShareWhileTheyWait) {
  const ModelConfig m = model_preset("gpt2-mini");
  Cluster c = cluster("this-cpu", 4);
  c.shared_node = false;
  TrainSetup st;
  st.seq = m.seq_len;
  st.micro_batch = 4;
  st.global_batch = 16;
  Layout l;
  l.strategy = Strategy::NoShard;
  l.dp_replicate = 2;
  l.pp = 2;
  l.schedule = Schedule::OneFOneB;
  l.micro_batch = 4;
  l.microbatches = 4;
  const Estimate own = estimate(m, c, st, l);
  ASSERT_GT(own.time.bubble, 0);
  for (double cpr : {1.0, 2.0}) {
    c.cores_per_rank = cpr;
    EXPECT_DOUBLE_EQ(estimate(m, c, st, l).time.total(), own.time.total()) << cpr;
  }
  c.cores_per_rank = 0.5;
  const Estimate shared = estimate(m, c, st, l);
  const double beta = own.time.compute / own.time.total();
  const double s = std::max(0.5, beta);
  EXPECT_LT(s, 1.0);
  EXPECT_NEAR(shared.time.compute, s * own.time.compute, 1e-12 * own.time.compute);
  EXPECT_NEAR(shared.time.bubble, s * own.time.bubble, 1e-12 * own.time.bubble);
  EXPECT_DOUBLE_EQ(shared.time.exposed_comm, own.time.exposed_comm);
  // Crowded cores (c / n below the compute share): the scale is the compute share itself.
  c.cores_per_rank = 0.01;
  const Estimate crowded = estimate(m, c, st, l);
  EXPECT_NEAR(crowded.time.compute, beta * own.time.compute, 1e-12 * own.time.compute);
}

TEST(Estimate, RejectsInvalidLayouts) {
  const ModelConfig m = model_preset("gpt2-124m");
  const Cluster c = cluster("h100-80g-ib400", 8);
  TrainSetup st;
  Layout l = dp_layout(Strategy::FullShard, 8);
  l.tp = 5;  // 12 heads
  EXPECT_NE(check_layout(m, c, st, l).find("n_head"), std::string::npos);
  EXPECT_THROW(estimate(m, c, st, l), std::invalid_argument);
  l.tp = 1;
  l.pp = 2;  // no schedule
  EXPECT_FALSE(check_layout(m, c, st, l).empty());
  l.schedule = Schedule::Interleaved;
  l.virtual_stages = 2;
  l.microbatches = 3;  // Megatron needs m % p == 0
  EXPECT_FALSE(check_layout(m, c, st, l).empty());
  Layout h = dp_layout(Strategy::HybridShard, 8);
  EXPECT_FALSE(check_layout(m, c, st, h).empty());  // needs both dims >= 2
}

TEST(Cluster, PresetsAndCpuSharing) {
  for (const auto& n : cluster_preset_names()) EXPECT_NO_THROW(cluster_preset(n).validate()) << n;
  EXPECT_THROW(cluster_preset("nope"), std::invalid_argument);
  const Cluster cpu = cluster_preset("this-cpu");
  const Cluster one = cpu.per_rank(1), two = cpu.per_rank(2);
  EXPECT_DOUBLE_EQ(one.peak_flops_fp32, cpu.peak_flops_fp32);  // one rank uses both cores
  EXPECT_DOUBLE_EQ(two.peak_flops_fp32, cpu.peak_flops_fp32 / 2);
  EXPECT_DOUBLE_EQ(two.mem_per_gpu, cpu.mem_per_gpu / 2);
  const Cluster h = cluster_preset("h100-80g-ib400");
  EXPECT_DOUBLE_EQ(h.per_rank(64).peak_flops_bf16, 989e12);
  EXPECT_EQ(h.gpus_per_node, 8);
}


// elementwise_bytes is what estimate() charges to bandwidth for that work: on the this-cpu preset
// with a bandwidth of B, its elementwise + optimizer seconds times B equal it (fp32 and bf16, tp 1
// and 2, with and without sequence parallelism); the activation part grows with the micro-batch,
// the optimizer's 28 B/param does not; under SP the norms and residual adds see 1/tp of the rows.
TEST(ElementwiseBytes, IsWhatEstimateChargesToBandwidth) {
  ModelConfig m = model_preset("gpt2-mini");
  m.resolve();
  for (bool bf16 : {false, true})
    for (int tp : {1, 2})
      for (bool sp : {false, true}) {
      Cluster c = cluster("this-cpu", tp);
      c.shared_node = false;  // 10 GB/s per rank
      c.mem_bw = 10e9;
      c.mem_bw_efficiency = 1.0;
      TrainSetup st;
      st.fp32 = !bf16;
      st.grad_bytes = 4;
      st.seq = m.seq_len;
      st.global_batch = st.micro_batch = 4;
      st.sequence_parallel = sp && tp > 1;
      Layout l;
      l.tp = tp;
      l.micro_batch = 4;
      const Estimate e = estimate(m, c, st, l);
      const double bytes = elementwise_bytes(m, 4, bf16, tp, sp);
      EXPECT_NEAR((e.elementwise_s + e.optimizer_s) * 10e9, bytes, 1e-6 * bytes) << bf16 << " tp " << tp << " sp " << sp;
      if (sp && tp > 1) {
        EXPECT_LT(bytes, elementwise_bytes(m, 4, bf16, tp, false));
      }
      if (tp == 1) {
        EXPECT_DOUBLE_EQ(bytes, elementwise_bytes(m, 4, bf16, tp, !sp));
      }
    }
  const double one = elementwise_bytes(m, 1, false), two = elementwise_bytes(m, 2, false);
  const double opt = 28.0 * static_cast<double>(m.num_params());
  EXPECT_NEAR(two - opt, 2.0 * (one - opt), 1e-6 * one);
}

}  // namespace
}  // namespace mt::plan
