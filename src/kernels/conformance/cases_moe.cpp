// Conformance cases: the mixture-of-experts kernels (cpu/moe.h): router forward and backward
// (softmax and sigmoid scores), balance probabilities, the row gathers that sort tokens by expert,
// and the weighted combine and its backward.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"

namespace mt::kernels::conformance {

namespace {

struct Moe {
  const char* tag;
  int64_t N, E, k, C;
  int sigmoid;
  bool model;
  std::string str() const {
    return label(tag, {{"N", N}, {"E", E}, {"k", k}, {"C", C}}) + (sigmoid ? " sigmoid" : " softmax");
  }
};

// Small: Mixtral's softmax router and DeepSeek-V3's sigmoid one. Model: GPT-2 width, 333 tokens,
// 8 experts, top 2.
const Moe kMoes[] = {
    {"small", 37, 8, 2, 96, 0, false}, {"small", 29, 16, 4, 40, 1, false}, {"gpt2", kGpt2Rows, 8, 2, kGpt2C, 0, true}};

struct Routed {
  std::vector<float> logits, scores, w, lse;
  std::vector<int32_t> idx;
  explicit Routed(const Moe& m) : logits(uniform(m.N * m.E, 500, -3.0f, 3.0f)) {
    scores.resize(m.N * m.E), w.resize(m.N * m.k), lse.resize(m.N), idx.resize(m.N * m.k);
    reference().moe_router_forward(scores.data(), idx.data(), w.data(), lse.data(), logits.data(), m.N, m.E, m.k,
                                   m.sigmoid);
  }
};

void router(std::vector<CaseSpec>& out, const Moe& m) {
  add_case(out, Op::moe_router_forward, DType::F32, m.model, [m] {
    Case c(Op::moe_router_forward, DType::F32, m.str());
    const int s = c.out("scores", uniform(m.N * m.E, 501)), idx = c.out("idx", uniform_ids(m.N * m.k, 502, 0, 99)),
              w = c.out("w", uniform(m.N * m.k, 503)), lse = c.out("lse", uniform(m.N, 504)),
              lg = c.in("logits", uniform(m.N * m.E, 500, -3.0f, 3.0f));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.moe_router_forward(a.f(s), a.i32(idx), a.f(w), a.f(lse), a.f(lg), m.N, m.E, m.k, m.sigmoid);
    };
    return c;
  });
  // With the load-balancing term (aux) and the z-loss; dlogits is written.
  add_case(out, Op::moe_router_backward, DType::F32, m.model, [m] {
    Case c(Op::moe_router_backward, DType::F32, m.str());
    const Routed r(m);
    const int g = c.out("dlogits", uniform(m.N * m.E, 505)), dw = c.in("dw", uniform(m.N * m.k, 506)),
              s = c.in("scores", r.scores), idx = c.in("idx", r.idx), w = c.in("w", r.w), lse = c.in("lse", r.lse),
              lg = c.in("logits", r.logits), aux = c.in("aux", uniform(m.E, 507, 0.0f, 0.1f));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.moe_router_backward(a.f(g), a.f(dw), a.f(s), a.i32(idx), a.f(w), a.f(lse), a.f(lg), a.f(aux), 1e-3f, m.N, m.E,
                            m.k, m.sigmoid);
    };
    return c;
  });
  add_case(out, Op::moe_balance_probs, DType::F32, m.model, [m] {
    Case c(Op::moe_balance_probs, DType::F32, m.str());
    const Routed r(m);
    const int P = c.out("P", uniform(m.E, 508)), s = c.in("scores", r.scores);
    c.call = [=](const KernelTable& k, const Args& a) { k.moe_balance_probs(a.f(P), a.f(s), m.N, m.E, m.sigmoid); };
    return c;
  });
}

// The expert rows of the N * k (token, slot) pairs in a shuffled order, every fifth dropped (-1).
std::vector<int32_t> expert_rows(const Moe& m, uint64_t seed) {
  std::vector<int32_t> rows(m.N * m.k);
  std::iota(rows.begin(), rows.end(), 0);
  const std::vector<int32_t> r = uniform_ids(rows.size(), seed, 0, 1 << 30);
  for (size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[static_cast<size_t>(r[i - 1]) % i]);
  for (size_t i = 2; i < rows.size(); i += 5) rows[i] = -1;
  return rows;
}

void dispatch(std::vector<CaseSpec>& out, const Moe& m) {
  // Gathers N * k rows of C elements (fp32 activations, or the bf16 compute copy).
  for (DType dt : {DType::F32, DType::BF16}) {
    add_case(out, Op::moe_gather_rows, dt, m.model, [m, dt] {
      Case c(Op::moe_gather_rows, dt, m.str());
      const int64_t n = m.N * m.k, row_bytes = m.C * static_cast<int64_t>(dtype_size(dt));
      const std::vector<float> src = uniform(m.N * m.C, 510), dst = uniform(n * m.C, 511);
      const int o = dt == DType::BF16 ? c.out("out", to_bf16(dst)) : c.out("out", dst),
                in = dt == DType::BF16 ? c.in("in", to_bf16(src)) : c.in("in", src);
      std::vector<int32_t> rows = uniform_ids(n, 512, 0, static_cast<int32_t>(m.N));
      for (size_t i = 4; i < rows.size(); i += 9) rows[i] = -1;  // padding rows
      const int r = c.in("rows", rows);
      c.call = [=](const KernelTable& k, const Args& a) { k.moe_gather_rows(a.v(o), a.v(in), a.i32(r), n, row_bytes); };
      return c;
    });
  }
  // out[t] += sum_j w[t, j] y[pos[t, j]]: with the router's weights, and with none (weight 1).
  for (bool weighted : {true, false}) {
    if (m.model && !weighted) continue;
    add_case(out, Op::moe_combine, DType::F32, m.model, [m, weighted] {
      Case c(Op::moe_combine, DType::F32, m.str() + (weighted ? "" : " unweighted"));
      const int o = c.out("out", uniform(m.N * m.C, 520)), y = c.in("y", uniform(m.N * m.k * m.C, 521)),
                p = c.in("pos", expert_rows(m, 522)),
                w = weighted ? c.in("w", uniform(m.N * m.k, 523, 0.0f, 1.0f)) : -1;
      c.call = [=](const KernelTable& k, const Args& a) {
        k.moe_combine(a.f(o), a.f(y), a.i32(p), a.f(w), m.N, m.k, m.C);
      };
      return c;
    });
  }
  add_case(out, Op::moe_combine_backward, DType::F32, m.model, [m] {
    Case c(Op::moe_combine_backward, DType::F32, m.str());
    const int dy = c.out("dy", uniform(m.N * m.k * m.C, 530)), dw = c.out("dw", uniform(m.N * m.k, 531)),
              g = c.in("dout", uniform(m.N * m.C, 532)), y = c.in("y", uniform(m.N * m.k * m.C, 533)),
              p = c.in("pos", expert_rows(m, 534)), w = c.in("w", uniform(m.N * m.k, 535, 0.0f, 1.0f));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.moe_combine_backward(a.f(dy), a.f(dw), a.f(g), a.f(y), a.i32(p), a.f(w), m.N, m.k, m.C);
    };
    return c;
  });
}

}  // namespace

void moe_cases(std::vector<CaseSpec>& out) {
  for (const Moe& m : kMoes) {
    router(out, m);
    dispatch(out, m);
  }
}

}  // namespace mt::kernels::conformance
