// Conformance cases: linear layers (fp32 and bf16 GEMMs) and the norms.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"

namespace mt::kernels::conformance {

namespace {

struct Lin {
  const char* tag;
  int64_t N, C, OC;
  bool bias, dinp, model;  // dinp false: the backward gets a null dinp (skipped)
  std::string str() const {
    return label(tag, {{"N", N}, {"C", C}, {"OC", OC}}) + (bias ? " bias" : "") + (dinp ? "" : " no-dinp");
  }
};

// Small: odd sizes with and without a bias (and a null dinp: skipped by the backward).
// Model: GPT-2's MLP up-projection, its LM head (vocabulary padded to 50304), the Llama-style
// SwiGLU projection.
const Lin kLinears[] = {
    {"small", 67, 96, 130, true, true, false},
    {"small", 17, 40, 24, false, false, false},
    {"gpt2", kGpt2Rows, kGpt2C, kGpt2F, true, true, true},
    {"gpt2", 77, kGpt2C, kGpt2Vp, false, true, true},
    {"llama", kLlamaRows, kLlamaC, kLlamaF, false, true, true},
};

// Inputs of magnitude ~1, weights scaled by 1/sqrt(C) and output gradients by 1/sqrt(OC), so that
// every output is of order 1 whatever the shape and one tolerance fits all.
struct LinData {
  std::vector<float> x, W, b, dy;
  explicit LinData(const Lin& l, uint64_t seed)
      : x(uniform(l.N * l.C, seed)),
        W(uniform(l.OC * l.C, seed + 1, -1.0f / std::sqrt(static_cast<float>(l.C)),
                  1.0f / std::sqrt(static_cast<float>(l.C)))),
        b(uniform(l.OC, seed + 2)),
        dy(uniform(l.N * l.OC, seed + 3, -1.0f / std::sqrt(static_cast<float>(l.OC)),
                   1.0f / std::sqrt(static_cast<float>(l.OC)))) {}
};

// The linear layer computed exactly: every sum in double, one rounding to float at the end, the
// operands as the kernel sees them (bf16 widened). The GEMMs are oneDNN's (or the AMX GEMM's) in
// every CPU variant and depend on the ISA level, so they are checked against this instead of the
// baseline. Gradients are added to the outputs' contents.
double wide(float v) { return v; }
double wide(bf16 v) { return bf16_to_float(v); }

template <class T>
void exact_forward(float* out, const T* x, const T* W, const float* bias, const Lin& l) {
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < l.OC; ++o)
    for (int64_t n = 0; n < l.N; ++n) {
      double s = bias ? bias[o] : 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < l.C; ++c) s += wide(x[n * l.C + c]) * wide(W[o * l.C + c]);
      out[n * l.OC + o] = static_cast<float>(s);
    }
}

// dy: the output gradient the GEMMs use (bf16 values where the kernel rounds it).
template <class T, class D>
void exact_backward(float* dinp, float* dW, const D* dy, const T* x, const T* W, const Lin& l) {
  constexpr int64_t kCols = 64;  // dinp: each task a block of columns, every row of W read once
  if (dinp) {
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < l.C; c0 += kCols) {
      const int64_t c1 = std::min(l.C, c0 + kCols);
      std::vector<double> acc(static_cast<size_t>(l.N * kCols), 0.0);
      for (int64_t o = 0; o < l.OC; ++o)
        for (int64_t n = 0; n < l.N; ++n) {
          const double d = wide(dy[n * l.OC + o]);
          for (int64_t c = c0; c < c1; ++c) acc[n * kCols + c - c0] += d * wide(W[o * l.C + c]);
        }
      for (int64_t n = 0; n < l.N; ++n)
        for (int64_t c = c0; c < c1; ++c)
          dinp[n * l.C + c] = static_cast<float>(dinp[n * l.C + c] + acc[n * kCols + c - c0]);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < l.OC; ++o) {
    std::vector<double> acc(static_cast<size_t>(l.C), 0.0);
    for (int64_t n = 0; n < l.N; ++n) {
      const double d = wide(dy[n * l.OC + o]);
      for (int64_t c = 0; c < l.C; ++c) acc[c] += d * wide(x[n * l.C + c]);
    }
    for (int64_t c = 0; c < l.C; ++c) dW[o * l.C + c] = static_cast<float>(dW[o * l.C + c] + acc[c]);
  }
}

void exact_bias_backward(float* dbias, const float* dy, const Lin& l) {
  if (!dbias) return;
  for (int64_t o = 0; o < l.OC; ++o) {
    double s = dbias[o];
    for (int64_t n = 0; n < l.N; ++n) s += dy[n * l.OC + o];
    dbias[o] = static_cast<float>(s);
  }
}

void forward(std::vector<CaseSpec>& out, const Lin& l, DType dt) {
  const Op op = dt == DType::BF16 ? Op::linear_forward_bf16 : Op::linear_forward;
  add_case(out, op, dt, l.model, [l, dt, op] {
    Case c(op, dt, l.str());
    const LinData d(l, 60);
    const int o = c.out("out", uniform(l.N * l.OC, 64));
    const int b = l.bias ? c.in("bias", d.b) : -1;
    if (dt == DType::BF16) {
      const int x = c.in("inp", to_bf16(d.x)), W = c.in("W", to_bf16(d.W));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.linear_forward_bf16(a.f(o), a.bf(x), a.bf(W), a.f(b), l.N, l.C, l.OC);
      };
      c.exact = [=](const Args& a) { exact_forward(a.f(o), a.bf(x), a.bf(W), a.f(b), l); };
    } else {
      const int x = c.in("inp", d.x), W = c.in("W", d.W);
      c.call = [=](const KernelTable& k, const Args& a) {
        k.linear_forward(a.f(o), a.f(x), a.f(W), a.f(b), l.N, l.C, l.OC);
      };
      c.exact = [=](const Args& a) { exact_forward(a.f(o), a.f(x), a.f(W), a.f(b), l); };
    }
    return c;
  });
}

// The bf16 forward with its output rounded to bf16 (Llama's gate and up projections in bf16 runs):
// against the exact GEMM rounded once to bf16.
void forward_out16(std::vector<CaseSpec>& out, const Lin& l) {
  add_case(out, Op::linear_forward_bf16_out16, DType::BF16, l.model, [l] {
    Case c(Op::linear_forward_bf16_out16, DType::BF16, l.str());
    const LinData d(l, 60);
    const int o = c.out("out", to_bf16(uniform(l.N * l.OC, 64)));
    const int b = l.bias ? c.in("bias", d.b) : -1;
    const int x = c.in("inp", to_bf16(d.x)), W = c.in("W", to_bf16(d.W));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.linear_forward_bf16_out16(a.bf(o), a.bf(x), a.bf(W), a.f(b), l.N, l.C, l.OC);
    };
    c.exact = [=](const Args& a) {
      std::vector<float> y(static_cast<size_t>(l.N * l.OC));
      exact_forward(y.data(), a.bf(x), a.bf(W), a.f(b), l);
      for (size_t i = 0; i < y.size(); ++i) a.bf(o)[i] = float_to_bf16(y[i]);
    };
    return c;
  });
}

// Gradients start nonzero (the kernels accumulate). Without a bias dbias is null.
void backward(std::vector<CaseSpec>& out, const Lin& l, DType dt) {
  const Op op = dt == DType::BF16 ? Op::linear_backward_bf16 : Op::linear_backward;
  add_case(out, op, dt, l.model, [l, dt, op] {
    Case c(op, dt, l.str());
    const LinData d(l, 70);
    const int gx = l.dinp ? c.out("dinp", uniform(l.N * l.C, 74)) : -1, gW = c.out("dW", uniform(l.OC * l.C, 75)),
              gb = l.bias ? c.out("dbias", uniform(l.OC, 76)) : -1, dy = c.in("dout", d.dy);
    if (dt == DType::BF16) {
      const int x = c.in("inp", to_bf16(d.x)), W = c.in("W", to_bf16(d.W));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.linear_backward_bf16(a.f(gx), a.f(gW), a.f(gb), a.f(dy), a.bf(x), a.bf(W), l.N, l.C, l.OC);
      };
      c.exact = [=](const Args& a) {  // the kernel rounds dout to bf16 for its GEMMs, not for the bias
        const std::vector<bf16> d16 = to_bf16(std::vector<float>(a.f(dy), a.f(dy) + l.N * l.OC));
        exact_backward(a.f(gx), a.f(gW), d16.data(), a.bf(x), a.bf(W), l);
        exact_bias_backward(a.f(gb), a.f(dy), l);
      };
    } else {
      const int x = c.in("inp", d.x), W = c.in("W", d.W);
      c.call = [=](const KernelTable& k, const Args& a) {
        k.linear_backward(a.f(gx), a.f(gW), a.f(gb), a.f(dy), a.f(x), a.f(W), l.N, l.C, l.OC);
      };
      c.exact = [=](const Args& a) {
        exact_backward(a.f(gx), a.f(gW), a.f(dy), a.f(x), a.f(W), l);
        exact_bias_backward(a.f(gb), a.f(dy), l);
      };
    }
    return c;
  });
  if (dt != DType::BF16) return;
  // The LM head's backward from the bf16 gradient that softmax_cross_entropy_bf16 leaves.
  add_case(out, Op::linear_backward_bf16_dy, dt, l.model, [l] {
    Case c(Op::linear_backward_bf16_dy, DType::BF16, l.str());
    const LinData d(l, 80);
    const int gx = c.out("dinp", uniform(l.N * l.C, 84)), gW = c.out("dW", uniform(l.OC * l.C, 85)),
              dy = c.in("dout", to_bf16(d.dy)), x = c.in("inp", to_bf16(d.x)), W = c.in("W", to_bf16(d.W));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.linear_backward_bf16_dy(a.f(gx), a.f(gW), a.bf(dy), a.bf(x), a.bf(W), l.N, l.C, l.OC);
    };
    c.exact = [=](const Args& a) { exact_backward(a.f(gx), a.f(gW), a.bf(dy), a.bf(x), a.bf(W), l); };
    return c;
  });
}

// GPT-2's MLP with fused GEMM epilogues, against the unfused path computed exactly (the GEMM in
// double, rounded to float once, then GELU in double and the rounding to bf16). Shapes: leading
// dimensions that cuBLASLt can fuse (multiples of 8) and ones it cannot (130: the unfused passes),
// with and without a bias; at model shape the GPT-2 up projection (C 768 -> F 3072: the forward and
// fc's backward) and the down projection (F -> C: the backward through the GELU).
const Lin kGeluLinears[] = {
    {"small", 67, 96, 130, true, true, false},
    {"small", 17, 40, 24, false, false, false},
    {"small", 33, 130, 72, true, true, false},
    {"gpt2", kGpt2Rows, kGpt2C, kGpt2F, true, true, true},
    {"gpt2", kGpt2Rows, kGpt2F, kGpt2C, true, true, true},
};

double gelu_exact(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
double dgelu_exact(double x) {
  const double k = 0.7978845608028654, t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

void gelu_linears(std::vector<CaseSpec>& out, const Lin& l) {
  const bool up = !l.model || l.OC == kGpt2F, down = !l.model || l.C == kGpt2F;
  if (up) add_case(out, Op::linear_gelu_forward_bf16, DType::BF16, l.model, [l] {
    Case c(Op::linear_gelu_forward_bf16, DType::BF16, l.str());
    const LinData d(l, 110);
    const int act = c.out("act", to_bf16(uniform(l.N * l.OC, 114))), pre = c.out("pre", to_bf16(uniform(l.N * l.OC, 115)));
    const int b = l.bias ? c.in("bias", d.b) : -1;
    const int x = c.in("inp", to_bf16(d.x)), W = c.in("W", to_bf16(d.W));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.linear_gelu_forward_bf16(a.bf(act), a.bf(pre), a.bf(x), a.bf(W), a.f(b), l.N, l.C, l.OC);
    };
    c.exact = [=](const Args& a) {
      std::vector<float> y(static_cast<size_t>(l.N * l.OC));
      exact_forward(y.data(), a.bf(x), a.bf(W), a.f(b), l);
      for (size_t i = 0; i < y.size(); ++i) {
        a.bf(pre)[i] = float_to_bf16(y[i]);
        a.bf(act)[i] = float_to_bf16(static_cast<float>(gelu_exact(y[i])));
      }
    };
    return c;
  });
  // Gradients start nonzero (dW and dbias accumulate; dpre is written). Without dinp, dpre is null.
  if (down) add_case(out, Op::linear_backward_dgelu_bf16, DType::BF16, l.model, [l] {
    Case c(Op::linear_backward_dgelu_bf16, DType::BF16, l.str());
    const LinData d(l, 120);
    const int gp = l.dinp ? c.out("dpre", to_bf16(uniform(l.N * l.C, 124))) : -1,
              gW = c.out("dW", uniform(l.OC * l.C, 125)), gb = l.bias ? c.out("dbias", uniform(l.OC, 126)) : -1,
              dy = c.in("dout", d.dy), x = c.in("inp", to_bf16(d.x)), W = c.in("W", to_bf16(d.W)),
              pre = c.in("pre", to_bf16(uniform(l.N * l.C, 127, -3.0f, 3.0f)));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.linear_backward_dgelu_bf16(a.bf(gp), a.f(gW), a.f(gb), a.f(dy), a.bf(x), a.bf(W), a.bf(pre), l.N, l.C, l.OC);
    };
    c.exact = [=](const Args& a) {
      const std::vector<bf16> d16 = to_bf16(std::vector<float>(a.f(dy), a.f(dy) + l.N * l.OC));
      std::vector<float> dx(static_cast<size_t>(l.N * l.C), 0.0f);
      exact_backward(gp >= 0 ? dx.data() : nullptr, a.f(gW), d16.data(), a.bf(x), a.bf(W), l);
      exact_bias_backward(a.f(gb), a.f(dy), l);
      if (gp < 0) return;
      for (size_t i = 0; i < dx.size(); ++i)
        a.bf(gp)[i] = float_to_bf16(static_cast<float>(dx[i] * dgelu_exact(bf16_to_float(a.bf(pre)[i]))));
    };
    return c;
  });
  if (up) add_case(out, Op::linear_backward_bf16_dy_bias, DType::BF16, l.model, [l] {
    Case c(Op::linear_backward_bf16_dy_bias, DType::BF16, l.str());
    const LinData d(l, 130);
    const int gx = l.dinp ? c.out("dinp", uniform(l.N * l.C, 134)) : -1, gW = c.out("dW", uniform(l.OC * l.C, 135)),
              gb = l.bias ? c.out("dbias", uniform(l.OC, 136)) : -1, dy = c.in("dout", to_bf16(d.dy)),
              x = c.in("inp", to_bf16(d.x)), W = c.in("W", to_bf16(d.W));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.linear_backward_bf16_dy_bias(a.f(gx), a.f(gW), a.f(gb), a.bf(dy), a.bf(x), a.bf(W), l.N, l.C, l.OC);
    };
    c.exact = [=](const Args& a) {
      exact_backward(a.f(gx), a.f(gW), a.bf(dy), a.bf(x), a.bf(W), l);
      if (gb < 0) return;
      for (int64_t o = 0; o < l.OC; ++o) {
        double s = a.f(gb)[o];
        for (int64_t n = 0; n < l.N; ++n) s += bf16_to_float(a.bf(dy)[n * l.OC + o]);
        a.f(gb)[o] = static_cast<float>(s);
      }
    };
    return c;
  });
}

struct Rows {
  const char* tag;
  int64_t N, C;
  bool model;
  std::string str() const { return label(tag, {{"N", N}, {"C", C}}); }
};

// Inputs with a nonzero mean and a spread unlike 1, so that the statistics matter.
std::vector<float> norm_input(const Rows& r, uint64_t seed) { return uniform(r.N * r.C, seed, -1.0f, 2.5f); }

void layernorm(std::vector<CaseSpec>& out, const Rows& r) {
  add_case(out, Op::layernorm_forward, DType::F32, r.model, [r] {
    Case c(Op::layernorm_forward, DType::F32, r.str());
    const int o = c.out("out", uniform(r.N * r.C, 90)), mean = c.out("mean", uniform(r.N, 91)),
              rstd = c.out("rstd", uniform(r.N, 92)), x = c.in("inp", norm_input(r, 93)),
              w = c.in("w", uniform(r.C, 94)), b = c.in("b", uniform(r.C, 95));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.layernorm_forward(a.f(o), a.f(mean), a.f(rstd), a.f(x), a.f(w), a.f(b), r.N, r.C, 1e-5f);
    };
    return c;
  });
  // The residual stream (res, updated in place) starts as the branch output; x is the residual.
  add_case(out, Op::residual_layernorm_forward, DType::F32, r.model, [r] {
    Case c(Op::residual_layernorm_forward, DType::F32, r.str());
    const int o = c.out("out", uniform(r.N * r.C, 140)), mean = c.out("mean", uniform(r.N, 141)),
              rstd = c.out("rstd", uniform(r.N, 142)), res = c.out("res", norm_input(r, 143)),
              x = c.in("x", uniform(r.N * r.C, 144)), w = c.in("w", uniform(r.C, 145)), b = c.in("b", uniform(r.C, 146));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.residual_layernorm_forward(a.f(o), a.f(mean), a.f(rstd), a.f(res), a.f(x), a.f(w), a.f(b), r.N, r.C, 1e-5f);
    };
    return c;
  });
  add_case(out, Op::layernorm_backward, DType::F32, r.model, [r] {
    Case c(Op::layernorm_backward, DType::F32, r.str());
    const std::vector<float> x = norm_input(r, 93), w = uniform(r.C, 94), b = uniform(r.C, 95);
    std::vector<float> y(r.N * r.C), mean(r.N), rstd(r.N);
    reference().layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), r.N, r.C, 1e-5f);
    const int gx = c.out("dinp", uniform(r.N * r.C, 96)), gw = c.out("dw", uniform(r.C, 97)),
              gb = c.out("db", uniform(r.C, 98)), dy = c.in("dout", uniform(r.N * r.C, 99)), xi = c.in("inp", x),
              wi = c.in("w", w), mi = c.in("mean", mean), ri = c.in("rstd", rstd);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.layernorm_backward(a.f(gx), a.f(gw), a.f(gb), a.f(dy), a.f(xi), a.f(wi), a.f(mi), a.f(ri), r.N, r.C);
    };
    return c;
  });
}

// The bf16 residual stream: the norm after the add (res_out = bf16(res + x)) and of the stream alone
// (x null), and the backward from the bf16 input.
void layernorm_bf16(std::vector<CaseSpec>& out, const Rows& r) {
  for (bool add : {true, false})
    add_case(out, Op::residual_layernorm_forward_bf16, DType::BF16, r.model, [r, add] {
      Case c(Op::residual_layernorm_forward_bf16, DType::BF16, r.str() + (add ? " add" : " no-add"));
      const int o = c.out("out", uniform(r.N * r.C, 160)), mean = c.out("mean", uniform(r.N, 161)),
                rstd = c.out("rstd", uniform(r.N, 162)),
                ro = add ? c.out("res_out", to_bf16(uniform(r.N * r.C, 163))) : -1,
                res = c.in("res", to_bf16(norm_input(r, 164))), x = add ? c.in("x", uniform(r.N * r.C, 165)) : -1,
                w = c.in("w", uniform(r.C, 166)), b = c.in("b", uniform(r.C, 167));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.residual_layernorm_forward_bf16(a.f(o), a.f(mean), a.f(rstd), a.bf(ro), a.bf(res), a.f(x), a.f(w), a.f(b),
                                          r.N, r.C, 1e-5f);
      };
      return c;
    });
  add_case(out, Op::layernorm_backward_bf16, DType::BF16, r.model, [r] {
    Case c(Op::layernorm_backward_bf16, DType::BF16, r.str());
    const std::vector<bf16> x = to_bf16(norm_input(r, 168));
    const std::vector<float> w = uniform(r.C, 169), b = uniform(r.C, 170);
    std::vector<float> y(r.N * r.C), mean(r.N), rstd(r.N);
    reference().residual_layernorm_forward_bf16(y.data(), mean.data(), rstd.data(), nullptr, x.data(), nullptr,
                                                w.data(), b.data(), r.N, r.C, 1e-5f);
    const int gx = c.out("dinp", uniform(r.N * r.C, 171)), gw = c.out("dw", uniform(r.C, 172)),
              gb = c.out("db", uniform(r.C, 173)), dy = c.in("dout", uniform(r.N * r.C, 174)), xi = c.in("inp", x),
              wi = c.in("w", w), mi = c.in("mean", mean), ri = c.in("rstd", rstd);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.layernorm_backward_bf16(a.f(gx), a.f(gw), a.f(gb), a.f(dy), a.bf(xi), a.f(wi), a.f(mi), a.f(ri), r.N, r.C);
    };
    return c;
  });
  // The add alone (the end of a block): one rounding of the same fp32 sum. Over all but the last
  // 3 elements, so that a kernel moving 8 elements per step also runs its tail (the rest must
  // stay as it was).
  add_case(out, Op::residual_add_bf16, DType::BF16, r.model, [r] {
    Case c(Op::residual_add_bf16, DType::BF16, r.str());
    const int o = c.out("out", to_bf16(uniform(r.N * r.C, 175))), res = c.in("res", to_bf16(norm_input(r, 176))),
              x = c.in("x", uniform(r.N * r.C, 177));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.residual_add_bf16(a.bf(o), a.bf(res), a.f(x), r.N * r.C - 3);
    };
    return c;
  });
}

void rmsnorm_bf16(std::vector<CaseSpec>& out, const Rows& r) {
  for (bool add : {true, false})
    add_case(out, Op::residual_rmsnorm_forward_bf16, DType::BF16, r.model, [r, add] {
      Case c(Op::residual_rmsnorm_forward_bf16, DType::BF16, r.str() + (add ? " add" : " no-add"));
      const int o = c.out("out", uniform(r.N * r.C, 180)), rstd = c.out("rstd", uniform(r.N, 181)),
                ro = add ? c.out("res_out", to_bf16(uniform(r.N * r.C, 182))) : -1,
                res = c.in("res", to_bf16(norm_input(r, 183))), x = add ? c.in("x", uniform(r.N * r.C, 184)) : -1,
                w = c.in("w", uniform(r.C, 185));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.residual_rmsnorm_forward_bf16(a.f(o), a.f(rstd), a.bf(ro), a.bf(res), a.f(x), a.f(w), r.N, r.C, 1e-5f);
      };
      return c;
    });
  add_case(out, Op::rmsnorm_backward_bf16, DType::BF16, r.model, [r] {
    Case c(Op::rmsnorm_backward_bf16, DType::BF16, r.str());
    const std::vector<bf16> x = to_bf16(norm_input(r, 186));
    const std::vector<float> w = uniform(r.C, 187);
    std::vector<float> y(r.N * r.C), rstd(r.N);
    reference().residual_rmsnorm_forward_bf16(y.data(), rstd.data(), nullptr, x.data(), nullptr, w.data(), r.N, r.C,
                                              1e-5f);
    const int gx = c.out("dinp", uniform(r.N * r.C, 188)), gw = c.out("dw", uniform(r.C, 189)),
              dy = c.in("dout", uniform(r.N * r.C, 190)), xi = c.in("inp", x), wi = c.in("w", w),
              ri = c.in("rstd", rstd);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.rmsnorm_backward_bf16(a.f(gx), a.f(gw), a.f(dy), a.bf(xi), a.f(wi), a.f(ri), r.N, r.C);
    };
    return c;
  });
}

void rmsnorm(std::vector<CaseSpec>& out, const Rows& r) {
  add_case(out, Op::rmsnorm_forward, DType::F32, r.model, [r] {
    Case c(Op::rmsnorm_forward, DType::F32, r.str());
    const int o = c.out("out", uniform(r.N * r.C, 100)), rstd = c.out("rstd", uniform(r.N, 101)),
              x = c.in("inp", norm_input(r, 102)), w = c.in("w", uniform(r.C, 103));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.rmsnorm_forward(a.f(o), a.f(rstd), a.f(x), a.f(w), r.N, r.C, 1e-5f);
    };
    return c;
  });
  add_case(out, Op::residual_rmsnorm_forward, DType::F32, r.model, [r] {
    Case c(Op::residual_rmsnorm_forward, DType::F32, r.str());
    const int o = c.out("out", uniform(r.N * r.C, 150)), rstd = c.out("rstd", uniform(r.N, 151)),
              res = c.out("res", norm_input(r, 152)), x = c.in("x", uniform(r.N * r.C, 153)),
              w = c.in("w", uniform(r.C, 154));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.residual_rmsnorm_forward(a.f(o), a.f(rstd), a.f(res), a.f(x), a.f(w), r.N, r.C, 1e-5f);
    };
    return c;
  });
  add_case(out, Op::rmsnorm_backward, DType::F32, r.model, [r] {
    Case c(Op::rmsnorm_backward, DType::F32, r.str());
    const std::vector<float> x = norm_input(r, 102), w = uniform(r.C, 103);
    std::vector<float> y(r.N * r.C), rstd(r.N);
    reference().rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), r.N, r.C, 1e-5f);
    const int gx = c.out("dinp", uniform(r.N * r.C, 104)), gw = c.out("dw", uniform(r.C, 105)),
              dy = c.in("dout", uniform(r.N * r.C, 106)), xi = c.in("inp", x), wi = c.in("w", w),
              ri = c.in("rstd", rstd);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.rmsnorm_backward(a.f(gx), a.f(gw), a.f(dy), a.f(xi), a.f(wi), a.f(ri), r.N, r.C);
    };
    return c;
  });
}

}  // namespace

void linear_norm_cases(std::vector<CaseSpec>& out) {
  for (DType dt : {DType::F32, DType::BF16})
    for (const Lin& l : kLinears) {
      forward(out, l, dt);
      backward(out, l, dt);
    }
  for (const Lin& l : kLinears)
    if (!l.model || l.OC == kLlamaF) forward_out16(out, l);  // odd small shapes and the SwiGLU projection
  for (const Lin& l : kGeluLinears) gelu_linears(out, l);
  for (const Rows& r :
       {Rows{"small", 33, 96, false}, Rows{"small", 7, 1000, false}, Rows{"gpt2", kGpt2Rows, kGpt2C, true}}) {
    layernorm(out, r);
    layernorm_bf16(out, r);
  }
  for (const Rows& r :
       {Rows{"small", 33, 96, false}, Rows{"small", 7, 1000, false}, Rows{"llama", kLlamaRows, kLlamaC, true}}) {
    rmsnorm(out, r);
    rmsnorm_bf16(out, r);
  }
}

}  // namespace mt::kernels::conformance
