// Conformance cases: token and position embeddings (plain and vocab-parallel) and the losses
// (fused, bf16-gradient, forward-only and vocab-parallel cross-entropy).
#include <cmath>
#include <string>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"

namespace mt::kernels::conformance {

namespace {

struct Emb {
  const char* tag;
  int64_t V, C, B, T;
  bool model;
  std::string str() const { return label(tag, {{"V", V}, {"C", C}, {"B", B}, {"T", T}}); }
};

// Small: ids that repeat (the backward adds them in token order). Model: GPT-2's padded
// vocabulary at T = 1000.
const Emb kEmbs[] = {{"small", 50, 96, 3, 17, false}, {"gpt2", kGpt2Vp, kGpt2C, 1, 1000, true}};

void token_embeddings(std::vector<CaseSpec>& out, const Emb& e) {
  const int64_t N = e.B * e.T;
  add_case(out, Op::embedding_forward, DType::F32, e.model, [e, N] {
    Case c(Op::embedding_forward, DType::F32, e.str());
    const int o = c.out("out", uniform(N * e.C, 400)), ids = c.in("ids", uniform_ids(N, 401, 0, e.V)),
              t = c.in("table", uniform(e.V * e.C, 402));
    c.call = [=](const KernelTable& k, const Args& a) { k.embedding_forward(a.f(o), a.i32(ids), a.f(t), N, e.C); };
    return c;
  });
  add_case(out, Op::embedding_backward, DType::F32, e.model, [e, N] {
    Case c(Op::embedding_backward, DType::F32, e.str());
    const int g = c.out("dtable", uniform(e.V * e.C, 403)), dy = c.in("dout", uniform(N * e.C, 404)),
              ids = c.in("ids", uniform_ids(N, 405, 0, e.V / 3));
    c.call = [=](const KernelTable& k, const Args& a) { k.embedding_backward(a.f(g), a.f(dy), a.i32(ids), N, e.C); };
    return c;
  });
  // A rank's share [lo, lo + rows) of the vocabulary (tensor parallelism over 2 ranks: the second
  // share, which holds the padding rows); the bf16 form reads a bf16 table.
  const int64_t rows = e.V - e.V / 2, lo = e.V / 2;
  for (DType dt : {DType::F32, DType::BF16}) {
    add_case(out, Op::vocab_embedding_forward, dt, e.model, [e, N, rows, lo, dt] {
      Case c(Op::vocab_embedding_forward, dt, e.str() + " lo=" + std::to_string(lo));
      const std::vector<float> tab = uniform(rows * e.C, 406);
      const int o = c.out("out", uniform(N * e.C, 407)), ids = c.in("ids", uniform_ids(N, 408, 0, e.V)),
                t = dt == DType::BF16 ? c.in("table", to_bf16(tab)) : c.in("table", tab);
      c.call = [=](const KernelTable& k, const Args& a) {
        k.vocab_embedding_forward(a.f(o), a.i32(ids), a.v(t), dt, lo, rows, N, e.C);
      };
      return c;
    });
  }
  add_case(out, Op::vocab_embedding_backward, DType::F32, e.model, [e, N, rows, lo] {
    Case c(Op::vocab_embedding_backward, DType::F32, e.str() + " lo=" + std::to_string(lo));
    const int g = c.out("dtable", uniform(rows * e.C, 409)), dy = c.in("dout", uniform(N * e.C, 410)),
              ids = c.in("ids", uniform_ids(N, 411, 0, e.V));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.vocab_embedding_backward(a.f(g), a.f(dy), a.i32(ids), lo, rows, N, e.C);
    };
    return c;
  });
}

void position_embeddings(std::vector<CaseSpec>& out, const Emb& e) {
  add_case(out, Op::position_add_forward, DType::F32, e.model, [e] {
    Case c(Op::position_add_forward, DType::F32, e.str());
    const int x = c.out("x", uniform(e.B * e.T * e.C, 420)), p = c.in("pos", uniform(e.T * e.C, 421));
    c.call = [=](const KernelTable& k, const Args& a) { k.position_add_forward(a.f(x), a.f(p), e.B, e.T, e.C); };
    return c;
  });
  add_case(out, Op::position_add_backward, DType::F32, e.model, [e] {
    Case c(Op::position_add_backward, DType::F32, e.str());
    const int g = c.out("dpos", uniform(e.T * e.C, 422)), dy = c.in("dout", uniform(e.B * e.T * e.C, 423));
    c.call = [=](const KernelTable& k, const Args& a) { k.position_add_backward(a.f(g), a.f(dy), e.B, e.T, e.C); };
    return c;
  });
  // Sequence parallelism over 3 ranks: the middle rank's rows.
  const int64_t R = e.B * e.T / 3 + 1, row0 = R;
  add_case(out, Op::position_add_rows, DType::F32, e.model, [e, R, row0] {
    Case c(Op::position_add_rows, DType::F32, e.str() + " R=" + std::to_string(R));
    const int x = c.out("x", uniform(R * e.C, 424)), p = c.in("pos", uniform(e.T * e.C, 425));
    c.call = [=](const KernelTable& k, const Args& a) { k.position_add_rows(a.f(x), a.f(p), R, e.T, row0, e.C); };
    return c;
  });
}

struct Loss {
  const char* tag;
  int64_t N, V, Vp;
  bool model;
  std::string str() const { return label(tag, {{"N", N}, {"V", V}, {"Vp", Vp}}); }
};

const Loss kLosses[] = {{"small", 29, 1000, 1024, false},
                        {"gpt2", 77, kGpt2V, kGpt2Vp, true},
                        {"llama", kLlamaRows, kLlamaV, kLlamaV, true}};

// Logits of a few units (padded columns hold garbage the loss must ignore); every seventh target
// ignored (-1).
std::vector<float> logits(const Loss& l, uint64_t seed) { return uniform(l.N * l.Vp, seed, -4.0f, 4.0f); }
std::vector<int32_t> targets(const Loss& l, uint64_t seed) {
  std::vector<int32_t> t = uniform_ids(l.N, seed, 0, static_cast<int32_t>(l.V));
  for (size_t i = 3; i < t.size(); i += 7) t[i] = -1;
  return t;
}

void fused_losses(std::vector<CaseSpec>& out, const Loss& l) {
  for (DType dt : {DType::F32, DType::BF16}) {
    const Op op = dt == DType::BF16 ? Op::softmax_cross_entropy_bf16 : Op::softmax_cross_entropy;
    add_case(out, op, dt, l.model, [l, dt, op] {
      Case c(op, dt, l.str());
      const int lg = c.out("logits", logits(l, 430)), ls = c.out("losses", uniform(l.N, 431)),
                t = c.in("targets", targets(l, 432));
      if (dt == DType::BF16) {  // the gradient: a dense bf16 [N, Vp] over the first half of the storage
        c.bufs[lg].view = Elem::BF16;
        c.bufs[lg].view_count = l.N * l.Vp;
      }
      c.call = [=](const KernelTable& k, const Args& a) {
        (dt == DType::BF16 ? k.softmax_cross_entropy_bf16 : k.softmax_cross_entropy)(a.f(lg), a.f(ls), a.i32(t), l.N,
                                                                                     l.V, l.Vp, 1.0f / l.N);
      };
      return c;
    });
  }
  add_case(out, Op::softmax_cross_entropy_forward, DType::F32, l.model, [l] {
    Case c(Op::softmax_cross_entropy_forward, DType::F32, l.str());
    const int lg = c.in("logits", logits(l, 433)), ls = c.out("losses", uniform(l.N, 434)),
              t = c.in("targets", targets(l, 435));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.softmax_cross_entropy_forward(a.f(lg), a.f(ls), a.i32(t), l.N, l.V, l.Vp);
    };
    return c;
  });
}

// The loss from bf16 logits (the head GEMM's bf16 output): losses only, and losses with the bf16
// gradient written over the logits in place.
void losses_from_bf16(std::vector<CaseSpec>& out, const Loss& l) {
  for (bool train : {false, true}) {
    add_case(out, Op::softmax_cross_entropy_from_bf16, DType::BF16, l.model, [l, train] {
      Case c(Op::softmax_cross_entropy_from_bf16, DType::BF16, l.str() + (train ? " train" : " eval"));
      const std::vector<bf16> x = to_bf16(logits(l, 436));
      const int lg = train ? c.out("logits", x) : c.in("logits", x), ls = c.out("losses", uniform(l.N, 437)),
                t = c.in("targets", targets(l, 438));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.softmax_cross_entropy_from_bf16(a.bf(lg), a.f(ls), a.i32(t), l.N, l.V, l.Vp, train, 1.0f / l.N);
      };
      return c;
    });
  }
}

// Vocab-parallel passes on the second of two shares (columns [lo, Vp), of which `valid` are real
// vocabulary), the statistics of the earlier passes from the reference; finish with and without
// the gradient.
void vocab_parallel(std::vector<CaseSpec>& out, const Loss& l) {
  const int64_t lo = l.Vp / 2, Vl = l.Vp - lo, valid = l.V - lo;
  const std::string tag = l.str() + " lo=" + std::to_string(lo);
  add_case(out, Op::vp_ce_rowmax, DType::F32, l.model, [l, Vl, valid, tag] {
    Case c(Op::vp_ce_rowmax, DType::F32, tag);
    const int mx = c.out("rowmax", uniform(l.N, 440)), lg = c.in("lg", uniform(l.N * Vl, 441, -4.0f, 4.0f));
    c.call = [=](const KernelTable& k, const Args& a) { k.vp_ce_rowmax(a.f(mx), a.f(lg), l.N, Vl, valid); };
    return c;
  });
  add_case(out, Op::vp_ce_stats, DType::F32, l.model, [l, lo, Vl, valid, tag] {
    Case c(Op::vp_ce_stats, DType::F32, tag);
    const std::vector<float> lg = uniform(l.N * Vl, 441, -4.0f, 4.0f);
    std::vector<float> mx(l.N);
    reference().vp_ce_rowmax(mx.data(), lg.data(), l.N, Vl, valid);
    const int st = c.out("stats", uniform(2 * l.N, 442)), g = c.in("lg", lg), m = c.in("rowmax", mx),
              t = c.in("targets", targets(l, 443));
    c.call = [=](const KernelTable& k, const Args& a) {
      k.vp_ce_stats(a.f(st), a.f(g), a.f(m), a.i32(t), l.N, Vl, valid, lo);
    };
    return c;
  });
  for (bool train : {true, false}) {
    add_case(out, Op::vp_ce_finish, DType::F32, l.model, [l, lo, Vl, valid, tag, train] {
      Case c(Op::vp_ce_finish, DType::F32, tag + (train ? " train" : " eval"));
      const std::vector<float> lg = uniform(l.N * Vl, 441, -4.0f, 4.0f);
      const std::vector<int32_t> tg = targets(l, 443);
      std::vector<float> mx(l.N), st(2 * l.N);
      reference().vp_ce_rowmax(mx.data(), lg.data(), l.N, Vl, valid);
      reference().vp_ce_stats(st.data(), lg.data(), mx.data(), tg.data(), l.N, Vl, valid, lo);
      const int g = c.out("lg", lg), ls = c.out("losses", uniform(l.N, 444)), m = c.in("rowmax", mx),
                s = c.in("stats", st), t = c.in("targets", tg);
      c.call = [=](const KernelTable& k, const Args& a) {
        k.vp_ce_finish(a.f(g), a.f(ls), a.f(m), a.f(s), a.i32(t), l.N, Vl, valid, lo, train, 1.0f / l.N);
      };
      return c;
    });
  }
}

}  // namespace

void embedding_loss_cases(std::vector<CaseSpec>& out) {
  for (const Emb& e : kEmbs) {
    token_embeddings(out, e);
    position_embeddings(out, e);
  }
  for (const Loss& l : kLosses) {
    fused_losses(out, l);
    losses_from_bf16(out, l);
    vocab_parallel(out, l);
  }
  // A prime vocabulary padded by a width that is a multiple of nothing, an odd row count.
  losses_from_bf16(out, Loss{"odd", 13, 997, 1003, false});
}

}  // namespace mt::kernels::conformance
