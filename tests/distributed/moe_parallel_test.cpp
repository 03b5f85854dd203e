// Mixture of experts with expert parallelism against single-process training on the same global
// batch, as real processes under mpirun: ep = 2 and 4, ep 2 x FULL_SHARD, ep 2 x pp 2, ep 2 x tp 2,
// tp 2 with sequence parallelism (with and without ep), cp 2 (alone, with ep 2, with tp 2 + SP). The
// reference runs each rank's micro-batch as one micro-batch of its own (grad_accum), so the
// per-micro-batch load-balancing loss is the same quantity in both runs; losses, aux losses,
// expert loads and final weights must agree at fp32 tolerance. Also: exact model-state bytes with
// experts split, sharded checkpoints across ep / tp layouts, and the refused layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "harness.h"

namespace mt {
namespace {

constexpr double kLossTol = 2e-5, kWeightTol = 5e-5;
const std::string kMoe =
    " --model.preset llama-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1"
    " --model.moe_aux_loss_coef 0.02 --model.moe_z_loss_coef 0.001";

class MoeParity : public ParityFixture {
 protected:
  // Per step: the aux loss and the tokens per expert of every MoE layer.
  struct Moe {
    std::vector<double> aux;
    std::vector<nlohmann::json> tokens;
  };
  Moe moe(const std::string& tag) {
    Moe m;
    std::ifstream f(dir_ / ("m_" + tag + ".jsonl"));
    std::string line;
    while (std::getline(f, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("final")) continue;
      m.aux.push_back(j.at("moe_aux_loss").get<double>());
      m.tokens.push_back(j.at("expert_tokens"));
    }
    return m;
  }
  // The 8 steps' aux losses of run `other` equal run `ref`'s (1e-5) and, with `tokens`, so do the
  // tokens per expert. Returns the largest |aux difference|.
  double expect_same_routing(const std::string& ref, const std::string& other, bool tokens, const std::string& what = "") {
    const Moe a = moe(ref), b = moe(other);
    EXPECT_EQ(b.aux.size(), 8u);
    if (b.aux.size() != 8u || a.aux.size() < 8u) return 0.0;
    double worst = 0;
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_NEAR(a.aux[i], b.aux[i], 1e-5) << what << "aux loss, step " << i + 1;
      worst = std::max(worst, std::abs(a.aux[i] - b.aux[i]));
      if (tokens) {
        EXPECT_EQ(a.tokens[i], b.tokens[i]) << what << "tokens per expert, step " << i + 1;
      }
    }
    return worst;
  }
  // Model state per rank, exactly: the strategy's flat buffers (DDP, fp32: 16 bytes per element)
  // plus the local experts' weights, gradients and two moments (none apart with ep = 1).
  static void expect_ddp_model_state(const nlohmann::json& fin, size_t ranks) {
    const int64_t flat = fin.at("flat_size").get<int64_t>();
    const nlohmann::json es = fin.value("expert_state_bytes", nlohmann::json{{"params", 0}, {"grads", 0}, {"optimizer", 0}});
    ASSERT_EQ(fin.at("mem_resident_by_category_per_rank").size(), ranks);
    for (const auto& r : fin.at("mem_resident_by_category_per_rank")) {
      EXPECT_EQ(r.at("params").get<int64_t>(), 4 * flat + es.at("params").get<int64_t>());
      EXPECT_EQ(r.at("grads").get<int64_t>(), 4 * flat + es.at("grads").get<int64_t>());
      EXPECT_EQ(r.at("optimizer").get<int64_t>(), 8 * flat + es.at("optimizer").get<int64_t>());
    }
  }
  // The Meta dry run of each of `world` ranks with `args` builds the real run's layout: its model
  // state is the real run's (`fin`), to the byte (activations and all-to-all bytes depend on the
  // routing, which a dry run cannot see: it assumes an even spread; with `routing_free` (experts
  // padded to their capacity) activations and workspace are compared too).
  void expect_dry_runs_match(int world, const std::string& args, const nlohmann::json& fin, bool routing_free = false) {
    for (int r = 0; r < world; ++r) {
      const std::string m = (dir_ / ("dry" + std::to_string(r) + ".jsonl")).string();
      RunOut d = run("MESHTRAIN_MPI=0 " + std::string(MT_BINARY) + " train --dry-run --world " + std::to_string(world) +
                     " --rank " + std::to_string(r) + args + " --log.metrics_out " + m);
      ASSERT_EQ(d.code, 0) << d.output;
      const auto dj = final_metrics(m).at("mem_resident_by_category");
      const auto& rj = fin.at("mem_resident_by_category_per_rank")[r];
      for (const char* k : {"params", "grads", "optimizer"}) EXPECT_EQ(dj.at(k), rj.at(k)) << "rank " << r << " " << k;
      if (routing_free) {
        for (const char* k : {"activations", "workspace"}) EXPECT_EQ(dj.at(k), rj.at(k)) << "rank " << r << " " << k;
      }
    }
  }
};

TEST_F(MoeParity, ExpertParallelTwoRanksMatchesOneRank) {
  auto ref = train(1, 2, 2, "ref", kMoe);
  auto ep = train(2, 2, 1, "ep2", kMoe + " --parallel.ep 2");
  ASSERT_FALSE(ep.losses.empty());
  expect_close(ref, ep, kLossTol, kWeightTol, "ep=2");
  expect_same_routing("ref", "ep2", true);
  // Dropless: 2 MoE layers x 2 choices x 4 sequences of 32 tokens per step x 8 steps, all served.
  EXPECT_EQ(ep.final.at("moe_dropped_tokens").get<int64_t>(), 0);
  int64_t total = 0;
  for (const auto& layer : ep.final.at("expert_tokens_total"))
    for (const auto& c : layer) total += c.get<int64_t>();
  EXPECT_EQ(total, 2 * 2 * 4 * 32 * 8);
  // The tokens travelled: the ep group's counters hold the all-to-all's bytes.
  EXPECT_GT(ep.final.at("comm_bytes_by_group").value("ep", int64_t{0}), 0);
  EXPECT_GT(ep.final.at("ep_all_to_all_bytes_per_step").get<int64_t>(), 0);
  expect_ddp_model_state(ep.final, 2);
  // Each rank holds half of the routed experts: 2 of 4 per MoE layer, 3 C x F weights each.
  EXPECT_EQ(ep.final.at("expert_state_bytes").at("params").get<int64_t>(), 4 * 2 * 2 * 3 * 32 * 64);
  expect_dry_runs_match(2, kMoe + " --parallel.ep 2 --train.micro_batch 2", ep.final);
}

TEST_F(MoeParity, ExpertParallelFourRanksMatchesOneRank) {
  auto ref = train(1, 2, 4, "ref", kMoe);
  auto ep = train(4, 2, 1, "ep4", kMoe + " --parallel.ep 4");
  ASSERT_FALSE(ep.losses.empty());
  expect_close(ref, ep, kLossTol, kWeightTol, "ep=4");
  expect_same_routing("ref", "ep4", false);
}

// ep 2 inside 4 data-parallel ranks: the expert gradients are also reduced over the 2 ranks that
// hold the same experts; the dense part is FULL_SHARD over all 4.
TEST_F(MoeParity, ExpertParallelWithFullShardMatchesOneRank) {
  auto ref = train(1, 2, 4, "ref", kMoe);
  auto ep = train(4, 2, 1, "ep2fs", kMoe + " --parallel.ep 2 --parallel.strategy FULL_SHARD");
  ASSERT_FALSE(ep.losses.empty());
  expect_close(ref, ep, kLossTol, kWeightTol, "ep=2 x FULL_SHARD 4");
  expect_same_routing("ref", "ep2fs", false);
  EXPECT_GT(ep.final.at("comm_bytes_by_group").value("edp", int64_t{0}), 0);
  // The same over a hybrid mesh (2 replicas x 2 shards) and ZeRO-1 with every rank's own experts.
  auto hy = train(4, 2, 1, "ep2hy", kMoe + " --parallel.ep 2 --parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2");
  expect_close(ref, hy, kLossTol, kWeightTol, "ep=2 x HYBRID_SHARD 2x2");
  auto z1 = train(4, 2, 1, "ep4z1", kMoe + " --parallel.ep 4 --parallel.strategy ZERO1");
  expect_close(ref, z1, kLossTol, kWeightTol, "ep=4 x ZERO1 4");
}

TEST_F(MoeParity, ExpertParallelWithPipelineMatchesOneRank) {
  auto ref = train(1, 2, 4, "ref", kMoe);
  auto ep = train(4, 2, 2, "ep2pp2", kMoe + " --parallel.ep 2 --parallel.pp 2");
  ASSERT_FALSE(ep.losses.empty());
  expect_close(ref, ep, kLossTol, kWeightTol, "ep=2 x pp=2");
  expect_same_routing("ref", "ep2pp2", false);
}

// Expert parallelism with tensor parallelism (Megatron's expert-tensor-parallel = tp): ep 2 x tp 2
// on 4 ranks, every tp rank holding its tp slice of its ep rank's experts, the tokens exchanged
// among the ep peers sharing a tp rank, the outputs summed over tp. Llama (SwiGLU) experts with a
// shared expert, and GPT-2 experts (replicated down-projection biases, added once over tp).
TEST_F(MoeParity, ExpertParallelWithTensorParallelMatchesOneRank) {
  auto ref = train(1, 2, 2, "ref", kMoe);
  auto et = train(4, 2, 1, "ep2tp2", kMoe + " --parallel.ep 2 --parallel.tp 2");
  ASSERT_FALSE(et.losses.empty());
  expect_close(ref, et, kLossTol, kWeightTol, "llama MoE, ep=2 x tp=2");
  const double maxaux = expect_same_routing("ref", "ep2tp2", true);
  std::printf("[ep=2 x tp=2] max |d aux| %.3g\n", maxaux);
  EXPECT_EQ(et.final.at("moe_dropped_tokens").get<int64_t>(), 0);
  EXPECT_GT(et.final.at("comm_bytes_by_group").value("ep", int64_t{0}), 0);
  EXPECT_GT(et.final.at("comm_bytes_by_group").value("tp", int64_t{0}), 0);
  // Model state per rank, exactly: DDP's flat buffers plus the local experts' tp slices: 2 of 4
  // experts per MoE layer, 3 matrices of C x F / tp each.
  EXPECT_EQ(et.final.at("expert_state_bytes").at("params").get<int64_t>(), 4 * 2 * 2 * 3 * 32 * 64 / 2);
  expect_ddp_model_state(et.final, 4);
  // The dry run of every rank builds the same layout: the real run's model state, to the byte.
  expect_dry_runs_match(4, kMoe + " --parallel.ep 2 --parallel.tp 2 --train.micro_batch 2", et.final);
  const std::string gpt = " --model.preset gpt2-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1"
                          " --model.moe_aux_loss_coef 0.02";
  // Both in the full format (Hugging Face layout: GPT-2's Conv1D weights transposed), which also
  // gathers every expert's slices over ep and tp.
  auto gref = train(1, 2, 2, "gref", gpt + " --train.checkpoint_format full");
  auto get = train(4, 2, 1, "gep2tp2", gpt + " --parallel.ep 2 --parallel.tp 2 --train.checkpoint_format full");
  ASSERT_FALSE(get.losses.empty());
  expect_close(gref, get, kLossTol, kWeightTol, "gpt2 MoE, ep=2 x tp=2");
  expect_same_routing("gref", "gep2tp2", false, "gpt2 ");
}

// Tensor parallelism splits every expert's hidden width (ep = 1): Llama experts with a shared
// expert on tp 2, and GPT-2 experts (biases added once over the tp ranks) on tp 2 x FULL_SHARD 2.
TEST_F(MoeParity, TensorParallelExpertsMatchOneRank) {
  auto ref = train(1, 2, 1, "ref", kMoe);
  auto tp = train(2, 2, 1, "tp2", kMoe + " --parallel.tp 2");
  ASSERT_FALSE(tp.losses.empty());
  expect_close(ref, tp, kLossTol, kWeightTol, "llama MoE, tp=2");
  expect_same_routing("ref", "tp2", true, "(tokens counted once over tp) ");
  const std::string gpt = " --model.preset gpt2-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1";
  auto gref = train(1, 2, 2, "gref", gpt);
  auto gtp = train(4, 2, 1, "gtp", gpt + " --parallel.tp 2 --parallel.strategy FULL_SHARD");
  ASSERT_FALSE(gtp.losses.empty());
  expect_close(gref, gtp, kLossTol, kWeightTol, "gpt2 MoE, tp=2 x FULL_SHARD 2");
}

// Sequence parallelism (Megatron's all-gather dispatcher): the MoE layer's sequence-sharded input is
// gathered over tp, every tp rank routes the whole micro-batch and runs its slice of the experts,
// and the output is reduce-scattered back to the rank's rows. tp 2 + SP on 2 ranks (Llama experts
// with a shared expert, and GPT-2 experts), and ep 2 x tp 2 + SP on 4, against one process: the
// same losses, aux losses and tokens per expert (the whole micro-batch's), final weights, every
// rank's exact model-state bytes and its dry run's.
TEST_F(MoeParity, SequenceParallelExpertsMatchOneRank) {
  const std::string sp = " --parallel.tp 2 --parallel.sequence_parallel true";
  auto ref = train(1, 2, 1, "ref", kMoe);
  auto tp = train(2, 2, 1, "tp2sp", kMoe + sp);
  ASSERT_FALSE(tp.losses.empty());
  expect_close(ref, tp, kLossTol, kWeightTol, "llama MoE, tp=2 + SP");
  std::printf("[tp=2 + SP] max |d aux| %.3g\n", expect_same_routing("ref", "tp2sp", true, "(tp 2 + SP) "));
  EXPECT_GT(tp.final.at("comm_bytes_by_group").value("tp", int64_t{0}), 0);
  expect_ddp_model_state(tp.final, 2);
  expect_dry_runs_match(2, kMoe + sp + " --train.micro_batch 2", tp.final);
  // Against tp 2 without SP in bf16 (activations cross the tp group in bf16 both ways), with full
  // recompute (a recomputed MoE layer gathers its input again).
  auto tpb = train(2, 2, 1, "tp2b", kMoe + " --parallel.tp 2 --train.dtype bf16");
  auto spb = train(2, 2, 1, "tp2spb", kMoe + sp + " --train.dtype bf16 --train.activation_checkpointing full");
  ASSERT_FALSE(spb.losses.empty());
  expect_close(tpb, spb, kLossTol, kWeightTol, "bf16 llama MoE, tp=2 + SP + full recompute vs tp=2");
  const std::string gpt = " --model.preset gpt2-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1"
                          " --model.moe_aux_loss_coef 0.02";
  auto gref = train(1, 2, 1, "gref", gpt);
  auto gtp = train(2, 2, 1, "gtp2sp", gpt + sp);
  ASSERT_FALSE(gtp.losses.empty());
  expect_close(gref, gtp, kLossTol, kWeightTol, "gpt2 MoE, tp=2 + SP");
  expect_same_routing("gref", "gtp2sp", true, "gpt2 (tp 2 + SP) ");
  auto ref2 = train(1, 2, 2, "ref2", kMoe);
  auto et = train(4, 2, 1, "ep2tp2sp", kMoe + " --parallel.ep 2" + sp);
  ASSERT_FALSE(et.losses.empty());
  expect_close(ref2, et, kLossTol, kWeightTol, "llama MoE, ep=2 x tp=2 + SP");
  std::printf("[ep=2 x tp=2 + SP] max |d aux| %.3g\n", expect_same_routing("ref2", "ep2tp2sp", true, "(ep 2 x tp 2 + SP) "));
  EXPECT_EQ(et.final.at("moe_dropped_tokens").get<int64_t>(), 0);
  EXPECT_GT(et.final.at("comm_bytes_by_group").value("ep", int64_t{0}), 0);
  EXPECT_EQ(et.final.at("expert_state_bytes").at("params").get<int64_t>(), 4 * 2 * 2 * 3 * 32 * 64 / 2);
  expect_ddp_model_state(et.final, 4);
  expect_dry_runs_match(4, kMoe + " --parallel.ep 2" + sp + " --train.micro_batch 2", et.final);
}

// Context parallelism: each cp rank routes its chunks of every sequence; the load-balancing loss
// counts f_e over the whole micro-batch (summed over cp), and each rank's aux / z losses are its
// share of the micro-batch's, so they sum to one process's and so do their gradients. cp 2 on 2
// ranks; ep 2 x cp 2 on 4 (the experts' gradients reduced over edp x cp), with DDP and FULL_SHARD;
// cp 2 x tp 2 + SP on 4 with GPT-2 experts. Against one process: losses, aux losses, tokens per
// expert, final weights, every rank's exact model-state bytes and its dry run's.
TEST_F(MoeParity, ContextParallelExpertsMatchOneRank) {
  auto ref = train(1, 2, 1, "ref", kMoe);
  auto cp = train(2, 2, 1, "cp2", kMoe + " --parallel.cp 2");
  ASSERT_FALSE(cp.losses.empty());
  expect_close(ref, cp, kLossTol, kWeightTol, "llama MoE, cp=2");
  std::printf("[cp=2] max |d aux| %.3g\n", expect_same_routing("ref", "cp2", true, "(cp 2) "));
  expect_ddp_model_state(cp.final, 2);
  expect_dry_runs_match(2, kMoe + " --parallel.cp 2 --train.micro_batch 2", cp.final);
  auto ref2 = train(1, 2, 2, "ref2", kMoe);
  auto ec = train(4, 2, 1, "ep2cp2", kMoe + " --parallel.ep 2 --parallel.cp 2");
  ASSERT_FALSE(ec.losses.empty());
  expect_close(ref2, ec, kLossTol, kWeightTol, "llama MoE, ep=2 x cp=2");
  std::printf("[ep=2 x cp=2] max |d aux| %.3g\n", expect_same_routing("ref2", "ep2cp2", true, "(ep 2 x cp 2) "));
  EXPECT_GT(ec.final.at("comm_bytes_by_group").value("ep", int64_t{0}), 0);
  EXPECT_GT(ec.final.at("comm_bytes_by_group").value("edp", int64_t{0}), 0);
  EXPECT_EQ(ec.final.at("expert_state_bytes").at("params").get<int64_t>(), 4 * 2 * 2 * 3 * 32 * 64);
  expect_ddp_model_state(ec.final, 4);
  expect_dry_runs_match(4, kMoe + " --parallel.ep 2 --parallel.cp 2 --train.micro_batch 2", ec.final);
  auto ecfs = train(4, 2, 1, "ep2cp2fs", kMoe + " --parallel.ep 2 --parallel.cp 2 --parallel.strategy FULL_SHARD");
  expect_close(ref2, ecfs, kLossTol, kWeightTol, "llama MoE, ep=2 x cp=2 x FULL_SHARD");
  const std::string gpt = " --model.preset gpt2-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1"
                          " --model.moe_aux_loss_coef 0.02 --model.moe_z_loss_coef 0.001";
  auto gref = train(1, 2, 1, "gref", gpt);
  auto gct = train(4, 2, 1, "gcp2tp2sp", gpt + " --parallel.cp 2 --parallel.tp 2 --parallel.sequence_parallel true");
  ASSERT_FALSE(gct.losses.empty());
  expect_close(gref, gct, kLossTol, kWeightTol, "gpt2 MoE, cp=2 x tp=2 + SP");
  expect_same_routing("gref", "gcp2tp2sp", true, "gpt2 (cp 2 x tp 2 + SP) ");
}

// bf16 (rows travel in bf16, outputs and gradients in fp32); a capacity factor that drops tokens,
// with full recompute (a recomputed layer repeats its exchanges) and ZeRO-2 for the dense part.
TEST_F(MoeParity, ExpertParallelBf16CapacityAndRecomputeMatchOneRank) {
  auto ref = train(1, 2, 2, "refb", kMoe + " --train.dtype bf16");
  auto ep = train(2, 2, 1, "epb", kMoe + " --train.dtype bf16 --parallel.ep 2");
  ASSERT_FALSE(ep.losses.empty());
  expect_close(ref, ep, 2e-4, 2e-3, "ep=2 bf16");
  const std::string cap = kMoe + " --model.moe_capacity_factor 1.0 --train.activation_checkpointing full";
  auto refc = train(1, 2, 2, "refc", cap);
  auto epc = train(2, 2, 1, "epc", cap + " --parallel.ep 2 --parallel.strategy SHARD_GRAD_OP");
  ASSERT_FALSE(epc.losses.empty());
  expect_close(refc, epc, kLossTol, kWeightTol, "ep=2 x ZeRO-2, capacity 1.0, full recompute");
  const int64_t dropped = refc.final.at("moe_dropped_tokens").get<int64_t>();
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(epc.final.at("moe_dropped_tokens").get<int64_t>(), dropped);
}

// model.moe_pad_to_capacity: every expert receives exactly its capacity of rows from each rank, zero
// rows filling up (their outputs discarded, no gradient from them), so a padded run trains like the
// unpadded one with the same capacity (same drops), and its sizes no longer depend on the routing:
// every rank's dry run has the real run's activations and workspace to the byte. Llama experts in
// one process and on ep 2; GPT-2 experts (a zero row's hidden is gelu(bias), not zero) on one
// process and ep 2 x tp 2.
TEST_F(MoeParity, PaddedToCapacityMatchesUnpadded) {
  const std::string cap = kMoe + " --model.moe_capacity_factor 1.0";
  const std::string pad = cap + " --model.moe_pad_to_capacity true";
  auto ref = train(1, 2, 2, "refc", cap);
  auto one = train(1, 2, 2, "onep", pad);
  ASSERT_FALSE(one.losses.empty());
  expect_close(ref, one, kLossTol, kWeightTol, "llama MoE, capacity 1.0, padded vs not (one process)");
  expect_same_routing("refc", "onep", true, "(padded, one process) ");
  const int64_t dropped = ref.final.at("moe_dropped_tokens").get<int64_t>();
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(one.final.at("moe_dropped_tokens").get<int64_t>(), dropped);
  auto ep = train(2, 2, 1, "ep2p", pad + " --parallel.ep 2");
  ASSERT_FALSE(ep.losses.empty());
  expect_close(ref, ep, kLossTol, kWeightTol, "llama MoE, capacity 1.0, ep=2 padded vs one process unpadded");
  expect_same_routing("refc", "ep2p", true, "(padded, ep 2) ");
  EXPECT_EQ(ep.final.at("moe_dropped_tokens").get<int64_t>(), dropped);
  // Every step sends the same bytes: per MoE layer and micro-batch E x capacity rows leave each
  // rank, half of them to the other rank: capacity ceil(1.0 x 64 x 2 / 4) = 32 rows of 32 values,
  // fp32 input rows and outputs forward, output and input gradients backward.
  EXPECT_EQ(ep.final.at("ep_all_to_all_bytes_per_step").get<int64_t>(), 2 * (4 * 32 / 2) * 32 * 4 * 4);
  expect_ddp_model_state(ep.final, 2);
  expect_dry_runs_match(2, pad + " --parallel.ep 2 --train.micro_batch 2", ep.final, true);
  const std::string gcap = " --model.preset gpt2-tiny --model.moe_experts 4 --model.moe_top_k 2 --model.moe_shared_experts 1"
                           " --model.moe_aux_loss_coef 0.02 --model.moe_capacity_factor 1.0";
  auto gref = train(1, 2, 2, "gcap", gcap);
  auto gone = train(1, 2, 2, "gonep", gcap + " --model.moe_pad_to_capacity true");
  expect_close(gref, gone, kLossTol, kWeightTol, "gpt2 MoE, capacity 1.0, padded vs not (one process)");
  auto get = train(4, 2, 1, "gep2tp2p", gcap + " --model.moe_pad_to_capacity true --parallel.ep 2 --parallel.tp 2");
  ASSERT_FALSE(get.losses.empty());
  expect_close(gref, get, kLossTol, kWeightTol, "gpt2 MoE, capacity 1.0, ep=2 x tp=2 padded vs one process unpadded");
  expect_same_routing("gcap", "gep2tp2p", true, "gpt2 (padded, ep 2 x tp 2) ");
  expect_dry_runs_match(4, gcap + " --model.moe_pad_to_capacity true --parallel.ep 2 --parallel.tp 2 --train.micro_batch 2",
                        get.final, true);
}

// The largest absolute difference of two runs' final weights; NaN (an element no piece of a sharded
// checkpoint held) or a size mismatch fail.
double max_weight_diff(const RunResult& a, const RunResult& b, const std::string& what) {
  EXPECT_EQ(a.weights.size(), b.weights.size()) << what;
  EXPECT_FALSE(a.weights.empty()) << what;
  if (a.weights.size() != b.weights.size()) return 1e30;
  double maxd = 0;
  for (size_t i = 0; i < a.weights.size(); ++i) {
    const double d = std::abs(static_cast<double>(a.weights[i]) - static_cast<double>(b.weights[i]));
    if (std::isnan(d)) {
      ADD_FAILURE() << what << ": weight " << i << " is NaN (missing from a checkpoint)";
      return 1e30;
    }
    maxd = std::max(maxd, d);
  }
  std::printf("[%s] max |dw| %.3g\n", what.c_str(), maxd);
  return maxd;
}

// A sharded checkpoint's pieces of one logical tensor: the files holding them and the elements
// they cover.
struct TensorPieces {
  std::set<std::string> files;
  int64_t covered = 0, numel = 0;
};
TensorPieces tensor_pieces(const std::filesystem::path& ckdir, const std::string& name) {
  std::ifstream latest(ckdir / "latest");
  std::string step;
  std::getline(latest, step);
  TensorPieces out;
  std::ifstream mf(ckdir / step / "metadata.json");
  if (!mf) {
    ADD_FAILURE() << (ckdir / step).string() << " is not a sharded checkpoint";
    return out;
  }
  const auto meta = nlohmann::json::parse(mf);
  const auto& t = meta.at("tensors").at(name);
  out.numel = 1;
  for (const auto& d : t.at("shape")) out.numel *= d.get<int64_t>();
  for (const auto& p : t.at("pieces")) {
    out.files.insert(meta.at("files")[p[0].get<size_t>()].at("name").get<std::string>());
    out.covered += p[3].get<int64_t>() * p[5].get<int64_t>();
  }
  return out;
}

// Checkpoints hold every expert whatever the layout, in the sharded format too (each ep rank writes
// its own experts): 4 steps with ep = 2 (saved asynchronously), then resumed with ep = 1 (DDP, every
// rank all experts) and with ep = 2 again, both ending where 8 uninterrupted ep = 2 steps end
// (the same layout exactly); and an ep = 1 checkpoint in the full format resumed with ep = 2.
TEST_F(MoeParity, CheckpointFromExpertParallelResumesWithoutIt) {
  auto first = train(2, 2, 1, "first", kMoe + " --parallel.ep 2 --train.steps 4 --train.lr_schedule constant"
                                              " --train.checkpoint_async true");
  (void)first;
  const std::filesystem::path ck = dir_ / "ck_first";
  // Experts 2 and 3 live on ep rank 1 (world rank 1) only, and its file holds them; the dense part
  // is DDP's, its replicas splitting what they write.
  for (const char* name : {"model.layers.0.block_sparse_moe.experts.3.w1.weight",
                           "exp_avg_sq.model.layers.1.block_sparse_moe.experts.2.w2.weight"}) {
    const TensorPieces tp = tensor_pieces(ck, name);
    EXPECT_EQ(tp.files, std::set<std::string>{"rank_00001.safetensors"}) << name;
    EXPECT_EQ(tp.covered, tp.numel) << name;
  }
  EXPECT_EQ(tensor_pieces(ck, "model.layers.1.block_sparse_moe.experts.0.w3.weight").files,
            std::set<std::string>{"rank_00000.safetensors"});
  auto rest = train(2, 2, 1, "rest", kMoe + " --train.resume " + ck.string() + " --train.lr_schedule constant");
  auto again = train(2, 2, 1, "again", kMoe + " --parallel.ep 2 --train.resume " + ck.string() +
                                           " --train.lr_schedule constant");
  auto whole = train(2, 2, 1, "whole", kMoe + " --parallel.ep 2 --train.lr_schedule constant");
  ASSERT_EQ(rest.losses.size(), 4u);
  ASSERT_EQ(again.losses.size(), 4u);
  ASSERT_EQ(whole.losses.size(), 8u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(rest.losses[i], whole.losses[4 + i], kLossTol) << "ep 1 from ep 2, step " << 5 + i;
    EXPECT_EQ(again.losses[i], whole.losses[4 + i]) << "ep 2 from ep 2, step " << 5 + i;
  }
  EXPECT_LT(max_weight_diff(rest, whole, "sharded ep 2 -> ep 1"), kWeightTol);
  EXPECT_EQ(max_weight_diff(again, whole, "sharded ep 2 -> ep 2"), 0.0);
  // And the other way: ep = 1's checkpoint (full format) resumed with ep = 2 (each rank takes its
  // experts' weights and Adam moments out of it).
  train(2, 2, 1, "first1", kMoe + " --train.steps 4 --train.lr_schedule constant --train.checkpoint_format full");
  auto rest2 = train(2, 2, 1, "rest2", kMoe + " --parallel.ep 2 --train.resume " + (dir_ / "ck_first1").string() +
                                           " --train.lr_schedule constant");
  ASSERT_EQ(rest2.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(rest2.losses[i], whole.losses[4 + i], kLossTol) << "step " << 5 + i;
  EXPECT_LT(max_weight_diff(rest2, whole, "full ep 1 -> ep 2"), kWeightTol);
}

// A sharded checkpoint of ep 2 x tp 2 (4 ranks: each expert's tp slices in the files of the two tp
// ranks of its ep rank) resumed by ep 2 on 2 ranks, and an ep 2 one resumed by ep 2 x tp 2: both
// end where 8 uninterrupted ep 2 steps end.
TEST_F(MoeParity, ShardedCheckpointAcrossExpertAndTensorParallelLayouts) {
  const std::string c = " --train.lr_schedule constant";
  train(4, 2, 1, "first4", kMoe + " --parallel.ep 2 --parallel.tp 2 --train.steps 4" + c);
  const std::filesystem::path ck4 = dir_ / "ck_first4";
  // World rank = dp rank x 2 + tp rank; ep rank = dp rank (ep = dp = 2).
  for (const char* name : {"model.layers.0.block_sparse_moe.experts.3.w1.weight",   // rows split over tp
                           "exp_avg.model.layers.1.block_sparse_moe.experts.2.w2.weight"}) {  // columns
    const TensorPieces tp = tensor_pieces(ck4, name);
    EXPECT_EQ(tp.files, (std::set<std::string>{"rank_00002.safetensors", "rank_00003.safetensors"})) << name;
    EXPECT_EQ(tp.covered, tp.numel) << name;
  }
  EXPECT_EQ(tensor_pieces(ck4, "model.layers.0.block_sparse_moe.experts.1.w3.weight").files,
            (std::set<std::string>{"rank_00000.safetensors", "rank_00001.safetensors"}));
  auto whole = train(2, 2, 1, "whole", kMoe + " --parallel.ep 2" + c);
  auto rest = train(2, 2, 1, "rest", kMoe + " --parallel.ep 2 --train.resume " + ck4.string() + c);
  ASSERT_EQ(whole.losses.size(), 8u);
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(rest.losses[i], whole.losses[4 + i], kLossTol) << "step " << 5 + i;
  EXPECT_LT(max_weight_diff(rest, whole, "sharded ep 2 x tp 2 -> ep 2"), kWeightTol);
  train(2, 2, 1, "first2", kMoe + " --parallel.ep 2 --train.steps 4" + c);
  auto rest4 = train(4, 2, 1, "rest4", kMoe + " --parallel.ep 2 --parallel.tp 2 --train.resume " +
                                           (dir_ / "ck_first2").string() + c);
  ASSERT_EQ(rest4.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(rest4.losses[i], whole.losses[4 + i], kLossTol) << "step " << 5 + i;
  EXPECT_LT(max_weight_diff(rest4, whole, "sharded ep 2 -> ep 2 x tp 2"), kWeightTol);
}

TEST_F(MoeParity, RefusedLayoutsSayWhy) {
  const std::string base = std::string(MT_BINARY) + " train --data.train " + (dir_ / "train.bin").string() +
                           " --data.val= --train.steps 1 --train.threads 1";
  RunOut r = run(mpirun(2) + base + kMoe + " --parallel.ep 4");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("parallel.ep = 4 must divide the data-parallel degree"), std::string::npos) << r.output;
  r = run("MESHTRAIN_MPI=0 " + base + " --parallel.ep 2 --model.preset llama-tiny");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("needs a mixture-of-experts model"), std::string::npos) << r.output;
  r = run(mpirun(2) + base + " --model.preset llama-tiny --model.moe_experts 3 --parallel.ep 2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("must be divisible by parallel.ep"), std::string::npos) << r.output;
  r = run("MESHTRAIN_MPI=0 " + base + kMoe + " --model.moe_pad_to_capacity true");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("model.moe_pad_to_capacity needs a mixture of experts (model.moe_experts > 0) with a capacity "
                          "(model.moe_capacity_factor > 0)"),
            std::string::npos)
      << r.output;
  r = run(mpirun(2) + base + kMoe + " --parallel.cp 2 --model.moe_capacity_factor 1.25");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("model.moe_capacity_factor > 0 with parallel.cp = 2 is not supported"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace mt
