// The tensor-parallel layer types (model/tp_layers.h) on 2 thread-backed tp ranks, with and without
// sequence parallelism, against the same layer with tp = 1: each rank's outputs and gradients must
// be its slice of the unsplit layer's (up to the order of the fp32 sums).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "comm/process_group.h"
#include "kernels/backend.h"
#include "model/tp_layers.h"
#include "parallel/tensor_parallel.h"

namespace mt {
namespace {

constexpr int kRanks = 2;
constexpr int64_t N = 8, C = 16;  // tokens, model width

using Vec = std::vector<float>;

Vec values(int64_t n, int seed) {
  Vec v(static_cast<size_t>(n));
  uint32_t s = 2654435761u * static_cast<uint32_t>(seed + 1);
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(s >> 8) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
  }
  return v;
}

Tensor tensor(const Vec& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::F32, MemCategory::Workspace);
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

Vec host(const float* p, int64_t n) { return Vec(p, p + n); }

// Rows [r0, r0 + nr) and columns [c0, c0 + nc) of a row-major matrix with `cols` columns.
Vec block(const Vec& m, int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  Vec out;
  for (int64_t i = r0; i < r0 + nr; ++i)
    for (int64_t j = c0; j < c0 + nc; ++j) out.push_back(m[static_cast<size_t>(i * cols + j)]);
  return out;
}
Vec rows(const Vec& m, int64_t cols, int64_t r0, int64_t nr) { return block(m, cols, r0, nr, 0, cols); }

void expect_near(const Vec& got, const Vec& want, const char* what, int rank) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 2e-5) << what << " [" << i << "] on rank " << rank;
}

// Runs f(ctx) on one rank (tp = 1) or on kRanks thread ranks of one tp group.
void on_tp(int ranks, bool sp, const std::function<void(TpContext&)>& f) {
  auto run = [&](TpComm* comm) {
    TpContext ctx(&kernels::table(Device::CPU), DType::F32, comm);
    ctx.sp = sp && ctx.tp();
    Tensor stage = Tensor::empty({N * C}, DType::F32, MemCategory::Workspace);
    ctx.stage = stage.f32();
    ctx.allocate(N, C);
    f(ctx);
  };
  if (ranks == 1) return run(nullptr);
  auto g = comm::make_thread_group("tp_layers", ranks);
  std::vector<std::thread> ts;
  for (int r = 0; r < ranks; ++r) ts.emplace_back([&, r] {
    omp_set_num_threads(1);
    parallel::ProcessGroupTpComm comm(g[static_cast<size_t>(r)]);
    run(&comm);
  });
  for (auto& t : ts) t.join();
}

class TpLayers : public ::testing::TestWithParam<bool> {};  // parameter: sequence parallelism

// Gate and up of SwiGLU: two weights share one input, one gather and one input-gradient reduction.
TEST_P(TpLayers, ColumnParallelLinearMatchesUnsplit) {
  const bool sp = GetParam();
  const int64_t F = 12, Fl = F / kRanks, R = sp ? N / kRanks : N;
  const Vec x = values(N * C, 1), w1 = values(F * C, 2), w2 = values(F * C, 3), b1 = values(F, 4);
  const Vec dy1 = values(N * F, 5), dy2 = values(N * F, 6);
  // One layer of f output columns per weight on the input rows xs; returns y1, y2, the summed input
  // gradient (this rank's rows), dw1, dw2, db1.
  auto run = [&](TpContext& ctx, const Vec& xs, int64_t nr, const Vec& w1s, const Vec& w2s, const Vec& b1s,
                 const Vec& dy1s, const Vec& dy2s, int64_t f) {
    Tensor xt = tensor(xs), o1 = tensor(Vec(N * f)), o2 = tensor(Vec(N * f)), g1 = tensor(dy1s), g2 = tensor(dy2s);
    Tensor tw1 = tensor(w1s), tw2 = tensor(w2s), tb1 = tensor(b1s);
    Tensor gw1 = tensor(Vec(f * C)), gw2 = tensor(Vec(f * C)), gb1 = tensor(Vec(f)), d = tensor(Vec(N * C));
    ColumnParallelLinear col(ctx, C);
    col.forward(xt, xt.f32(), {{o1.f32(), {tw1.f32(), nullptr, tb1.f32(), nullptr, nullptr, f}},
                               {o2.f32(), {tw2.f32(), nullptr, nullptr, nullptr, nullptr, f}}});
    const float* s = col.backward(xt, {{g1.f32(), {tw1.f32(), nullptr, nullptr, gw1.f32(), gb1.f32(), f}},
                                       {g2.f32(), {tw2.f32(), nullptr, nullptr, gw2.f32(), nullptr, f}}},
                                  d.f32());
    return std::vector<Vec>{host(o1.f32(), N * f), host(o2.f32(), N * f), host(s, nr * C), host(gw1.f32(), f * C),
                            host(gw2.f32(), f * C), host(gb1.f32(), f)};
  };
  std::vector<Vec> full;
  on_tp(1, false, [&](TpContext& ctx) { full = run(ctx, x, N, w1, w2, b1, dy1, dy2, F); });
  on_tp(kRanks, sp, [&](TpContext& ctx) {
    const int r = ctx.rank;
    const int64_t r0 = ctx.sp ? r * R : 0;  // this rank's first row
    const Vec b1s(b1.begin() + r * Fl, b1.begin() + (r + 1) * Fl);
    auto v = run(ctx, rows(x, C, r0, R), R, rows(w1, C, r * Fl, Fl), rows(w2, C, r * Fl, Fl), b1s,
                 block(dy1, F, 0, N, r * Fl, Fl), block(dy2, F, 0, N, r * Fl, Fl), Fl);
    expect_near(v[0], block(full[0], F, 0, N, r * Fl, Fl), "y1", r);
    expect_near(v[1], block(full[1], F, 0, N, r * Fl, Fl), "y2", r);
    expect_near(v[2], rows(full[2], C, r0, R), "dx", r);
    expect_near(v[3], rows(full[3], C, r * Fl, Fl), "dw1", r);
    expect_near(v[4], rows(full[4], C, r * Fl, Fl), "dw2", r);
    expect_near(v[5], Vec(full[5].begin() + r * Fl, full[5].begin() + (r + 1) * Fl), "db1", r);
  });
}

TEST_P(TpLayers, RowParallelLinearMatchesUnsplit) {
  const bool sp = GetParam();
  const int64_t K = 12, Kl = K / kRanks, R = sp ? N / kRanks : N;
  const Vec x = values(N * K, 7), w = values(C * K, 8), b = values(C, 9), dy = values(N * C, 10);
  Vec y, dx, dw, db;
  on_tp(1, false, [&](TpContext& ctx) {
    Tensor xt = tensor(x), tw = tensor(w), tb = tensor(b), o = tensor(Vec(N * C)), g = tensor(dy);
    Tensor d = tensor(Vec(N * K)), gw = tensor(Vec(C * K)), gb = tensor(Vec(C));
    RowParallelLinear row(ctx, K, {tw.f32(), nullptr, tb.f32(), gw.f32(), gb.f32(), C});
    row.forward(o.f32(), xt);
    row.backward(d.f32(), g.f32(), xt);
    y = host(o.f32(), N * C), dx = host(d.f32(), N * K), dw = host(gw.f32(), C * K), db = host(gb.f32(), C);
  });
  on_tp(kRanks, sp, [&](TpContext& ctx) {
    const int r = ctx.rank;
    const int64_t r0 = ctx.sp ? r * R : 0;  // this rank's first row
    Tensor xt = tensor(block(x, K, 0, N, r * Kl, Kl)), tw = tensor(block(w, K, 0, C, r * Kl, Kl)), tb = tensor(b);
    Tensor o = tensor(Vec(R * C)), g = tensor(rows(dy, C, r0, R));
    Tensor d = tensor(Vec(N * Kl)), gw = tensor(Vec(C * Kl)), gb = tensor(Vec(C));
    RowParallelLinear row(ctx, Kl, {tw.f32(), nullptr, tb.f32(), gw.f32(), gb.f32(), C});
    row.forward(o.f32(), xt);
    row.backward(d.f32(), g.f32(), xt);
    expect_near(host(o.f32(), R * C), rows(y, C, r0, R), "y", r);
    expect_near(host(d.f32(), N * Kl), block(dx, K, 0, N, r * Kl, Kl), "dx", r);
    expect_near(host(gw.f32(), C * Kl), block(dw, K, 0, C, r * Kl, Kl), "dw", r);
    expect_near(host(gb.f32(), C), db, "db", r);
  });
}

// LayerNorm and RMSNorm: under SP each rank normalises its rows; the parameter gradients are the
// unsplit ones on every rank.
TEST_P(TpLayers, NormMatchesUnsplit) {
  const bool sp = GetParam();
  const int64_t R = sp ? N / kRanks : N;
  const Vec x = values(N * C, 11), w = values(C, 12), b = values(C, 13), dy = values(N * C, 14);
  for (bool layernorm : {true, false}) {
    Vec y, dx, dw, db;
    auto run = [&](TpContext& ctx, int64_t r0, int64_t nr) {
      Tensor xt = tensor(rows(x, C, r0, nr)), tw = tensor(w), tb = tensor(b), g = tensor(rows(dy, C, r0, nr));
      Tensor o = tensor(Vec(nr * C)), d = tensor(Vec(nr * C)), gw = tensor(Vec(C)), gb = tensor(Vec(C));
      Tensor mean = tensor(Vec(nr)), rstd = tensor(Vec(nr));
      Norm norm(ctx, C, 1e-5f, tw.f32(), layernorm ? tb.f32() : nullptr, gw.f32(), layernorm ? gb.f32() : nullptr,
                layernorm);
      norm.forward(o.f32(), mean, rstd, xt.f32(), nr);
      norm.backward(d.f32(), g.f32(), xt.f32(), mean, rstd, nr);
      return std::vector<Vec>{host(o.f32(), nr * C), host(d.f32(), nr * C), host(gw.f32(), C), host(gb.f32(), C)};
    };
    on_tp(1, false, [&](TpContext& ctx) {
      auto v = run(ctx, 0, N);
      y = v[0], dx = v[1], dw = v[2], db = v[3];
    });
    on_tp(kRanks, sp, [&](TpContext& ctx) {
      const int r = ctx.rank;
      const int64_t r0 = ctx.sp ? r * R : 0;  // this rank's first row
      auto v = run(ctx, r0, R);
      expect_near(v[0], rows(y, C, r0, R), "y", r);
      expect_near(v[1], rows(dx, C, r0, R), "dx", r);
      expect_near(v[2], dw, "dw", r);
      expect_near(v[3], db, "db", r);
    });
  }
}

TEST_P(TpLayers, VocabParallelEmbeddingMatchesUnsplit) {
  const bool sp = GetParam();
  const int64_t Vp = 16, Vl = Vp / kRanks, R = sp ? N / kRanks : N;
  const Vec table = values(Vp * C, 15), dy = values(N * C, 16);
  std::vector<int32_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 5 + 3) % Vp);
  Vec y, dw;
  on_tp(1, false, [&](TpContext& ctx) {
    Tensor tt = tensor(table), o = tensor(Vec(N * C)), g = tensor(dy), gw = tensor(Vec(Vp * C));
    VocabParallelEmbedding emb(ctx, C, 0, Vp);
    emb.forward(o.f32(), ids.data(), tt.f32());
    emb.backward(gw.f32(), emb.grad_rows(g.f32()), ids.data());
    y = host(o.f32(), N * C), dw = host(gw.f32(), Vp * C);
  });
  on_tp(kRanks, sp, [&](TpContext& ctx) {
    const int r = ctx.rank;
    const int64_t r0 = ctx.sp ? r * R : 0;  // this rank's first row
    Tensor tt = tensor(rows(table, C, r * Vl, Vl)), o = tensor(Vec(R * C)), g = tensor(rows(dy, C, r0, R));
    Tensor gw = tensor(Vec(Vl * C));
    VocabParallelEmbedding emb(ctx, C, r * Vl, Vl);
    emb.forward(o.f32(), ids.data(), tt.f32());
    emb.backward(gw.f32(), emb.grad_rows(g.f32()), ids.data());
    expect_near(host(o.f32(), R * C), rows(y, C, r0, R), "y", r);
    expect_near(host(gw.f32(), Vl * C), rows(dw, C, r * Vl, Vl), "dw", r);
  });
}

// The vocabulary (14) is padded to 16 columns: rank 1 holds two padding columns.
TEST_P(TpLayers, VocabParallelCrossEntropyMatchesUnsplit) {
  const int64_t V = 14, Vp = 16, Vl = Vp / kRanks;
  const Vec logits = values(N * Vp, 17);
  std::vector<int32_t> tg(N);
  for (int64_t i = 0; i < N; ++i) tg[static_cast<size_t>(i)] = static_cast<int32_t>((i * 3 + 1) % V);
  for (bool train : {true, false}) {
    Vec loss, grad;
    on_tp(1, false, [&](TpContext& ctx) {
      Tensor lg = tensor(logits), ls = tensor(Vec(N));
      VocabParallelCrossEntropy(ctx, V, 0, Vp).forward(lg.f32(), tg.data(), ls.f32(), N, train, 0.125f);
      loss = host(ls.f32(), N), grad = host(lg.f32(), N * Vp);
    });
    on_tp(kRanks, GetParam(), [&](TpContext& ctx) {
      const int r = ctx.rank;
      Tensor lg = tensor(block(logits, Vp, 0, N, r * Vl, Vl)), ls = tensor(Vec(N));
      VocabParallelCrossEntropy(ctx, V, r * Vl, Vl).forward(lg.f32(), tg.data(), ls.f32(), N, train, 0.125f);
      expect_near(host(ls.f32(), N), loss, "loss", r);
      if (train) expect_near(host(lg.f32(), N * Vl), block(grad, Vp, 0, N, r * Vl, Vl), "dlogits", r);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(SequenceParallel, TpLayers, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "SP" : "TP"; });

}  // namespace
}  // namespace mt
