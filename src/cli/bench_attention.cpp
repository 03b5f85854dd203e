// `meshtrain bench attention`: the attention kernels of a device timed per call (CUDA events on
// the GPU), the fp32 ops (attention_forward / attention_backward) beside the bf16 ones
// (attention_forward_bf16 / attention_backward_bf16: the tensor-core kernels on CUDA), with the
// achieved FLOP rate and its share of a given peak. argv, buffers and printing only.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "kernels/backend.h"
#include "kernels/timing.h"
#include "runtime/device.h"
#include "runtime/dtype.h"

namespace mt::cli {

namespace {

const char* kHelp =
    "usage: meshtrain bench attention [--device cuda|cpu] [--shapes LIST] [--shape B,T,NH,NKV,HD]\n"
    "                                 [--iters N] [--peak TFLOPS]\n"
    "\n"
    "Times the causal attention kernels of a device, forward and backward, fp32\n"
    "(attention_forward / attention_backward) and bf16 (attention_forward_bf16 /\n"
    "attention_backward_bf16, the tensor-core kernels on CUDA), on random inputs. Each kernel runs\n"
    "once untimed, then N times between two CUDA events (the host clock on the CPU); the time is the\n"
    "mean per call. FLOPs count the causal half of the score matrix: forward 4 B NH HD T(T+1)/2\n"
    "(Q K^T and P V), backward 2.5 times that (five matrix products), whatever a kernel recomputes.\n"
    "\n"
    "options:\n"
    "  --device D      cuda (default) or cpu\n"
    "  --shapes LIST   comma-separated presets: gpt2 (B 8, T 1024, 12 heads of 64), llama (B 2,\n"
    "                  T 2048, 32 query heads of 128 on 8 kv heads); default gpt2,llama\n"
    "  --shape S       one shape B,T,NH,NKV,HD instead of the presets\n"
    "  --iters N       timed calls per kernel (default 10)\n"
    "  --peak TFLOPS   the device's dense bf16 peak: adds the share of it each kernel reaches\n"
    "                  (H100 SXM and H200: 989)\n"
    "  --help          this text\n"
    "\n"
    "exit status: 0 done, 2 bad options or a device that cannot run here\n";

struct Shape {
  std::string name;
  int64_t B, T, nh, nkv, hd;
};

struct Call {
  const kernels::KernelTable* k;
  const Shape* s;
  float *out, *lse, *dqkv, *dout, *qkv;
  bf16 *qkv16, *out16;  // the bf16 ops' q|k|v and output
  int which;  // 0 fwd f32, 1 fwd bf16, 2 bwd f32, 3 bwd bf16
  int iters;
};

void run_calls(void* p) {
  const Call& c = *static_cast<const Call*>(p);
  const Shape& s = *c.s;
  for (int i = 0; i < c.iters; ++i) {
    switch (c.which) {
      case 0: c.k->attention_forward(c.out, c.lse, c.qkv, s.B, s.T, s.nh, s.nkv, s.hd, nullptr); break;
      case 1: c.k->attention_forward_bf16(c.out16, c.lse, c.qkv16, s.B, s.T, s.nh, s.nkv, s.hd, nullptr); break;
      case 2: c.k->attention_backward(c.dqkv, c.dout, c.qkv, c.out, c.lse, s.B, s.T, s.nh, s.nkv, s.hd, nullptr); break;
      default:
        c.k->attention_backward_bf16(c.dqkv, c.dout, c.qkv16, c.out16, c.lse, s.B, s.T, s.nh, s.nkv, s.hd, nullptr);
        break;
    }
  }
}

// Device buffer with host contents (values in [-1, 1) from a fixed seed).
template <class T>
T* upload(Device d, size_t n, uint64_t seed, std::vector<void*>& owned, std::vector<size_t>& sizes) {
  std::vector<T> h(n);
  uint64_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const float f = static_cast<float>((x >> 40) & 0xffffff) / 8388608.0f - 1.0f;
    if constexpr (std::is_same_v<T, bf16>) h[i] = float_to_bf16(f);
    else h[i] = f;
  }
  void* p = device_alloc(d, n * sizeof(T), MemCategory::Scratch);
  dev::copy_from_host(d, p, h.data(), n * sizeof(T));
  owned.push_back(p);
  sizes.push_back(n * sizeof(T));
  return static_cast<T*>(p);
}

bool parse_shape(const std::string& text, Shape* s) {
  std::vector<int64_t> v;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end || x <= 0) return false;
    v.push_back(x);
  }
  if (v.size() != 5 || v[2] % v[3] != 0) return false;
  *s = Shape{"custom", v[0], v[1], v[2], v[3], v[4]};
  return true;
}

}  // namespace

int run_bench_attention_command(int argc, char** argv) {
  int first = 0;
  if (first < argc && !std::strcmp(argv[first], "bench")) ++first;
  if (first < argc && !std::strcmp(argv[first], "attention")) ++first;
  const char* cmd = "bench attention";
  ArgParser ap({"device", "shapes", "shape", "iters", "peak"}, {"help"});
  try {
    ap.parse(argc, argv, first);
  } catch (const ArgError& e) {
    return cli_support::fail(cmd, e.what());
  }
  if (ap.flag("help")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  Device d = Device::CUDA;
  if (!parse_device(ap.get("device", "cuda"), &d) || d == Device::Meta)
    return cli_support::fail(cmd, "--device must be cuda or cpu, got '" + ap.get("device") + "'");
  std::vector<Shape> shapes;
  if (ap.has("shape")) {
    Shape s;
    if (!parse_shape(ap.get("shape"), &s))
      return cli_support::fail(cmd, "--shape must be B,T,NH,NKV,HD (positive, NH a multiple of NKV), got '" +
                                        ap.get("shape") + "'");
    shapes.push_back(s);
  } else {
    std::stringstream ss(ap.get("shapes", "gpt2,llama"));
    std::string item;
    while (std::getline(ss, item, ',')) {
      if (item == "gpt2") shapes.push_back({"gpt2", 8, 1024, 12, 12, 64});
      else if (item == "llama") shapes.push_back({"llama", 2, 2048, 32, 8, 128});
      else return cli_support::fail(cmd, "--shapes takes gpt2 and llama, got '" + item + "'");
    }
  }
  const int iters = std::atoi(ap.get("iters", "10").c_str());
  if (iters <= 0) return cli_support::fail(cmd, "--iters must be a positive number, got '" + ap.get("iters") + "'");
  const double peak = ap.has("peak") ? std::atof(ap.get("peak").c_str()) : 0.0;
  if (ap.has("peak") && peak <= 0.0)
    return cli_support::fail(cmd, "--peak must be a positive TFLOP/s figure, got '" + ap.get("peak") + "'");
  if (std::string why; !device_available(d, &why))
    return cli_support::fail(cmd, std::string("device ") + device_name(d) + " cannot run here: " + why);

  try {
    const kernels::KernelTable& k = kernels::table(d);
    std::printf("device: %s\n", kernels::describe(d).c_str());
    std::printf("%-8s %-20s %-26s %10s %10s %8s\n", "shape", "B,T,NH,NKV,HD", "kernel", "ms/call", "TFLOP/s",
                peak > 0 ? "of peak" : "");
    for (const Shape& s : shapes) {
      std::vector<void*> owned;
      std::vector<size_t> sizes;
      const size_t nq = static_cast<size_t>(s.B * s.T * (s.nh + 2 * s.nkv) * s.hd);
      const size_t no = static_cast<size_t>(s.B * s.T * s.nh * s.hd);
      Call c{&k, &s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 1};
      c.qkv = upload<float>(d, nq, 1, owned, sizes);
      c.qkv16 = upload<bf16>(d, nq, 1, owned, sizes);
      c.out = upload<float>(d, no, 2, owned, sizes);
      c.out16 = upload<bf16>(d, no, 2, owned, sizes);
      c.dout = upload<float>(d, no, 3, owned, sizes);
      c.dqkv = upload<float>(d, nq, 4, owned, sizes);
      c.lse = upload<float>(d, static_cast<size_t>(s.B * s.nh * s.T), 5, owned, sizes);
      const double fwd_flops = 4.0 * static_cast<double>(s.B * s.nh * s.hd) * static_cast<double>(s.T) *
                               static_cast<double>(s.T + 1) / 2.0;
      const char* names[4] = {"attention_forward", "attention_forward_bf16", "attention_backward",
                              "attention_backward_bf16"};  // the ops' names
      // The forwards run first so the backwards read the lse and out of the same precision's forward.
      for (int w = 0; w < 4; ++w) {
        const int which = w == 0 ? 0 : w == 1 ? 2 : w == 2 ? 1 : 3;  // f32 fwd, f32 bwd, bf16 fwd, bf16 bwd
        c.which = which;
        c.iters = 1;
        kernels::time_ms(d, run_calls, &c);  // warm-up (and the f32 forward's lse for its backward)
        c.iters = iters;
        const double ms = kernels::time_ms(d, run_calls, &c) / iters;
        const double flops = which < 2 ? fwd_flops : 2.5 * fwd_flops;
        const double tf = flops / (ms * 1e-3) / 1e12;
        char share[32] = "";
        if (peak > 0) std::snprintf(share, sizeof share, "%.1f%%", 100.0 * tf / peak);
        char dims[64];
        std::snprintf(dims, sizeof dims, "%lld,%lld,%lld,%lld,%lld", static_cast<long long>(s.B),
                      static_cast<long long>(s.T), static_cast<long long>(s.nh), static_cast<long long>(s.nkv),
                      static_cast<long long>(s.hd));
        std::printf("%-8s %-20s %-26s %10.4g %10.4g %8s\n", s.name.c_str(), dims, names[which], ms, tf, share);
        std::fflush(stdout);
      }
      for (size_t i = 0; i < owned.size(); ++i) device_free(d, owned[i], sizes[i], MemCategory::Scratch);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain bench attention: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace mt::cli
