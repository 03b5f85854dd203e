// Multi-tensor AdamW (contract: kernels/ops.def adamw_update_multi, cpu/adamw.h). The tensors'
// pointers travel by value in the kernel's parameters, up to kGroup tensors per launch, so a
// model's update is a few launches instead of one per parameter, and no host array is copied to
// the device (a copy from pageable memory would make the host wait). Block (x, t) updates a
// grid-stride share of tensor t. The element update is adamw_update's (common.cuh adamw_element).
// With a device norm, every thread derives the clipping scale from it, as the trainer would on the
// host, so clipping needs no read of the norm.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kThreads = 256;
constexpr int kGroup = 16;         // tensors per launch (about 1 KiB of parameters)
constexpr int64_t kMaxBlocksX = 1024;  // blocks per tensor at most (grid-stride beyond)

struct Group {
  float* p[kGroup];
  const float* g[kGroup];
  float* m[kGroup];
  float* v[kGroup];
  uint16_t* pb[kGroup];
  int64_t n[kGroup];
  float lr_wd[kGroup];
};

__global__ void adamw_multi_k(Group grp, float lr, float beta1, float beta2, float eps, float inv_bc1, float inv_bc2,
                              float grad_scale, const double* clip_norm_sq, double clip_max) {
  const int t = static_cast<int>(blockIdx.y);
  const int64_t n = grp.n[t];
  if (clip_norm_sq && !isfinite(*clip_norm_sq)) return;  // the step is refused: nothing changes
  float scale = grad_scale;
  if (clip_norm_sq && clip_max > 0) {
    const double norm = sqrt(*clip_norm_sq);
    if (norm > clip_max) scale = static_cast<float>(clip_max / (norm + 1e-6));
  }
  float* param = grp.p[t];
  const float* grad = grp.g[t];
  float* m = grp.m[t];
  float* v = grp.v[t];
  uint16_t* pb = grp.pb[t];
  const float lr_wd = grp.lr_wd[t];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    adamw_element(param, grad, m, v, i, lr, beta1, beta2, eps, lr_wd, inv_bc1, inv_bc2, scale, pb);
  }
}
}  // namespace

void adamw_update_multi(const AdamWTensor* tensors, int64_t count, float lr, float beta1, float beta2, float eps,
                        int64_t step, float grad_scale, const double* clip_norm_sq, double clip_max) {
  if (count <= 0) return;
  // Bias corrections as the CPU computes them (double, then float).
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  const float inv_bc1 = static_cast<float>(1.0 / bc1), inv_bc2 = static_cast<float>(1.0 / bc2);
  for (int64_t first = 0; first < count;) {
    Group grp{};
    int k = 0;
    int64_t most = 0;
    for (; first < count && k < kGroup; ++first) {
      const AdamWTensor& t = tensors[first];
      if (t.n <= 0) continue;
      grp.p[k] = t.param;
      grp.g[k] = t.grad;
      grp.m[k] = t.m;
      grp.v[k] = t.v;
      grp.pb[k] = reinterpret_cast<uint16_t*>(t.param_bf16);
      grp.n[k] = t.n;
      grp.lr_wd[k] = lr * t.weight_decay;
      most = t.n > most ? t.n : most;
      ++k;
    }
    if (k == 0) break;
    const dim3 grid(grid_for(most, kThreads, kMaxBlocksX), static_cast<unsigned>(k));
    MT_LAUNCH(adamw_multi_k, grid, kThreads, 0, stream())(grp, lr, beta1, beta2, eps, inv_bc1, inv_bc2, grad_scale,
                                                          clip_norm_sq, clip_max);
    check_launch("adamw_update_multi");
  }
}

}  // namespace mt::kernels::cuda
