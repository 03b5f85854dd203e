// Conformance cases: causal attention (grouped-query) and rotary embedding.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"

namespace mt::kernels::conformance {

namespace {

int64_t qkv_width(const AttnShape& s) { return (s.nh + 2 * s.nkv) * s.hd; }

// q and k of magnitude ~2 per element: scores of a few units after the 1/sqrt(hd) scale, so that
// the softmax is neither flat nor one-hot.
std::vector<float> qkv_input(const AttnShape& s, uint64_t seed) {
  return uniform(s.B * s.T * qkv_width(s), seed, -2.0f, 2.0f);
}

// Causal attention computed exactly (scores, softmax and sums in double, one rounding at the end).
// The CPU kernels' inner products are oneDNN GEMMs, shared by every variant and dependent on the
// ISA level, so attention is checked against this instead of the baseline. One task per sequence
// and kv head: it owns that head's key / value gradients and its query heads' rows.
struct ExactAttention {
  const AttnShape& s;
  int64_t W = (s.nh + 2 * s.nkv) * s.hd;
  double scale = 1.0 / std::sqrt(static_cast<double>(s.hd));
  const int32_t* ds = nullptr;  // document masking: the first key query (b, t) sees, [B*T] (null: 0)
  int64_t first(int64_t b, int64_t t) const { return ds ? ds[b * s.T + t] : 0; }
  const float* q(const float* qkv, int64_t b, int64_t t, int64_t h) const { return qkv + (b * s.T + t) * W + h * s.hd; }
  const float* k(const float* qkv, int64_t b, int64_t t, int64_t g) const { return q(qkv, b, t, s.nh + g); }
  const float* v(const float* qkv, int64_t b, int64_t t, int64_t g) const { return q(qkv, b, t, s.nh + s.nkv + g); }
  double dot(const float* x, const float* y) const {
    double d = 0;
#pragma omp simd reduction(+ : d)
    for (int64_t i = 0; i < s.hd; ++i) d += static_cast<double>(x[i]) * y[i];
    return d;
  }

  void forward(float* out, float* lse, const float* qkv) const {
    const int64_t group = s.nh / s.nkv;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < s.B * s.nh; ++bh) {
      const int64_t b = bh / s.nh, h = bh % s.nh;
      std::vector<double> p(s.T), o(s.hd);
      for (int64_t t = 0; t < s.T; ++t) {
        double m = -INFINITY, z = 0;
        for (int64_t u = first(b, t); u <= t; ++u) {
          p[u] = scale * dot(q(qkv, b, t, h), k(qkv, b, u, h / group));
          m = std::max(m, p[u]);
        }
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t u = first(b, t); u <= t; ++u) {
          const double e = std::exp(p[u] - m);
          z += e;
          const float* vu = v(qkv, b, u, h / group);
          for (int64_t i = 0; i < s.hd; ++i) o[i] += e * vu[i];
        }
        float* y = out + (b * s.T + t) * s.nh * s.hd + h * s.hd;
        for (int64_t i = 0; i < s.hd; ++i) y[i] = static_cast<float>(o[i] / z);
        lse[(b * s.nh + h) * s.T + t] = static_cast<float>(m + std::log(z));
      }
    }
  }

  // dqkv += the gradient, the probabilities recomputed from the given lse (as the kernels do).
  void backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse) const {
    const int64_t group = s.nh / s.nkv, od = s.nh * s.hd;
#pragma omp parallel for schedule(static)
    for (int64_t bg = 0; bg < s.B * s.nkv; ++bg) {
      const int64_t b = bg / s.nkv, g = bg % s.nkv;
      std::vector<double> dk(s.T * s.hd, 0.0), dv(s.T * s.hd, 0.0), dq(s.hd);
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        for (int64_t t = 0; t < s.T; ++t) {
          const float* dy = dout + (b * s.T + t) * od + h * s.hd;
          const double D = dot(dy, out + (b * s.T + t) * od + h * s.hd), L = lse[(b * s.nh + h) * s.T + t];
          std::fill(dq.begin(), dq.end(), 0.0);
          for (int64_t u = first(b, t); u <= t; ++u) {
            const double p = std::exp(scale * dot(q(qkv, b, t, h), k(qkv, b, u, g)) - L);
            const double ds = p * (dot(dy, v(qkv, b, u, g)) - D) * scale;
            const float *ku = k(qkv, b, u, g), *qt = q(qkv, b, t, h);
            for (int64_t i = 0; i < s.hd; ++i) {
              dq[i] += ds * ku[i];
              dk[u * s.hd + i] += ds * qt[i];
              dv[u * s.hd + i] += p * dy[i];
            }
          }
          float* gq = dqkv + (b * s.T + t) * W + h * s.hd;
          for (int64_t i = 0; i < s.hd; ++i) gq[i] = static_cast<float>(gq[i] + dq[i]);
        }
      for (int64_t u = 0; u < s.T; ++u) {
        float* gk = dqkv + (b * s.T + u) * W + (s.nh + g) * s.hd;
        float* gv = dqkv + (b * s.T + u) * W + (s.nh + s.nkv + g) * s.hd;
        for (int64_t i = 0; i < s.hd; ++i) {
          gk[i] = static_cast<float>(gk[i] + dk[u * s.hd + i]);
          gv[i] = static_cast<float>(gv[i] + dv[u * s.hd + i]);
        }
      }
    }
  }
};

void attention(std::vector<CaseSpec>& out, const AttnShape& s) {
  add_case(out, Op::attention_forward, DType::F32, s.model, [s] {
    Case c(Op::attention_forward, DType::F32, s.str());
    const int o = c.out("out", uniform(s.B * s.T * s.nh * s.hd, 200)),
              lse = c.out("lse", uniform(s.B * s.nh * s.T, 201)), q = c.in("qkv", qkv_input(s, 202));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_forward(a.f(o), a.f(lse), a.f(q), s.B, s.T, s.nh, s.nkv, s.hd, nullptr);
    };
    c.exact = [=](const Args& a) { ExactAttention{s}.forward(a.f(o), a.f(lse), a.f(q)); };
    return c;
  });
  add_case(out, Op::attention_backward, DType::F32, s.model, [s] {
    Case c(Op::attention_backward, DType::F32, s.str());
    const std::vector<float> qkv = qkv_input(s, 202);
    std::vector<float> y(s.B * s.T * s.nh * s.hd), lse(s.B * s.nh * s.T);
    reference().attention_forward(y.data(), lse.data(), qkv.data(), s.B, s.T, s.nh, s.nkv, s.hd, nullptr);
    const int g = c.out("dqkv", uniform(qkv.size(), 203)), dy = c.in("dout", uniform(y.size(), 204)),
              q = c.in("qkv", qkv), o = c.in("out", y), l = c.in("lse", lse);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_backward(a.f(g), a.f(dy), a.f(q), a.f(o), a.f(l), s.B, s.T, s.nh, s.nkv, s.hd, nullptr);
    };
    c.exact = [=](const Args& a) { ExactAttention{s}.backward(a.f(g), a.f(dy), a.f(q), a.f(o), a.f(l)); };
    return c;
  });
}

// Document masking: documents start where (t + b) % 5 == 2 (and at every row's start).
std::vector<int32_t> doc_starts(const AttnShape& s) {
  std::vector<int32_t> d(static_cast<size_t>(s.B * s.T));
  for (int64_t b = 0; b < s.B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < s.T; ++t) {
      if ((t + b) % 5 == 2) start = static_cast<int32_t>(t);
      d[b * s.T + t] = start;
    }
  }
  return d;
}

// Long documents: starts where (t + 13 b) % 71 == 40, so whole tiles of 64 or 32 keys lie before
// a query's document (the flash kernels' skipped tiles).
std::vector<int32_t> doc_starts_long(const AttnShape& s) {
  std::vector<int32_t> d(static_cast<size_t>(s.B * s.T));
  for (int64_t b = 0; b < s.B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < s.T; ++t) {
      if ((t + 13 * b) % 71 == 40) start = static_cast<int32_t>(t);
      d[b * s.T + t] = start;
    }
  }
  return d;
}

void attention_docs(std::vector<CaseSpec>& out, const AttnShape& s) {
  add_case(out, Op::attention_forward, DType::F32, s.model, [s] {
    Case c(Op::attention_forward, DType::F32, s.str() + " documents");
    const int o = c.out("out", uniform(s.B * s.T * s.nh * s.hd, 200)),
              lse = c.out("lse", uniform(s.B * s.nh * s.T, 201)), q = c.in("qkv", qkv_input(s, 202)),
              d = c.in("doc_start", doc_starts(s));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_forward(a.f(o), a.f(lse), a.f(q), s.B, s.T, s.nh, s.nkv, s.hd, a.i32(d));
    };
    c.exact = [=](const Args& a) {
      ExactAttention e{s};
      e.ds = a.i32(d);
      e.forward(a.f(o), a.f(lse), a.f(q));
    };
    return c;
  });
  add_case(out, Op::attention_backward, DType::F32, s.model, [s] {
    Case c(Op::attention_backward, DType::F32, s.str() + " documents");
    const std::vector<float> qkv = qkv_input(s, 202);
    const std::vector<int32_t> ds = doc_starts(s);
    std::vector<float> y(s.B * s.T * s.nh * s.hd), lse(s.B * s.nh * s.T);
    reference().attention_forward(y.data(), lse.data(), qkv.data(), s.B, s.T, s.nh, s.nkv, s.hd, ds.data());
    const int g = c.out("dqkv", uniform(qkv.size(), 203)), dy = c.in("dout", uniform(y.size(), 204)),
              q = c.in("qkv", qkv), o = c.in("out", y), l = c.in("lse", lse), d = c.in("doc_start", ds);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_backward(a.f(g), a.f(dy), a.f(q), a.f(o), a.f(l), s.B, s.T, s.nh, s.nkv, s.hd, a.i32(d));
    };
    c.exact = [=](const Args& a) {
      ExactAttention e{s};
      e.ds = a.i32(d);
      e.backward(a.f(g), a.f(dy), a.f(q), a.f(o), a.f(l));
    };
    return c;
  });
}

// The bf16 ops on the bf16-rounded inputs of the fp32 cases; the reference is the exact attention
// of the same bf16 values, its output rounded to bf16 (and, backward, of dout rounded to bf16 and
// the bf16 output the forward leaves).
std::vector<float> widen(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

// docs: 0 causal, 1 document masking with the short documents of doc_starts, 2 with long ones
// (doc_starts_long: whole key tiles before a query's document).
void attention_bf16(std::vector<CaseSpec>& out, const AttnShape& s, int docs = 0) {
  const std::string tag = s.str() + (docs == 1 ? " documents" : docs == 2 ? " long documents" : "");
  const std::vector<int32_t> dsv = docs == 1 ? doc_starts(s) : docs == 2 ? doc_starts_long(s) : std::vector<int32_t>{};
  add_case(out, Op::attention_forward_bf16, DType::BF16, s.model, [s, tag, dsv] {
    Case c(Op::attention_forward_bf16, DType::BF16, tag);
    const int64_t no = s.B * s.T * s.nh * s.hd;
    const int o = c.out("out", to_bf16(uniform(no, 200))), lse = c.out("lse", uniform(s.B * s.nh * s.T, 201)),
              q = c.in("qkv", to_bf16(qkv_input(s, 202))), d = dsv.empty() ? -1 : c.in("doc_start", dsv);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_forward_bf16(a.bf(o), a.f(lse), a.bf(q), s.B, s.T, s.nh, s.nkv, s.hd, d < 0 ? nullptr : a.i32(d));
    };
    c.exact = [=](const Args& a) {
      const std::vector<bf16> qb(a.bf(q), a.bf(q) + s.B * s.T * qkv_width(s));
      std::vector<float> y(static_cast<size_t>(no));
      ExactAttention e{s};
      e.ds = d < 0 ? nullptr : a.i32(d);
      e.forward(y.data(), a.f(lse), widen(qb).data());
      for (int64_t i = 0; i < no; ++i) a.bf(o)[i] = float_to_bf16(y[static_cast<size_t>(i)]);
    };
    return c;
  });
  add_case(out, Op::attention_backward_bf16, DType::BF16, s.model, [s, tag, dsv] {
    Case c(Op::attention_backward_bf16, DType::BF16, tag);
    const std::vector<bf16> qkv = to_bf16(qkv_input(s, 202));
    std::vector<bf16> y(s.B * s.T * s.nh * s.hd);
    std::vector<float> lse(s.B * s.nh * s.T);
    const int32_t* dsp = dsv.empty() ? nullptr : dsv.data();
    reference().attention_forward_bf16(y.data(), lse.data(), qkv.data(), s.B, s.T, s.nh, s.nkv, s.hd, dsp);
    const int g = c.out("dqkv", uniform(qkv.size(), 203)), dy = c.in("dout", uniform(y.size(), 204)),
              q = c.in("qkv", qkv), o = c.in("out", y), l = c.in("lse", lse),
              d = dsv.empty() ? -1 : c.in("doc_start", dsv);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_backward_bf16(a.f(g), a.f(dy), a.bf(q), a.bf(o), a.f(l), s.B, s.T, s.nh, s.nkv, s.hd,
                                d < 0 ? nullptr : a.i32(d));
    };
    c.exact = [=](const Args& a) {
      const std::vector<bf16> qb(a.bf(q), a.bf(q) + s.B * s.T * qkv_width(s));
      std::vector<float> dr(a.f(dy), a.f(dy) + s.B * s.T * s.nh * s.hd);
      for (float& x : dr) x = round_to_bf16(x);
      ExactAttention e{s};
      e.ds = d < 0 ? nullptr : a.i32(d);
      const std::vector<bf16> ob(a.bf(o), a.bf(o) + s.B * s.T * s.nh * s.hd);
      e.backward(a.f(g), dr.data(), widen(qb).data(), widen(ob).data(), a.f(l));
    };
    return c;
  });
}

// Shapes of the bf16 (tensor-core) attention at small sizes: sequence lengths that are no multiple
// of the tiles (16, 32, 64), head dims 32 to 128 and one the kernel pads (40) or hands to the
// simple kernel (144), query heads per kv head 1, 2 and 4.
const std::vector<AttnShape>& bf16_attention_shapes() {
  static const std::vector<AttnShape> v = {
      {"small", 1, 33, 4, 4, 32, false}, {"small", 1, 45, 4, 2, 48, false}, {"small", 1, 77, 4, 1, 64, false},
      {"small", 1, 19, 2, 1, 80, false}, {"small", 1, 70, 2, 1, 128, false}, {"small", 1, 9, 2, 2, 40, false},
      {"small", 1, 7, 2, 1, 144, false},
  };
  return v;
}

// Llama 3.1's scaled frequencies in shape: theta 500000, the low-frequency half divided by 8.
std::vector<float> scaled_inv_freq(int64_t hd) {
  std::vector<float> f(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) {
    const double base = std::pow(500000.0, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
    f[i] = static_cast<float>(i < hd / 4 ? base : base / 8.0);
  }
  return f;
}

void rope(std::vector<CaseSpec>& out, const AttnShape& s) {
  const float theta = s.hd == 128 ? 500000.0f : 10000.0f;
  for (Op op : {Op::rope_forward, Op::rope_backward}) {
    add_case(out, op, DType::F32, s.model, [s, op, theta] {
      Case c(op, DType::F32, s.str());
      const int q = c.out(op == Op::rope_forward ? "qkv" : "dqkv", qkv_input(s, 210));
      c.call = [=](const KernelTable& k, const Args& a) {
        (op == Op::rope_forward ? k.rope_forward : k.rope_backward)(a.f(q), s.B, s.T, s.nh, s.nkv, s.hd, theta);
      };
      return c;
    });
  }
  for (Op op : {Op::rope_forward_freq, Op::rope_backward_freq}) {
    add_case(out, op, DType::F32, s.model, [s, op] {
      Case c(op, DType::F32, s.str());
      const int q = c.out(op == Op::rope_forward_freq ? "qkv" : "dqkv", qkv_input(s, 211)),
                f = c.host("inv_freq", scaled_inv_freq(s.hd));
      c.call = [=](const KernelTable& k, const Args& a) {
        (op == Op::rope_forward_freq ? k.rope_forward_freq : k.rope_backward_freq)(a.f(q), s.B, s.T, s.nh, s.nkv, s.hd,
                                                                                   a.f(f));
      };
      return c;
    });
  }
}

}  // namespace

void attention_cases(std::vector<CaseSpec>& out) {
  for (const AttnShape& s : attention_shapes()) {
    attention(out, s);
    attention_docs(out, s);
    rope(out, s);
    if (s.model) attention_bf16(out, s);
  }
  for (const AttnShape& s : bf16_attention_shapes()) attention_bf16(out, s);
  // Document masking on the bf16 (flash) kernels: odd lengths, several documents per row, two rows.
  for (const AttnShape& s : {AttnShape{"small", 2, 77, 4, 2, 64, false}, AttnShape{"small", 2, 150, 4, 1, 32, false},
                             AttnShape{"small", 1, 45, 4, 2, 48, false}, AttnShape{"small", 2, 9, 2, 2, 40, false},
                             AttnShape{"small", 1, 7, 2, 1, 144, false}}) {
    attention_bf16(out, s, 1);
    attention_bf16(out, s, 2);
  }
}

}  // namespace mt::kernels::conformance
