// Single-process tests of the comm layer (run without mpirun; MESHTRAIN_MPI=0): helpers, the
// reduction kernel (every dtype), the Meta backend's host values, a world of one rank, mesh
// validation, printing and the launcher's command.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cli/commands.h"
#include "comm/comm.h"
#include "comm/detail.h"

using namespace mt;
using namespace mt::comm;

TEST(Partition, SegmentsCoverTheBufferAndAreBalanced) {
  for (size_t count : {0, 1, 5, 7, 64, 1001}) {
    for (int n : {1, 2, 3, 4, 7}) {
      size_t next = 0, mx = 0, mn = ~size_t(0);
      for (int i = 0; i < n; ++i) {
        detail::Seg s = detail::segment(count, n, i);
        EXPECT_EQ(s.off, next);
        next += s.len;
        mx = std::max(mx, s.len);
        mn = std::min(mn, s.len);
      }
      EXPECT_EQ(next, count);
      EXPECT_LE(mx - mn, 1u);
    }
  }
}

TEST(Reduce, Bf16RoundsLikeTheRuntimeAndAccumulatesInFp32) {
  // Rounding: every kind of value, including ties, infinities and NaN.
  std::vector<float> vals = {0.0f, -0.0f, 1.0f, 1.00390625f, 1.01171875f, 3.14159f, -2.5e-3f,
                             65504.0f, 3.0e38f, std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN(), 1e-40f};
  for (float v : vals) {
    bf16 in = float_to_bf16(v), zero = float_to_bf16(0.0f), out{};
    const void* srcs[2] = {&in, &zero};
    detail::reduce_into(DType::BF16, ReduceOp::Sum, 2, srcs, &out, 1);
    EXPECT_EQ(out.bits, float_to_bf16(bf16_to_float(in) + 0.0f).bits) << v;
  }
  // 256 + 1 + 1 + 1 = 259 -> 260 when rounded once; 256 if rounded after every addition.
  std::vector<bf16> a(1000, float_to_bf16(256.0f)), b(1000, float_to_bf16(1.0f)), out(1000);
  const void* srcs[4] = {a.data(), b.data(), b.data(), b.data()};
  detail::reduce_into(DType::BF16, ReduceOp::Sum, 4, srcs, out.data(), 1000);
  for (auto x : out) ASSERT_EQ(bf16_to_float(x), 260.0f);
  detail::reduce_into(DType::BF16, ReduceOp::Avg, 4, srcs, out.data(), 1000);
  for (auto x : out) ASSERT_EQ(bf16_to_float(x), round_to_bf16(259.0f / 4));
}

TEST(Reduce, F32InRankOrderAvgMaxAndAliasing) {
  const size_t len = 3000;  // several blocks
  std::vector<float> a(len), b(len), c(len);
  for (size_t i = 0; i < len; ++i) {
    a[i] = 0.1f * static_cast<float>(i);
    b[i] = 1e7f;
    c[i] = -1e7f;
  }
  b[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> keep = a;
  const void* srcs[3] = {a.data(), b.data(), c.data()};
  detail::reduce_into(DType::F32, ReduceOp::Sum, 3, srcs, a.data(), len);  // out aliases src 0
  for (size_t i = 0; i < len; ++i) {
    if (i == 5) {
      EXPECT_TRUE(std::isnan(a[i]));
      continue;
    }
    float want = keep[i];
    want += 1e7f;
    want += -1e7f;
    ASSERT_EQ(a[i], want) << i;  // (a + b) + c, not a + (b + c)
  }
  a = keep;
  detail::reduce_into(DType::F32, ReduceOp::Max, 3, srcs, c.data(), len);
  EXPECT_TRUE(std::isnan(c[5]));
  EXPECT_EQ(c[0], 1e7f);
  a = keep;
  b.assign(len, 2.0f);
  const void* two[2] = {a.data(), b.data()};
  std::vector<float> out(len);
  detail::reduce_into(DType::F32, ReduceOp::Avg, 2, two, out.data(), len);
  EXPECT_EQ(out[10], (keep[10] + 2.0f) / 2.0f);
}

// Integers reduce in their own type: exact where an fp32 (or fp64) accumulator rounds, wrapping
// around on overflow; they do not average, and do not mix with another type.
TEST(Reduce, IntegersAreExactInTheirOwnType) {
  const int64_t big = (int64_t{1} << 60) + 1;  // above 2^53: a double keeps it only to 256
  std::vector<int64_t> a = {big, -5, 7, INT64_MAX}, b = {1, -3, 9, 1}, c = {1, -4, 8, 0};
  const void* srcs[3] = {a.data(), b.data(), c.data()};
  std::vector<int64_t> out(4);
  detail::reduce_into(DType::I64, ReduceOp::Sum, 3, srcs, out.data(), 4);
  EXPECT_EQ(out[0], big + 2);
  EXPECT_EQ(out[1], -12);
  EXPECT_EQ(out[2], 24);
  EXPECT_EQ(out[3], INT64_MIN);  // wraps around
  detail::reduce_into(DType::I64, ReduceOp::Max, 3, srcs, a.data(), 4);  // out aliases src 0
  EXPECT_EQ(a, (std::vector<int64_t>{big, -3, 9, INT64_MAX}));
  // i32, several blocks, in rank order.
  const size_t len = 3000;
  std::vector<int32_t> x(len), y(len), z(len);
  for (size_t i = 0; i < len; ++i) {
    x[i] = (1 << 24) + 1 + static_cast<int32_t>(i);  // fp32 rounds these sums
    y[i] = -static_cast<int32_t>(i % 17);
    z[i] = 3;
  }
  const void* s32[3] = {x.data(), y.data(), z.data()};
  std::vector<int32_t> o32(len);
  detail::reduce_into(DType::I32, ReduceOp::Sum, 3, s32, o32.data(), len);
  for (size_t i = 0; i < len; ++i) ASSERT_EQ(o32[i], x[i] + y[i] + 3) << i;
  detail::reduce_into(DType::I32, ReduceOp::Max, 3, s32, o32.data(), len);
  for (size_t i = 0; i < len; ++i) ASSERT_EQ(o32[i], x[i]) << i;
  EXPECT_THROW(detail::reduce_into(DType::I32, ReduceOp::Avg, 3, s32, o32.data(), len), std::logic_error);
  EXPECT_THROW(detail::reduce_mixed(DType::I32, DType::F32, ReduceOp::Sum, 3, s32, o32.data(), len, 1),
               std::logic_error);
  EXPECT_EQ(detail::partial_dtype(DType::BF16), DType::F32);
  EXPECT_EQ(detail::partial_dtype(DType::I64), DType::I64);
}

// The Meta backend (the dry run) leaves host buffers as if every rank had passed this rank's
// values: a sum multiplies by the group size, in the buffer's own type.
TEST(MetaBackend, HostSumsScaleByTheGroupSizeInTheirType) {
  detail::MetaBackend meta(1, 4);
  auto run = [&](DType dt, ReduceOp op, void* buf, size_t count) {
    detail::Op o;
    o.d.kind = OpKind::AllReduce;
    o.d.dt = dt;
    o.d.op = op;
    o.d.count = count;
    o.rbuf = buf;
    meta.run(o);
  };
  std::vector<int64_t> l = {(int64_t{1} << 53) + 1, -3};
  run(DType::I64, ReduceOp::Sum, l.data(), l.size());
  EXPECT_EQ(l, (std::vector<int64_t>{(int64_t{1} << 55) + 4, -12}));
  std::vector<int32_t> i = {7, -1};
  run(DType::I32, ReduceOp::Sum, i.data(), i.size());
  EXPECT_EQ(i, (std::vector<int32_t>{28, -4}));
  run(DType::I32, ReduceOp::Max, i.data(), i.size());
  EXPECT_EQ(i, (std::vector<int32_t>{28, -4}));
  std::vector<float> f = {0.5f};
  run(DType::F32, ReduceOp::Sum, f.data(), f.size());
  EXPECT_EQ(f[0], 2.0f);
  meta.shutdown();
}

TEST(Describe, Formats) {
  detail::OpDesc d;
  d.kind = OpKind::AllGather;
  d.dt = DType::BF16;
  d.count = 1024;
  EXPECT_EQ(detail::describe(d, false), "all_gather(bf16, 1024)");
  d.kind = OpKind::AllReduce;
  d.dt = DType::F32;
  d.count = 4096;
  d.op = ReduceOp::Avg;
  EXPECT_EQ(detail::describe(d, false), "all_reduce(f32, 4096)");
  EXPECT_EQ(detail::describe(d, true), "all_reduce(f32, 4096, avg)");
  d.kind = OpKind::Send;
  d.peer = 1;
  d.tag = 7;
  std::vector<int> granks = {4, 6};
  EXPECT_EQ(detail::describe(d, false, &granks), "send(f32, 4096) to rank 6 tag 7");
  d.kind = OpKind::Barrier;
  EXPECT_EQ(detail::describe(d, false), "barrier()");
}

TEST(SingleProcess, WorldOfOneCompletesEverythingAtOnce) {
  int argc = 1;
  char arg0[] = "comm_unit_test";
  char* args[] = {arg0, nullptr};
  char** argv = args;
  World& w = World::init(&argc, &argv);
  EXPECT_FALSE(w.uses_mpi());
  EXPECT_EQ(w.size(), 1);
  EXPECT_EQ(w.rank(), 0);
  auto g = w.world();
  EXPECT_EQ(g->size(), 1);
  std::vector<float> x = {1, 2, 3}, y(3);
  auto h = g->all_reduce(x.data(), 3, DType::F32, ReduceOp::Avg);
  EXPECT_TRUE(h->test());
  h->wait();
  EXPECT_EQ(x, (std::vector<float>{1, 2, 3}));
  g->reduce_scatter(x.data(), y.data(), 3, DType::F32)->wait();
  EXPECT_EQ(y, x);
  y.assign(3, 0);
  g->all_gather(x.data(), y.data(), 3, DType::F32)->wait();
  EXPECT_EQ(y, x);
  g->broadcast(x.data(), 3, DType::F32, 0)->wait();
  g->barrier()->wait();
  // Self send/recv, in either order, matched by tag.
  std::vector<float> r1(3), r2(3);
  auto s1 = g->send(x.data(), 3, DType::F32, 0, 5);
  EXPECT_FALSE(s1->test());
  auto rr2 = g->recv(r2.data(), 3, DType::F32, 0, 6);
  auto rr1 = g->recv(r1.data(), 3, DType::F32, 0, 5);
  EXPECT_TRUE(s1->test());
  EXPECT_TRUE(rr1->test());
  EXPECT_FALSE(rr2->test());
  auto s2 = g->send(y.data(), 3, DType::F32, 0, 6);
  wait_all({s1, s2, rr1, rr2});
  EXPECT_EQ(r1, x);
  EXPECT_EQ(r2, y);
  EXPECT_THROW(g->broadcast(x.data(), 3, DType::F32, 1), CommError);
  EXPECT_THROW(g->send(x.data(), 3, DType::F32, 0, -1), CommError);
  CommStats s = g->stats();
  EXPECT_EQ(s[OpKind::AllReduce].calls, 1u);
  EXPECT_EQ(s[OpKind::Send].calls, 2u);
  EXPECT_EQ(s.total_bytes(), 0u);  // nothing moves between ranks in a world of one
  EXPECT_TRUE(comm_bytes_by_group().count("world"));

  // A mesh of ones; every group has size 1 and the expected name.
  DeviceMesh mesh(w, {{"pp", 1}, {"dp_replicate", 1}, {"dp_shard", -1}, {"tp", 1}});
  EXPECT_EQ(mesh.size("dp_shard"), 1);
  EXPECT_EQ(mesh.group("dp")->name(), "dp");
  EXPECT_EQ(mesh.group(std::vector<std::string>{"dp_shard", "dp_replicate"})->name(), "dp");
  EXPECT_EQ(mesh.group(std::vector<std::string>{"tp", "dp_shard"})->name(), "dp_shard+tp");
  EXPECT_EQ(mesh.group(std::vector<std::string>{"pp", "dp_replicate", "dp_shard", "tp"})->name(),
            "world");
  EXPECT_EQ(mesh.group("tp")->size(), 1);
  EXPECT_EQ(mesh.coord("tp"), 0);
  EXPECT_EQ(mesh.describe(), "pp=1 x dp_replicate=1 x dp_shard=1 x tp=1");
  EXPECT_THROW(mesh.group("ep"), CommError);
  EXPECT_THROW(mesh.coord("ep"), CommError);
}

TEST(MeshResolve, ValidatesAndNamesTheWrongDimension) {
  auto r = DeviceMesh::resolve({{"pp", 2}, {"dp_replicate", 1}, {"dp_shard", -1}, {"tp", 2}}, 16);
  EXPECT_EQ(r[2].second, 4);
  auto msg = [](std::vector<std::pair<std::string, int>> d, int n) -> std::string {
    try {
      DeviceMesh::resolve(std::move(d), n);
    } catch (const CommError& e) {
      return e.what();
    }
    return "";
  };
  std::string m = msg({{"pp", 1}, {"dp_replicate", 1}, {"dp_shard", 3}, {"tp", 1}}, 4);
  EXPECT_NE(m.find("has 3 ranks but the world has 4"), std::string::npos) << m;
  EXPECT_NE(m.find("'dp_shard' should be 4"), std::string::npos) << m;
  m = msg({{"pp", 1}, {"dp_shard", -1}, {"tp", 3}}, 8);
  EXPECT_NE(m.find("'dp_shard' cannot fill"), std::string::npos) << m;
  m = msg({{"dp_shard", -1}, {"tp", -1}}, 8);
  EXPECT_NE(m.find("only one dimension may be -1"), std::string::npos) << m;
  m = msg({{"tp", 0}}, 1);
  EXPECT_NE(m.find("'tp' has size 0"), std::string::npos) << m;
  m = msg({{"tp", 1}, {"tp", 1}}, 1);
  EXPECT_NE(m.find("appears twice"), std::string::npos) << m;
}

TEST(Printing, ShouldPrintFollowsLogRanks) {
  unsetenv("MESHTRAIN_LOG_RANKS");
  EXPECT_TRUE(should_print(0));
  EXPECT_FALSE(should_print(3));
  setenv("MESHTRAIN_LOG_RANKS", "all", 1);
  EXPECT_TRUE(should_print(3));
  setenv("MESHTRAIN_LOG_RANKS", "1,3", 1);
  EXPECT_TRUE(should_print(3));
  EXPECT_FALSE(should_print(2));
  EXPECT_TRUE(should_print(0));
  unsetenv("MESHTRAIN_LOG_RANKS");
}

TEST(Launch, OneMachineDefaults) {
  LaunchOptions o;
  o.nranks = 4;
  o.cores = 2;
  o.exe = "/opt/meshtrain";
  o.is_root = true;
  o.command = {"train", "--config", "a b.toml"};
  o.forward_env = {"MESHTRAIN_DEBUG"};
  LaunchPlan p = build_launch_plan(o);
  std::string line = shell_join(p.argv);
  EXPECT_NE(line.find("mpirun -np 4 --bind-to none --oversubscribe --mca mpi_yield_when_idle 1"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("-x OMP_NUM_THREADS=1"), std::string::npos) << line;
  EXPECT_NE(line.find("GLIBC_TUNABLES="), std::string::npos) << line;
  EXPECT_NE(line.find("glibc.malloc.hugetlb=1"), std::string::npos) << line;
  EXPECT_NE(line.find("-x MESHTRAIN_DEBUG"), std::string::npos) << line;
  EXPECT_NE(line.find("/opt/meshtrain train --config 'a b.toml'"), std::string::npos) << line;
  ASSERT_EQ(p.env.size(), 2u);
  EXPECT_EQ(p.env[0].first, "OMPI_ALLOW_RUN_AS_ROOT");

  o.nranks = 1;
  o.is_root = false;
  p = build_launch_plan(o);
  line = shell_join(p.argv);
  EXPECT_EQ(line.find("--oversubscribe"), std::string::npos) << line;
  EXPECT_NE(line.find("-x OMP_NUM_THREADS=2"), std::string::npos) << line;
  EXPECT_NE(line.find("--use-hwthread-cpus --map-by slot:PE=2 --bind-to hwthread:if-supported"), std::string::npos) << line;
  EXPECT_TRUE(p.env.empty());

  // The ranks' threads fit: each rank bound to its own CPUs; they do not: no binding.
  o.nranks = 2;
  p = build_launch_plan(o);
  line = shell_join(p.argv);
  EXPECT_NE(line.find("mpirun -np 2 --use-hwthread-cpus --map-by slot:PE=1 --bind-to hwthread:if-supported"), std::string::npos)
      << line;
  o.threads = 2;
  p = build_launch_plan(o);
  line = shell_join(p.argv);
  EXPECT_NE(line.find("mpirun -np 2 --bind-to none -x OMP_NUM_THREADS=2"), std::string::npos) << line;
  o.threads = 0;
  o.bind = "none";
  p = build_launch_plan(o);
  EXPECT_NE(shell_join(p.argv).find("mpirun -np 2 --bind-to none"), std::string::npos) << shell_join(p.argv);
  o.bind = "cores";
  o.extra_mpirun_args = {"--map-by", "core"};  // the user's placement wins
  p = build_launch_plan(o);
  line = shell_join(p.argv);
  EXPECT_EQ(line.find("--bind-to"), std::string::npos) << line;
  EXPECT_NE(line.find("--map-by core"), std::string::npos) << line;
  o.extra_mpirun_args.clear();

  o.hostfile = "hosts.txt";
  o.nranks = 8;
  p = build_launch_plan(o);
  line = shell_join(p.argv);
  EXPECT_NE(line.find("--hostfile hosts.txt"), std::string::npos) << line;
  EXPECT_EQ(line.find("--oversubscribe"), std::string::npos) << line;
}

TEST(Launch, CommandLineErrorsAndDryRun) {
  auto run = [](std::vector<std::string> a) {
    std::vector<char*> v;
    for (auto& s : a) v.push_back(s.data());
    return mt::cli::run_launch_command(static_cast<int>(v.size()), v.data());
  };
  EXPECT_EQ(run({"launch", "--", "train"}), 2);           // no -n
  EXPECT_EQ(run({"launch", "-n", "2"}), 2);               // no subcommand
  EXPECT_EQ(run({"launch", "-n", "2", "--bogus", "--", "x"}), 2);
  EXPECT_EQ(run({"launch", "-n", "2", "--dry-run", "--", "bench", "comm"}), 0);
  EXPECT_EQ(run({"launch", "--help"}), 0);
}

TEST(BenchCommand, HelpAndErrors) {
  auto run = [](std::vector<std::string> a) {
    std::vector<char*> v;
    for (auto& s : a) v.push_back(s.data());
    return mt::cli::run_bench_comm_command(static_cast<int>(v.size()), v.data());
  };
  EXPECT_EQ(run({"bench", "comm", "--help"}), 0);
  EXPECT_EQ(run({"comm", "--ops", "all_to_all"}), 2);
  EXPECT_EQ(run({"comm", "--dtype", "f64"}), 2);
  EXPECT_EQ(run({"comm", "--min-bytes", "1M", "--max-bytes", "1K"}), 2);
  // A world of one rank: runs, checks the results, returns 0.
  EXPECT_EQ(run({"comm", "--max-bytes", "8K", "--iters", "2"}), 0);
}
