// `meshtrain train --dry-run --world N --rank R` (the count-only Meta backend) against real runs
// of the same config on N ranks under mpirun: every rank's memory by category (peak and resident)
// and rank 0's bytes by group must be the same, byte for byte. Two documented exceptions: the
// `scratch` category (a backend's own kernel buffers: the CPU GEMM's packing blocks and attention
// tiles; the Meta backend's kernels need none), and the gradient peak of strategies that free a
// unit's full gradient when its reduce-scatter is seen to finish - a real run can hold a few more
// of them while reductions are in flight, the dry run (communication that keeps up) holds the
// fewest; the test bounds that difference by the model's full gradient. And the peak of `comm`
// can move by up to the groups' staging buffers: those grow (once, in the first step) when the
// communication thread starts an operation, which in a real run can come after the caller has
// allocated or freed other buffers; the dry run grows them when the operation is issued. The
// resident bytes (after the step) of every category are exact.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "harness.h"

namespace mt {
namespace {

struct DryCase {
  const char* name;
  int np;
  std::string args;        // layout and model overrides
  bool grads_timing = false;  // gradients freed when a reduction is seen to finish
};

// What a failing case prints for GetParam().
void PrintTo(const DryCase& k, std::ostream* os) { *os << k.name << " on " << k.np << " ranks: " << k.args; }

class DryRun : public ParityFixture, public ::testing::WithParamInterface<DryCase> {
 protected:
  std::string common() const {
    return " --model.preset gpt2-tiny --data.train " + (dir_ / "train.bin").string() +
           " --data.val '' --train.steps 1 --train.warmup_steps 1 --train.threads 1 --train.micro_batch 2"
           " --parallel.bucket_mb 0.01 ";
  }
};

TEST_P(DryRun, MatchesARealRunByteForByte) {
  const DryCase& c = GetParam();
  const std::string real_m = (dir_ / "real.jsonl").string();
  RunOut r = run(mpirun(c.np) + MT_BINARY + std::string(" train") + common() + c.args + " --log.metrics_out " + real_m);
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json real = final_metrics(real_m);
  ASSERT_TRUE(real.contains("mem_peak_by_category_per_rank")) << real.dump();
  const int64_t full_grads = 4 * real["flat_size"].get<int64_t>();
  for (int rank = 0; rank < c.np; ++rank) {
    const std::string dry_m = (dir_ / ("dry" + std::to_string(rank) + ".jsonl")).string();
    RunOut d = run(std::string(MT_BINARY) + " train" + common() + c.args + " --dry-run --world " +
                   std::to_string(c.np) + " --rank " + std::to_string(rank) + " --log.metrics_out " + dry_m);
    ASSERT_EQ(d.code, 0) << d.output;
    const nlohmann::json dry = final_metrics(dry_m);
    ASSERT_TRUE(dry.value("dry_run", false));
    for (const char* kind : {"peak", "resident"}) {
      const nlohmann::json& want = real[std::string("mem_") + kind + "_by_category_per_rank"][rank];
      const nlohmann::json& got = dry[std::string("mem_") + kind + "_by_category"];
      for (const auto& [cat, bytes] : want.items()) {
        const int64_t w = bytes.get<int64_t>(), g = got.at(cat).get<int64_t>();
        if (cat == "scratch") {
          EXPECT_EQ(g, 0) << "the Meta backend's kernels keep no scratch";
        } else if (cat == "comm" && std::string(kind) == "peak") {
          const int64_t staging = real["mem_resident_by_category_per_rank"][rank]["comm"].get<int64_t>();
          EXPECT_LE(std::llabs(w - g), staging) << c.name << " rank " << rank << " comm peak";
          if (w != g) std::printf("%s rank %d: comm peak %lld real vs %lld dry (staging grown at another moment)\n",
                                  c.name, rank, static_cast<long long>(w), static_cast<long long>(g));
        } else if (cat == "grads" && std::string(kind) == "peak" && c.grads_timing) {
          EXPECT_LE(g, w) << c.name << " rank " << rank << ": the dry run holds the fewest full gradients";
          EXPECT_LE(w - g, full_grads) << c.name << " rank " << rank;
          if (w != g) std::printf("%s rank %d: gradient peak %lld real vs %lld dry (reductions in flight)\n", c.name,
                                  rank, static_cast<long long>(w), static_cast<long long>(g));
        } else {
          EXPECT_EQ(g, w) << c.name << " rank " << rank << " " << kind << " " << cat;
        }
      }
    }
    if (rank == 0) {  // the real run reports rank 0's bytes by group
      EXPECT_EQ(dry["comm_bytes_by_group"], real["comm_bytes_by_group"]) << c.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, DryRun,
    ::testing::Values(
        DryCase{"ddp", 2, "--parallel.strategy NO_SHARD"},
        DryCase{"lora_ddp_llama_bf16", 2,
                "--model.preset llama-tiny --lora.rank 4 --lora.targets q,k,v,o,gate,up,down --train.dtype bf16"},
        DryCase{"lora_fsdp", 2, "--lora.rank 4 --lora.targets c_attn,o,up,down --parallel.strategy FULL_SHARD", true},
        DryCase{"lora_fsdp_llama_bf16", 2,
                "--model.preset llama-tiny --lora.rank 4 --lora.targets q,k,v,o,gate,up,down --train.dtype bf16 "
                "--parallel.strategy FULL_SHARD",
                true},
        DryCase{"lora_zero1_bf16", 2, "--lora.rank 4 --lora.targets c_attn,o,up,down --parallel.strategy ZERO1 --train.dtype bf16"},
        DryCase{"zero1_bf16", 2, "--parallel.strategy ZERO1 --train.dtype bf16"},
        DryCase{"zero2", 2, "--parallel.strategy SHARD_GRAD_OP --train.grad_accum 2", true},
        DryCase{"fsdp_bf16_recompute", 2,
                "--parallel.strategy FULL_SHARD --train.dtype bf16 --train.activation_checkpointing selective", true},
        DryCase{"hsdp", 4, "--parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2", true},
        DryCase{"hsdp_zero2_bf16", 4,
                "--parallel.strategy HYBRID_SHARD_ZERO2 --parallel.dp_replicate 2 --train.dtype bf16", true},
        DryCase{"tp2_sp_llama", 2,
                "--model.preset llama-tiny --parallel.tp 2 --parallel.sequence_parallel true --train.dtype bf16"},
        DryCase{"tp2_fsdp2", 4, "--parallel.strategy FULL_SHARD --parallel.tp 2", true},
        DryCase{"pp2_1f1b_ddp2", 4, "--parallel.pp 2 --parallel.pp_microbatches 4"},
        DryCase{"pp2_interleaved_chunked_loss", 2,
                "--model.preset llama-tiny --parallel.pp 2 --parallel.pp_schedule interleaved_1f1b "
                "--parallel.pp_virtual_stages 2 --parallel.pp_microbatches 4 --train.loss_chunk_tokens 16"},
        // Split backward: the copies held from B to W are activations, in the dry run too.
        DryCase{"pp2_zb1p_ddp2", 4, "--parallel.pp 2 --parallel.pp_schedule zb1p --parallel.pp_microbatches 4"},
        DryCase{"pp2_zbv_fsdp2_llama", 4,
                "--model.preset llama-tiny --parallel.pp 2 --parallel.pp_schedule zbv --parallel.pp_microbatches 4 "
                "--parallel.strategy FULL_SHARD",
                true},
        DryCase{"cp2_fsdp2_llama", 4, "--model.preset llama-tiny --parallel.cp 2 --parallel.strategy FULL_SHARD", true},
        DryCase{"cp2_tp2_allgather_bf16", 4,
                "--parallel.cp 2 --parallel.tp 2 --parallel.cp_mode allgather --train.dtype bf16"}),
    [](const ::testing::TestParamInfo<DryCase>& i) { return std::string(i.param.name); });

// Llama 3 70B on 512 ranks (FULL_SHARD x tp 8 x pp 4, bf16, full recompute, sequence parallel):
// one rank's exact figures in one process, without the memory. The model state is what the ZeRO-3
// formula says for its stage (params 0 resident, fp32 gradient shard, 12 B of optimizer per
// parameter per 16-way shard) and the run needs no data files.
TEST(DryRunScale, Llama70BOn512RanksInSeconds) {
  const std::string m = (std::filesystem::temp_directory_path() / ("mt_dry70b_" + std::to_string(::getpid()) + ".jsonl")).string();
  RunOut d = run(std::string(MT_BINARY) +
                 " train --model.preset llama3-70b --parallel.strategy FULL_SHARD --parallel.tp 8 --parallel.pp 4"
                 " --train.micro_batch 1 --train.grad_accum 8 --train.dtype bf16 --train.activation_checkpointing full"
                 " --parallel.sequence_parallel true --data.train /nonexistent --dry-run --world 512 --rank 0"
                 " --log.metrics_out " + m);
  ASSERT_EQ(d.code, 0) << d.output;
  const nlohmann::json f = final_metrics(m);
  std::filesystem::remove(m);
  EXPECT_EQ(f["world_size"].get<int>(), 512);
  EXPECT_EQ(f["shard_group_size"].get<int>(), 16);
  const int64_t flat = f["flat_size"].get<int64_t>();  // this tp rank's pipeline stage, before sharding
  const auto& res = f["mem_resident_by_category"];
  EXPECT_EQ(res["params"].get<int64_t>(), 0);
  EXPECT_EQ(res["grads"].get<int64_t>(), 4 * flat / 16);
  EXPECT_EQ(res["optimizer"].get<int64_t>(), 12 * flat / 16);
  EXPECT_GT(f["mem_peak_by_category"]["activations"].get<int64_t>(), int64_t(1) << 30);
  for (const char* g : {"dp", "tp", "pp"}) EXPECT_GT(f["comm_bytes_by_group"][g].get<uint64_t>(), 0u) << g;
}

}  // namespace
}  // namespace mt
