// The conformance suite's case type (kernels/conformance/check.h): one call of one op on host
// buffers that the runner uploads to the device under test, with the outputs it compares.
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/conformance/check.h"
#include "kernels/ops.h"
#include "runtime/dtype.h"

namespace mt::kernels {
struct KernelTable;
}

namespace mt::kernels::conformance {

enum class Elem : uint8_t { F32, BF16, I32, I8 };
size_t elem_size(Elem e);

// In: device memory the op reads (checked unchanged afterwards). Out: device memory the op writes,
// compared with the reference (it starts with the case's contents: nonzero, so a backward that
// overwrites instead of accumulating fails). Host: host memory by the op's contract (pos, modes,
// inv_freq).
enum class Role : uint8_t { In, Out, Host };

struct Buffer {
  std::string name;
  Elem elem = Elem::F32;
  Role role = Role::In;
  std::vector<unsigned char> bytes;  // initial contents
  // An output is compared as `view_count` elements of `view` from its start (the bf16 gradient
  // softmax_cross_entropy_bf16 leaves over fp32 storage); by default the whole buffer.
  Elem view = Elem::F32;
  size_t view_count = 0;
};

// Pointers to a case's buffers in the memory of the call (index -1: null).
struct Args {
  std::vector<void*> p;
  void* v(int i) const { return i < 0 ? nullptr : p[static_cast<size_t>(i)]; }
  float* f(int i) const { return static_cast<float*>(v(i)); }
  bf16* bf(int i) const { return static_cast<bf16*>(v(i)); }
  int32_t* i32(int i) const { return static_cast<int32_t*>(v(i)); }
  int8_t* i8(int i) const { return static_cast<int8_t*>(v(i)); }
};

struct Case {
  Op op{};
  DType dtype = DType::F32;
  std::string shape;
  std::vector<Buffer> bufs;
  // Calls the op of table k on the buffers (`reduce` instead for an op with a host result, which
  // is compared like an output).
  std::function<void(const KernelTable& k, const Args& a)> call;
  std::function<double(const KernelTable& k, const Args& a)> reduce;
  // The reference computed exactly (in double, on host buffers) instead of by the CPU baseline's
  // kernel: for ops whose CPU kernel every variant shares and whose arithmetic depends on the ISA
  // level (oneDNN's and the AMX GEMMs).
  std::function<void(const Args& a)> exact;

  Case(Op o, DType d, std::string s) : op(o), dtype(d), shape(std::move(s)) {}
  int in(const char* name, const std::vector<float>& v) { return add(name, Role::In, v); }
  int in(const char* name, const std::vector<bf16>& v) { return add(name, Role::In, v); }
  int in(const char* name, const std::vector<int32_t>& v) { return add(name, Role::In, v); }
  int out(const char* name, const std::vector<float>& v) { return add(name, Role::Out, v); }
  int out(const char* name, const std::vector<bf16>& v) { return add(name, Role::Out, v); }
  int out(const char* name, const std::vector<int32_t>& v) { return add(name, Role::Out, v); }
  int host(const char* name, const std::vector<float>& v) { return add(name, Role::Host, v); }
  int host(const char* name, const std::vector<int32_t>& v) { return add(name, Role::Host, v); }
  int host(const char* name, const std::vector<int8_t>& v) { return add(name, Role::Host, v); }

 private:
  template <class T>
  int add(const char* name, Role r, const std::vector<T>& v);
};

template <class T>
int Case::add(const char* name, Role r, const std::vector<T>& v) {
  Buffer b;
  b.name = name;
  b.role = r;
  if constexpr (std::is_same_v<T, float>)
    b.elem = Elem::F32;
  else if constexpr (std::is_same_v<T, bf16>)
    b.elem = Elem::BF16;
  else if constexpr (std::is_same_v<T, int32_t>)
    b.elem = Elem::I32;
  else
    b.elem = Elem::I8;
  b.bytes.resize(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.bytes.data(), v.data(), b.bytes.size());
  b.view = b.elem;
  b.view_count = v.size();
  bufs.push_back(std::move(b));
  return static_cast<int>(bufs.size()) - 1;
}

// A case not yet built (model-shape buffers are large: the runner builds one at a time).
struct CaseSpec {
  Op op{};
  DType dtype = DType::F32;
  bool model = false;  // a model-shape case (else small)
  std::function<Case()> make;
};

// Every case of the suite, in registry order within each family.
std::vector<CaseSpec> all_cases();

// Case families (one file each) append their cases.
void elementwise_cases(std::vector<CaseSpec>& out);
void linear_norm_cases(std::vector<CaseSpec>& out);
void attention_cases(std::vector<CaseSpec>& out);
void context_parallel_cases(std::vector<CaseSpec>& out);
void embedding_loss_cases(std::vector<CaseSpec>& out);
void moe_cases(std::vector<CaseSpec>& out);

// --- helpers for the families ---
// Deterministic uniform values in [lo, hi) (splitmix64; fast enough for model-size buffers).
std::vector<float> uniform(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f);
std::vector<int32_t> uniform_ids(size_t n, uint64_t seed, int32_t lo, int32_t hi);  // in [lo, hi)
std::vector<bf16> to_bf16(const std::vector<float>& v);
// The reference table (cpu::base), for inputs that a forward computes (norm statistics, lse).
const KernelTable& reference();
// A case's shape label: "gpt2 N=333 C=768".
std::string label(const char* tag, std::initializer_list<std::pair<const char*, int64_t>> dims);
// Appends a spec; `model` marks a model-shape case.
void add_case(std::vector<CaseSpec>& out, Op op, DType dt, bool model, std::function<Case()> make);

// Shapes shared by the families. Model shapes: GPT-2 124M (C 768, 12 heads of 64, F 3072,
// vocabulary 50257 padded to 50304) and a Llama-style grouped-query config scaled to width 1024
// (8 heads of 128 on 2 kv heads, SwiGLU F 2816, RMSNorm, vocabulary 32000); row counts and
// sequence lengths that are not multiples of any tile (333, 155, 1000, 77).
struct AttnShape {
  const char* tag;
  int64_t B, T, nh, nkv, hd;
  bool model;
  std::string str() const;
};
const std::vector<AttnShape>& attention_shapes();
inline constexpr int64_t kGpt2C = 768, kGpt2F = 3072, kGpt2V = 50257, kGpt2Vp = 50304, kGpt2Rows = 333;
inline constexpr int64_t kLlamaC = 1024, kLlamaF = 2816, kLlamaV = 32000, kLlamaRows = 155;

}  // namespace mt::kernels::conformance
