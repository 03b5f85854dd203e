// The kernel tables: complete for every device by the op registry (each op supported, or not and
// then throwing the registry's error), the CPU table is the CPU kernels, the Meta table touches no
// memory, and the kernels added for the seam match the code they replaced.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/ops.h"

namespace mt::kernels {
namespace {

// Calls an entry with value-initialised arguments (null pointers, zero sizes): only for entries
// that must throw before they touch anything.
template <Op O>
void call_with_nothing(OpFn<O> fn) {
  [&]<class R, class... A>(R (*f)(A...)) { f(A{}...); }(fn);
}

// Every entry of a table is set, and an op the table does not support is explicitly so: its entry
// throws the registry's error naming the op and the device (it never runs a kernel).
void expect_complete(const KernelTable& t) {
  int unsupported = 0;
  auto check = [&]<Op O>(OpFn<O> fn) {
    const char* name = op_name(O);
    ASSERT_NE(fn, nullptr) << device_name(t.device) << " table entry " << name << " is not set";
    if (t.supports(O)) return;
    ++unsupported;
    try {
      call_with_nothing<O>(fn);
      ADD_FAILURE() << device_name(t.device) << ": unsupported " << name << " did not throw";
    } catch (const std::runtime_error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find(std::string("device ") + device_name(t.device) + " has no kernel for " + name),
                std::string::npos)
          << w;
    }
  };
#define MT_OP(name, flags, dtypes, needs, ret, params) check.template operator()<Op::name>(t.name);
#include "kernels/ops.def"
#undef MT_OP
  if (t.device != Device::CUDA) {
    EXPECT_EQ(unsupported, 0) << device_name(t.device) << " must support every op";
  }
}

TEST(KernelTable, EveryBackendIsCompleteByTheRegistry) {
  expect_complete(table(Device::CPU));
  expect_complete(table(Device::Meta));
  EXPECT_EQ(table(Device::CPU).device, Device::CPU);
  EXPECT_EQ(table(Device::Meta).device, Device::Meta);
  // The CPU table is one instruction-set variant of the CPU kernels (cpu_isa.h); both are complete.
  expect_complete(cpu::base::isa_table());
  expect_complete(cpu::avx512::isa_table());
  EXPECT_EQ(cpu::base::isa_table().accumulate, &cpu::accumulate);
  // An op served by an overload of another op's kernel: the same function as before the registry.
  EXPECT_EQ(cpu::base::isa_table().rope_forward_freq,
            static_cast<OpFn<Op::rope_forward_freq>>(&cpu::base::rope_forward));
  EXPECT_EQ(&table(Device::CPU), &cpu::table_for(cpu::active_isa()));
  if (cuda_built()) {
    const KernelTable& g = table(Device::CUDA);
    EXPECT_EQ(g.device, Device::CUDA);
    expect_complete(g);
    // A dense GPT-2 or Llama run, fp32 or bf16, tensor- and sequence-parallel: every op on CUDA.
    for (bool llama : {false, true})
      EXPECT_EQ(unsupported_need(g, {.llama = llama, .rope_scaled = llama, .bf16 = true, .tensor_parallel = true,
                                     .sequence_parallel = true}),
                "");
  }
}

TEST(KernelTable, MetaKernelsTouchNothing) {
  const KernelTable& k = table(Device::Meta);
  std::vector<float> x = {1, 2, 3, 4}, y = {5, 6, 7, 8};
  k.accumulate(y.data(), x.data(), 4);
  k.linear_forward(y.data(), x.data(), x.data(), nullptr, 1, 2, 2);
  EXPECT_EQ(y, (std::vector<float>{5, 6, 7, 8}));
  EXPECT_EQ(k.sum(x.data(), 4), 0.0);
  EXPECT_EQ(k.sum_squares(x.data(), 4), 0.0);
}

TEST(KernelTable, VocabEmbeddingTakesOnlyTheRowsARankHolds) {
  const KernelTable& k = table(Device::CPU);
  const int64_t C = 3, rows = 2, lo = 2;  // this rank holds vocabulary rows 2 and 3
  std::vector<float> table_rows = {1, 2, 3, 4, 5, 6};
  std::vector<int32_t> ids = {0, 3, 2, 5};
  std::vector<float> out(ids.size() * C, -1.0f);
  k.vocab_embedding_forward(out.data(), ids.data(), table_rows.data(), DType::F32, lo, rows, 4, C);
  EXPECT_EQ(out, (std::vector<float>{0, 0, 0, 4, 5, 6, 1, 2, 3, 0, 0, 0}));
  std::vector<float> dt(rows * C, 0.0f), dout = {1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4};
  k.vocab_embedding_backward(dt.data(), dout.data(), ids.data(), lo, rows, 4, C);
  EXPECT_EQ(dt, (std::vector<float>{3, 3, 3, 2, 2, 2}));
}

// The three vocab-parallel passes on one rank holding the whole vocabulary equal the fused
// softmax cross-entropy.
TEST(KernelTable, VocabParallelCrossEntropyOnOneRankIsTheFusedLoss) {
  const KernelTable& k = table(Device::CPU);
  const int64_t N = 3, V = 5, Vp = 8;
  std::vector<float> lg(N * Vp);
  for (size_t i = 0; i < lg.size(); ++i) lg[i] = std::sin(0.7f * static_cast<float>(i));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = V; j < Vp; ++j) lg[n * Vp + j] = 0.0f;
  std::vector<int32_t> tg = {1, 4, -1};
  std::vector<float> ref = lg, ref_loss(N), loss(N), mx(N), stats(2 * N);
  k.softmax_cross_entropy(ref.data(), ref_loss.data(), tg.data(), N, V, Vp, 0.5f);
  k.vp_ce_rowmax(mx.data(), lg.data(), N, Vp, V);
  k.vp_ce_stats(stats.data(), lg.data(), mx.data(), tg.data(), N, Vp, V, 0);
  k.vp_ce_finish(lg.data(), loss.data(), mx.data(), stats.data(), tg.data(), N, Vp, V, 0, true, 0.5f);
  for (int64_t n = 0; n < N; ++n) EXPECT_NEAR(loss[n], ref_loss[n], 1e-5) << n;
  for (size_t i = 0; i < lg.size(); ++i) EXPECT_NEAR(lg[i], ref[i], 1e-6) << i;
}

// The same loss with the vocabulary split over two "ranks" (columns [0, 300) and [300, 601) of a
// row padded to 640; the second holds the padding): the statistics combined as the tp layer
// combines them (max, then sums) give the fused loss and its gradient.
TEST(KernelTable, VocabParallelCrossEntropySplitOverTwoShardsIsTheFusedLoss) {
  const KernelTable& k = table(Device::CPU);
  const int64_t N = 37, V = 601, Vp = 640, lo1 = 300;
  const int64_t Vl[2] = {lo1, Vp - lo1}, valid[2] = {lo1, V - lo1}, lo[2] = {0, lo1};
  std::vector<float> lg(N * Vp, 0.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < V; ++j) lg[n * Vp + j] = 3.0f * std::sin(0.37f * static_cast<float>(n * V + j));
  std::vector<int32_t> tg(N);
  for (int64_t n = 0; n < N; ++n) tg[n] = n == 5 ? -1 : static_cast<int32_t>((n * 97) % V);
  std::vector<float> ref = lg, ref_loss(N);
  k.softmax_cross_entropy(ref.data(), ref_loss.data(), tg.data(), N, V, Vp, 1.0f / N);
  std::vector<float> sh[2], mx[2], st[2], loss[2];
  for (int r = 0; r < 2; ++r) {
    sh[r].resize(N * Vl[r]);
    for (int64_t n = 0; n < N; ++n)
      std::copy_n(lg.begin() + n * Vp + lo[r], Vl[r], sh[r].begin() + n * Vl[r]);
    mx[r].resize(N), st[r].resize(2 * N), loss[r].resize(N);
    k.vp_ce_rowmax(mx[r].data(), sh[r].data(), N, Vl[r], valid[r]);
  }
  std::vector<float> gmx(N), gst(2 * N, 0.0f);
  for (int64_t n = 0; n < N; ++n) gmx[n] = std::max(mx[0][n], mx[1][n]);
  for (int r = 0; r < 2; ++r) {
    k.vp_ce_stats(st[r].data(), sh[r].data(), gmx.data(), tg.data(), N, Vl[r], valid[r], lo[r]);
    for (int64_t i = 0; i < 2 * N; ++i) gst[i] += st[r][i];
  }
  for (int r = 0; r < 2; ++r) {
    k.vp_ce_finish(sh[r].data(), loss[r].data(), gmx.data(), gst.data(), tg.data(), N, Vl[r], valid[r], lo[r], true,
                   1.0f / N);
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_NEAR(loss[r][n], ref_loss[n], 2e-6 * (1 + std::fabs(ref_loss[n]))) << r << " row " << n;
      for (int64_t j = 0; j < Vl[r]; ++j)
        EXPECT_NEAR(sh[r][n * Vl[r] + j], ref[n * Vp + lo[r] + j], 1e-8) << r << " row " << n << " col " << j;
    }
  }
  EXPECT_EQ(loss[0][5], 0.0f);  // an ignored target: no loss, no gradient
}

TEST(KernelTable, CopyColumnsAndBias) {
  const KernelTable& k = table(Device::CPU);
  std::vector<float> m = {0, 1, 2, 3, 10, 11, 12, 13}, out(4);
  k.copy_columns(out.data(), m.data(), 2, 4, 1, 2);
  EXPECT_EQ(out, (std::vector<float>{1, 2, 11, 12}));
  std::vector<float> b = {100, 200};
  k.add_bias(out.data(), b.data(), 2, 2);
  EXPECT_EQ(out, (std::vector<float>{101, 202, 111, 212}));
  std::vector<float> pos = {1, 1, 2, 2, 3, 3}, x(4, 0.0f);  // T = 3, rows 2..3 of the flat tokens
  k.position_add_rows(x.data(), pos.data(), 2, 3, 2, 2);
  EXPECT_EQ(x, (std::vector<float>{3, 3, 1, 1}));
  EXPECT_EQ(k.sum(pos.data(), 6), 12.0);
}

}  // namespace
}  // namespace mt::kernels
