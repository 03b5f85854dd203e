// The conformance suite's case list and the helpers its families share.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"
#include "kernels/cpu/cpu_isa.h"

namespace mt::kernels::conformance {

size_t elem_size(Elem e) {
  switch (e) {
    case Elem::F32:
      return 4;
    case Elem::I32:
      return 4;
    case Elem::BF16:
      return 2;
    case Elem::I8:
      return 1;
  }
  return 1;
}

std::vector<float> uniform(size_t n, uint64_t seed, float lo, float hi) {
  std::vector<float> v(n);
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // 24 bits: [0, 1)
    v[i] = lo + (hi - lo) * u;
  }
  return v;
}

std::vector<int32_t> uniform_ids(size_t n, uint64_t seed, int32_t lo, int32_t hi) {
  const std::vector<float> u = uniform(n, seed, 0.0f, 1.0f);
  std::vector<int32_t> v(n);
  const double span = static_cast<double>(hi) - lo;
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<int32_t>(std::min<double>(hi - 1, lo + std::floor(static_cast<double>(u[i]) * span)));
  return v;
}

std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = float_to_bf16(v[i]);
  return o;
}

const KernelTable& reference() { return cpu::base::isa_table(); }

void add_case(std::vector<CaseSpec>& out, Op op, DType dt, bool model, std::function<Case()> make) {
  out.push_back(CaseSpec{op, dt, model, std::move(make)});
}

std::string label(const char* tag, std::initializer_list<std::pair<const char*, int64_t>> dims) {
  std::string s = tag;
  for (const auto& [name, v] : dims) s += std::string(" ") + name + "=" + std::to_string(v);
  return s;
}

std::string AttnShape::str() const { return label(tag, {{"B", B}, {"T", T}, {"nh", nh}, {"nkv", nkv}, {"hd", hd}}); }

const std::vector<AttnShape>& attention_shapes() {
  // Head dims 16 and 32 at small shapes (grouped and not), 64 (GPT-2, T = 1000) and 128 (the
  // Llama-style config: 8 query heads on 2 kv heads, T = 77) at model shapes.
  static const std::vector<AttnShape> s = {
      {"small", 2, 77, 6, 2, 16, false},
      {"small", 1, 33, 4, 4, 32, false},
      {"gpt2", 1, 1000, 12, 12, 64, true},
      {"llama", 2, 77, 8, 2, 128, true},
  };
  return s;
}

std::vector<CaseSpec> all_cases() {
  std::vector<CaseSpec> v;
  elementwise_cases(v);
  linear_norm_cases(v);
  attention_cases(v);
  context_parallel_cases(v);
  embedding_loss_cases(v);
  moe_cases(v);
  return v;
}

std::vector<std::string> missing_cases() {
  const std::vector<CaseSpec> cases = all_cases();
  std::vector<std::string> missing;
  for (int i = 0; i < kNumOps; ++i) {
    const Op op = op_at(i);
    for (DType dt : {DType::F32, DType::BF16}) {
      if (!(op_info(op).dtypes & (dt == DType::F32 ? kF32 : kBF16))) continue;
      bool found = false;
      for (const CaseSpec& c : cases) found = found || (c.op == op && c.dtype == dt && !c.model);
      if (!found) missing.push_back(std::string(op_name(op)) + " " + dtype_name(dt));
    }
  }
  return missing;
}

Shapes parse_shapes(const std::string& s) {
  if (s == "small") return Shapes::Small;
  if (s == "model") return Shapes::Model;
  if (s == "all") return Shapes::All;
  throw std::invalid_argument("unknown shape set '" + s + "' (expected small, model or all)");
}

}  // namespace mt::kernels::conformance
