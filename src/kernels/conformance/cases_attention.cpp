// Conformance cases: causal attention (grouped-query) and rotary embedding.
#include <cmath>
#include <string>

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

void attention(std::vector<CaseSpec>& out, const AttnShape& s) {
  add_case(out, Op::attention_forward, DType::F32, s.model, [s] {
    Case c(Op::attention_forward, DType::F32, s.str());
    const int o = c.out("out", uniform(s.B * s.T * s.nh * s.hd, 200)),
              lse = c.out("lse", uniform(s.B * s.nh * s.T, 201)), q = c.in("qkv", qkv_input(s, 202));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_forward(a.f(o), a.f(lse), a.f(q), s.B, s.T, s.nh, s.nkv, s.hd);
    };
    return c;
  });
  add_case(out, Op::attention_backward, DType::F32, s.model, [s] {
    Case c(Op::attention_backward, DType::F32, s.str());
    const std::vector<float> qkv = qkv_input(s, 202);
    std::vector<float> y(s.B * s.T * s.nh * s.hd), lse(s.B * s.nh * s.T);
    reference().attention_forward(y.data(), lse.data(), qkv.data(), s.B, s.T, s.nh, s.nkv, s.hd);
    const int g = c.out("dqkv", uniform(qkv.size(), 203)), dy = c.in("dout", uniform(y.size(), 204)),
              q = c.in("qkv", qkv), o = c.in("out", y), l = c.in("lse", lse);
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_backward(a.f(g), a.f(dy), a.f(q), a.f(o), a.f(l), s.B, s.T, s.nh, s.nkv, s.hd);
    };
    return c;
  });
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
    rope(out, s);
  }
}

}  // namespace mt::kernels::conformance
