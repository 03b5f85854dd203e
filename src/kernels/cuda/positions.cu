// Context parallelism's learned positions at explicit positions and its column add (contracts:
// kernels/cpu/attention_block.h). The positions are host memory by contract; each call copies them
// to the device first. Elementwise, one element per thread; the table gradient sums the batch in
// order per element, so it is bitwise the CPU's.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kThreads = 256;

__global__ void pos_add_pos_k(float* x, const float* table, const int32_t* pos, int64_t R, int64_t T, int64_t row0,
                              int64_t C) {
  MT_GRID_STRIDE(e, R * C) {
    const int64_t i = e / C, c = e % C;
    x[e] += table[static_cast<int64_t>(pos[(row0 + i) % T]) * C + c];
  }
}

// One thread per (t, c): dtable[pos[t], c] += dout[b * T + t, c] for b in order (the positions of
// a rank are distinct, so no two threads share an element).
__global__ void pos_bwd_pos_k(float* dtable, const float* dout, const int32_t* pos, int64_t B, int64_t T, int64_t C) {
  MT_GRID_STRIDE(e, T * C) {
    const int64_t t = e / C, c = e % C;
    float* d = dtable + static_cast<int64_t>(pos[t]) * C + c;
    float s = *d;
    for (int64_t b = 0; b < B; ++b) s += dout[(b * T + t) * C + c];
    *d = s;
  }
}

__global__ void add_columns_k(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols) {
  MT_GRID_STRIDE(e, N * cols) {
    const int64_t n = e / cols, j = e % cols;
    out[n * ld + c0 + j] += in[e];
  }
}
}  // namespace

void position_add_pos(float* x, const float* table, const int32_t* pos, int64_t R, int64_t T, int64_t row0,
                      int64_t C) {
  if (R <= 0 || T <= 0 || C <= 0) return;
  const int32_t* dpos = upload(kScratchHostArgs, pos, T);
  MT_LAUNCH(pos_add_pos_k, grid_for(R * C, kThreads), kThreads, 0, stream())(x, table, dpos, R, T, row0, C);
  check_launch("position_add_pos");
}

void position_backward_pos(float* dtable, const float* dout, const int32_t* pos, int64_t B, int64_t T, int64_t C) {
  if (B <= 0 || T <= 0 || C <= 0) return;
  const int32_t* dpos = upload(kScratchHostArgs, pos, T);
  MT_LAUNCH(pos_bwd_pos_k, grid_for(T * C, kThreads), kThreads, 0, stream())(dtable, dout, dpos, B, T, C);
  check_launch("position_backward_pos");
}

void add_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols) {
  if (N <= 0 || cols <= 0) return;
  MT_LAUNCH(add_columns_k, grid_for(N * cols, kThreads), kThreads, 0, stream())(out, in, N, ld, c0, cols);
  check_launch("add_columns");
}

}  // namespace mt::kernels::cuda
