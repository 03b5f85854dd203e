// The CUDA kernel table against the CPU kernel table on random inputs: every entry, forward and
// backward (which accumulate: gradients start nonzero), fp32 and bf16, with stated tolerances,
// and the reductions run twice to check they are deterministic. They run on a GPU and, in the
// emulator build (-DMESHTRAIN_CUDA=EMU, which CI runs under three schedules and AddressSanitizer,
// docs/gpu.md), on the CPU; elsewhere they skip with a message. The table checks run everywhere.
//
// Tolerances: the GPU contracts a * b + c into FMAs where the CPU kernels round every product (and
// libm and CUDA's math functions differ by a few ulps), so fp32 results agree to a few ulps of the
// terms that were summed, not bitwise, except where a kernel only moves or rounds values.
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
#include "kernels/conformance/check.h"
#include "runtime/device.h"
#include "test_util.h"

namespace mt::kernels {
namespace {

TEST(CudaTable, CompleteInCudaBuildsAndAClearErrorElsewhere) {
  if (!cuda_built()) {
    try {
      table(Device::CUDA);
      ADD_FAILURE() << "table(cuda) did not throw in a build without CUDA";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("built without the CUDA backend"), std::string::npos) << e.what();
    }
    return;
  }
  const KernelTable& t = table(Device::CUDA);
  EXPECT_EQ(t.device, Device::CUDA);
  const size_t first = offsetof(KernelTable, gelu_forward);
  const size_t n = (sizeof(KernelTable) - first) / sizeof(void (*)());
  for (size_t i = 0; i < n; ++i) {
    uintptr_t p = 0;
    std::memcpy(&p, reinterpret_cast<const char*>(&t) + first + i * sizeof(void (*)()), sizeof p);
    EXPECT_NE(p, 0u) << "cuda table entry " << i << " is not set";
  }
  // No entry is the CPU's (a CUDA kernel on host pointers would be a silent bug).
  const KernelTable& c = table(Device::CPU);
  for (size_t i = 0; i < n; ++i) {
    uintptr_t a = 0, b = 0;
    std::memcpy(&a, reinterpret_cast<const char*>(&t) + first + i * sizeof(void (*)()), sizeof a);
    std::memcpy(&b, reinterpret_cast<const char*>(&c) + first + i * sizeof(void (*)()), sizeof b);
    EXPECT_NE(a, b) << "cuda table entry " << i << " is the CPU kernel";
  }
  // Every op of the registry has a CUDA kernel.
  for (int i = 0; i < kNumOps; ++i) EXPECT_TRUE(t.supports(op_at(i))) << op_name(op_at(i)) << " has no CUDA kernel";
}

#define REQUIRE_GPU()                                                                                   \
  do {                                                                                                  \
    std::string why_;                                                                                   \
    if (!device_available(Device::CUDA, &why_)) GTEST_SKIP() << "GPU kernel test not run: " << why_; \
  } while (0)

// A device copy of a host vector, freed on scope exit.
template <class T>
struct DBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DBuf(const std::vector<T>& h) : n(h.size()) {
    p = static_cast<T*>(device_alloc(Device::CUDA, std::max<size_t>(n, 1) * sizeof(T), MemCategory::Workspace));
    dev::copy_from_host(Device::CUDA, p, h.data(), n * sizeof(T));
  }
  ~DBuf() { device_free(Device::CUDA, p, std::max<size_t>(n, 1) * sizeof(T), MemCategory::Workspace); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    dev::copy_to_host(Device::CUDA, h.data(), p, n * sizeof(T));
    return h;
  }
  DBuf(const DBuf&) = delete;
  DBuf& operator=(const DBuf&) = delete;
};

const KernelTable& G() { return table(Device::CUDA); }
const KernelTable& C() { return table(Device::CPU); }

::testing::AssertionResult near(const std::vector<float>& got, const std::vector<float>& want, double rtol,
                                double atol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  return kt::close(got, kt::to_double(want), rtol, atol);
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = float_to_bf16(v[i]);
  return o;
}

TEST(CudaKernels, Elementwise) {
  REQUIRE_GPU();
  const int64_t n = 10007;
  auto x = kt::randn(n, 1, 2.0f), y = kt::randn(n, 2), dy = kt::randn(n, 3), g0 = kt::randn(n, 4);
  {
    DBuf<float> dx(x), dout(y);
    std::vector<float> want(n);
    C().gelu_forward(want.data(), x.data(), n);
    G().gelu_forward(dout.p, dx.p, n);
    EXPECT_TRUE(near(dout.host(), want, 1e-5, 1e-6)) << "gelu_forward";
  }
  {
    DBuf<float> dx(x), ddy(dy), dg(g0);
    auto want = g0;
    C().gelu_backward(want.data(), x.data(), dy.data(), n);
    G().gelu_backward(dg.p, dx.p, ddy.p, n);
    EXPECT_TRUE(near(dg.host(), want, 1e-5, 1e-5)) << "gelu_backward";
  }
  {
    DBuf<float> dgate(x), dup(y), dout(g0);
    std::vector<float> want(n);
    C().swiglu_forward(want.data(), x.data(), y.data(), n);
    G().swiglu_forward(dout.p, dgate.p, dup.p, n);
    EXPECT_TRUE(near(dout.host(), want, 1e-5, 1e-6)) << "swiglu_forward";
    auto wg = g0, wu = dy;
    DBuf<float> gg(g0), gu(dy), gdy(y);
    C().swiglu_backward(wg.data(), wu.data(), y.data(), x.data(), y.data(), n);
    G().swiglu_backward(gg.p, gu.p, gdy.p, dgate.p, dup.p, n);
    EXPECT_TRUE(near(gg.host(), wg, 1e-5, 1e-5)) << "swiglu_backward dgate";
    EXPECT_TRUE(near(gu.host(), wu, 1e-5, 1e-5)) << "swiglu_backward dup";
  }
  {
    DBuf<float> a(g0), b(x);
    auto want = g0;
    C().accumulate(want.data(), x.data(), n);
    C().scale(want.data(), 0.37f, n);
    G().accumulate(a.p, b.p, n);
    G().scale(a.p, 0.37f, n);
    EXPECT_TRUE(kt::bitwise_equal(a.host(), want)) << "accumulate + scale";
  }
  {
    DBuf<float> a(x);
    const double s1 = G().sum(a.p, n), s2 = G().sum(a.p, n);
    const double q1 = G().sum_squares(a.p, n), q2 = G().sum_squares(a.p, n);
    EXPECT_EQ(s1, s2) << "sum is not deterministic";
    EXPECT_EQ(q1, q2) << "sum_squares is not deterministic";
    EXPECT_NEAR(s1, C().sum(x.data(), n), 1e-9 * n);
    EXPECT_NEAR(q1, C().sum_squares(x.data(), n), 1e-12 * q1 * 100);
  }
  {  // casts: bitwise the CPU's round-to-nearest-even, specials included
    auto v = x;
    v[0] = INFINITY;
    v[1] = -0.0f;
    v[2] = 1.0f + 1.0f / 256.0f;  // a tie
    v[3] = 3.0e38f;
    DBuf<float> a(v);
    DBuf<bf16> h{std::vector<bf16>(n)};
    G().cast_f32_to_bf16(h.p, a.p, n);
    std::vector<bf16> want(n);
    C().cast_f32_to_bf16(want.data(), v.data(), n);
    const auto got = h.host();
    EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(bf16)), 0) << "cast_f32_to_bf16";
    DBuf<float> back{std::vector<float>(n)};
    G().cast_bf16_to_f32(back.p, h.p, n);
    std::vector<float> wb(n);
    C().cast_bf16_to_f32(wb.data(), want.data(), n);
    EXPECT_TRUE(kt::bitwise_equal(back.host(), wb)) << "cast_bf16_to_f32";
  }
  {
    const int64_t N = 37, Cc = 129, ld = 300, c0 = 71;
    auto m = kt::randn(N * ld, 5), b = kt::randn(ld, 6);
    DBuf<float> dm(m), db(b), dcol{std::vector<float>(N * Cc)};
    auto want = m;
    C().add_bias(want.data(), b.data(), N, ld);
    G().add_bias(dm.p, db.p, N, ld);
    EXPECT_TRUE(kt::bitwise_equal(dm.host(), want)) << "add_bias";
    std::vector<float> wc(N * Cc);
    C().copy_columns(wc.data(), want.data(), N, ld, c0, Cc);
    G().copy_columns(dcol.p, dm.p, N, ld, c0, Cc);
    EXPECT_TRUE(kt::bitwise_equal(dcol.host(), wc)) << "copy_columns";
  }
}

// LayerNorm and RMSNorm forward and backward on N rows of Cc channels.
void check_norms(int64_t N, int64_t Cc) {
  auto x = kt::randn(N * Cc, 10, 1.5f), w = kt::randn(Cc, 11), b = kt::randn(Cc, 12), dy = kt::randn(N * Cc, 13);
  auto gx0 = kt::randn(N * Cc, 14), gw0 = kt::randn(Cc, 15), gb0 = kt::randn(Cc, 16);
  std::vector<float> out(N * Cc), mean(N), rstd(N);
  C().layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, Cc, 1e-5f);
  // Outputs start as zeros on the device (not the CPU's results): a kernel that writes nothing fails.
  DBuf<float> dx(x), dw(w), db(b), dout{std::vector<float>(N * Cc)}, dmean{std::vector<float>(N)},
      drstd{std::vector<float>(N)}, ddy(dy), dgx(gx0), dgw(gw0), dgb(gb0);
  G().layernorm_forward(dout.p, dmean.p, drstd.p, dx.p, dw.p, db.p, N, Cc, 1e-5f);
  EXPECT_TRUE(near(dout.host(), out, 1e-5, 1e-5)) << "layernorm_forward C=" << Cc;
  EXPECT_TRUE(near(drstd.host(), rstd, 1e-5, 1e-6)) << "layernorm rstd C=" << Cc;
  auto gx = gx0, gw = gw0, gb = gb0;
  C().layernorm_backward(gx.data(), gw.data(), gb.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N,
                         Cc);
  G().layernorm_backward(dgx.p, dgw.p, dgb.p, ddy.p, dx.p, dw.p, dmean.p, drstd.p, N, Cc);
  EXPECT_TRUE(near(dgx.host(), gx, 1e-4, 1e-4)) << "layernorm_backward dinp C=" << Cc;
  EXPECT_TRUE(near(dgw.host(), gw, 1e-4, 1e-4)) << "layernorm_backward dw C=" << Cc;
  EXPECT_TRUE(near(dgb.host(), gb, 1e-4, 1e-4)) << "layernorm_backward db C=" << Cc;

  std::vector<float> rout(N * Cc), rr(N);
  C().rmsnorm_forward(rout.data(), rr.data(), x.data(), w.data(), N, Cc, 1e-5f);
  DBuf<float> drout{std::vector<float>(N * Cc)}, drr{std::vector<float>(N)}, dgx2(gx0), dgw2(gw0);
  G().rmsnorm_forward(drout.p, drr.p, dx.p, dw.p, N, Cc, 1e-5f);
  EXPECT_TRUE(near(drout.host(), rout, 1e-5, 1e-5)) << "rmsnorm_forward C=" << Cc;
  auto rgx = gx0, rgw = gw0;
  C().rmsnorm_backward(rgx.data(), rgw.data(), dy.data(), x.data(), w.data(), rr.data(), N, Cc);
  G().rmsnorm_backward(dgx2.p, dgw2.p, ddy.p, dx.p, dw.p, drr.p, N, Cc);
  EXPECT_TRUE(near(dgx2.host(), rgx, 1e-4, 1e-4)) << "rmsnorm_backward dinp C=" << Cc;
  EXPECT_TRUE(near(dgw2.host(), rgw, 1e-4, 1e-4)) << "rmsnorm_backward dw C=" << Cc;
}

TEST(CudaKernels, Norms) {
  REQUIRE_GPU();
  for (int64_t Cc : {64, 768, 1000}) check_norms(33, Cc);
}

TEST(CudaKernels, Embeddings) {
  REQUIRE_GPU();
  const int64_t V = 50, Cc = 96, B = 3, T = 17, N = B * T;
  auto tab = kt::randn(V * Cc, 20), pos = kt::randn(T * Cc, 21), dy = kt::randn(N * Cc, 22), g0 = kt::randn(V * Cc, 23);
  std::vector<int32_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[i] = static_cast<int32_t>((i * 7 + i / 5) % V);  // repeats
  DBuf<float> dtab(tab), dpos(pos), ddy(dy), dg(g0), dout{std::vector<float>(N * Cc)};
  DBuf<int32_t> dids(ids);
  std::vector<float> out(N * Cc);
  C().embedding_forward(out.data(), ids.data(), tab.data(), N, Cc);
  C().position_add_forward(out.data(), pos.data(), B, T, Cc);
  G().embedding_forward(dout.p, dids.p, dtab.p, N, Cc);
  G().position_add_forward(dout.p, dpos.p, B, T, Cc);
  EXPECT_TRUE(kt::bitwise_equal(dout.host(), out)) << "embedding + position forward";
  auto g = g0;
  C().embedding_backward(g.data(), dy.data(), ids.data(), N, Cc);
  G().embedding_backward(dg.p, ddy.p, dids.p, N, Cc);
  EXPECT_TRUE(kt::bitwise_equal(dg.host(), g)) << "embedding_backward (token order, as the CPU)";
  auto gp0 = kt::randn(T * Cc, 24), gp = gp0;
  DBuf<float> dgp(gp0);
  C().position_add_backward(gp.data(), dy.data(), B, T, Cc);
  G().position_add_backward(dgp.p, ddy.p, B, T, Cc);
  EXPECT_TRUE(near(dgp.host(), gp, 1e-6, 1e-6)) << "position_add_backward";
  // Vocab-parallel share [lo, lo + rows), fp32 and bf16 tables; rows of a sequence-parallel rank.
  const int64_t lo = 10, rows = 25;
  std::vector<float> share(tab.begin() + lo * Cc, tab.begin() + (lo + rows) * Cc);
  DBuf<float> dshare(share);
  DBuf<bf16> dshare16(to_bf16(share));
  auto share16 = to_bf16(share);
  for (int pass = 0; pass < 2; ++pass) {
    const DType dt = pass ? DType::BF16 : DType::F32;
    const void* ht = pass ? static_cast<const void*>(share16.data()) : share.data();
    const void* gt = pass ? static_cast<const void*>(dshare16.p) : dshare.p;
    std::vector<float> w(N * Cc);
    C().vocab_embedding_forward(w.data(), ids.data(), ht, dt, lo, rows, N, Cc);
    G().vocab_embedding_forward(dout.p, dids.p, gt, dt, lo, rows, N, Cc);
    EXPECT_TRUE(kt::bitwise_equal(dout.host(), w)) << "vocab_embedding_forward " << dtype_name(dt);
  }
  std::vector<float> gs0 = kt::randn(rows * Cc, 25), gs = gs0;
  DBuf<float> dgs(gs0);
  C().vocab_embedding_backward(gs.data(), dy.data(), ids.data(), lo, rows, N, Cc);
  G().vocab_embedding_backward(dgs.p, ddy.p, dids.p, lo, rows, N, Cc);
  EXPECT_TRUE(kt::bitwise_equal(dgs.host(), gs)) << "vocab_embedding_backward";
  auto xr = dy;
  DBuf<float> dxr(dy);
  C().position_add_rows(xr.data(), pos.data(), 20, T, 13, Cc);
  G().position_add_rows(dxr.p, dpos.p, 20, T, 13, Cc);
  EXPECT_TRUE(kt::bitwise_equal(dxr.host(), xr)) << "position_add_rows";
}

std::vector<int32_t> targets(int64_t N, int64_t V) {
  std::vector<int32_t> tg(N);
  for (int64_t i = 0; i < N; ++i) tg[i] = i % 7 == 3 ? -1 : static_cast<int32_t>((i * 131) % V);
  tg[N - 1] = static_cast<int32_t>(V - 1);
  return tg;
}

// The fused cross-entropy over N rows: forward only, with the fp32 gradient, and with the gradient
// rounded to bf16 over the first half of the logits (the values before rounding differ by ulps, so
// a rounded value may be the neighbouring bf16: one bf16 ulp, at most 2^-7 relative).
void check_cross_entropy(int64_t N, int64_t V, int64_t Vp) {
  const std::string tag = " N=" + std::to_string(N) + " V=" + std::to_string(V);
  const auto lg = kt::randn(N * Vp, 30, 3.0f);
  const auto tg = targets(N, V);
  DBuf<int32_t> dtg(tg);
  std::vector<float> l(N);
  {
    DBuf<float> dlg(lg), dl{std::vector<float>(N)};
    C().softmax_cross_entropy_forward(lg.data(), l.data(), tg.data(), N, V, Vp);
    G().softmax_cross_entropy_forward(dlg.p, dl.p, dtg.p, N, V, Vp);
    EXPECT_TRUE(near(dl.host(), l, 1e-5, 1e-5)) << "softmax_cross_entropy_forward" << tag;
    EXPECT_TRUE(kt::bitwise_equal(dlg.host(), lg)) << "softmax_cross_entropy_forward wrote the logits" << tag;
  }
  for (int bf = 0; bf < 2; ++bf) {
    const char* what = bf ? "softmax_cross_entropy_bf16" : "softmax_cross_entropy";
    auto g = lg;
    DBuf<float> dlg(lg), dl{std::vector<float>(N)};
    (bf ? C().softmax_cross_entropy_bf16 : C().softmax_cross_entropy)(g.data(), l.data(), tg.data(), N, V, Vp, 0.25f);
    (bf ? G().softmax_cross_entropy_bf16 : G().softmax_cross_entropy)(dlg.p, dl.p, dtg.p, N, V, Vp, 0.25f);
    EXPECT_TRUE(near(dl.host(), l, 1e-5, 1e-5)) << what << " losses" << tag;
    auto got = dlg.host();
    if (bf) {  // widen both bf16 matrices [N, Vp] to compare them as floats
      std::vector<bf16> a(N * Vp), b(N * Vp);
      std::memcpy(a.data(), got.data(), a.size() * sizeof(bf16));
      std::memcpy(b.data(), g.data(), b.size() * sizeof(bf16));
      got.resize(a.size());
      g.resize(b.size());
      C().cast_bf16_to_f32(got.data(), a.data(), N * Vp);
      C().cast_bf16_to_f32(g.data(), b.data(), N * Vp);
    }
    EXPECT_TRUE(near(got, g, bf ? 1.0 / 128 : 1e-5, bf ? 1e-12 : 1e-7)) << what << " gradient" << tag;
  }
}

TEST(CudaKernels, CrossEntropy) {
  REQUIRE_GPU();
  const int64_t N = 29, V = 1000, Vp = 1024;
  check_cross_entropy(N, V, Vp);
  const auto lg = kt::randn(N * Vp, 30, 3.0f);
  const auto tg = targets(N, V);
  DBuf<int32_t> dtg(tg);
  {  // the vocab-parallel passes on a share of Vl columns, `valid` of them real
    const int64_t Vl = 512, valid = 500, lo = 400;
    std::vector<float> sh(N * Vl);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Vl; ++j) sh[n * Vl + j] = lg[n * Vp + lo + j];
    DBuf<float> dsh(sh), dmx{std::vector<float>(N)}, dst{std::vector<float>(2 * N)}, dl{std::vector<float>(N)};
    std::vector<float> mx(N), st(2 * N), l(N);
    C().vp_ce_rowmax(mx.data(), sh.data(), N, Vl, valid);
    G().vp_ce_rowmax(dmx.p, dsh.p, N, Vl, valid);
    EXPECT_TRUE(kt::bitwise_equal(dmx.host(), mx)) << "vp_ce_rowmax";
    C().vp_ce_stats(st.data(), sh.data(), mx.data(), tg.data(), N, Vl, valid, lo);
    G().vp_ce_stats(dst.p, dsh.p, dmx.p, dtg.p, N, Vl, valid, lo);
    EXPECT_TRUE(near(dst.host(), st, 1e-5, 1e-6)) << "vp_ce_stats";
    C().vp_ce_finish(sh.data(), l.data(), mx.data(), st.data(), tg.data(), N, Vl, valid, lo, true, 0.5f);
    G().vp_ce_finish(dsh.p, dl.p, dmx.p, dst.p, dtg.p, N, Vl, valid, lo, true, 0.5f);
    EXPECT_TRUE(near(dl.host(), l, 1e-5, 1e-5)) << "vp_ce_finish losses";
    EXPECT_TRUE(near(dsh.host(), sh, 1e-5, 1e-7)) << "vp_ce_finish gradient";
  }
}

// The row kernels at GPT-2 124M sizes: C = 768 channels, the vocabulary 50257 padded to 50304,
// and row counts that are not multiples of anything.
TEST(CudaKernels, RowKernelsAtGpt2Sizes) {
  REQUIRE_GPU();
  check_norms(300, 768);
  check_cross_entropy(257, 50257, 50304);
}

// The bias gradient is a two-stage column sum (kernels/cuda/reduce.cu): rows cut into slices (as
// many as N / 32, at most 256), per slice 8 row lanes each summing every 8th row, the lanes added
// in order, then the slices added in order per column. Plain additions (no products to fuse), so
// the device's result is exactly that order's, computed here on the host, at row counts with one
// slice, several, and the cap; and two calls give the same bits.
std::vector<float> two_stage_column_sums(const std::vector<float>& y, int64_t N, int64_t Cc) {
  int64_t parts = std::clamp<int64_t>((N + 31) / 32, 1, 256);
  const int64_t rows = (N + parts - 1) / parts;
  parts = (N + rows - 1) / rows;
  std::vector<float> out(Cc, 0.0f);
  for (int64_t c = 0; c < Cc; ++c) {
    float total = 0.0f;
    for (int64_t p = 0; p < parts; ++p) {
      float slice = 0.0f;
      for (int64_t lane = 0; lane < 8; ++lane) {
        float s = 0.0f;
        for (int64_t n = p * rows + lane; n < std::min(N, (p + 1) * rows); n += 8) s += y[n * Cc + c];
        slice += s;
      }
      total += slice;
    }
    out[c] = total;
  }
  return out;
}

TEST(CudaKernels, BiasGradientIsATwoStageSumInAFixedOrder) {
  REQUIRE_GPU();
  const int64_t OC = 70;
  for (int64_t N : {20, 1000, 9000}) {
    const auto dy = kt::randn(N * OC, 90), b0 = kt::randn(OC, 91);
    auto want = two_stage_column_sums(dy, N, OC);
    for (int64_t c = 0; c < OC; ++c) want[c] = b0[c] + want[c];
    DBuf<float> ddy(dy), db(b0), db2(b0);
    G().linear_backward(nullptr, nullptr, db.p, ddy.p, nullptr, nullptr, N, 8, OC);
    G().linear_backward(nullptr, nullptr, db2.p, ddy.p, nullptr, nullptr, N, 8, OC);
    EXPECT_TRUE(kt::bitwise_equal(db.host(), want)) << "bias gradient N=" << N;
    EXPECT_TRUE(kt::bitwise_equal(db2.host(), db.host())) << "two calls differ, N=" << N;
  }
}

// The elementwise kernels take 16 bytes per access where every pointer is 16-byte aligned and one
// float otherwise; both forms apply the same per-element function, so they agree bitwise (n = 1030:
// 257 vectors and a tail of 2; the unaligned form starts one float in).
TEST(CudaKernels, ElementwiseVectorAndScalarFormsAgreeBitwise) {
  REQUIRE_GPU();
  const int64_t n = 1030;
  const auto x = kt::randn(n, 95), g = kt::randn(n, 96), y0 = kt::randn(n, 97);
  auto run = [&](int64_t off) {  // gelu forward, gelu backward, accumulate, scale, swiglu forward
    auto at = [&](const std::vector<float>& v) {  // v starting `off` floats into the buffer
      std::vector<float> b(static_cast<size_t>(off), 0.0f);
      b.insert(b.end(), v.begin(), v.end());
      return b;
    };
    DBuf<float> dx(at(x)), dg(at(g)), dy(at(y0)), dout{std::vector<float>(n + 1)}, dgrad(at(y0)),
        dsw{std::vector<float>(n + 1)};
    G().gelu_forward(dout.p + off, dx.p + off, n);
    G().gelu_backward(dgrad.p + off, dx.p + off, dg.p + off, n);
    G().accumulate(dy.p + off, dx.p + off, n);
    G().scale(dy.p + off, 0.37f, n);
    G().swiglu_forward(dsw.p + off, dx.p + off, dg.p + off, n);
    std::vector<std::vector<float>> r;
    for (const DBuf<float>* b : {&dout, &dgrad, &dy, &dsw}) {
      const auto h = b->host();
      r.emplace_back(h.begin() + off, h.begin() + off + n);
    }
    return r;
  };
  const auto vec = run(0), scalar = run(1);
  const char* names[] = {"gelu_forward", "gelu_backward", "accumulate + scale", "swiglu_forward"};
  for (size_t i = 0; i < vec.size(); ++i) EXPECT_TRUE(kt::bitwise_equal(vec[i], scalar[i])) << names[i];
  // accumulate + scale against the CPU (both exact per element).
  std::vector<float> want = y0;
  C().accumulate(want.data(), x.data(), n);
  C().scale(want.data(), 0.37f, n);
  EXPECT_TRUE(kt::bitwise_equal(vec[2], want)) << "accumulate + scale against the CPU";
}

// The kernels that move eight elements per step (two 16-byte fp32 or one 16-byte bf16 access per
// operand: SwiGLU's backward and its bf16 forms, the casts, the bf16 residual add) and the bias add
// (four columns per access): the vector form (aligned pointers) and the scalar form (every pointer
// one element off, so not 16-byte aligned) give the same bits. n = 1030: 128 groups of 8 and a tail of 6.
TEST(CudaKernels, EightWideKernelsAgreeWithTheirScalarForms) {
  REQUIRE_GPU();
  const int64_t n = 1030, N = 10, Cb = 103 * 4;  // the bias add: N rows of Cb columns
  const auto x = kt::randn(n, 195), g = kt::randn(n, 196), u = kt::randn(n, 197), dy = kt::randn(n, 198),
             acc = kt::randn(n, 199), xb = kt::randn(N * Cb, 200), b = kt::randn(Cb, 201);
  const auto gh = to_bf16(g), uh = to_bf16(u), xh = to_bf16(x);
  auto shift = [](auto v, int64_t off) {  // v starting `off` elements into the buffer
    v.insert(v.begin(), static_cast<size_t>(off), typename decltype(v)::value_type{});
    return v;
  };
  auto bits = [](const auto& h, int64_t off, int64_t len) {  // the `len` elements after `off`, as bytes
    std::vector<unsigned char> r(static_cast<size_t>(len) * sizeof(h[0]));
    std::memcpy(r.data(), h.data() + off, r.size());
    return r;
  };
  auto run = [&](int64_t off) {
    DBuf<float> dgate(shift(acc, off)), dup(shift(acc, off)), ddy(shift(dy, off)), dg(shift(g, off)), du(shift(u, off)),
        dx(shift(x, off)), f32out(shift(std::vector<float>(n), off)), xbias(shift(xb, off)), bias(shift(b, off));
    DBuf<bf16> hg(shift(gh, off)), hu(shift(uh, off)), hx(shift(xh, off)), hout(shift(std::vector<bf16>(n), off)),
        hdg(shift(std::vector<bf16>(n), off)), hdu(shift(std::vector<bf16>(n), off)),
        hcast(shift(std::vector<bf16>(n), off)), hres(shift(std::vector<bf16>(n), off));
    G().swiglu_backward(dgate.p + off, dup.p + off, ddy.p + off, dg.p + off, du.p + off, n);
    G().swiglu_forward_bf16(hout.p + off, hg.p + off, hu.p + off, n);
    G().swiglu_backward_bf16(hdg.p + off, hdu.p + off, ddy.p + off, hg.p + off, hu.p + off, n);
    G().cast_f32_to_bf16(hcast.p + off, dx.p + off, n);
    G().cast_bf16_to_f32(f32out.p + off, hx.p + off, n);
    G().residual_add_bf16(hres.p + off, hx.p + off, ddy.p + off, n);
    G().add_bias(xbias.p + off, bias.p + off, N, Cb);
    return std::vector<std::vector<unsigned char>>{
        bits(dgate.host(), off, n), bits(dup.host(), off, n),  bits(hout.host(), off, n), bits(hdg.host(), off, n),
        bits(hdu.host(), off, n),   bits(hcast.host(), off, n), bits(f32out.host(), off, n), bits(hres.host(), off, n),
        bits(xbias.host(), off, N * Cb)};
  };
  const auto vec = run(0), scalar = run(1);
  const char* names[] = {"swiglu_backward dgate", "swiglu_backward dup", "swiglu_forward_bf16",
                         "swiglu_backward_bf16 dgate", "swiglu_backward_bf16 dup", "cast_f32_to_bf16",
                         "cast_bf16_to_f32", "residual_add_bf16", "add_bias"};
  for (size_t i = 0; i < vec.size(); ++i) EXPECT_EQ(vec[i], scalar[i]) << names[i];
  // The exact ones against the CPU as well: the casts, the residual add and the bias add.
  std::vector<bf16> cast(n), res(n);
  std::vector<float> back(n), biased = xb;
  C().cast_f32_to_bf16(cast.data(), x.data(), n);
  C().cast_bf16_to_f32(back.data(), xh.data(), n);
  C().residual_add_bf16(res.data(), xh.data(), dy.data(), n);
  C().add_bias(biased.data(), b.data(), N, Cb);
  EXPECT_EQ(vec[5], bits(cast, 0, n)) << "cast_f32_to_bf16 against the CPU";
  EXPECT_EQ(vec[6], bits(back, 0, n)) << "cast_bf16_to_f32 against the CPU";
  EXPECT_EQ(vec[7], bits(res, 0, n)) << "residual_add_bf16 against the CPU";
  EXPECT_EQ(vec[8], bits(biased, 0, N * Cb)) << "add_bias against the CPU";
}

TEST(CudaKernels, AdamW) {
  REQUIRE_GPU();
  const int64_t n = 5003;
  auto p = kt::randn(n, 40), m = kt::randn(n, 41, 0.1f), v = kt::uniform(n, 42, 0.0f, 0.01f);
  DBuf<float> dp(p), dm(m), dv(v);
  for (int64_t step = 1; step <= 3; ++step) {
    auto g = kt::randn(n, 50 + step);
    DBuf<float> dg(g);
    C().adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.7f, nullptr);
    G().adamw_update(dp.p, dg.p, dm.p, dv.p, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.7f, nullptr);
  }
  // m = beta1 m + (1 - beta1) g: the GPU fuses one product into an FMA, the CPU rounds both, so a
  // step may differ by half an ulp of the larger term (|m|, |g| ~ 0.1 here: ~4e-9); where the
  // terms cancel that is a large relative error, hence the absolute 1e-7 (three steps, with margin).
  EXPECT_TRUE(near(dp.host(), p, 1e-6, 1e-7)) << "adamw param";
  EXPECT_TRUE(near(dm.host(), m, 1e-6, 1e-7)) << "adamw m";
  EXPECT_TRUE(near(dv.host(), v, 1e-6, 1e-10)) << "adamw v";
  // The bf16 copy of the parameters is the device's own fp32 result rounded to nearest even.
  auto g = kt::randn(n, 60);
  DBuf<float> dg(g);
  DBuf<bf16> dp16{std::vector<bf16>(n)};
  G().adamw_update(dp.p, dg.p, dm.p, dv.p, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 4, 1.0f, dp16.p);
  const auto p32 = dp.host();
  const auto p16 = dp16.host();
  size_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bf16 want = float_to_bf16(p32[i]);
    bad += std::memcmp(&p16[i], &want, sizeof want) != 0;
  }
  EXPECT_EQ(bad, 0u) << "adamw param_bf16 is not the rounded fp32 parameter";
}

// fp32 GEMMs: CUBLAS_COMPUTE_32F against oneDNN fp32 (orders differ: 1e-4 relative at K ~ 300);
// bf16: the same bf16 inputs on both, fp32 accumulation (2e-3 relative + a K-scaled absolute).
TEST(CudaKernels, Linear) {
  REQUIRE_GPU();
  const int64_t N = 67, Cc = 96, OC = 130;
  auto x = kt::randn(N * Cc, 60), W = kt::randn(OC * Cc, 61, 0.1f), b = kt::randn(OC, 62), dy = kt::randn(N * OC, 63);
  auto gx0 = kt::randn(N * Cc, 64), gW0 = kt::randn(OC * Cc, 65), gb0 = kt::randn(OC, 66);
  for (int bf = 0; bf < 2; ++bf) {
    const double rt = bf ? 2e-3 : 1e-4, at = bf ? 2e-3 : 1e-4;
    const char* tag = bf ? "bf16" : "fp32";
    DBuf<float> dx(x), dW(W), db(b), ddy(dy), dout{std::vector<float>(N * OC)}, dgx(gx0), dgW(gW0), dgb(gb0);
    auto x16 = to_bf16(x), W16 = to_bf16(W);
    DBuf<bf16> dx16(x16), dW16(W16);
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      std::vector<float> out(N * OC);
      const float* hb = with_bias ? b.data() : nullptr;
      const float* gb = with_bias ? db.p : nullptr;
      if (bf) {
        C().linear_forward_bf16(out.data(), x16.data(), W16.data(), hb, N, Cc, OC);
        G().linear_forward_bf16(dout.p, dx16.p, dW16.p, gb, N, Cc, OC);
      } else {
        C().linear_forward(out.data(), x.data(), W.data(), hb, N, Cc, OC);
        G().linear_forward(dout.p, dx.p, dW.p, gb, N, Cc, OC);
      }
      EXPECT_TRUE(near(dout.host(), out, rt, at)) << tag << " linear_forward bias=" << with_bias;
    }
    auto gx = gx0, gW = gW0, gbias = gb0;
    if (bf) {
      C().linear_backward_bf16(gx.data(), gW.data(), gbias.data(), dy.data(), x16.data(), W16.data(), N, Cc, OC);
      G().linear_backward_bf16(dgx.p, dgW.p, dgb.p, ddy.p, dx16.p, dW16.p, N, Cc, OC);
    } else {
      C().linear_backward(gx.data(), gW.data(), gbias.data(), dy.data(), x.data(), W.data(), N, Cc, OC);
      G().linear_backward(dgx.p, dgW.p, dgb.p, ddy.p, dx.p, dW.p, N, Cc, OC);
    }
    EXPECT_TRUE(near(dgx.host(), gx, rt, at * 4)) << tag << " linear_backward dinp";
    EXPECT_TRUE(near(dgW.host(), gW, rt, at * 8)) << tag << " linear_backward dW";
    EXPECT_TRUE(near(dgb.host(), gbias, 1e-5, 1e-4)) << tag << " linear_backward dbias";
    if (bf) {  // from an output gradient that is already bf16 (the LM head's)
      const auto dy16 = to_bf16(dy);
      DBuf<bf16> ddy16(dy16);
      DBuf<float> dgx2(gx0), dgW2(gW0);
      auto gx2 = gx0, gW2 = gW0;
      C().linear_backward_bf16_dy(gx2.data(), gW2.data(), dy16.data(), x16.data(), W16.data(), N, Cc, OC);
      G().linear_backward_bf16_dy(dgx2.p, dgW2.p, ddy16.p, dx16.p, dW16.p, N, Cc, OC);
      EXPECT_TRUE(near(dgx2.host(), gx2, rt, at * 4)) << "linear_backward_bf16_dy dinp";
      EXPECT_TRUE(near(dgW2.host(), gW2, rt, at * 8)) << "linear_backward_bf16_dy dW";
    }
    // nullptr gradients are skipped.
    if (bf) G().linear_backward_bf16(nullptr, dgW.p, nullptr, ddy.p, dx16.p, dW16.p, N, Cc, OC);
    else G().linear_backward(nullptr, dgW.p, nullptr, ddy.p, dx.p, dW.p, N, Cc, OC);
    synchronize(default_stream(Device::CUDA));
  }
}

TEST(CudaKernels, AttentionAndRope) {
  REQUIRE_GPU();
  struct Case {
    int64_t B, T, nh, nkv, hd;
  };
  // Row counts B nh T and B nkv T that are not multiples of the 4 warps of a block (the last block's
  // extra warps return at once), and head dims below one element per lane.
  for (const Case& k : {Case{2, 33, 4, 4, 32}, Case{1, 70, 8, 2, 64}, Case{1, 16, 2, 1, 128}, Case{1, 7, 3, 1, 16},
                        Case{1, 9, 2, 1, 8}, Case{1, 11, 6, 2, 48}}) {
    const int64_t ld = (k.nh + 2 * k.nkv) * k.hd, no = k.B * k.T * k.nh * k.hd;
    auto qkv = kt::randn(k.B * k.T * ld, 70 + k.hd), dy = kt::randn(no, 71), g0 = kt::randn(k.B * k.T * ld, 72);
    std::string tag = "B" + std::to_string(k.B) + " T" + std::to_string(k.T) + " nh" + std::to_string(k.nh) + " nkv" +
                      std::to_string(k.nkv) + " hd" + std::to_string(k.hd);
    // Rope forward (theta), then attention; backward through both.
    auto hq = qkv;
    DBuf<float> dq(qkv);
    C().rope_forward(hq.data(), k.B, k.T, k.nh, k.nkv, k.hd, 10000.0f);
    G().rope_forward(dq.p, k.B, k.T, k.nh, k.nkv, k.hd, 10000.0f);
    EXPECT_TRUE(near(dq.host(), hq, 1e-6, 1e-6)) << "rope_forward " << tag;
    std::vector<float> out(no), lse(k.B * k.nh * k.T);
    DBuf<float> dout(out), dlse(lse), ddy(dy), dg(g0);
    C().attention_forward(out.data(), lse.data(), hq.data(), k.B, k.T, k.nh, k.nkv, k.hd, nullptr);
    G().attention_forward(dout.p, dlse.p, dq.p, k.B, k.T, k.nh, k.nkv, k.hd, nullptr);
    EXPECT_TRUE(near(dout.host(), out, 1e-4, 1e-5)) << "attention_forward " << tag;
    EXPECT_TRUE(near(dlse.host(), lse, 1e-5, 1e-5)) << "attention lse " << tag;
    auto g = g0;
    C().attention_backward(g.data(), dy.data(), hq.data(), out.data(), lse.data(), k.B, k.T, k.nh, k.nkv, k.hd, nullptr);
    G().attention_backward(dg.p, ddy.p, dq.p, dout.p, dlse.p, k.B, k.T, k.nh, k.nkv, k.hd, nullptr);
    EXPECT_TRUE(near(dg.host(), g, 1e-4, 1e-4)) << "attention_backward " << tag;
    C().rope_backward(g.data(), k.B, k.T, k.nh, k.nkv, k.hd, 10000.0f);
    G().rope_backward(dg.p, k.B, k.T, k.nh, k.nkv, k.hd, 10000.0f);
    EXPECT_TRUE(near(dg.host(), g, 1e-4, 1e-4)) << "rope_backward " << tag;
    // Explicit frequencies (host array).
    std::vector<float> freq(k.hd / 2);
    for (size_t i = 0; i < freq.size(); ++i) freq[i] = 1.0f / (1.0f + 0.37f * static_cast<float>(i));
    auto f1 = qkv;
    DBuf<float> df(qkv);
    C().rope_forward_freq(f1.data(), k.B, k.T, k.nh, k.nkv, k.hd, freq.data());
    G().rope_forward_freq(df.p, k.B, k.T, k.nh, k.nkv, k.hd, freq.data());
    C().rope_backward_freq(f1.data(), k.B, k.T, k.nh, k.nkv, k.hd, freq.data());
    G().rope_backward_freq(df.p, k.B, k.T, k.nh, k.nkv, k.hd, freq.data());
    EXPECT_TRUE(near(df.host(), f1, 1e-6, 1e-6)) << "rope freq fwd+bwd " << tag;
  }
}

// Every op's CUDA kernel against the CPU baseline at small shapes: the conformance suite of
// `meshtrain check-ops --device cuda` (docs/kernels.md), here under each emulator schedule and
// AddressSanitizer too.
TEST(CudaKernels, EveryOpConformsAtSmallShapes) {
  REQUIRE_GPU();
  const std::vector<conformance::Target> ts = conformance::targets(Device::CUDA);
  ASSERT_EQ(ts.size(), 1u);
  const std::vector<conformance::Result> rs = conformance::run(ts[0], conformance::Options{});
  EXPECT_GT(rs.size(), static_cast<size_t>(kNumOps) / 2);
  for (const conformance::Result& r : rs)
    EXPECT_TRUE(r.supported && r.pass) << op_name(r.op) << " " << r.shape << ": "
                                       << (r.supported ? r.detail : "not supported");
}

}  // namespace
}  // namespace mt::kernels
