// The CPU backend's instruction-set variants (kernels/cpu/isa.h, cpu_isa.h): detection and the
// MESHTRAIN_CPU_ISA cap, every kernel of the AVX-512 variant against the baseline (AVX2) variant
// on the same inputs (bit-identical where the arithmetic is the same; within float rounding where
// the vector width changes the order of a reduction), and the binary itself: no AVX-512
// instruction outside the avx512 variant, so a build runs on every x86-64-v3 CPU.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_isa.h"
#include "kernels/cpu/gemm_internal.h"
#include "runtime/dtype.h"
#include "test_util.h"

using namespace mt;
using namespace mt::kernels;
using mt::kernels::cpu::CpuIsa;

namespace {

bool have_avx512() { return cpu::missing_for(CpuIsa::AVX512).empty(); }

// Runs `fn` once per table and compares the vectors it fills: exact (bitwise) or within rtol.
struct Pair {
  const KernelTable& a = cpu::base::isa_table();
  const KernelTable& b = cpu::avx512::isa_table();
};

::testing::AssertionResult same(const std::vector<float>& x, const std::vector<float>& y, double rtol,
                                double atol) {
  if (x.size() != y.size()) return ::testing::AssertionFailure() << "size " << x.size() << " vs " << y.size();
  if (rtol == 0.0 && atol == 0.0) {
    for (size_t i = 0; i < x.size(); ++i) {
      uint32_t u, v;
      std::memcpy(&u, &x[i], 4);
      std::memcpy(&v, &y[i], 4);
      if (u != v)
        return ::testing::AssertionFailure() << "element " << i << ": avx2 " << x[i] << " vs avx512 " << y[i]
                                             << " (bitwise comparison)";
    }
    return ::testing::AssertionSuccess();
  }
  return kt::close(y, kt::to_double(x), rtol, atol);
}

template <class F>
void check(const char* what, F&& fn, double rtol = 0.0, double atol = 0.0) {
  Pair p;
  std::vector<std::vector<float>> ra, rb;
  fn(p.a, ra);
  fn(p.b, rb);
  ASSERT_EQ(ra.size(), rb.size());
  for (size_t i = 0; i < ra.size(); ++i) EXPECT_TRUE(same(ra[i], rb[i], rtol, atol)) << what << ", output " << i;
}

std::vector<float> bf_to_f(const std::vector<bf16>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_to_float(v[i]);
  return r;
}

}  // namespace

TEST(CpuIsa, DetectsTheBaselineAndNamesEveryLevel) {
  for (CpuIsa i : {CpuIsa::AVX2, CpuIsa::AVX512, CpuIsa::AVX512_BF16, CpuIsa::AMX_BF16})
    EXPECT_EQ(cpu::parse_isa(cpu::isa_name(i)), i);
  EXPECT_THROW(cpu::parse_isa("sse2"), std::invalid_argument);
  // This binary is built for x86-64-v3: it runs only where the baseline is there.
  EXPECT_EQ(cpu::missing_for(CpuIsa::AVX2), "");
  EXPECT_EQ(cpu::missing_for(cpu::detected_isa()), "");
  const CpuIsa d = cpu::detected_isa();
  if (d < CpuIsa::AMX_BF16) {
    EXPECT_NE(cpu::missing_for(static_cast<CpuIsa>(static_cast<int>(d) + 1)), "");
  }
  const std::string s = cpu::isa_summary();
  EXPECT_NE(s.find(std::string("isa ") + cpu::isa_name(cpu::active_isa())), std::string::npos) << s;
  EXPECT_NE(s.find("oneDNN "), std::string::npos) << s;
  EXPECT_EQ(s.find("AMX tiles") != std::string::npos, kernels::cpu::detail::amx_gemm_ready()) << s;
  // The dispatched table is the active level's variant.
  EXPECT_EQ(&table(Device::CPU), &cpu::table_for(cpu::active_isa()));
  if (!have_avx512()) {
    EXPECT_THROW(cpu::table_for(CpuIsa::AVX512), std::runtime_error);
  }
}

TEST(CpuIsa, CapFromTheEnvironmentReachesKernelsAndOneDnn) {
  // A fresh process per setting: the cap is read once, before oneDNN's first GEMM.
  const std::string exe = MT_BINARY;
  if (!std::ifstream(exe).good()) GTEST_SKIP() << "meshtrain binary not built at " << exe;
  auto run = [&](const std::string& env) {
    std::string out;
    const std::string cmd = env + " " + exe + " bench --cpu-isa 2>&1";
    std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
    std::array<char, 512> buf;
    while (p && fgets(buf.data(), buf.size(), p.get())) out += buf.data();
    return out;
  };
  const std::string capped = run("MESHTRAIN_CPU_ISA=avx2");
  EXPECT_NE(capped.find("isa avx2"), std::string::npos) << capped;
  EXPECT_NE(capped.find("kernels avx2, oneDNN avx2"), std::string::npos) << capped;
  const std::string bad = run("MESHTRAIN_CPU_ISA=avx1024");
  EXPECT_NE(bad.find("unknown CPU ISA level 'avx1024'"), std::string::npos) << bad;
  // The AMX GEMM switch: 0 turns it off (the header says so by omission), anything but 0 / 1 is refused.
  const std::string off = run("MESHTRAIN_AMX_GEMM=0");
  EXPECT_EQ(off.find("AMX tiles"), std::string::npos) << off;
  EXPECT_NE(off.find("oneDNN "), std::string::npos) << off;
  const std::string wrong = run("MESHTRAIN_AMX_GEMM=off");
  EXPECT_NE(wrong.find("MESHTRAIN_AMX_GEMM=off (expected 0"), std::string::npos) << wrong;
  if (!cpu::missing_for(CpuIsa::AMX_BF16).empty()) {
    const std::string beyond = run("MESHTRAIN_CPU_ISA=amx_bf16");
    EXPECT_NE(beyond.find("lacks"), std::string::npos) << beyond;
    EXPECT_NE(beyond.find("amx"), std::string::npos) << beyond;
  }
}

// Every kernel of the AVX-512 variant against the baseline on the same inputs, one test per family.
class Avx512Variant : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_avx512())
      GTEST_SKIP() << "this CPU lacks " << cpu::missing_for(CpuIsa::AVX512)
                   << ": the avx512 variant cannot run here (it is compiled and checked for stray instructions)";
  }
  using Out = std::vector<std::vector<float>>;
  static constexpr int64_t n = 4099;  // not a multiple of any vector width
  const std::vector<float> x = kt::randn(n, 1), y = kt::randn(n, 2), z = kt::randn(n, 3);
  // Rows for norms, embeddings and losses.
  static constexpr int64_t N = 33, C = 96;
  const std::vector<float> inp = kt::randn(N * C, 4), w = kt::randn(C, 5), b = kt::randn(C, 6),
                           dout = kt::randn(N * C, 7);
  // Attention, grouped-query (6 query heads on 2 kv heads).
  static constexpr int64_t B = 2, T = 77, nh = 6, nkv = 2, hd = 16, ld = (nh + 2 * nkv) * hd;
  const std::vector<float> qkv0 = kt::randn(B * T * ld, 8), datt = kt::randn(B * T * nh * hd, 9);
};

TEST_F(Avx512Variant, ElementwiseKernelsMatchTheBaseline) {
  check("gelu", [&](const KernelTable& k, Out& o) {
    std::vector<float> f(n), d = z;
    k.gelu_forward(f.data(), x.data(), n);
    k.gelu_backward(d.data(), x.data(), y.data(), n);
    o = {f, d};
  });
  check("swiglu", [&](const KernelTable& k, Out& o) {
    std::vector<float> f(n), dg = z, du = x;
    k.swiglu_forward(f.data(), x.data(), y.data(), n);
    k.swiglu_backward(dg.data(), du.data(), z.data(), x.data(), y.data(), n);
    o = {f, dg, du};
  });
  check("accumulate, scale, add_bias, copy_columns", [&](const KernelTable& k, Out& o) {
    std::vector<float> a = x, c(37 * 50);
    k.accumulate(a.data(), y.data(), n);
    k.scale(a.data(), 0.37f, n);
    std::vector<float> m(x.begin(), x.begin() + 37 * 100);
    k.add_bias(m.data(), y.data(), 37, 100);
    k.copy_columns(c.data(), m.data(), 37, 100, 13, 50);
    o = {a, m, c};
  });
  check("sum, casts", [&](const KernelTable& k, Out& o) {
    std::vector<bf16> h(n);
    std::vector<float> back(n);
    k.cast_f32_to_bf16(h.data(), x.data(), n);
    k.cast_bf16_to_f32(back.data(), h.data(), n);
    o = {bf_to_f(h), back, {static_cast<float>(k.sum(x.data(), n))}};
  });
  check("sum_squares", [&](const KernelTable& k, Out& o) {
    o = {{static_cast<float>(k.sum_squares(x.data(), n))}};
  }, 1e-12, 0.0);
  check("adamw", [&](const KernelTable& k, Out& o) {
    std::vector<float> p = x, m = y, v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = std::abs(z[i]);
    std::vector<bf16> pb(n);
    k.adamw_update(p.data(), z.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7, 0.5f, pb.data());
    o = {p, m, v, bf_to_f(pb)};
  });
}

TEST_F(Avx512Variant, NormsMatchTheBaseline) {
  check("layernorm", [&](const KernelTable& k, Out& o) {
    std::vector<float> out(N * C), mean(N), rstd(N), dinp(N * C), dw(C), db(C);
    k.layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C, 1e-5f);
    k.layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(),
                         rstd.data(), N, C);
    o = {out, mean, rstd, dinp, dw, db};
  }, 1e-5, 1e-6);
  check("rmsnorm", [&](const KernelTable& k, Out& o) {
    std::vector<float> out(N * C), rstd(N), dinp(N * C), dw(C);
    k.rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-5f);
    k.rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
    o = {out, rstd, dinp, dw};
  }, 1e-5, 1e-6);
}

TEST_F(Avx512Variant, AttentionAndRotaryEmbeddingMatchTheBaseline) {
  check("rope + attention", [&](const KernelTable& k, Out& o) {
    std::vector<float> qkv = qkv0, att(B * T * nh * hd), lse(B * nh * T), dqkv(B * T * ld, 0.0f);
    k.rope_forward(qkv.data(), B, T, nh, nkv, hd, 10000.0f);
    o.push_back(qkv);
    k.attention_forward(att.data(), lse.data(), qkv.data(), B, T, nh, nkv, hd, nullptr);
    k.attention_backward(dqkv.data(), datt.data(), qkv.data(), att.data(), lse.data(), B, T, nh, nkv, hd, nullptr);
    k.rope_backward(dqkv.data(), B, T, nh, nkv, hd, 10000.0f);
    o.push_back(att);
    o.push_back(lse);
    o.push_back(dqkv);
  }, 1e-4, 1e-5);
  // Context parallelism's block attention (two chunks of 38 tokens: T = 76), positions and columns.
  check("context-parallel block attention, rope_pos, add_columns", [&](const KernelTable& k, Out& o) {
    const int64_t Tb = 76, KVW = 2 * nkv * hd;
    std::vector<float> qkv(qkv0.begin(), qkv0.begin() + B * Tb * ld), kv(B * Tb * KVW), att(B * Tb * nh * hd),
        lse(B * nh * Tb), dqkv(B * Tb * ld, 0.0f), dkv(B * Tb * KVW, 0.0f);
    std::vector<int32_t> p(Tb);
    for (int64_t t = 0; t < Tb; ++t) p[t] = static_cast<int32_t>(t < 38 ? t : 114 + t);
    k.rope_forward_pos(qkv.data(), B, Tb, nh, nkv, hd, 10000.0f, nullptr, p.data());
    k.copy_columns(kv.data(), qkv.data(), B * Tb, ld, nh * hd, KVW);
    const int8_t own[4] = {2, 0, 1, 2}, other[4] = {1, 0, 1, 0};
    k.attention_block_forward(att.data(), lse.data(), qkv.data(), kv.data(), B, Tb, nh, nkv, hd, 2, own, true, nullptr,
                              nullptr);
    k.attention_block_forward(att.data(), lse.data(), qkv.data(), kv.data(), B, Tb, nh, nkv, hd, 2, other, false,
                              nullptr, nullptr);
    for (const int8_t* m : {own, other})
      k.attention_block_backward(dqkv.data(), dkv.data(), datt.data(), qkv.data(), kv.data(), att.data(), lse.data(), B,
                                 Tb, nh, nkv, hd, 2, m, nullptr, nullptr);
    k.add_columns(dqkv.data(), dkv.data(), B * Tb, ld, nh * hd, KVW);
    k.rope_backward_pos(dqkv.data(), B, Tb, nh, nkv, hd, 10000.0f, nullptr, p.data());
    o = {qkv, att, lse, dqkv};
  }, 1e-4, 1e-5);
  check("rope (exact)", [&](const KernelTable& k, Out& o) {
    std::vector<float> qkv = qkv0, freq(hd / 2);
    for (int64_t i = 0; i < hd / 2; ++i) freq[i] = std::pow(500000.0f, -2.0f * i / hd);
    k.rope_forward(qkv.data(), B, T, nh, nkv, hd, 10000.0f);
    k.rope_backward_freq(qkv.data(), B, T, nh, nkv, hd, freq.data());
    o = {qkv};
  });
}

TEST_F(Avx512Variant, EmbeddingsAndLossesMatchTheBaseline) {
  const int64_t V = 1000, Vt = 512, Vp = 1024;
  std::vector<int32_t> ids(N), tg(N);
  for (int64_t i = 0; i < N; ++i) {
    ids[i] = static_cast<int32_t>((i * 37) % V);
    tg[i] = i == 5 ? -1 : static_cast<int32_t>((i * 101) % V);
  }
  const auto tab = kt::randn(V * C, 10), pos = kt::randn(T * C, 11);
  check("embeddings", [&](const KernelTable& k, Out& o) {
    std::vector<float> e(N * C), dt(V * C, 0.0f), x2 = inp, dpos(T * C, 0.0f), v(N * C), dv(Vt * C, 0.0f);
    k.embedding_forward(e.data(), ids.data(), tab.data(), N, C);
    k.embedding_backward(dt.data(), dout.data(), ids.data(), N, C);
    k.position_add_rows(x2.data(), pos.data(), N, T, 3, C);
    k.vocab_embedding_forward(v.data(), ids.data(), tab.data(), DType::F32, 400, Vt, N, C);
    k.vocab_embedding_backward(dv.data(), dout.data(), ids.data(), 400, Vt, N, C);
    o = {e, dt, x2, v, dv};
  });
  const auto logits = kt::randn(N * Vp, 12, 3.0f);
  check("cross-entropy", [&](const KernelTable& k, Out& o) {
    std::vector<float> lg = logits, l1(N), l2(N);
    k.softmax_cross_entropy_forward(lg.data(), l1.data(), tg.data(), N, V, Vp);
    k.softmax_cross_entropy(lg.data(), l2.data(), tg.data(), N, V, Vp, 1.0f / N);
    std::vector<float> vl = logits, mx(N), st(2 * N), l3(N);
    k.vp_ce_rowmax(mx.data(), vl.data(), N, Vp, 600);
    k.vp_ce_stats(st.data(), vl.data(), mx.data(), tg.data(), N, Vp, 600, 0);
    k.vp_ce_finish(vl.data(), l3.data(), mx.data(), st.data(), tg.data(), N, Vp, 600, 0, true, 0.5f);
    o = {l1, l2, lg, mx, st, l3, vl};
  }, 1e-5, 1e-7);
  check("cross-entropy, bf16 gradient", [&](const KernelTable& k, Out& o) {
    std::vector<float> lg = logits, l(N);
    k.softmax_cross_entropy_bf16(lg.data(), l.data(), tg.data(), N, V, Vp, 1.0f / N);
    std::vector<bf16> g(N * Vp);
    std::memcpy(g.data(), lg.data(), g.size() * sizeof(bf16));
    o = {l, bf_to_f(g)};
  }, 1e-5, 1e-7);
}

// Every function of this test program and of the meshtrain binary that uses an AVX-512-only
// register (zmm, ymm16-31/xmm16-31, the k mask registers) must be AVX-512 code by name - the
// avx512 kernel variant, or a probe named *_avx512 that runs only after the run-time check
// (train/compute_probe.cpp): anything else would fault on an AVX2-only CPU.
TEST(CpuIsa, NoAvx512InstructionOutsideTheAvx512Variant) {
  // (objdump is a child process: /proc/self/exe must be resolved here.)
  for (const std::string& exe : {std::filesystem::read_symlink("/proc/self/exe").string(), std::string(MT_BINARY)}) {
    if (!std::ifstream(exe).good()) continue;
    const std::string cmd = "objdump -d -C --no-show-raw-insn " + exe + " 2>/dev/null";
    std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
    ASSERT_TRUE(p) << cmd;
    const std::regex fn_re(R"(^[0-9a-f]+ <(.*)>:$)");
    const std::regex wide_re(R"(%zmm|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|%k[0-7]\b)");
    std::array<char, 4096> buf;
    std::string fn, bad;
    size_t lines = 0, bad_count = 0, inside = 0;
    while (fgets(buf.data(), buf.size(), p.get())) {
      ++lines;
      std::string line(buf.data());
      if (!line.empty() && line.back() == '\n') line.pop_back();
      std::smatch m;
      if (line.size() > 2 && line[0] != ' ' && std::regex_match(line, m, fn_re)) {
        fn = m[1];
        continue;
      }
      if (line.find('%') == std::string::npos || !std::regex_search(line, wide_re)) continue;
      if (fn.find("avx512") != std::string::npos)
        ++inside;
      else if (bad_count++ < 5)
        bad += "\n  " + fn + ":" + line;
    }
    if (lines == 0) GTEST_SKIP() << "objdump is not available";
    EXPECT_EQ(bad_count, 0u) << exe << ": AVX-512 instructions outside the avx512 variant:" << bad;
    // The scan sees wide registers where they belong: the variant really is AVX-512 code.
    EXPECT_GT(inside, 100u) << exe;
  }
}
