// Multi-rank tests of the process groups and the device mesh, run under mpirun with 2, 3 and 4
// ranks. Every result is compared with a sequentially computed reference (bit for bit: reductions
// run in rank order with an fp32 accumulator, like the reference loops here; integers exactly).
#include <gtest/gtest.h>
#include "comm/mpi_include.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/comm.h"
#include "comm/detail.h"
#include "runtime/clock.h"  // ms_since

using namespace mt;
using namespace mt::comm;

namespace {

World* g_world = nullptr;

// Deterministic, non-integer input of `rank` at index i (already representable in `dt`). Only
// correctly rounded operations (no libm, whose vector and scalar versions may differ).
// noinline: keeps the compiler from fusing the reference's additions with this multiply (FMA).
__attribute__((noinline)) float input(int rank, size_t i, DType dt) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u + static_cast<uint32_t>(rank) * 40503u;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  float v = static_cast<float>(static_cast<int>(h % 200001u) - 100000) * 1.37e-3f;
  return dt == DType::BF16 ? round_to_bf16(v) : v;
}

void fill(void* buf, size_t count, DType dt, int rank, size_t offset = 0) {
  for (size_t i = 0; i < count; ++i) {
    float v = input(rank, i + offset, dt);
    if (dt == DType::F32)
      static_cast<float*>(buf)[i] = v;
    else
      static_cast<bf16*>(buf)[i] = float_to_bf16(v);
  }
}

float get(const void* buf, size_t i, DType dt) {
  return dt == DType::F32 ? static_cast<const float*>(buf)[i]
                          : bf16_to_float(static_cast<const bf16*>(buf)[i]);
}

// Sequential reference of element i reduced over ranks 0..n-1 (inputs at index i + offset).
float reference(ReduceOp op, int n, size_t idx, DType dt) {
  float acc = input(0, idx, dt);
  for (int q = 1; q < n; ++q) {
    float x = input(q, idx, dt);
    if (op == ReduceOp::Max)
      acc = x > acc ? x : acc;
    else
      acc += x;
  }
  if (op == ReduceOp::Avg) acc /= static_cast<float>(n);
  return dt == DType::BF16 ? round_to_bf16(acc) : acc;
}

bool bits_equal(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

struct Buf {
  std::vector<char> v;
  Buf(size_t count, DType dt) : v(std::max<size_t>(count, 1) * dtype_size(dt)) {}
  void* p() { return v.data(); }
};

const std::vector<size_t> kCounts = {0, 1, 3, 7, 1000, 4097, 100003};

}  // namespace

TEST(ProcessGroup, Basics) {
  auto w = g_world->world();
  EXPECT_EQ(w->size(), g_world->size());
  EXPECT_EQ(w->rank(), g_world->rank());
  EXPECT_EQ(w->name(), "world");
  auto gr = w->global_ranks();
  ASSERT_EQ(static_cast<int>(gr.size()), w->size());
  for (int i = 0; i < w->size(); ++i) EXPECT_EQ(gr[i], i);
  EXPECT_GE(g_world->local_size(), 1);
  EXPECT_EQ(g_world->num_nodes(), 1);
}

TEST(ProcessGroup, AllReduceEveryDtypeOpAndCount) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      for (size_t count : kCounts) {
        Buf b(count, dt);
        fill(b.p(), count, dt, r);
        w->all_reduce(b.p(), count, dt, op)->wait();
        size_t bad = 0;
        for (size_t i = 0; i < count; ++i) {
          if (!bits_equal(get(b.p(), i, dt), reference(op, n, i, dt)) && bad++ < 3)
            ADD_FAILURE() << dtype_name(dt) << " " << reduce_op_name(op) << " count " << count
                          << " [" << i << "] = " << get(b.p(), i, dt) << " want "
                          << reference(op, n, i, dt);
        }
        EXPECT_EQ(bad, 0u);
      }
    }
  }
}

// Small slices and no one-shot path: every reduction runs in many pipelined pieces, and tiny
// counts (fewer elements than ranks: empty segments) go through the two-step algorithm.
TEST(ProcessGroup, AllReduceAndReduceScatterInSmallSlices) {
  setenv("MESHTRAIN_COMM_SLICE_KB", "4", 1);
  setenv("MESHTRAIN_COMM_ONESHOT_KB", "0", 1);
  detail::reload_config();
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (size_t count : {size_t(1), size_t(2), size_t(3), size_t(5), size_t(50001)}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
        Buf b(count, dt);
        fill(b.p(), count, dt, r);
        w->all_reduce(b.p(), count, dt, op)->wait();
        for (size_t i = 0; i < count; ++i)
          ASSERT_TRUE(bits_equal(get(b.p(), i, dt), reference(op, n, i, dt)))
              << i << " got " << get(b.p(), i, dt) << " want " << reference(op, n, i, dt);
      }
    }
    const size_t rc = 7001;
    Buf s(rc * n, dt), out(rc, dt);
    fill(s.p(), rc * n, dt, r);
    w->reduce_scatter(s.p(), out.p(), rc, dt, ReduceOp::Avg)->wait();
    for (size_t i = 0; i < rc; ++i)
      ASSERT_TRUE(bits_equal(get(out.p(), i, dt), reference(ReduceOp::Avg, n, r * rc + i, dt)));
  }
  unsetenv("MESHTRAIN_COMM_SLICE_KB");
  unsetenv("MESHTRAIN_COMM_ONESHOT_KB");
  detail::reload_config();
}

// The two-level all_reduce of groups spanning several nodes, on pretend nodes of 2 ranks: the
// sum is grouped per node ((x0 + x1) + (x2 + x3)) in fp32, rounded once.
TEST(ProcessGroup, TwoLevelAllReduceOnPretendNodes) {
  const int n = g_world->size(), r = g_world->rank();
  if (n != 4) GTEST_SKIP() << "needs 4 ranks";
  setenv("MESHTRAIN_COMM_FAKE_NODE_SIZE", "2", 1);
  setenv("MESHTRAIN_COMM_ONESHOT_KB", "0", 1);
  detail::reload_config();
  auto g = g_world->split(0, r, "two_level");
  auto* mpi = dynamic_cast<detail::MpiBackend*>(g->impl().backend.get());
  ASSERT_NE(mpi, nullptr);
  ASSERT_TRUE(mpi->hier);
  EXPECT_EQ(mpi->local_n, 2);
  EXPECT_EQ(mpi->nodes_n, 2);
  auto grouped = [&](ReduceOp op, size_t i, DType dt) {
    float a = input(0, i, dt), b = input(1, i, dt), c = input(2, i, dt), d = input(3, i, dt);
    float acc;
    if (op == ReduceOp::Max) {
      float m0 = b > a ? b : a, m1 = d > c ? d : c;
      acc = m1 > m0 ? m1 : m0;
    } else {
      float p0 = a, p1 = c;
      p0 += b;
      p1 += d;
      acc = p0;
      acc += p1;
      if (op == ReduceOp::Avg) acc /= 4.0f;
    }
    return dt == DType::BF16 ? round_to_bf16(acc) : acc;
  };
  for (const char* slice : {"16384", "4"}) {
    setenv("MESHTRAIN_COMM_SLICE_KB", slice, 1);
    detail::reload_config();
    for (DType dt : {DType::F32, DType::BF16}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        for (size_t count : {size_t(1), size_t(3), size_t(7), size_t(1000), size_t(100003)}) {
          Buf b(count, dt);
          fill(b.p(), count, dt, r);
          g->all_reduce(b.p(), count, dt, op)->wait();
          for (size_t i = 0; i < count; ++i)
            ASSERT_TRUE(bits_equal(get(b.p(), i, dt), grouped(op, i, dt)))
                << dtype_name(dt) << " " << reduce_op_name(op) << " count " << count << " [" << i
                << "] = " << get(b.p(), i, dt) << " want " << grouped(op, i, dt);
        }
      }
    }
  }
  // bf16: 256 + 1 + 1 + 1 rounds once (to 260), also across the two levels.
  std::vector<bf16> v(64, float_to_bf16(r == 0 ? 256.0f : 1.0f));
  g->all_reduce(v.data(), v.size(), DType::BF16, ReduceOp::Sum)->wait();
  for (auto x : v) EXPECT_EQ(bf16_to_float(x), 260.0f);
  unsetenv("MESHTRAIN_COMM_FAKE_NODE_SIZE");
  unsetenv("MESHTRAIN_COMM_ONESHOT_KB");
  unsetenv("MESHTRAIN_COMM_SLICE_KB");
  detail::reload_config();
}

// The point of fp32 accumulation: 256 + 1 + 1 + ... rounded once, not at every addition.
TEST(ProcessGroup, Bf16SumAccumulatesInFp32) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  std::vector<bf16> v(64, float_to_bf16(r == 0 ? 256.0f : 1.0f));
  w->all_reduce(v.data(), v.size(), DType::BF16, ReduceOp::Sum)->wait();
  float want = round_to_bf16(256.0f + static_cast<float>(n - 1));
  for (auto x : v) EXPECT_EQ(bf16_to_float(x), want);
}

// i32 and i64: sums and maxima are exact in their own type on every algorithm (one-shot,
// pipelined slices, the two-level all_reduce on pretend nodes of 2 ranks, reduce_scatter), gathers
// and broadcasts deliver every rank's values, and an average of integers is refused.
TEST(ProcessGroup, IntegerDtypesEveryCollectiveExactly) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  // Above 2^53 for i64 (a float or double accumulator loses the low bits), signed.
  auto value = [](int rank, size_t i, DType dt) -> int64_t {
    const int64_t h = static_cast<int64_t>((i * 2654435761u + static_cast<size_t>(rank) * 40503u) % 200001u) - 100000;
    return dt == DType::I64 ? (int64_t{1} << 58) + h * 1000003 + rank : h;
  };
  auto put = [](void* buf, size_t i, DType dt, int64_t v) {
    if (dt == DType::I64)
      static_cast<int64_t*>(buf)[i] = v;
    else
      static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v);
  };
  auto at = [](const void* buf, size_t i, DType dt) -> int64_t {
    return dt == DType::I64 ? static_cast<const int64_t*>(buf)[i] : static_cast<const int32_t*>(buf)[i];
  };
  auto want = [&](ReduceOp op, int ranks, size_t i, DType dt) {
    int64_t acc = value(0, i, dt);
    for (int q = 1; q < ranks; ++q) acc = op == ReduceOp::Max ? std::max(acc, value(q, i, dt)) : acc + value(q, i, dt);
    return acc;
  };
  auto all_reduce_matches = [&](ProcessGroup& g, const char* how) {
    for (DType dt : {DType::I32, DType::I64})
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max})
        for (size_t count : kCounts) {
          Buf b(count, dt);
          for (size_t i = 0; i < count; ++i) put(b.p(), i, dt, value(g.rank(), i, dt));
          g.all_reduce(b.p(), count, dt, op)->wait();
          for (size_t i = 0; i < count; ++i)
            ASSERT_EQ(at(b.p(), i, dt), want(op, g.size(), i, dt))
                << how << " " << dtype_name(dt) << " " << reduce_op_name(op) << " count " << count << " [" << i << "]";
        }
  };
  all_reduce_matches(*w, "one-shot and ring");
  setenv("MESHTRAIN_COMM_SLICE_KB", "4", 1);
  setenv("MESHTRAIN_COMM_ONESHOT_KB", "0", 1);
  detail::reload_config();
  all_reduce_matches(*w, "4 KB slices");
  if (n == 4) {
    setenv("MESHTRAIN_COMM_FAKE_NODE_SIZE", "2", 1);
    detail::reload_config();
    auto g = g_world->split(0, r, "two_level_int");
    ASSERT_TRUE(dynamic_cast<detail::MpiBackend*>(g->impl().backend.get())->hier);
    all_reduce_matches(*g, "two-level");
    unsetenv("MESHTRAIN_COMM_FAKE_NODE_SIZE");
  }
  unsetenv("MESHTRAIN_COMM_SLICE_KB");
  unsetenv("MESHTRAIN_COMM_ONESHOT_KB");
  detail::reload_config();

  for (DType dt : {DType::I32, DType::I64}) {
    for (size_t c : {size_t(0), size_t(1), size_t(5), size_t(1000), size_t(33333)}) {
      Buf s(c * n, dt), out(c, dt), all(c * n, dt);
      for (size_t i = 0; i < c * n; ++i) put(s.p(), i, dt, value(r, i, dt));
      w->reduce_scatter(s.p(), out.p(), c, dt, ReduceOp::Sum)->wait();
      for (size_t i = 0; i < c; ++i) ASSERT_EQ(at(out.p(), i, dt), want(ReduceOp::Sum, n, r * c + i, dt)) << c;
      w->all_gather(out.p(), all.p(), c, dt)->wait();
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < c; ++i) ASSERT_EQ(at(all.p(), q * c + i, dt), want(ReduceOp::Sum, n, q * c + i, dt));
    }
    for (int root = 0; root < n; ++root) {
      Buf b(777, dt);
      for (size_t i = 0; i < 777; ++i) put(b.p(), i, dt, value(r, i, dt));
      w->broadcast(b.p(), 777, dt, root)->wait();
      for (size_t i = 0; i < 777; ++i) ASSERT_EQ(at(b.p(), i, dt), value(root, i, dt)) << "root " << root;
    }
    Buf b(3, dt);
    EXPECT_THROW(w->all_reduce(b.p(), 3, dt, ReduceOp::Avg), CommError);
  }
  // The sum of 2^60 + 1 and n - 1 ones is 2^60 + n: every bit of an i64 survives.
  int64_t x = r == 0 ? (int64_t{1} << 60) + 1 : 1;
  w->all_reduce(&x, 1, DType::I64)->wait();
  EXPECT_EQ(x, (int64_t{1} << 60) + n);
}

TEST(ProcessGroup, ReduceScatter) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      for (size_t rc : {size_t(0), size_t(1), size_t(5), size_t(1000), size_t(33333)}) {
        Buf s(rc * n, dt), out(rc, dt);
        fill(s.p(), rc * n, dt, r);
        w->reduce_scatter(s.p(), out.p(), rc, dt, op)->wait();
        for (size_t i = 0; i < rc; ++i)
          ASSERT_TRUE(bits_equal(get(out.p(), i, dt), reference(op, n, r * rc + i, dt)))
              << dtype_name(dt) << " " << reduce_op_name(op) << " rc " << rc << " i " << i;
        // In place: the result lands in this rank's segment of the input.
        fill(s.p(), rc * n, dt, r);
        char* own = static_cast<char*>(s.p()) + r * rc * dtype_size(dt);
        w->reduce_scatter(s.p(), own, rc, dt, op)->wait();
        for (size_t i = 0; i < rc; ++i)
          ASSERT_TRUE(bits_equal(get(own, i, dt), reference(op, n, r * rc + i, dt)));
      }
    }
  }
}

TEST(ProcessGroup, AllGather) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (size_t sc : {size_t(0), size_t(1), size_t(3), size_t(1000), size_t(65537)}) {
      Buf s(sc, dt), out(sc * n, dt);
      fill(s.p(), sc, dt, r, r * sc);
      w->all_gather(s.p(), out.p(), sc, dt)->wait();
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < sc; ++i)
          ASSERT_EQ(get(out.p(), q * sc + i, dt), input(q, q * sc + i, dt));
      // In place.
      Buf io(sc * n, dt);
      char* own = static_cast<char*>(io.p()) + r * sc * dtype_size(dt);
      fill(own, sc, dt, r, r * sc);
      w->all_gather(own, io.p(), sc, dt)->wait();
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < sc; ++i)
          ASSERT_EQ(get(io.p(), q * sc + i, dt), input(q, q * sc + i, dt));
    }
  }
}

TEST(ProcessGroup, BroadcastFromEveryRoot) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (int root = 0; root < n; ++root) {
      for (size_t count : {size_t(1), size_t(777), size_t(300001)}) {
        Buf b(count, dt);
        if (r == root)
          fill(b.p(), count, dt, root);
        else
          std::memset(b.p(), 0, b.v.size());
        w->broadcast(b.p(), count, dt, root)->wait();
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(get(b.p(), i, dt), input(root, i, dt));
      }
    }
  }
}

TEST(ProcessGroup, SendRecvBothWaysAtOnce) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (size_t count : {size_t(1), size_t(5000), size_t(2000000)}) {
    // Everyone sends first, then receives: must not deadlock (p2p ops run concurrently).
    Buf out1(count, DType::F32), out2(count, DType::F32), in1(count, DType::F32),
        in2(count, DType::F32);
    fill(out1.p(), count, DType::F32, r, 0);
    fill(out2.p(), count, DType::F32, r, 17);
    auto s1 = w->send(out1.p(), count, DType::F32, next, 1);
    auto s2 = w->send(out2.p(), count, DType::F32, prev, 2);
    auto r1 = w->recv(in1.p(), count, DType::F32, prev, 1);
    auto r2 = w->recv(in2.p(), count, DType::F32, next, 2);
    wait_all({s1, s2, r1, r2});
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(get(in1.p(), i, DType::F32), input(prev, i, DType::F32));
      ASSERT_EQ(get(in2.p(), i, DType::F32), input(next, i + 17, DType::F32));
    }
  }
}

// A receive posted long before its data comes (as a pipeline posts them) is polled lazily while
// nobody waits for it: on one node the thread's sleeps grow to MESHTRAIN_COMM_POLL_IDLE_US (1 ms)
// instead of staying at MESHTRAIN_COMM_POLL_US (50 us), so 300 ms in flight take a few hundred
// polls, not thousands (sleeps last at least what they ask, so the bound holds on a loaded
// machine). Waiting for it then completes it with the data.
TEST(ProcessGroup, PointToPointInFlightIsPolledLazilyUntilWaitedFor) {
  auto g = g_world->split(0, g_world->rank(), "lazy_p2p");
  const int r = g->rank();
  const size_t count = 1u << 18;  // 1 MiB: large enough for the rendezvous protocol
  Buf buf(count, DType::F32);
  if (r == 0) {
    auto recv = g->recv(buf.p(), count, DType::F32, 1, 7);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the thread is past its spins
    const uint64_t p0 = g->idle_polls();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const uint64_t polls = g->idle_polls() - p0;
    EXPECT_FALSE(recv->test()) << "rank 1 sends after 500 ms";
    EXPECT_LT(polls, 600u) << "polls of a receive in flight for 300 ms that nobody waited for";
    recv->wait();
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(get(buf.p(), i, DType::F32), input(1, i, DType::F32)) << i;
  } else if (r == 1) {
    fill(buf.p(), count, DType::F32, 1, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    g->send(buf.p(), count, DType::F32, 0, 7)->wait();
  }
  g->barrier()->wait();
}

TEST(ProcessGroup, ManyOutstandingCollectivesCompleteInOrder) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  const int k = 24;
  const size_t count = 3001;
  std::vector<std::vector<float>> bufs(k, std::vector<float>(count));
  std::vector<WorkHandle> works;
  const auto t0 = std::chrono::steady_clock::now();
  for (int j = 0; j < k; ++j) {
    fill(bufs[j].data(), count, DType::F32, r, j);
    if (j % 3 == 2) works.push_back(w->barrier());
    works.push_back(w->all_reduce(bufs[j].data(), count, DType::F32, ReduceOp::Sum));
  }
  // The last one done implies all done (in-order execution).
  works.back()->wait();
  const double observed_ms = ms_since(t0);
  for (auto& h : works) EXPECT_TRUE(h->test());
  for (int j = 0; j < k; ++j)
    for (size_t i = 0; i < count; i += 101)
      ASSERT_TRUE(bits_equal(bufs[j][i], reference(ReduceOp::Sum, n, i + j, DType::F32)));
  // Each handle's accounting (queued, then running) lies inside the interval this thread watched
  // from before the first issue to the end of the last wait, on the same steady clock; an
  // operation with a peer takes some time to run.
  for (auto& h : works) {
    EXPECT_GE(h->queued_ms(), 0.0);
    EXPECT_LE(h->queued_ms() + h->elapsed_ms(), observed_ms);
    if (n > 1) {
      EXPECT_GT(h->elapsed_ms(), 0.0);
    }
  }
}

// InlineScope: a small collective on an idle group completes inside the call (it ran on this
// thread), with the same result and accounting; one issued while the group is busy, or one above
// the size limit, still goes through the communication thread; the two mix in issue order.
TEST(ProcessGroup, InlineScopeRunsSmallCollectivesOnTheCaller) {
  auto g = g_world->split(0, g_world->rank(), "inline_test");
  const int n = g->size(), r = g->rank();
  const size_t count = 4097;
  std::vector<float> a(count), big((4u << 20) / 4);
  fill(a.data(), count, DType::F32, r);
  WorkHandle w;
  {
    InlineScope in;
    w = g->all_reduce(a.data(), count, DType::F32, ReduceOp::Sum);
    EXPECT_TRUE(w->test()) << "an inline collective is complete when the call returns";
  }
  for (size_t i = 0; i < count; ++i) ASSERT_TRUE(bits_equal(a[i], reference(ReduceOp::Sum, n, i, DType::F32))) << i;
  EXPECT_GT(w->elapsed_ms(), 0.0);
  // Above MESHTRAIN_COMM_INLINE_KB (1 MiB): queued. Then small ones behind it queue too, and all
  // complete in order with the right values.
  std::vector<std::vector<float>> smalls(6, std::vector<float>(count));
  std::vector<WorkHandle> ws;
  {
    InlineScope in;
    fill(big.data(), big.size(), DType::F32, r);
    ws.push_back(g->all_reduce(big.data(), big.size(), DType::F32, ReduceOp::Sum));
    for (size_t j = 0; j < smalls.size(); ++j) {
      fill(smalls[j].data(), count, DType::F32, r, static_cast<int>(j));
      ws.push_back(g->all_reduce(smalls[j].data(), count, DType::F32, ReduceOp::Max));
    }
  }
  wait_all(ws);
  for (size_t i = 0; i < big.size(); i += 977)
    ASSERT_TRUE(bits_equal(big[i], reference(ReduceOp::Sum, n, i, DType::F32))) << i;
  for (size_t j = 0; j < smalls.size(); ++j)
    for (size_t i = 0; i < count; i += 31)
      ASSERT_TRUE(bits_equal(smalls[j][i], reference(ReduceOp::Max, n, i + j, DType::F32))) << j << " " << i;
  // Inline and queued collectives interleaved: alternate scopes, every one correct.
  for (int k = 0; k < 20; ++k) {
    fill(a.data(), count, DType::F32, r, k);
    if (k % 2) {
      InlineScope in;
      g->all_reduce(a.data(), count, DType::F32, ReduceOp::Sum)->wait();
    } else {
      g->all_reduce(a.data(), count, DType::F32, ReduceOp::Sum)->wait();
    }
    for (size_t i = 0; i < count; i += 101)
      ASSERT_TRUE(bits_equal(a[i], reference(ReduceOp::Sum, n, i + k, DType::F32))) << k << " " << i;
  }
  CommStats s = g->stats();
  EXPECT_EQ(s[OpKind::AllReduce].calls, 1u + 1u + smalls.size() + 20u);
  EXPECT_EQ(g->collectives_called(), 1u + 1u + smalls.size() + 20u);
}

TEST(ProcessGroup, StatsCountAlgorithmVolume) {
  auto g = g_world->split(0, g_world->rank(), "stats_test");
  const int n = g->size();
  std::vector<float> a(1000 * n), b(1000 * n);
  std::vector<bf16> h(512);
  g->all_reduce(a.data(), 1000, DType::F32)->wait();
  g->all_reduce(h.data(), 512, DType::BF16)->wait();
  g->reduce_scatter(a.data(), b.data(), 1000, DType::F32)->wait();
  g->all_gather(a.data(), b.data(), 1000, DType::F32)->wait();
  g->broadcast(a.data(), 100, DType::F32, 0)->wait();
  g->barrier()->wait();
  CommStats s = g->stats();
  const uint64_t un = n;
  EXPECT_EQ(s[OpKind::AllReduce].calls, 2u);
  EXPECT_EQ(s[OpKind::AllReduce].bytes, 2 * (un - 1) * 4000 / un + 2 * (un - 1) * 1024 / un);
  EXPECT_EQ(s[OpKind::ReduceScatter].bytes, (un - 1) * 4000);
  EXPECT_EQ(s[OpKind::AllGather].bytes, (un - 1) * 4000);
  EXPECT_EQ(s[OpKind::Broadcast].bytes, 400u);
  EXPECT_EQ(s[OpKind::Barrier].calls, 1u);
  EXPECT_EQ(s[OpKind::Barrier].bytes, 0u);
  EXPECT_GT(s[OpKind::AllReduce].ms, 0.0);
  EXPECT_EQ(s.total_calls(), 6u);
  auto by = comm_bytes_by_group();
  ASSERT_TRUE(by.count("stats_test"));
  EXPECT_EQ(by["stats_test"], s.total_bytes());
  EXPECT_NE(comm_summary_table().find("stats_test"), std::string::npos);
}

TEST(DeviceMesh, SubGroupsMatchCoordinates) {
  const int n = g_world->size(), r = g_world->rank();
  const int tp = n % 2 == 0 ? 2 : 1;
  DeviceMesh mesh(*g_world, {{"pp", 1}, {"dp_replicate", 1}, {"dp_shard", -1}, {"tp", tp}});
  EXPECT_EQ(mesh.size("dp_shard"), n / tp);
  EXPECT_EQ(mesh.coord("tp"), r % tp);
  EXPECT_EQ(mesh.coord("dp_shard"), r / tp);
  EXPECT_EQ(mesh.rank_at({0, 0, mesh.coord("dp_shard"), mesh.coord("tp")}), r);
  auto tpg = mesh.group("tp");
  auto dpg = mesh.group("dp");
  auto dps = mesh.group("dp_shard");
  auto all = mesh.group(std::vector<std::string>{"tp", "dp_shard", "dp_replicate", "pp"});
  EXPECT_EQ(tpg->name(), "tp");
  EXPECT_EQ(dpg->name(), "dp");
  EXPECT_EQ(all->name(), "world");
  EXPECT_EQ(tpg->size(), tp);
  EXPECT_EQ(dpg->size(), n / tp);
  EXPECT_EQ(dps->size(), n / tp);
  EXPECT_EQ(all->size(), n);
  EXPECT_EQ(mesh.group("pp")->size(), 1);
  EXPECT_EQ(tpg->rank(), mesh.coord("tp"));
  EXPECT_EQ(dpg->rank(), mesh.coord("dp_shard"));
  for (int i = 0; i < tpg->size(); ++i) EXPECT_EQ(tpg->global_ranks()[i], (r / tp) * tp + i);
  for (int i = 0; i < dpg->size(); ++i) EXPECT_EQ(dpg->global_ranks()[i], i * tp + r % tp);
  for (int i = 0; i < n; ++i) EXPECT_EQ(all->global_ranks()[i], i);

  // tp and dp collectives in flight at the same time, results per group.
  const size_t count = 200003;
  std::vector<float> a(count), b(count);
  for (size_t i = 0; i < count; ++i) {
    a[i] = static_cast<float>(r + 1);
    b[i] = static_cast<float>(10 * (r + 1));
  }
  auto h1 = tpg->all_reduce(a.data(), count, DType::F32, ReduceOp::Sum);
  auto h2 = dpg->all_reduce(b.data(), count, DType::F32, ReduceOp::Max);
  h2->wait();
  h1->wait();
  float want_tp = 0;
  for (int q : tpg->global_ranks()) want_tp += static_cast<float>(q + 1);
  float want_dp = 0;
  for (int q : dpg->global_ranks()) want_dp = std::max(want_dp, static_cast<float>(10 * (q + 1)));
  for (size_t i = 0; i < count; i += 1000) {
    ASSERT_EQ(a[i], want_tp);
    ASSERT_EQ(b[i], want_dp);
  }
  // A size-1 group completes at once and is counted.
  std::vector<float> one(10, 3.0f);
  auto h = mesh.group("pp")->all_reduce(one.data(), 10, DType::F32, ReduceOp::Avg);
  EXPECT_TRUE(h->test());
  EXPECT_EQ(one[0], 3.0f);
  EXPECT_EQ(mesh.group("pp")->stats()[OpKind::AllReduce].calls, 1u);
}

TEST(DeviceMesh, TwoByTwo) {
  const int n = g_world->size(), r = g_world->rank();
  if (n != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh(*g_world, {{"pp", 1}, {"dp_replicate", 2}, {"dp_shard", 2}, {"tp", 1}});
  auto rep = mesh.group("dp_replicate");
  auto sh = mesh.group("dp_shard");
  auto dp = mesh.group(std::vector<std::string>{"dp_shard", "dp_replicate"});
  EXPECT_EQ(dp->name(), "dp");
  EXPECT_EQ(dp->size(), 4);
  EXPECT_EQ(rep->global_ranks(), (std::vector<int>{r % 2, r % 2 + 2}));
  EXPECT_EQ(sh->global_ranks(), (std::vector<int>{(r / 2) * 2, (r / 2) * 2 + 1}));
  // HSDP pattern: reduce-scatter inside the shard group, all-reduce across replicas.
  const size_t rc = 1001;
  std::vector<float> g(2 * rc), part(rc);
  fill(g.data(), 2 * rc, DType::F32, r);
  sh->reduce_scatter(g.data(), part.data(), rc, DType::F32, ReduceOp::Sum)->wait();
  rep->all_reduce(part.data(), rc, DType::F32, ReduceOp::Sum)->wait();
  const int c = mesh.coord("dp_shard");
  for (size_t i = 0; i < rc; ++i) {
    // (x0 + x1) + (x2 + x3) for the pairs of shard groups, element c*rc+i.
    float s0 = input(0, c * rc + i, DType::F32) + input(1, c * rc + i, DType::F32);
    float s1 = input(2, c * rc + i, DType::F32) + input(3, c * rc + i, DType::F32);
    ASSERT_TRUE(bits_equal(part[i], s0 + s1));
  }
}

TEST(DeviceMesh, ValidationNamesTheDimension) {
  const int n = g_world->size();
  try {
    DeviceMesh bad(*g_world, {{"pp", 1}, {"dp_replicate", 1}, {"dp_shard", n + 1}, {"tp", 1}});
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("'dp_shard' should be " + std::to_string(n)), std::string::npos) << m;
  }
  try {
    DeviceMesh bad(*g_world, {{"dp_shard", -1}, {"tp", n + 1}});
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("dp_shard"), std::string::npos) << e.what();
  }
}

// Overlap: a large all-reduce issued before computing finishes during the computation.
namespace {
// Register-only arithmetic for `ms` milliseconds of wall time (noipa: never merged or removed).
__attribute__((noipa)) double compute_ms(double ms) {
  auto t0 = std::chrono::steady_clock::now();
  float acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = 1.0f + j;
  while (ms_since(t0) < ms)
    for (int i = 0; i < 4096; ++i)
      for (int j = 0; j < 16; ++j) acc[j] = acc[j] * 0.9999999f + 0.0000001f;
  double s = 0;
  for (float a : acc) s += a;
  return s;
}
}  // namespace

TEST(ProcessGroup, CommunicationProgressesWhileComputing) {
  // The communication thread must finish a collective while the caller only computes: the caller
  // never waits, it computes in slices and polls Work::test() (which only reads the state). If the
  // engine progressed only inside wait(), the handle would never complete and the test would fail at
  // its deadline. Rank 0 issues first and sees its collective pending before the other ranks are
  // let in (through a second group), so the overlap does not rest on the collective outliving a
  // poll. Timing figures are printed, not asserted (shared CI machines make them noisy).
  auto w = g_world->world();
  auto go = g_world->split_like(*w, "overlap_go");
  const size_t count = 8u << 20;  // 32 MiB of f32
  std::vector<float> buf(count, 1.0f);
  w->all_reduce(buf.data(), count, DType::F32)->wait();  // warm-up (staging buffers)
  double comm_ms = 1e9;
  for (int rep = 0; rep < 2; ++rep) {
    w->barrier()->wait();
    auto t0 = std::chrono::steady_clock::now();
    w->all_reduce(buf.data(), count, DType::F32)->wait();
    comm_ms = std::min(comm_ms, ms_since(t0));
  }
  MPI_Allreduce(MPI_IN_PLACE, &comm_ms, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  w->barrier()->wait();
  auto t0 = std::chrono::steady_clock::now();
  WorkHandle h;
  if (w->rank() == 0) {
    h = w->all_reduce(buf.data(), count, DType::F32);
    // No other rank has issued it yet: it cannot have completed.
    if (w->size() > 1) {
      EXPECT_FALSE(h->test()) << "the all-reduce completed before its peers joined";
    }
    go->barrier()->wait();
  } else {
    go->barrier()->wait();
    h = w->all_reduce(buf.data(), count, DType::F32);
  }
  double sink = 0;
  int slices = 0;
  bool done = false;
  while (!(done = h->test()) && ms_since(t0) < 60000.0) {
    sink += compute_ms(0.5);
    ++slices;
  }
  const double together_ms = ms_since(t0);
  EXPECT_TRUE(done) << "the all-reduce made no progress in 60 s while the caller computed";
  if (!done) h->wait();
  if (slices > 0) {
    EXPECT_GT(sink, 0.0);  // the computation really ran (on one rank it may not have been needed)
  }
  // Every element was summed over the ranks three times (warm-up and two timed runs) before this one.
  const float expect = std::pow(static_cast<float>(w->size()), 4.0f);
  EXPECT_EQ(buf[0], expect);
  EXPECT_EQ(buf[count - 1], expect);
  if (g_world->rank() == 0)
    std::printf("[overlap] all_reduce 32 MiB alone %.1f ms; finished during %d compute slices of "
                "0.5 ms (%.1f ms), never waited on\n",
                comm_ms, slices, together_ms);
}

// Prints only rank 0's progress; failures of any rank are shown with the rank.
class RankPrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankPrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] FAILURE %s:%d\n%s\n", rank_, r.file_name() ? r.file_name() : "",
                   r.line_number(), r.message());
  }

 private:
  int rank_;
};

// Variable-size all-to-all over MPI, in both dtypes: rank r sends (q + 1) x (r + 1) x 100 elements
// to rank q (none to itself on odd ranks, none to rank 0 from the last rank), each naming its
// sender, receiver and index; sizes large enough for several MPI messages in flight.
TEST(ProcessGroup, AllToAllVDeliversEveryRanksPart) {
  auto w = g_world->world();
  const int n = w->size(), r = w->rank();
  auto cnt = [n](int from, int to) {
    if ((from % 2 == 1 && from == to) || (from == n - 1 && to == 0 && n > 2)) return size_t{0};
    return size_t(to + 1) * size_t(from + 1) * 100;
  };
  for (DType dt : {DType::F32, DType::BF16}) {
    std::vector<size_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
    std::vector<float> send, want;
    for (int q = 0; q < n; ++q) {
      sc[q] = cnt(r, q);
      rc[q] = cnt(q, r);
      for (size_t i = 0; i < sc[q]; ++i) send.push_back(static_cast<float>(r * 4 + q) + static_cast<float>(i % 8) * 16);
      for (size_t i = 0; i < rc[q]; ++i) want.push_back(static_cast<float>(q * 4 + r) + static_cast<float>(i % 8) * 16);
    }
    std::vector<float> recv(want.size(), -1.0f);
    if (dt == DType::F32) {
      w->all_to_all_v(send.data(), sc.data(), recv.data(), rc.data(), DType::F32)->wait();
    } else {  // the values are integers below 128: exact in bf16
      std::vector<bf16> sb(send.size()), rb(std::max<size_t>(want.size(), 1));
      for (size_t i = 0; i < send.size(); ++i) sb[i] = float_to_bf16(send[i]);
      w->all_to_all_v(sb.data(), sc.data(), rb.data(), rc.data(), DType::BF16)->wait();
      for (size_t i = 0; i < want.size(); ++i) recv[i] = bf16_to_float(rb[i]);
    }
    EXPECT_EQ(recv, want) << dtype_name(dt) << " rank " << r;
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  World& w = World::init(&argc, &argv);
  g_world = &w;
  if (w.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankPrinter(w.rank()));
  }
  int rc = RUN_ALL_TESTS();
  int worst = rc;
  if (w.uses_mpi()) MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  w.finalize();
  return worst;
}
