// The conformance suite of the kernel tables (ggml's test-backend-ops): every op of the registry
// (kernels/ops.def), forward and backward, at small shapes and at model shapes (GPT-2 124M and a
// Llama-style grouped-query config), in each dtype it has, run on a table's device against the CPU
// baseline table (cpu::base; the GEMMs and attention, whose CPU arithmetic depends on the ISA
// level, against an exact double-precision computation) and compared element by element within
// the op's stated tolerance;
// each op runs twice on the device and must give bitwise equal results. Inputs are uploaded to the
// device under test and results copied back through the runtime's dev:: copies, so the same cases
// run against the CPU variants, CUDA and the CUDA emulator. `meshtrain check-ops` prints the
// results (docs/kernels.md).
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace mt::kernels {
struct KernelTable;
}

namespace mt::kernels::conformance {

enum class Shapes { Small, Model, All };
// "small", "model", "all"; throws std::invalid_argument naming the valid ones.
Shapes parse_shapes(const std::string& s);

// Elementwise bound: |got - want| <= atol + rtol * |want|. Both 0: bitwise equality.
struct Tolerance {
  double rtol = 0, atol = 0;
};
// The stated tolerance of an op's outputs in a dtype (tolerance.cpp says why for each).
Tolerance tolerance(Op op, DType dt);

// A table to check and the device whose memory its kernels take.
struct Target {
  std::string name;  // "cpu avx2", "cpu avx512", "cuda"
  const KernelTable* table = nullptr;
  Device device = Device::CPU;
};
// The tables of device d: on the CPU every kernel variant this CPU runs up to the active level
// (MESHTRAIN_CPU_ISA caps it); on CUDA the CUDA table (which exists without a GPU; running it needs
// device_available). Throws where d has no kernels in this build.
std::vector<Target> targets(Device d);

struct Options {
  std::optional<Op> op;        // only this op
  std::optional<DType> dtype;  // only cases in this dtype
  Shapes shapes = Shapes::Small;
  int time_reps = 0;  // > 0: also time each passing case, that many calls (after one warm-up call)
};

// A timed case (Options::time_reps): the device's time per call (CUDA: events on the stream around
// the calls; CPU: the wall clock), the bytes of its operands (accumulated outputs read and written)
// and its floating-point operations where they are known (GEMMs, attention; 0 elsewhere).
struct Timing {
  double ms = -1;  // < 0: not timed
  double bytes = 0, flops = 0;
};

struct Result {
  std::string target;
  Op op{};
  DType dtype = DType::F32;
  std::string shape;                // "small N=33 C=96", "gpt2 N=333 C=768 OC=3072", ...
  bool supported = true;            // false: the table does not support the op (nothing ran)
  double max_abs = 0, max_rel = 0;  // over every output (rel: |got - want| / max(|want|, 1e-6))
  Tolerance tol;
  bool pass = true;    // within tolerance, deterministic, inputs untouched
  std::string detail;  // why it failed: the output and its worst element, or what differed
  Timing timing;
};

// Milliseconds device d spends on f(): on CUDA two events recorded on the compute stream around
// it (one wait, at the end); on the CPU the wall clock.
double device_ms(Device d, const std::function<void()>& f);
// The floating-point operations of one call of op at a case's shape label ("gpt2 N=333 C=768
// OC=3072", "... B=1 T=1000 nh=12 nkv=12 hd=64"): 2 N C OC per GEMM, 4 B nh T^2 hd / 2 for causal
// attention's forward and 2.5 times that for its backward; 0 for every other op.
double case_flops(Op op, const std::string& shape);

// Runs the cases Options selects against one target; `each` sees every result as it is made.
std::vector<Result> run(const Target& t, const Options& o, const std::function<void(const Result&)>& each = {});

// Case-list checks: every op of the registry has a case at small shapes in every dtype it
// declares. Returns the missing "op dtype" pairs (empty when complete).
std::vector<std::string> missing_cases();

}  // namespace mt::kernels::conformance
