// Runs conformance cases on a target table and compares them with the CPU baseline.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "kernels/conformance/case.h"
#include "kernels/cpu/cpu_isa.h"

namespace mt::kernels::conformance {

namespace {

using Bytes = std::vector<unsigned char>;

// What one call left: the outputs' bytes afterwards (and, when asked for, the inputs', to check
// them) and the host result.
struct Run {
  std::vector<Bytes> bufs;
  double result = 0;
};

// A case's buffers in device d's memory (host-role buffers in host memory), freed at scope exit.
class Placed {
 public:
  Placed(const Case& c, Device d) : c_(c), d_(d), ptrs_(c.bufs.size(), nullptr), host_(c.bufs.size()) {
    for (size_t i = 0; i < c.bufs.size(); ++i) {
      const Buffer& b = c.bufs[i];
      if (b.role == Role::Host) {
        host_[i] = b.bytes;
        ptrs_[i] = host_[i].data();
        continue;
      }
      ptrs_[i] = device_alloc(d, std::max<size_t>(b.bytes.size(), 1), MemCategory::Workspace);
      dev::copy_from_host(d, ptrs_[i], b.bytes.data(), b.bytes.size());
    }
  }
  ~Placed() {
    for (size_t i = 0; i < c_.bufs.size(); ++i)
      if (ptrs_[i] && c_.bufs[i].role != Role::Host)
        device_free(d_, ptrs_[i], std::max<size_t>(c_.bufs[i].bytes.size(), 1), MemCategory::Workspace);
  }
  Placed(const Placed&) = delete;
  Placed& operator=(const Placed&) = delete;
  const std::vector<void*>& ptrs() const { return ptrs_; }
  Bytes copy_back(size_t i) const {
    Bytes b(c_.bufs[i].bytes.size());
    dev::copy_to_host(d_, b.data(), ptrs_[i], b.size());
    return b;
  }

 private:
  const Case& c_;
  Device d_;
  std::vector<void*> ptrs_;
  std::vector<Bytes> host_;
};

// One call of c on table t with its buffers in device d's memory; the outputs (with `inputs`, the
// inputs too) copied back.
Run execute(const Case& c, const KernelTable& t, Device d, bool inputs = false) {
  Placed p(c, d);
  const Args a{p.ptrs()};
  Run r;
  if (c.reduce)
    r.result = c.reduce(t, a);
  else
    c.call(t, a);
  synchronize(default_stream(d));
  r.bufs.resize(c.bufs.size());
  for (size_t i = 0; i < c.bufs.size(); ++i)
    if (c.bufs[i].role == Role::Out || (inputs && c.bufs[i].role == Role::In)) r.bufs[i] = p.copy_back(i);
  return r;
}

// The reference: the case's exact computation (the same on any thread count), or the baseline
// table on one thread (so that it is the same on every machine, and a CPU target's threads are
// checked too).
Run reference_run(const Case& c) {
  if (c.exact) {
    Placed p(c, Device::CPU);
    c.exact(Args{p.ptrs()});
    Run r;
    r.bufs.resize(c.bufs.size());
    for (size_t i = 0; i < c.bufs.size(); ++i)
      if (c.bufs[i].role == Role::Out) r.bufs[i] = p.copy_back(i);
    return r;
  }
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  try {
    Run r = execute(c, reference(), Device::CPU);
    omp_set_num_threads(threads);
    return r;
  } catch (...) {
    omp_set_num_threads(threads);
    throw;
  }
}

double element(Elem e, const unsigned char* p, size_t i) {
  switch (e) {
    case Elem::F32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case Elem::BF16: {
      bf16 h;
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_float(h);
    }
    case Elem::I32: {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case Elem::I8:
      return static_cast<int8_t>(p[i]);
  }
  return 0;
}

// The comparison of one output (or of the host result) with the reference.
struct Cmp {
  double max_abs = 0, max_rel = 0;
  size_t bad = 0, worst = 0;
  double worst_excess = -1, got = 0, want = 0;
};

Cmp compare(Elem e, const unsigned char* got, const unsigned char* want, size_t n, Tolerance tol) {
  Cmp c;
  const bool bitwise = tol.rtol == 0 && tol.atol == 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = element(e, got, i), w = element(e, want, i);
    const size_t es = elem_size(e);
    const bool same_bits = std::memcmp(got + i * es, want + i * es, es) == 0;
    const double d = (g == w || (std::isnan(g) && std::isnan(w))) ? 0.0 : std::fabs(g - w);
    const double rel = d / std::max(std::fabs(w), 1e-6);
    if (!std::isnan(d)) {
      c.max_abs = std::max(c.max_abs, d);
      c.max_rel = std::max(c.max_rel, rel);
    } else {
      c.max_abs = c.max_rel = INFINITY;
    }
    // Integers (indices) must be equal whatever the op's bound.
    const bool ok = bitwise || e == Elem::I32 || e == Elem::I8 ? same_bits : d <= tol.atol + tol.rtol * std::fabs(w);
    if (ok) continue;
    ++c.bad;
    const double excess = std::isnan(d) ? INFINITY : d - (tol.atol + tol.rtol * std::fabs(w));
    if (excess > c.worst_excess || c.bad == 1) {
      c.worst_excess = excess;
      c.worst = i;
      c.got = g;
      c.want = w;
    }
  }
  return c;
}

// An output kept in bf16 from a value computed in fp32 may round to the neighbouring bf16 value when
// that value differs within the op's bound: one bf16 step (2^-7 relative at most).
Tolerance output_tolerance(const Buffer& b, Tolerance op_tol) {
  if (b.view != Elem::BF16 || (op_tol.rtol == 0 && op_tol.atol == 0)) return op_tol;
  return {std::max(op_tol.rtol, 1.0 / 128.0), op_tol.atol};
}

std::string fmt(double v) {
  char s[32];
  std::snprintf(s, sizeof s, "%.9g", v);
  return s;
}

// Fills r from the device's two runs and the reference.
void judge(const Case& c, const Run& ref, const Run& a, const Run& b, Result& r) {
  auto fail = [&](const std::string& why) {
    if (r.pass) r.detail = why;
    r.pass = false;
  };
  if (c.reduce) {
    const Tolerance t = r.tol;
    const double d = std::fabs(a.result - ref.result);
    r.max_abs = std::max(r.max_abs, d);
    r.max_rel = std::max(r.max_rel, d / std::max(std::fabs(ref.result), 1e-6));
    if (!(d <= t.atol + t.rtol * std::fabs(ref.result))) fail("result " + fmt(a.result) + ", want " + fmt(ref.result));
    if (std::memcmp(&a.result, &b.result, sizeof(double)) != 0)
      fail("not deterministic: result " + fmt(a.result) + " then " + fmt(b.result));
  }
  for (size_t i = 0; i < c.bufs.size(); ++i) {
    const Buffer& buf = c.bufs[i];
    if (buf.role == Role::Host) continue;
    if (buf.role == Role::In) {
      if (a.bufs[i] != buf.bytes) fail("input " + buf.name + " was modified");
      continue;
    }
    const Cmp m = compare(buf.view, a.bufs[i].data(), ref.bufs[i].data(), buf.view_count, output_tolerance(buf, r.tol));
    r.max_abs = std::max(r.max_abs, m.max_abs);
    r.max_rel = std::max(r.max_rel, m.max_rel);
    if (m.bad)
      fail(buf.name + ": " + std::to_string(m.bad) + " of " + std::to_string(buf.view_count) +
           " elements out of tolerance; worst at " + std::to_string(m.worst) + ": got " + fmt(m.got) + ", want " +
           fmt(m.want));
    if (a.bufs[i] != b.bufs[i]) fail("not deterministic: " + buf.name + " differs between two runs");
  }
}

// A case's own consistency: it is the op and dtype its spec says, and the outputs of an
// accumulating op start nonzero (so that a kernel that overwrites them fails).
std::string case_error(const CaseSpec& s, const Case& c) {
  if (c.op != s.op || c.dtype != s.dtype) return "case builds another op or dtype than its spec";
  if (!c.call && !c.reduce) return "case has no call";
  if (op_info(c.op).flags & kAccumulates)
    for (const Buffer& b : c.bufs)
      if (b.role == Role::Out && std::all_of(b.bytes.begin(), b.bytes.end(), [](unsigned char x) { return x == 0; }))
        return "output " + b.name + " of an accumulating op starts at zero";
  return "";
}

bool selected(const CaseSpec& s, const Options& o) {
  if (o.op && s.op != *o.op) return false;
  if (o.dtype && s.dtype != *o.dtype) return false;
  return o.shapes == Shapes::All || s.model == (o.shapes == Shapes::Model);
}

// dim=value in a shape label, or 0.
double dim(const std::string& shape, const char* name) {
  const std::string key = std::string(" ") + name + "=";
  const size_t at = shape.find(key);
  return at == std::string::npos ? 0.0 : std::atof(shape.c_str() + at + key.size());
}

// One warm-up call, then time_reps calls timed together on the device (outputs keep changing:
// the time, not the values, is measured).
Timing time_case(const Case& c, const KernelTable& t, Device d, int reps) {
  Placed p(c, d);
  const Args a{p.ptrs()};
  auto once = [&] {
    if (c.reduce) c.reduce(t, a);
    else c.call(t, a);
  };
  once();
  Timing tm;
  tm.ms = device_ms(d, [&] {
            for (int i = 0; i < reps; ++i) once();
          }) /
          reps;
  for (const Buffer& b : c.bufs) {
    if (b.role == Role::Host) continue;
    const bool rw = b.role == Role::Out && (op_info(c.op).flags & kAccumulates);
    tm.bytes += static_cast<double>(b.bytes.size()) * (rw ? 2 : 1);
  }
  tm.flops = case_flops(c.op, c.shape);
  return tm;
}

}  // namespace

double case_flops(Op op, const std::string& shape) {
  const double N = dim(shape, "N"), C = dim(shape, "C"), OC = dim(shape, "OC");
  const double B = dim(shape, "B"), T = dim(shape, "T"), nh = dim(shape, "nh"), hd = dim(shape, "hd");
  const double gemm = 2 * N * C * OC, attn = 4 * B * nh * T * T * hd / 2;
  switch (op) {
    case Op::linear_forward:
    case Op::linear_forward_bf16:
    case Op::linear_gelu_forward_bf16:
      return gemm;
    case Op::linear_backward:
    case Op::linear_backward_bf16:
    case Op::linear_backward_bf16_dy:
    case Op::linear_backward_dgelu_bf16:
    case Op::linear_backward_bf16_dy_bias:
      return (shape.find("no-dinp") == std::string::npos ? 2 : 1) * gemm;  // dinp and dW
    case Op::attention_forward:
      return attn;
    case Op::attention_backward:
      return 2.5 * attn;
    default:
      return 0;
  }
}

std::vector<Target> targets(Device d) {
  switch (d) {
    case Device::CPU: {
      std::vector<Target> t = {{"cpu avx2", &cpu::base::isa_table(), Device::CPU}};
      if (cpu::active_isa() >= cpu::CpuIsa::AVX512) t.push_back({"cpu avx512", &cpu::avx512::isa_table(), Device::CPU});
      return t;
    }
    case Device::CUDA:
      return {{"cuda", &table(Device::CUDA), Device::CUDA}};
    case Device::Meta:
      break;
  }
  throw std::invalid_argument("check-ops runs on cpu or cuda (the meta device computes nothing)");
}

std::vector<Result> run(const Target& t, const Options& o, const std::function<void(const Result&)>& each) {
  std::vector<Result> results;
  for (const CaseSpec& spec : all_cases()) {
    if (!selected(spec, o)) continue;
    Result r;
    r.target = t.name;
    r.op = spec.op;
    r.dtype = spec.dtype;
    r.tol = tolerance(spec.op, spec.dtype);
    if (!t.table->supports(spec.op)) {  // one result per op and dtype
      const bool seen = std::any_of(results.begin(), results.end(), [&](const Result& x) {
        return !x.supported && x.op == spec.op && x.dtype == spec.dtype;
      });
      if (seen) continue;
      r.supported = false;
    } else {
      const Case c = spec.make();
      r.shape = c.shape;
      const std::string err = case_error(spec, c);
      if (!err.empty()) {
        r.pass = false;
        r.detail = "case error: " + err;
      } else {
        try {
          const Run ref = reference_run(c);
          const Run a = execute(c, *t.table, t.device, true), b = execute(c, *t.table, t.device);
          judge(c, ref, a, b, r);
          if (r.pass && o.time_reps > 0) r.timing = time_case(c, *t.table, t.device, o.time_reps);
        } catch (const std::exception& e) {
          r.pass = false;
          r.detail = std::string("threw: ") + e.what();
        }
      }
    }
    if (each) each(r);
    results.push_back(std::move(r));
  }
  return results;
}

}  // namespace mt::kernels::conformance
