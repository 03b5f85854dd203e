// `meshtrain check-ops`: every op of the kernel registry on a device's tables against the CPU
// baseline (kernels/conformance/check.h), as a table; argv and printing only.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "kernels/backend.h"
#include "kernels/conformance/check.h"
#include "kernels/ops.h"

namespace mt::cli {

namespace {

namespace conf = kernels::conformance;

const char* kCheckOpsHelp =
    "usage: meshtrain check-ops [--device cpu|cuda] [--op NAME] [--dtype f32|bf16]\n"
    "                           [--shapes small|model|all] [--list]\n"
    "                           [--time REPS [--peak-tflops F] [--peak-gbs G]]\n"
    "\n"
    "Runs every op of the kernel registry that the device supports, forward and backward, on\n"
    "random inputs uploaded to the device, and compares the results copied back with the CPU\n"
    "baseline kernels (the AVX2 variant, on one thread; the GEMMs and attention with an exact\n"
    "double-precision computation): each output element within the op's\n"
    "stated tolerance (|got - want| <= atol + rtol |want|; 0 / 0 = bitwise), gradients starting\n"
    "nonzero (a backward must add into them), inputs left unchanged, and two runs on the device\n"
    "bitwise equal. Prints one row per case and exits non-zero if any fails.\n"
    "\n"
    "options:\n"
    "  --device D      cpu (default): every CPU kernel variant this CPU runs up to the level in\n"
    "                  force (avx2, and avx512 where the CPU has AVX-512; MESHTRAIN_CPU_ISA caps\n"
    "                  it); cuda: the CUDA kernels (a GPU, or the emulator build)\n"
    "  --op NAME       only this op (--list names them)\n"
    "  --dtype T       only cases in f32 or bf16 (an op's bf16 form: bf16 operands)\n"
    "  --shapes S      small (default): odd sizes, head dims 16 to 144; model: GPT-2 124M\n"
    "                  (C 768, 12 heads of 64, F 3072, vocabulary 50304, T 1000) and a Llama-style\n"
    "                  grouped-query config (C 1024, 8 heads of 128 on 2, F 2816, vocabulary 32000);\n"
    "                  all: both\n"
    "  --list          print the registry instead: each op's dtypes, whether its backward\n"
    "                  accumulates, the runs that need it, and whether each table supports it\n"
    "  --time REPS     also time every passing case: one warm-up call, then REPS calls between two\n"
    "                  CUDA events on the compute stream (on the CPU: the wall clock), and print a\n"
    "                  per-kernel table: microseconds per call, the bytes of its operands per\n"
    "                  second, TFLOP/s where the op's flops are known (GEMMs, attention), and the\n"
    "                  share of the roofline reached: max(bytes / peak bandwidth, flops / peak\n"
    "                  flops) over the measured time\n"
    "  --peak-tflops F the roofline's flops (default 989: an H200's dense bf16 tensor cores)\n"
    "  --peak-gbs G    the roofline's memory bandwidth in GB/s (default 4800: an H200's HBM3e)\n"
    "  --help          this text\n"
    "\n"
    "columns: target (the table checked), op, dtype, shape, max abs err, max rel err\n"
    "(|got - want| / max(|want|, 1e-6)) over every output, tolerance (rtol / atol), result\n"
    "(pass, FAIL with the first reason on the next line, or not supported). docs/kernels.md.\n"
    "\n"
    "exit status: 0 every supported case passed, 1 a case failed, 2 bad options or a device\n"
    "that cannot run here\n";

std::string need_names(uint32_t needs) {
  static const std::pair<uint32_t, const char*> kNames[] = {
      {kernels::kNeedGpt2, "gpt2"}, {kernels::kNeedLlama, "llama"}, {kernels::kNeedRopeScaled, "rope_scaled"},
      {kernels::kNeedBf16, "bf16"}, {kernels::kNeedTp, "tp"},       {kernels::kNeedSp, "sp"},
      {kernels::kNeedCp, "cp"},     {kernels::kNeedMoe, "moe"}};
  std::string s;
  for (const auto& [bit, name] : kNames)
    if (needs & bit) s += (s.empty() ? "" : "+") + std::string(name);
  return s.empty() ? "every run" : s;
}

void print_list(const std::vector<conf::Target>& ts) {
  std::printf("%-30s %-9s %-12s %-18s", "op", "dtypes", "kind", "needed by");
  for (const conf::Target& t : ts) std::printf(" %s", t.name.c_str());
  std::printf("\n");
  for (int i = 0; i < kernels::kNumOps; ++i) {
    const kernels::OpInfo& info = kernels::op_info(kernels::op_at(i));
    const std::string dt = std::string(info.dtypes & kernels::kF32 ? "f32" : "") +
                           (info.dtypes == (kernels::kF32 | kernels::kBF16) ? "," : "") +
                           (info.dtypes & kernels::kBF16 ? "bf16" : "");
    const char* kind = info.flags & kernels::kAccumulates  ? "accumulates"
                       : info.flags & kernels::kHostResult ? "host result"
                                                           : "writes";
    std::printf("%-30s %-9s %-12s %-18s", info.name, dt.c_str(), kind, need_names(info.needs).c_str());
    for (const conf::Target& t : ts)
      std::printf(" %-*s", static_cast<int>(t.name.size()), t.table->supports(kernels::op_at(i)) ? "yes" : "no");
    std::printf("\n");
  }
}

void print_row(const conf::Result& r) {
  char tol[48];
  std::snprintf(tol, sizeof tol, "%g / %g", r.tol.rtol, r.tol.atol);
  if (!r.supported) {
    std::printf("%-11s %-30s %-5s %-44s %11s %11s %-17s not supported\n", r.target.c_str(), kernels::op_name(r.op),
                dtype_name(r.dtype), "-", "-", "-", "-");
  } else {
    std::printf("%-11s %-30s %-5s %-44s %11.3g %11.3g %-17s %s\n", r.target.c_str(), kernels::op_name(r.op),
                dtype_name(r.dtype), r.shape.c_str(), r.max_abs, r.max_rel, tol, r.pass ? "pass" : "FAIL");
    if (!r.pass) std::printf("    %s\n", r.detail.c_str());
  }
  std::fflush(stdout);
}

// The per-kernel table of --time: time per call, achieved bandwidth and flops, share of the roofline.
void print_timings(const std::vector<conf::Result>& rs, int reps, double peak_tflops, double peak_gbs) {
  std::printf("\nper-kernel times (%d calls each after one warm-up; roofline: %.0f TFLOP/s, %.0f GB/s)\n", reps,
              peak_tflops, peak_gbs);
  std::printf("%-11s %-30s %-5s %-44s %12s %10s %10s %9s\n", "target", "op", "dtype", "shape", "us/call", "GB/s",
              "TFLOP/s", "roofline");
  double total_ms = 0;
  for (const conf::Result& r : rs) {
    const double s = r.timing.ms / 1e3;
    const double bound = std::max(r.timing.bytes / (peak_gbs * 1e9), r.timing.flops / (peak_tflops * 1e12));
    total_ms += r.timing.ms;
    char tf[32] = "-";
    if (r.timing.flops > 0) std::snprintf(tf, sizeof tf, "%.2f", s > 0 ? r.timing.flops / s / 1e12 : 0.0);
    std::printf("%-11s %-30s %-5s %-44s %12.1f %10.1f %10s %8.1f%%\n", r.target.c_str(), kernels::op_name(r.op),
                dtype_name(r.dtype), r.shape.c_str(), r.timing.ms * 1e3, s > 0 ? r.timing.bytes / s / 1e9 : 0.0, tf,
                s > 0 ? 100.0 * bound / s : 0.0);
  }
  std::printf("timed %zu cases: %.3f ms per call of each, summed\n", rs.size(), total_ms);
}

}  // namespace

int run_check_ops_command(int argc, char** argv) {
  ArgParser ap({"device", "op", "dtype", "shapes", "time", "peak-tflops", "peak-gbs"}, {"list", "help"});
  try {
    ap.parse(argc, argv, 1);
  } catch (const ArgError& e) {
    return cli_support::fail("check-ops", e.what());
  }
  if (ap.flag("help")) {
    std::fputs(kCheckOpsHelp, stdout);
    return 0;
  }
  conf::Options o;
  Device d = Device::CPU;
  if (!parse_device(ap.get("device", "cpu"), &d) || d == Device::Meta)
    return cli_support::fail("check-ops", "--device must be cpu or cuda, got '" + ap.get("device") + "'");
  if (ap.has("op")) {
    o.op = kernels::find_op(ap.get("op"));
    if (!o.op) return cli_support::fail("check-ops", "unknown op '" + ap.get("op") + "' (--list names them)");
  }
  if (ap.has("dtype")) {
    DType dt;
    if (!parse_dtype(ap.get("dtype"), &dt))
      return cli_support::fail("check-ops", "--dtype must be f32 or bf16, got '" + ap.get("dtype") + "'");
    o.dtype = dt;
  }
  double peak_tflops = 989, peak_gbs = 4800;
  try {
    if (ap.has("time")) o.time_reps = std::stoi(ap.get("time"));
    if (ap.has("peak-tflops")) peak_tflops = std::stod(ap.get("peak-tflops"));
    if (ap.has("peak-gbs")) peak_gbs = std::stod(ap.get("peak-gbs"));
  } catch (const std::exception&) {
    return cli_support::fail("check-ops", "--time, --peak-tflops and --peak-gbs take numbers");
  }
  if (ap.has("time") && o.time_reps < 1) return cli_support::fail("check-ops", "--time must be at least 1");
  if (peak_tflops <= 0 || peak_gbs <= 0) return cli_support::fail("check-ops", "--peak-tflops and --peak-gbs must be > 0");
  std::vector<conf::Target> ts;
  try {
    o.shapes = conf::parse_shapes(ap.get("shapes", "small"));
    ts = conf::targets(d);
  } catch (const std::exception& e) {
    return cli_support::fail("check-ops", e.what());
  }
  if (ap.flag("list")) {
    print_list(ts);
    return 0;
  }
  if (std::string why; !device_available(d, &why))
    return cli_support::fail("check-ops", std::string("device ") + device_name(d) + " cannot run here: " + why);
  std::printf(
      "device %s; reference: the baseline (avx2) CPU kernels on one thread, GEMMs and attention exact; %d threads\n",
      kernels::describe(d).c_str(), omp_get_max_threads());
  std::printf("%-11s %-30s %-5s %-44s %11s %11s %-17s %s\n", "target", "op", "dtype", "shape", "max abs err",
              "max rel err", "tolerance", "result");
  int passed = 0, failed = 0, unsupported = 0;
  std::vector<conf::Result> timed;
  for (const conf::Target& t : ts) {
    for (const conf::Result& r : conf::run(t, o, print_row)) {
      if (r.timing.ms >= 0) timed.push_back(r);
      if (!r.supported)
        ++unsupported;
      else if (r.pass)
        ++passed;
      else
        ++failed;
    }
  }
  if (o.time_reps > 0) print_timings(timed, o.time_reps, peak_tflops, peak_gbs);
  std::printf("check-ops: %d passed, %d failed, %d ops not supported (", passed, failed, unsupported);
  for (size_t i = 0; i < ts.size(); ++i) std::printf("%s%s", i ? ", " : "", ts[i].name.c_str());
  std::printf(")\n");
  if (passed + failed == 0) {
    std::fprintf(stderr, "meshtrain check-ops: no case ran (the filters select none the device supports)\n");
    return 1;
  }
  return failed ? 1 : 0;
}

}  // namespace mt::cli
