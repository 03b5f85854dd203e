// Packing with document masking: a packed row of several documents gives every document the
// logits, loss and parameter gradients it gets alone (plain causal attention over just its
// tokens), for learned (GPT-2) and rotary (Llama, grouped-query) positions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/rng.h"
#include "model/transformer.h"

namespace mt {

static void PrintTo(Arch a, std::ostream* os) { *os << arch_name(a); }

namespace {

constexpr int32_t kSep = 60;  // the document separator: starts every document

ModelConfig tiny(Arch a) {
  ModelConfig c = model_preset(a == Arch::GPT2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = 61;
  c.padded_vocab = 0;
  c.resolve();
  return c;
}

struct Doc {
  std::vector<int32_t> x, y;  // inputs (x[0] = kSep) and next-token targets
};

Doc make_doc(int64_t len, uint64_t seed) {
  Rng r(seed);
  Doc d;
  d.x.push_back(kSep);
  for (int64_t i = 1; i < len; ++i) d.x.push_back(static_cast<int32_t>(r.next_u64() % kSep));
  for (int64_t i = 0; i < len; ++i) d.y.push_back(static_cast<int32_t>(r.next_u64() % kSep));
  return d;
}

struct Result {
  double loss_sum = 0;             // summed cross-entropy of the document's targets
  std::vector<float> logits, grads;  // the document's logits rows; every parameter's gradient
};

// x / y of B rows of T tokens; `rows` are the document's rows in the flattened batch (its logits).
Result run(Transformer& m, const std::vector<int32_t>& x, const std::vector<int32_t>& y, int64_t B, int64_t T,
           int64_t row0, int64_t len) {
  Result r;
  const int64_t V = m.config().padded_vocab;
  m.forward(x.data(), y.data(), B, T, false);
  r.logits.assign(m.logits() + row0 * V, m.logits() + (row0 + len) * V);
  m.zero_grads();
  r.loss_sum = m.forward(x.data(), y.data(), B, T, true, 1.0f) * static_cast<double>(B * T);
  m.backward();
  r.grads.assign(m.grads().f32(), m.grads().f32() + m.flat_size());
  return r;
}

double max_abs(const std::vector<float>& v) {
  double a = 0;
  for (float f : v) a = std::max(a, static_cast<double>(std::fabs(f)));
  return a;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double tol = rel * std::max(1.0, max_abs(want));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::fabs(static_cast<double>(got[i]) - want[i]) > tol && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " differ, first at " << first << ": "
                     << got[first] << " vs " << want[first];
}

class DocumentMasking : public ::testing::TestWithParam<Arch> {};

TEST_P(DocumentMasking, PackedDocumentsMatchEachDocumentAlone) {
  const ModelConfig c = tiny(GetParam());
  Transformer m(c, DType::F32);
  m.init_weights(11);
  float* w = m.weights().f32();  // larger weights than the init: attention far from uniform
  Rng r(5);
  for (int64_t i = 0; i < m.flat_size(); ++i) w[i] += static_cast<float>(r.normal() * 0.1);

  const std::vector<Doc> docs = {make_doc(5, 1), make_doc(7, 2), make_doc(4, 3)};
  // Two rows of T = 16: documents 0 1 2, then 2 0 1.
  const std::vector<std::vector<int>> order = {{0, 1, 2}, {2, 0, 1}};
  const int64_t B = 2, T = 16;
  std::vector<int32_t> x;
  std::vector<std::vector<int64_t>> at(docs.size());  // where document k starts, per row
  for (int64_t b = 0; b < B; ++b)
    for (int k : order[b]) {
      at[k].push_back(static_cast<int64_t>(x.size()));
      x.insert(x.end(), docs[k].x.begin(), docs[k].x.end());
    }
  ASSERT_EQ(static_cast<int64_t>(x.size()), B * T);

  for (size_t k = 0; k < docs.size(); ++k) {
    const int64_t len = static_cast<int64_t>(docs[k].x.size());
    m.set_document_masking(-1);  // alone: plain causal attention, positions 0..len-1
    const Result alone = run(m, docs[k].x, docs[k].y, 1, len, 0, len);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t s = at[k][b];
      std::vector<int32_t> y(x.size(), -1);  // train only document k in row b
      std::copy(docs[k].y.begin(), docs[k].y.end(), y.begin() + s);
      m.set_document_masking(kSep);
      const Result packed = run(m, x, y, B, T, s, len);
      SCOPED_TRACE("document " + std::to_string(k) + " in row " + std::to_string(b));
      EXPECT_NEAR(packed.loss_sum, alone.loss_sum, 1e-4 * std::max(1.0, alone.loss_sum));
      expect_near(packed.logits, alone.logits, 1e-4, "logits");
      expect_near(packed.grads, alone.grads, 1e-4, "gradients");
      if (s % T > 0) {  // the test can fail: without the masking a later document sees the earlier ones
        m.set_document_masking(-1);
        const Result plain = run(m, x, y, B, T, s, len);
        EXPECT_GT(std::fabs(plain.loss_sum - alone.loss_sum), 1e-3);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Arch, DocumentMasking, ::testing::Values(Arch::GPT2, Arch::Llama),
                         [](const auto& i) { return std::string(arch_name(i.param)); });

TEST(DocumentMasking, DocumentStartsFollowTheSeparator) {
  const std::vector<int32_t> ids = {3, 4, kSep, 5, kSep, kSep, 6, kSep, 1, 2};
  std::vector<int32_t> ds(ids.size());
  Transformer::document_starts(ids.data(), 2, 5, kSep, ds.data());
  // Row 0: 3 4 | SEP 5 | SEP; row 1 (restarts at 0): SEP 6 | SEP 1 2.
  EXPECT_EQ(ds, (std::vector<int32_t>{0, 0, 2, 2, 4, 0, 0, 2, 2, 2}));
}

}  // namespace
}  // namespace mt
