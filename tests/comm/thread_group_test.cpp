// The thread backend: every operation of a group whose ranks are threads of this process against a
// sequential reference, its accounting, and the front end's desync check on it (a desync is a fatal
// job error, as on MPI: it ends the process, so that test runs in a child process).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/process_group.h"

namespace mt::comm {
namespace {

// Runs f(rank) on n threads.
void on_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back(f, r);
  for (auto& t : ts) t.join();
}

float value(int rank, size_t i) { return static_cast<float>(rank + 1) * 0.25f + static_cast<float>(i % 7); }

TEST(ThreadGroup, CollectivesMatchASequentialReference) {
  for (int n : {1, 2, 3, 4}) {
    auto g = make_thread_group("t" + std::to_string(n), n);
    const size_t count = 1000;
    on_ranks(n, [&](int r) {
      std::vector<float> x(count), sum(count), mx(count);
      for (size_t i = 0; i < count; ++i) x[i] = value(r, i);
      for (size_t i = 0; i < count; ++i) {
        float s = 0, m = value(0, i);
        for (int q = 0; q < n; ++q) {
          s += value(q, i);
          m = std::max(m, value(q, i));
        }
        sum[i] = s;
        mx[i] = m;
      }
      std::vector<float> a = x;
      g[r]->all_reduce(a.data(), count, DType::F32)->wait();
      EXPECT_EQ(a, sum) << "all_reduce sum, n " << n;
      a = x;
      g[r]->all_reduce(a.data(), count, DType::F32, ReduceOp::Max)->wait();
      EXPECT_EQ(a, mx);
      // reduce_scatter: rank r gets the sum of segment r
      std::vector<float> full(count * static_cast<size_t>(n)), seg(count);
      for (size_t i = 0; i < full.size(); ++i) full[i] = value(r, i);
      g[r]->reduce_scatter(full.data(), seg.data(), count, DType::F32)->wait();
      for (size_t i = 0; i < count; ++i) {
        float s = 0;
        for (int q = 0; q < n; ++q) s += value(q, static_cast<size_t>(r) * count + i);
        ASSERT_EQ(seg[i], s);
      }
      // all_gather in place
      std::vector<float> all(count * static_cast<size_t>(n), -1.0f);
      for (size_t i = 0; i < count; ++i) all[static_cast<size_t>(r) * count + i] = value(r, i);
      g[r]->all_gather(all.data() + static_cast<size_t>(r) * count, all.data(), count, DType::F32)->wait();
      for (int q = 0; q < n; ++q) ASSERT_EQ(all[static_cast<size_t>(q) * count + 5], value(q, 5));
      // broadcast from the last rank
      std::vector<float> b(8, static_cast<float>(r));
      g[r]->broadcast(b.data(), b.size(), DType::F32, n - 1)->wait();
      EXPECT_EQ(b[3], static_cast<float>(n - 1));
      // a ring of sends, received before they are sent on some ranks
      std::vector<float> out(4, static_cast<float>(r)), in(4, -1.0f);
      WorkHandle rv = g[r]->recv(in.data(), 4, DType::F32, (r + n - 1) % n, 7);
      WorkHandle sd = g[r]->send(out.data(), 4, DType::F32, (r + 1) % n, 7);
      wait_all({rv, sd});
      EXPECT_EQ(in[0], static_cast<float>((r + n - 1) % n));
      g[r]->barrier()->wait();
      // accounting: the same algorithm volume as the MPI backend
      const CommStats s = g[r]->stats();
      EXPECT_EQ(s[OpKind::AllReduce].calls, 2u);
      EXPECT_EQ(s[OpKind::AllReduce].bytes, n > 1 ? 2u * 2 * (n - 1) * count * 4 / n : 0u);
      EXPECT_EQ(s[OpKind::AllGather].bytes, static_cast<uint64_t>(n - 1) * count * 4);
    });
  }
}

// i32 and i64 through every collective of thread groups of 1..4 ranks: sums and maxima exact in
// their own type (an i64 above 2^53 keeps every bit), gathers and broadcasts copy, and averaging
// integers is refused with an error that names the type.
TEST(ThreadGroup, IntegerCollectivesAreExact) {
  const int64_t big = (int64_t{1} << 60) + 1;
  for (int n : {1, 2, 3, 4}) {
    auto g = make_thread_group("i" + std::to_string(n), n);
    on_ranks(n, [&](int r) {
      // all_reduce: rank 0 contributes 2^60 + 1, every other rank 1 and its rank.
      std::vector<int64_t> l = {r == 0 ? big : 1, -r, 1000 * r};
      g[r]->all_reduce(l.data(), l.size(), DType::I64)->wait();
      EXPECT_EQ(l[0], big + (n - 1)) << "n " << n;
      EXPECT_EQ(l[1], -n * (n - 1) / 2);
      std::vector<int32_t> m = {r, -r, (1 << 24) + 1 + r};
      g[r]->all_reduce(m.data(), m.size(), DType::I32, ReduceOp::Max)->wait();
      EXPECT_EQ(m, (std::vector<int32_t>{n - 1, 0, (1 << 24) + n}));
      // reduce_scatter: segment r of every rank's [q * 10 + i] summed.
      std::vector<int64_t> full(2 * static_cast<size_t>(n)), seg(2);
      for (size_t i = 0; i < full.size(); ++i) full[i] = big * (r == 0) + static_cast<int64_t>(i);
      g[r]->reduce_scatter(full.data(), seg.data(), 2, DType::I64)->wait();
      EXPECT_EQ(seg[0], big + n * (2 * r));
      EXPECT_EQ(seg[1], big + n * (2 * r + 1));
      // all_gather in place and broadcast from the last rank.
      std::vector<int32_t> all(2 * static_cast<size_t>(n), -1);
      all[2 * static_cast<size_t>(r)] = 7 * r;
      all[2 * static_cast<size_t>(r) + 1] = -7 * r;
      g[r]->all_gather(all.data() + 2 * r, all.data(), 2, DType::I32)->wait();
      for (int q = 0; q < n; ++q) EXPECT_EQ(all[2 * static_cast<size_t>(q) + 1], -7 * q);
      std::vector<int64_t> b = {big + r, r};
      g[r]->broadcast(b.data(), b.size(), DType::I64, n - 1)->wait();
      EXPECT_EQ(b, (std::vector<int64_t>{big + n - 1, n - 1}));
      try {
        g[r]->all_reduce(l.data(), l.size(), DType::I64, ReduceOp::Avg);
        ADD_FAILURE() << "an average of i64 values";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("cannot average i64"), std::string::npos) << e.what();
      }
      // accounting by element size: 8 bytes an i64
      const CommStats s = g[r]->stats();
      EXPECT_EQ(s[OpKind::Broadcast].bytes, n > 1 ? 2u * 8 : 0u);
    });
  }
}

TEST(ThreadGroup, Bf16SumsAccumulateInFp32AndRoundOnce) {
  auto g = make_thread_group("bf", 3);
  on_ranks(3, [&](int r) {
    std::vector<bf16> x(16, float_to_bf16(1.0f + 1.0f / 256.0f * static_cast<float>(r)));
    g[r]->all_reduce(x.data(), x.size(), DType::BF16)->wait();
    const float want = round_to_bf16(round_to_bf16(1.0f) + round_to_bf16(1.0f + 1.0f / 256) + round_to_bf16(1.0f + 2.0f / 256));
    EXPECT_EQ(bf16_to_float(x[0]), want);
  });
}

}  // namespace
}  // namespace mt::comm

namespace mt::comm {
namespace {

// Variable-size all-to-all: rank r sends (q + 1) x (r + 1) elements to rank q, none to itself on
// odd ranks; every element names its sender, receiver and index.
TEST(ThreadGroup, AllToAllVDeliversEveryRanksPart) {
  for (int n : {1, 2, 3, 4}) {
    auto g = make_thread_group("a2a" + std::to_string(n), n);
    on_ranks(n, [&](int r) {
      auto cnt = [](int from, int to) { return from % 2 == 1 && from == to ? size_t{0} : size_t(to + 1) * size_t(from + 1); };
      std::vector<size_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
      std::vector<float> send, want;
      for (int q = 0; q < n; ++q) {
        sc[q] = cnt(r, q);
        rc[q] = cnt(q, r);
        for (size_t i = 0; i < sc[q]; ++i) send.push_back(static_cast<float>(r * 10000 + q * 100) + static_cast<float>(i));
        for (size_t i = 0; i < rc[q]; ++i) want.push_back(static_cast<float>(q * 10000 + r * 100) + static_cast<float>(i));
      }
      std::vector<float> recv(want.size(), -1.0f);
      g[r]->all_to_all_v(send.data(), sc.data(), recv.data(), rc.data(), DType::F32)->wait();
      EXPECT_EQ(recv, want) << "n " << n << " rank " << r;
      uint64_t sent = 0;
      for (int q = 0; q < n; ++q)
        if (q != r) sent += sc[q] * 4;
      const CommStats s = g[r]->stats();
      EXPECT_EQ(s[OpKind::AllToAllV].calls, 1u);
      EXPECT_EQ(s[OpKind::AllToAllV].bytes, n > 1 ? sent : 0u);
    });
  }
}

// The desync check is the front end's, so the thread backend reports a mismatched collective with
// the MPI backend's message (tests/comm/comm_fail_test.cpp, Job.DesyncIsNamedOnEveryRank, runs the
// same calls over MPI), before any data moves. It ends the job, so it runs in a child process.
TEST(ThreadGroupDeathTest, MismatchedCollectiveIsNamedAsOnMpi) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto g = make_thread_group("dp", 4);
        std::vector<std::string> caught(4);
        on_ranks(4, [&](int r) {
          std::vector<float> a(4096, 1.0f);
          std::vector<bf16> b(1024 * 4);
          try {
            for (int i = 0; i < 3; ++i) g[r]->all_reduce(a.data(), a.size(), DType::F32)->wait();
            if (r == 2) g[r]->all_gather(b.data(), b.data(), 1024, DType::BF16)->wait();
            else g[r]->all_reduce(a.data(), a.size(), DType::F32)->wait();
          } catch (const CommError& e) {
            caught[static_cast<size_t>(r)] = e.what();
          }
        });
        bool all_failed = true;
        for (int r = 0; r < 4; ++r) {
          std::fprintf(stderr, "rank %d caught: %s\n", r, caught[static_cast<size_t>(r)].c_str());
          all_failed = all_failed && !caught[static_cast<size_t>(r)].empty();
        }
        std::fflush(stderr);
        std::_Exit(all_failed ? 3 : 4);
      },
      ::testing::ExitedWithCode(3),
      "rank 3 caught: collective desync: rank 2 called all_gather\\(bf16, 1024\\) as collective #4 of group dp "
      "while rank 0 called all_reduce\\(f32, 4096\\)");
}

}  // namespace
}  // namespace mt::comm
