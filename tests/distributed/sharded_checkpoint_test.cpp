// Sharded checkpoints as real jobs under mpirun: every rank writes its own file; a checkpoint
// written under one layout resumes under another and continues with the losses of the run that
// never stopped; async saves write the same files as synchronous ones; export of a sharded
// checkpoint equals export of a full one; damaged or mismatched checkpoints are refused naming
// the file and the tensor.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "harness.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

// fp32 across layouts: only where sums happen changes (as the parity tests); bf16 resumed under
// another layout: the reduction order can flip a bf16 rounding now and then.
constexpr double kLossTol = 1e-5, kBf16LossTol = 2e-3;

class ShardedCheckpoint : public ParityFixture {
 protected:
  std::string ck(const std::string& tag, int step) const {
    char b[32];
    std::snprintf(b, sizeof b, "/step_%08d", step);
    return (dir_ / ("ck_" + tag)).string() + b;
  }
  // Steps 9..12 of `resumed` against steps 9..12 of `longer`.
  static void expect_continues(const RunResult& longer, const RunResult& resumed, double tol, const std::string& what) {
    ASSERT_EQ(longer.losses.size(), 12u) << what;
    ASSERT_EQ(resumed.losses.size(), 4u) << what;
    for (int i = 0; i < 4; ++i) {
      std::printf("[%s] step %d: %.9f uninterrupted, %.9f resumed (%+.2e)\n", what.c_str(), 9 + i, longer.losses[8 + i],
                  resumed.losses[i], resumed.losses[i] - longer.losses[8 + i]);
      EXPECT_NEAR(resumed.losses[i], longer.losses[8 + i], tol) << what << " step " << 9 + i;
    }
  }
  std::string base_cmd(int np) const {
    return (np > 1 ? mpirun(np) : std::string("MESHTRAIN_MPI=0 ")) + MT_BINARY + " train --model.preset gpt2-tiny --data.train " +
           (dir_ / "train.bin").string() +
           " --data.val '' --train.steps 12 --train.warmup_steps 2 --train.lr 3e-3 --train.threads 1 --train.micro_batch 4 ";
  }
};

TEST_F(ShardedCheckpoint, EveryRankWritesItsOwnFile) {
  auto r = train(4, 2, 1, "fs4", "--parallel.strategy FULL_SHARD --train.steps 4");
  ASSERT_EQ(r.losses.size(), 4u);
  const std::string d = ck("fs4", 4);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(fs::exists(d + "/rank_0000" + std::to_string(i) + ".safetensors")) << i;
  EXPECT_TRUE(fs::exists(d + "/metadata.json"));
  EXPECT_FALSE(fs::exists(d + "/model.safetensors"));
  const auto meta = nlohmann::json::parse(std::ifstream(d + "/metadata.json"));
  // FULL_SHARD: each rank holds a quarter of every unit: the four files are of about equal size,
  // together the whole fp32 weights and both moments once (3 x 4 bytes x parameters, plus headers).
  int64_t total = 0, largest = 0;
  for (const auto& f : meta["files"]) {
    total += f["bytes"].get<int64_t>();
    largest = std::max(largest, f["bytes"].get<int64_t>());
  }
  const int64_t np = meta["num_params"].get<int64_t>();
  EXPECT_GE(total, 12 * np);
  EXPECT_LT(total, 12 * np + 4 * 64 * 1024);  // headers
  EXPECT_LT(largest, 12 * np / 4 + 64 * 1024);
  // Every element of every logical tensor is in exactly one piece.
  for (auto it = meta["tensors"].begin(); it != meta["tensors"].end(); ++it) {
    int64_t n = 1, held = 0;
    for (int64_t s : (*it)["shape"]) n *= s;
    for (const auto& p : (*it)["pieces"]) held += p[3].get<int64_t>() * p[5].get<int64_t>();
    EXPECT_EQ(held, n) << it.key();
  }
}

TEST_F(ShardedCheckpoint, FullShard4ResumesAsTp2xDp2) {
  auto longer = train(4, 2, 1, "fs4", "--parallel.strategy FULL_SHARD --train.steps 12 --train.checkpoint_every 4");
  auto resumed = train(4, 4, 1, "tp2dp2",
                       "--parallel.strategy FULL_SHARD --parallel.tp 2 --train.steps 12 --train.resume " + ck("fs4", 8));
  expect_continues(longer, resumed, kLossTol, "FULL_SHARD x4 -> tp 2 x FULL_SHARD 2");
}

TEST_F(ShardedCheckpoint, Pp2xTp2ResumesInOneProcess) {
  auto longer = train(4, 2, 4, "pp2tp2", "--parallel.pp 2 --parallel.tp 2 --train.steps 12 --train.checkpoint_every 4");
  auto back = train(1, 2, 4, "one", "--train.steps 12 --train.resume " + ck("pp2tp2", 8));
  expect_continues(longer, back, kLossTol, "pp 2 x tp 2 -> 1 process");
}

TEST_F(ShardedCheckpoint, TwoRanksGrowToFour) {
  auto longer = train(2, 4, 1, "two", "--parallel.strategy SHARD_GRAD_OP --train.steps 12 --train.checkpoint_every 4");
  auto grown = train(4, 2, 1, "four",
                     "--parallel.strategy HYBRID_SHARD --parallel.dp_replicate 2 --train.steps 12 --train.resume " +
                         ck("two", 8));
  expect_continues(longer, grown, kLossTol, "SHARD_GRAD_OP x2 -> HYBRID_SHARD 2 x 2");
}

TEST_F(ShardedCheckpoint, Bf16FullShardResumesAsZero1OnFour) {
  auto longer = train(2, 4, 1, "bf2",
                      "--train.dtype bf16 --parallel.strategy FULL_SHARD --train.steps 12 --train.checkpoint_every 4");
  auto resumed = train(4, 2, 1, "bf4", "--train.dtype bf16 --parallel.strategy ZERO1 --train.steps 12 --train.resume " +
                                           ck("bf2", 8));
  expect_continues(longer, resumed, kBf16LossTol, "bf16 FULL_SHARD x2 -> ZERO1 x4");
}

// Llama (separate q/k/v projections, grouped-query attention, SwiGLU): DDP x tp 2 on 4 ranks, whose
// replicas split the writing, resumed as HYBRID_SHARD_ZERO2 (2 replicas x 2 shards) without tp.
TEST_F(ShardedCheckpoint, LlamaDdpTp2ResumesAsHybridZero2) {
  const std::string llama = "--model.preset llama-tiny --train.steps 12 ";
  auto longer = train(4, 4, 1, "ddptp", llama + "--parallel.strategy NO_SHARD --parallel.tp 2 --train.checkpoint_every 4");
  auto resumed = train(4, 2, 1, "hz2", llama + "--parallel.strategy HYBRID_SHARD_ZERO2 --parallel.dp_replicate 2 "
                                                "--train.resume " + ck("ddptp", 8));
  expect_continues(longer, resumed, kLossTol, "llama NO_SHARD x tp 2 -> HYBRID_SHARD_ZERO2 2 x 2");
  // The two data-parallel replicas of each tp rank wrote half of its slice each: four files of
  // about equal size.
  const auto meta = nlohmann::json::parse(std::ifstream(ck("ddptp", 8) + "/metadata.json"));
  int64_t lo = INT64_MAX, hi = 0;
  for (const auto& f : meta["files"]) {
    lo = std::min(lo, f["bytes"].get<int64_t>());
    hi = std::max(hi, f["bytes"].get<int64_t>());
  }
  EXPECT_LT(static_cast<double>(hi), 1.25 * static_cast<double>(lo)) << meta["files"].dump();
}

// The earlier full format (rank 0 writes Hugging Face files) still resumes, under another layout.
TEST_F(ShardedCheckpoint, FullFormatStillResumesUnderAnotherLayout) {
  auto longer = train(2, 4, 1, "f2", "--parallel.strategy ZERO1 --train.checkpoint_format full --train.steps 12 "
                                     "--train.checkpoint_every 4");
  ASSERT_TRUE(fs::exists(ck("f2", 8) + "/optimizer.safetensors"));
  auto resumed = train(4, 2, 1, "f4", "--parallel.strategy FULL_SHARD --train.steps 12 --train.resume " + ck("f2", 8));
  expect_continues(longer, resumed, kLossTol, "full format ZERO1 x2 -> FULL_SHARD x4");
}

// Same layout, same arithmetic: the resumed run is the uninterrupted one, bit for bit (losses and
// the final checkpoint's weights).
TEST_F(ShardedCheckpoint, SameLayoutResumeIsBitIdentical) {
  auto longer = train(2, 4, 1, "a", "--parallel.strategy FULL_SHARD --train.steps 12 --train.checkpoint_every 4");
  auto resumed = train(2, 4, 1, "b", "--parallel.strategy FULL_SHARD --train.steps 12 --train.resume " + ck("a", 8));
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], longer.losses[8 + i]) << "step " << 9 + i;
  EXPECT_EQ(resumed.weights, longer.weights);
  EXPECT_FALSE(resumed.weights.empty());
}

// The Hugging Face export of a sharded checkpoint is the export of the rank-0 full checkpoint of
// the same run, byte for byte.
TEST_F(ShardedCheckpoint, ExportEqualsTheFullFormatsExport) {
  auto a = train(2, 4, 1, "sh", "--parallel.strategy ZERO1 --parallel.tp 1");
  auto b = train(2, 4, 1, "full", "--parallel.strategy ZERO1 --train.checkpoint_format full");
  EXPECT_EQ(a.losses, b.losses);
  ASSERT_TRUE(fs::exists(ck("full", 8) + "/model.safetensors"));
  for (const char* t : {"sh", "full"}) {
    RunOut r = run(std::string(MT_BINARY) + " export --checkpoint " + ck(t, 8) + " --out " + (dir_ / ("hf_" + std::string(t))).string());
    ASSERT_EQ(r.code, 0) << r.output;
  }
  auto read = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  const std::string x = read(dir_ / "hf_sh" / "model.safetensors"), y = read(dir_ / "hf_full" / "model.safetensors");
  EXPECT_FALSE(x.empty());
  EXPECT_TRUE(x == y) << "exports differ (" << x.size() << " vs " << y.size() << " bytes)";
  EXPECT_EQ(read(dir_ / "hf_sh" / "config.json"), read(dir_ / "hf_full" / "config.json"));
}

// Async saves write exactly what synchronous saves write (every file's CRC32C), change nothing in
// the run, and report their staging buffer.
TEST_F(ShardedCheckpoint, AsyncSaveWritesWhatSyncWrites) {
  const std::string layout = "--parallel.strategy FULL_SHARD --train.checkpoint_every 2 ";
  auto s = train(2, 4, 1, "sync", layout);
  auto a = train(2, 4, 1, "async", layout + "--train.checkpoint_async true");
  EXPECT_EQ(s.losses, a.losses);
  for (int step : {2, 4, 6, 8}) {
    const auto ms = nlohmann::json::parse(std::ifstream(ck("sync", step) + "/metadata.json"));
    const auto ma = nlohmann::json::parse(std::ifstream(ck("async", step) + "/metadata.json"));
    EXPECT_EQ(ms["files"], ma["files"]) << "step " << step;
    EXPECT_EQ(ma["step"], step);
  }
  ASSERT_TRUE(a.final.contains("checkpoint")) << a.final.dump();
  EXPECT_EQ(a.final["checkpoint"]["saves"], 4);
  EXPECT_EQ(a.final["checkpoint"]["async"], true);
  EXPECT_GT(a.final["checkpoint"]["staging_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(s.final["checkpoint"]["staging_bytes"].get<int64_t>(), 0);
}

TEST_F(ShardedCheckpoint, BadCheckpointsAreRefusedNamingFileAndTensor) {
  train(2, 4, 1, "base", "--parallel.strategy FULL_SHARD --train.checkpoint_every 4");
  const fs::path good = ck("base", 4);
  auto variant = [&](const std::string& name) {
    const fs::path d = dir_ / name;
    fs::remove_all(d);
    fs::copy(good, d, fs::copy_options::recursive);
    return d;
  };
  auto resume = [&](const fs::path& d, const std::string& extra = "") {
    return run(base_cmd(2) + "--parallel.strategy FULL_SHARD --train.resume " + d.string() + " " + extra);
  };
  auto expect_refused = [&](const RunOut& r, std::vector<std::string> words, const std::string& what) {
    EXPECT_NE(r.code, 0) << what << "\n" << r.output;
    for (const auto& w : words) EXPECT_NE(r.output.find(w), std::string::npos) << what << ": no '" << w << "' in\n" << r.output;
  };
  const auto meta = nlohmann::json::parse(std::ifstream(good / "metadata.json"));
  const std::string first_tensor = meta["tensors"].begin().key();

  // A missing rank file.
  fs::path d = variant("missing");
  fs::remove(d / "rank_00001.safetensors");
  expect_refused(resume(d), {"rank_00001.safetensors", "missing", "tensor "}, "missing file");

  // A truncated file.
  d = variant("truncated");
  fs::resize_file(d / "rank_00000.safetensors", fs::file_size(d / "rank_00000.safetensors") - 100);
  expect_refused(resume(d), {"rank_00000.safetensors", "truncated", "tensor "}, "truncated file");

  // A flipped byte inside a tensor's data: the CRC32C names the tensor; verification off skips it.
  d = variant("flipped");
  const auto& piece = meta["tensors"][first_tensor]["pieces"][0];
  const std::string file = meta["files"][piece[0].get<size_t>()]["name"];
  {
    std::fstream f(d / file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(piece[1].get<int64_t>() + 5);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(piece[1].get<int64_t>() + 5);
    f.write(&c, 1);
  }
  expect_refused(resume(d), {file, "tensor " + first_tensor, "CRC32C", "verify_checkpoint"}, "flipped byte");
  EXPECT_EQ(resume(d, "--train.verify_checkpoint false").code, 0);

  // metadata.json that disagrees with a file: a piece's offset moved.
  d = variant("moved");
  {
    auto m = meta;
    m["tensors"][first_tensor]["pieces"][0][1] = piece[1].get<int64_t>() + 4;
    std::ofstream(d / "metadata.json") << m.dump();
  }
  expect_refused(resume(d), {file, "tensor " + first_tensor, "disagrees with metadata.json"}, "moved piece");

  // A rank file of another checkpoint (step 8's) in step 4's directory.
  d = variant("mixed");
  fs::copy_file(fs::path(ck("base", 8)) / "rank_00001.safetensors", d / "rank_00001.safetensors",
                fs::copy_options::overwrite_existing);
  expect_refused(resume(d), {"rank_00001.safetensors", "step 8", "step 4"}, "file of another step");

  // A checkpoint of another model.
  expect_refused(resume(good, "--model.n_embd 64 --model.n_head 2"), {"metadata.json", "tensor ", "shape", "another model"},
                 "another model");

  // A layout that cannot hold the saved shapes (tp 3 of 2 heads).
  expect_refused(run(mpirun(3) + MT_BINARY + " train --model.preset gpt2-tiny --data.train " + (dir_ / "train.bin").string() +
                     " --data.val '' --train.steps 12 --parallel.tp 3 --train.resume " + good.string()),
                 {"parallel.tp (3)"}, "tp 3");

  // And the intact checkpoint still resumes.
  EXPECT_EQ(resume(good).code, 0);
}

}  // namespace
}  // namespace mt
