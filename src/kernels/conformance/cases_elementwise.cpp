// Conformance cases: elementwise ops, casts, reductions to the host and the optimizer.
#include <algorithm>
#include <cmath>
#include <vector>
#include <string>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"
#include "runtime/device.h"

namespace mt::kernels::conformance {

namespace {

struct Len {
  const char* tag;
  int64_t n;
  bool model;
  std::string str() const { return label(tag, {{"n", n}}); }
};

// Small: not a multiple of any vector width. Model: an MLP activation of GPT-2 (333 rows x F) and
// of the Llama-style config (155 rows x F).
const Len kSmall{"small", 4099, false};
const Len kGpt2Mlp{"gpt2", kGpt2Rows* kGpt2F, true};
const Len kLlamaMlp{"llama", kLlamaRows* kLlamaF, true};
// The parameters of one GPT-2 MLP matrix plus one (odd): the optimizer's and the norm's length.
const Len kGpt2Params{"gpt2", kGpt2C* kGpt2F + 1, true};

void activations(std::vector<CaseSpec>& out) {
  for (const Len& s : {kSmall, kGpt2Mlp}) {
    add_case(out, Op::gelu_forward, DType::F32, s.model, [s] {
      Case c(Op::gelu_forward, DType::F32, s.str());
      const int o = c.out("out", uniform(s.n, 1)), x = c.in("inp", uniform(s.n, 2, -4.0f, 4.0f));
      c.call = [=](const KernelTable& k, const Args& a) { k.gelu_forward(a.f(o), a.f(x), s.n); };
      return c;
    });
    add_case(out, Op::gelu_backward, DType::F32, s.model, [s] {
      Case c(Op::gelu_backward, DType::F32, s.str());
      const int d = c.out("dinp", uniform(s.n, 3)), x = c.in("inp", uniform(s.n, 4, -4.0f, 4.0f)),
                dy = c.in("dout", uniform(s.n, 5));
      c.call = [=](const KernelTable& k, const Args& a) { k.gelu_backward(a.f(d), a.f(x), a.f(dy), s.n); };
      return c;
    });
  }
  for (const Len& s : {kSmall, kLlamaMlp}) {
    add_case(out, Op::swiglu_forward, DType::F32, s.model, [s] {
      Case c(Op::swiglu_forward, DType::F32, s.str());
      const int o = c.out("out", uniform(s.n, 6)), g = c.in("gate", uniform(s.n, 7, -4.0f, 4.0f)),
                u = c.in("up", uniform(s.n, 8));
      c.call = [=](const KernelTable& k, const Args& a) { k.swiglu_forward(a.f(o), a.f(g), a.f(u), s.n); };
      return c;
    });
    add_case(out, Op::swiglu_backward, DType::F32, s.model, [s] {
      Case c(Op::swiglu_backward, DType::F32, s.str());
      const int dg = c.out("dgate", uniform(s.n, 9)), du = c.out("dup", uniform(s.n, 10)),
                dy = c.in("dout", uniform(s.n, 11)), g = c.in("gate", uniform(s.n, 12, -4.0f, 4.0f)),
                u = c.in("up", uniform(s.n, 13));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.swiglu_backward(a.f(dg), a.f(du), a.f(dy), a.f(g), a.f(u), s.n);
      };
      return c;
    });
    // The bf16 forms (Llama's MLP in bf16 runs): bf16 gate and up, bf16 results (the backward's
    // written, not added: they start nonzero).
    add_case(out, Op::swiglu_forward_bf16, DType::BF16, s.model, [s] {
      Case c(Op::swiglu_forward_bf16, DType::BF16, s.str());
      const int o = c.out("out", to_bf16(uniform(s.n, 6))), g = c.in("gate", to_bf16(uniform(s.n, 7, -4.0f, 4.0f))),
                u = c.in("up", to_bf16(uniform(s.n, 8)));
      c.call = [=](const KernelTable& k, const Args& a) { k.swiglu_forward_bf16(a.bf(o), a.bf(g), a.bf(u), s.n); };
      return c;
    });
    add_case(out, Op::swiglu_backward_bf16, DType::BF16, s.model, [s] {
      Case c(Op::swiglu_backward_bf16, DType::BF16, s.str());
      const int dg = c.out("dgate", to_bf16(uniform(s.n, 9))), du = c.out("dup", to_bf16(uniform(s.n, 10))),
                dy = c.in("dout", uniform(s.n, 11)), g = c.in("gate", to_bf16(uniform(s.n, 12, -4.0f, 4.0f))),
                u = c.in("up", to_bf16(uniform(s.n, 13)));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.swiglu_backward_bf16(a.bf(dg), a.bf(du), a.f(dy), a.bf(g), a.bf(u), s.n);
      };
      return c;
    });
  }
}

void arithmetic(std::vector<CaseSpec>& out) {
  for (const Len& s : {kSmall, kGpt2Params}) {
    add_case(out, Op::accumulate, DType::F32, s.model, [s] {
      Case c(Op::accumulate, DType::F32, s.str());
      const int y = c.out("y", uniform(s.n, 20)), x = c.in("x", uniform(s.n, 21));
      c.call = [=](const KernelTable& k, const Args& a) { k.accumulate(a.f(y), a.f(x), s.n); };
      return c;
    });
    add_case(out, Op::scale, DType::F32, s.model, [s] {
      Case c(Op::scale, DType::F32, s.str());
      const int x = c.out("x", uniform(s.n, 22));
      c.call = [=](const KernelTable& k, const Args& a) { k.scale(a.f(x), 0.37f, s.n); };
      return c;
    });
    add_case(out, Op::sum_squares, DType::F32, s.model, [s] {
      Case c(Op::sum_squares, DType::F32, s.str());
      const int x = c.in("x", uniform(s.n, 23));
      c.reduce = [=](const KernelTable& k, const Args& a) { return k.sum_squares(a.f(x), s.n); };
      return c;
    });
    add_case(out, Op::sum, DType::F32, s.model, [s] {
      Case c(Op::sum, DType::F32, s.str());
      const int x = c.in("x", uniform(s.n, 24));
      c.reduce = [=](const KernelTable& k, const Args& a) { return k.sum(a.f(x), s.n); };
      return c;
    });
    // The device-result forms: the double is read back here, after the call.
    for (const bool squares : {true, false}) {
      const Op op = squares ? Op::sum_squares_to : Op::sum_to;
      add_case(out, op, DType::F32, s.model, [s, op, squares] {
        Case c(op, DType::F32, s.str());
        const int x = c.in("x", uniform(s.n, squares ? 25 : 26));
        c.reduce = [=](const KernelTable& k, const Args& a) {
          auto* d = static_cast<double*>(device_alloc(k.device, sizeof(double), MemCategory::Workspace));
          if (squares) k.sum_squares_to(d, a.f(x), s.n);
          else k.sum_to(d, a.f(x), s.n);
          double r = 0;
          dev::copy_to_host(k.device, &r, d, sizeof r);
          device_free(k.device, d, sizeof(double), MemCategory::Workspace);
          return r;
        };
        return c;
      });
    }
  }
}

// Values with the rounding's special cases at the front: infinity, -0, a tie (rounds to even),
// the largest finite values (round to infinity or not), a denormal.
std::vector<float> cast_inputs(int64_t n, uint64_t seed) {
  std::vector<float> v = uniform(n, seed, -3.0f, 3.0f);
  const float specials[] = {INFINITY, -INFINITY, -0.0f, 1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f,
                            3.0e38f,  3.4e38f,   1e-40f};
  for (size_t i = 0; i < std::size(specials) && i < v.size(); ++i) v[i] = specials[i];
  return v;
}

void casts(std::vector<CaseSpec>& out) {
  for (const Len& s : {kSmall, kGpt2Params}) {
    add_case(out, Op::cast_f32_to_bf16, DType::BF16, s.model, [s] {
      Case c(Op::cast_f32_to_bf16, DType::BF16, s.str());
      const int o = c.out("out", to_bf16(uniform(s.n, 30))), x = c.in("in", cast_inputs(s.n, 31));
      c.call = [=](const KernelTable& k, const Args& a) { k.cast_f32_to_bf16(a.bf(o), a.f(x), s.n); };
      return c;
    });
    add_case(out, Op::cast_bf16_to_f32, DType::BF16, s.model, [s] {
      Case c(Op::cast_bf16_to_f32, DType::BF16, s.str());
      const int o = c.out("out", uniform(s.n, 32)), x = c.in("in", to_bf16(cast_inputs(s.n, 33)));
      c.call = [=](const KernelTable& k, const Args& a) { k.cast_bf16_to_f32(a.f(o), a.bf(x), s.n); };
      return c;
    });
  }
}

// A [N, ld] matrix: bias over all columns; a column block taken out (and added back by add_columns,
// context_parallel.cpp). Model: GPT-2's MLP rows and the fused qkv's key/value columns.
void matrix_ops(std::vector<CaseSpec>& out) {
  struct M {
    const char* tag;
    int64_t N, ld, c0, cols;
    bool model;
    std::string str() const { return label(tag, {{"N", N}, {"ld", ld}, {"c0", c0}, {"cols", cols}}); }
  };
  for (const M& m : {M{"small", 37, 300, 71, 129, false}, M{"odd", 5, 301, 3, 7, false},
                     M{"gpt2", 1000, 3 * kGpt2C, kGpt2C, 2 * kGpt2C, true}}) {
    add_case(out, Op::add_bias, DType::F32, m.model, [m] {
      Case c(Op::add_bias, DType::F32, m.str());
      const int x = c.out("x", uniform(m.N * m.ld, 40)), b = c.in("b", uniform(m.ld, 41));
      c.call = [=](const KernelTable& k, const Args& a) { k.add_bias(a.f(x), a.f(b), m.N, m.ld); };
      return c;
    });
    add_case(out, Op::copy_columns, DType::F32, m.model, [m] {
      Case c(Op::copy_columns, DType::F32, m.str());
      const int o = c.out("out", uniform(m.N * m.cols, 42)), x = c.in("in", uniform(m.N * m.ld, 43));
      c.call = [=](const KernelTable& k, const Args& a) { k.copy_columns(a.f(o), a.f(x), m.N, m.ld, m.c0, m.cols); };
      return c;
    });
    add_case(out, Op::add_columns, DType::F32, m.model, [m] {
      Case c(Op::add_columns, DType::F32, m.str());
      const int o = c.out("out", uniform(m.N * m.ld, 44)), x = c.in("in", uniform(m.N * m.cols, 45));
      c.call = [=](const KernelTable& k, const Args& a) { k.add_columns(a.f(o), a.f(x), m.N, m.ld, m.c0, m.cols); };
      return c;
    });
  }
}

// AdamW at step 7 with clipping's grad scale and weight decay; the bf16 form also writes the
// compute copy of the weights.
void optimizer(std::vector<CaseSpec>& out) {
  for (const Len& s : {Len{"small", 5003, false}, kGpt2Params}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      add_case(out, Op::adamw_update, dt, s.model, [s, dt] {
        Case c(Op::adamw_update, dt, s.str());
        const int p = c.out("param", uniform(s.n, 50)), g = c.in("grad", uniform(s.n, 51)),
                  m = c.out("m", uniform(s.n, 52, -0.1f, 0.1f)), v = c.out("v", uniform(s.n, 53, 0.0f, 0.01f));
        const int pb = dt == DType::BF16 ? c.out("param_bf16", to_bf16(uniform(s.n, 54))) : -1;
        c.call = [=](const KernelTable& k, const Args& a) {
          k.adamw_update(a.f(p), a.f(g), a.f(m), a.f(v), s.n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7, 0.7f, a.bf(pb));
        };
        return c;
      });
      // The multi-tensor form over 37 tensors of unequal lengths (more than one launch's group),
      // decay on every other one; clipped by a norm in the device's memory (clip 1) or not (0); a
      // norm that is not finite (clip 2) leaves every tensor as it was.
      for (const int clip : {0, 1, 2}) {
        add_case(out, Op::adamw_update_multi, dt, s.model, [s, dt, clip] {
          Case c(Op::adamw_update_multi, dt, s.str() + (clip == 1 ? " clip" : clip == 2 ? " nan-norm" : ""));
          const int p = c.out("param", uniform(s.n, 55)), g = c.in("grad", uniform(s.n, 56)),
                    m = c.out("m", uniform(s.n, 57, -0.1f, 0.1f)), v = c.out("v", uniform(s.n, 58, 0.0f, 0.01f));
          const int pb = dt == DType::BF16 ? c.out("param_bf16", to_bf16(uniform(s.n, 59))) : -1;
          c.call = [=](const KernelTable& k, const Args& a) {
            std::vector<AdamWTensor> ts;
            for (int64_t off = 0, i = 0; off < s.n; ++i) {
              const int64_t n = std::min<int64_t>(s.n - off, 1 + (i * 7919) % (2 * s.n / 37 + 1));
              ts.push_back({a.f(p) + off, a.f(g) + off, a.f(m) + off, a.f(v) + off,
                            pb < 0 ? nullptr : a.bf(pb) + off, n, i % 2 ? 0.1f : 0.0f});
              off += n;
            }
            double* d = nullptr;
            if (clip) {  // a norm of 3 clipped to 1.5, or a NaN norm
              const double norm_sq = clip == 1 ? 9.0 : std::nan("");
              d = static_cast<double*>(device_alloc(k.device, sizeof(double), MemCategory::Workspace));
              dev::copy_from_host(k.device, d, &norm_sq, sizeof norm_sq);
            }
            k.adamw_update_multi(ts.data(), static_cast<int64_t>(ts.size()), 1e-3f, 0.9f, 0.95f, 1e-8f, 7, 0.7f, d,
                                 1.5);
            if (d) device_free(k.device, d, sizeof(double), MemCategory::Workspace);
          };
          return c;
        });
      }
    }
  }
}

}  // namespace

void elementwise_cases(std::vector<CaseSpec>& out) {
  activations(out);
  arithmetic(out);
  casts(out);
  matrix_ops(out);
  optimizer(out);
}

}  // namespace mt::kernels::conformance
