// Conformance cases: context parallelism's block attention and the position-indexed rotary and
// learned position embeddings (cpu/attention_block.h). A rank of cp = 2 holds two chunks of every
// sequence (load balancing: chunks 0 and 3 of 4), so its T tokens sit at positions 0..c-1 and
// 3c..4c-1 with c = T / 2.
#include <cmath>
#include <string>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"

namespace mt::kernels::conformance {

namespace {

// Small: chunks of 38 and 17 tokens; model: GPT-2 (chunks of 500, hd 64) and the Llama-style
// config (chunks of 77, hd 128, grouped).
const AttnShape kCpShapes[] = {
    {"small", 2, 76, 6, 2, 16, false},
    {"small", 1, 34, 4, 4, 32, false},
    {"gpt2", 1, 1000, 12, 12, 64, true},
    {"llama", 1, 154, 8, 2, 128, true},
};

// modes[a * 2 + b]: how query chunk a sees key chunk b (0 skip, 1 full, 2 causal).
const std::vector<int8_t> kOwn = {2, 0, 1, 2};    // the rank's own keys
const std::vector<int8_t> kOther = {1, 0, 1, 0};  // an earlier rank's block
const std::vector<int8_t> kHalf = {0, 0, 1, 1};   // query chunk 0 sees none of this block

int64_t qkv_width(const AttnShape& s) { return (s.nh + 2 * s.nkv) * s.hd; }
int64_t kv_width(const AttnShape& s) { return 2 * s.nkv * s.hd; }

std::vector<int32_t> cp_positions(int64_t T) {
  std::vector<int32_t> p(T);
  const int64_t c = T / 2;
  for (int64_t t = 0; t < T; ++t) p[t] = static_cast<int32_t>(t < c ? t : t + 2 * c);
  return p;
}

// Document masking: the rank's queries sit at cp_positions (chunks 0 and 3 of 4), documents start
// where (position + b) % 7 == 3 (and at every sequence's start); both key blocks' chunks at the
// positions 0 and 3c (so the other block's key chunk 0, seen fully, is cut by the documents and
// query chunk 1 sees none of it: the rows that see nothing of a block).
struct Docs {
  std::vector<int32_t> ds, ks;
  explicit Docs(const AttnShape& s) : ds(static_cast<size_t>(s.B * s.T)), ks{0, static_cast<int32_t>(3 * (s.T / 2))} {
    const std::vector<int32_t> p = cp_positions(s.T);
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = 0; t < s.T; ++t) {
        int32_t g = p[t];
        while (g > 0 && (g + b) % 7 != 3) --g;
        ds[b * s.T + t] = g;
      }
  }
};

struct BlockData {
  std::vector<float> qkv, kv_own, kv_other, out, lse;  // out / lse: after the own and the other block
  const int32_t *ds = nullptr, *ks = nullptr;  // document masking (null: none)
  explicit BlockData(const AttnShape& s, const Docs* docs = nullptr)
      : qkv(uniform(s.B * s.T * qkv_width(s), 300, -2.0f, 2.0f)) {
    if (docs) {
      ds = docs->ds.data();
      ks = docs->ks.data();
    }
    kv_own.resize(s.B * s.T * kv_width(s));
    reference().copy_columns(kv_own.data(), qkv.data(), s.B * s.T, qkv_width(s), s.nh * s.hd, kv_width(s));
    kv_other = uniform(kv_own.size(), 301, -2.0f, 2.0f);
    out.resize(s.B * s.T * s.nh * s.hd);
    lse.resize(s.B * s.nh * s.T);
    const KernelTable& r = reference();
    r.attention_block_forward(out.data(), lse.data(), qkv.data(), kv_own.data(), s.B, s.T, s.nh, s.nkv, s.hd, 2,
                              kOwn.data(), true, ds, ks);
  }
  void merge_other(const AttnShape& s) {
    reference().attention_block_forward(out.data(), lse.data(), qkv.data(), kv_other.data(), s.B, s.T, s.nh, s.nkv,
                                        s.hd, 2, kOther.data(), false, ds, ks);
  }
};

// first: out / lse start as garbage and are overwritten; else the other block merges into the
// own block's result.
void block_forward(std::vector<CaseSpec>& out, const AttnShape& s, const std::vector<int8_t>& modes, bool first,
                   bool docs = false) {
  const std::string tag = s.str() + (first ? " first" : " merge") + (modes == kHalf ? " half" : "") +
                          (docs ? " documents" : "");
  add_case(out, Op::attention_block_forward, DType::F32, s.model, [s, modes, first, tag, docs] {
    Case c(Op::attention_block_forward, DType::F32, tag);
    const Docs dd(s);
    BlockData d(s, docs ? &dd : nullptr);
    const int o = c.out("out", first ? uniform(d.out.size(), 302) : d.out),
              l = c.out("lse", first ? uniform(d.lse.size(), 303) : d.lse), q = c.in("qkv", d.qkv),
              kv = c.in("kv", first ? d.kv_own : d.kv_other), m = c.host("modes", modes),
              ds = docs ? c.in("doc_start", dd.ds) : -1, ks = docs ? c.host("key_start", dd.ks) : -1;
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_block_forward(a.f(o), a.f(l), a.f(q), a.f(kv), s.B, s.T, s.nh, s.nkv, s.hd, 2, a.i8(m), first,
                                docs ? a.i32(ds) : nullptr, docs ? a.i32(ks) : nullptr);
    };
    return c;
  });
}

void block_backward(std::vector<CaseSpec>& out, const AttnShape& s, bool own, bool docs = false) {
  add_case(out, Op::attention_block_backward, DType::F32, s.model, [s, own, docs] {
    Case c(Op::attention_block_backward, DType::F32,
           s.str() + (own ? " own" : " other") + (docs ? " documents" : ""));
    const Docs dd(s);
    BlockData d(s, docs ? &dd : nullptr);
    d.merge_other(s);
    const int gq = c.out("dqkv", uniform(d.qkv.size(), 304)), gkv = c.out("dkv", uniform(d.kv_own.size(), 305)),
              dy = c.in("dout", uniform(d.out.size(), 306)), q = c.in("qkv", d.qkv),
              kv = c.in("kv", own ? d.kv_own : d.kv_other), o = c.in("out", d.out), l = c.in("lse", d.lse),
              m = c.host("modes", own ? kOwn : kOther), ds = docs ? c.in("doc_start", dd.ds) : -1,
              ks = docs ? c.host("key_start", dd.ks) : -1;
    c.call = [=](const KernelTable& k, const Args& a) {
      k.attention_block_backward(a.f(gq), a.f(gkv), a.f(dy), a.f(q), a.f(kv), a.f(o), a.f(l), s.B, s.T, s.nh, s.nkv,
                                 s.hd, 2, a.i8(m), docs ? a.i32(ds) : nullptr, docs ? a.i32(ks) : nullptr);
    };
    return c;
  });
}

// Rotary embedding at the rank's positions: theta, or (hd 128, the Llama-style config) explicit
// frequencies.
void rope_pos(std::vector<CaseSpec>& out, const AttnShape& s) {
  for (Op op : {Op::rope_forward_pos, Op::rope_backward_pos}) {
    add_case(out, op, DType::F32, s.model, [s, op] {
      const bool freq = s.hd == 128 || !s.model;
      Case c(op, DType::F32, s.str() + (freq ? " inv_freq" : " theta"));
      std::vector<float> f(s.hd / 2);
      for (int64_t i = 0; i < s.hd / 2; ++i) f[i] = 1.0f / (1.0f + 0.37f * static_cast<float>(i));
      const int q = c.out("qkv", uniform(s.B * s.T * qkv_width(s), 310, -2.0f, 2.0f)),
                p = c.host("pos", cp_positions(s.T)), fr = freq ? c.host("inv_freq", f) : -1;
      c.call = [=](const KernelTable& k, const Args& a) {
        (op == Op::rope_forward_pos ? k.rope_forward_pos : k.rope_backward_pos)(a.f(q), s.B, s.T, s.nh, s.nkv, s.hd,
                                                                                10000.0f, a.f(fr), a.i32(p));
      };
      return c;
    });
  }
}

// Learned positions (GPT-2) at the rank's positions; sp: the second half of the rows of a
// sequence-parallel pair (row0 > 0).
void positions(std::vector<CaseSpec>& out) {
  struct P {
    const char* tag;
    int64_t B, T, C;
    bool sp, model;
    std::string str() const { return label(tag, {{"B", B}, {"T", T}, {"C", C}}) + (sp ? " sp" : ""); }
  };
  for (const P& s : {P{"small", 2, 76, 96, false, false}, P{"small", 3, 34, 40, true, false},
                     P{"gpt2", 1, 500, kGpt2C, false, true}}) {
    const int64_t rows = 2 * s.T;  // the table covers every position of the full sequence
    add_case(out, Op::position_add_pos, DType::F32, s.model, [s, rows] {
      Case c(Op::position_add_pos, DType::F32, s.str());
      const int64_t R = s.sp ? s.B * s.T / 2 : s.B * s.T, row0 = s.sp ? R : 0;
      const int x = c.out("x", uniform(R * s.C, 320)), t = c.in("table", uniform(rows * s.C, 321)),
                p = c.host("pos", cp_positions(s.T));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.position_add_pos(a.f(x), a.f(t), a.i32(p), R, s.T, row0, s.C);
      };
      return c;
    });
    add_case(out, Op::position_backward_pos, DType::F32, s.model, [s, rows] {
      Case c(Op::position_backward_pos, DType::F32, s.str());
      const int g = c.out("dtable", uniform(rows * s.C, 322)), dy = c.in("dout", uniform(s.B * s.T * s.C, 323)),
                p = c.host("pos", cp_positions(s.T));
      c.call = [=](const KernelTable& k, const Args& a) {
        k.position_backward_pos(a.f(g), a.f(dy), a.i32(p), s.B, s.T, s.C);
      };
      return c;
    });
  }
}

}  // namespace

void context_parallel_cases(std::vector<CaseSpec>& out) {
  for (const AttnShape& s : kCpShapes) {
    if (!s.model) {
      block_forward(out, s, kOwn, true);
      block_forward(out, s, kHalf, true);
    }
    block_forward(out, s, kOther, false);
    block_backward(out, s, true);
    block_backward(out, s, false);
    if (!s.model) {  // document masking (docs/context_parallel.md)
      block_forward(out, s, kOwn, true, true);
      block_forward(out, s, kOther, false, true);
      block_backward(out, s, true, true);
      block_backward(out, s, false, true);
    }
    rope_pos(out, s);
  }
  positions(out);
}

}  // namespace mt::kernels::conformance
