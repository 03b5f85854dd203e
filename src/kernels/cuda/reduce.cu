// Column sums over the rows of an [N, C] matrix as two-stage deterministic reductions (the bias
// gradient of a linear layer, the weight and bias gradients of LayerNorm / RMSNorm).
//
// Stage 1: the rows are cut into `parts` consecutive slices, a number that depends only on N.
// A block covers 32 columns of one slice: its 8 warps each sum every 8th row of the slice for
// their 32 columns (coalesced 128-byte rows), and the 8 sums of a column are added in warp order.
// Each (slice, column) partial goes to scratch. Stage 2: one thread per column adds the partials in
// slice order and adds the total into the output. The order of every addition is fixed by N and
// C alone: two runs give the same bits, whatever the GPU and the schedule.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kCols = 32, kRowLanes = 8, kMaxParts = 256, kMinRowsPerPart = 32;

// inp null: a = sum dout. Else xhat = (inp - mean) * rstd (mean null: RMSNorm) and
// a = sum dout * xhat, b = sum dout.
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(uint16_t v) { return bf16_bits_to_f32(v); }

template <class In>
__global__ void colsum_partials_k(float* pa, float* pb, const float* dout, const In* inp, const float* mean,
                                  const float* rstd, int64_t N, int64_t C, int64_t rows_per_part) {
  MT_SHARED(shm, float[2 * kRowLanes * (kCols + 1)]);
  const int tx = static_cast<int>(threadIdx.x) & (kCols - 1), ty = static_cast<int>(threadIdx.x) / kCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + tx;
  const int64_t part = blockIdx.y;
  const int64_t r0 = part * rows_per_part, r1 = r0 + rows_per_part < N ? r0 + rows_per_part : N;
  float a = 0.0f, b = 0.0f;
  if (c < C) {
    for (int64_t n = r0 + ty; n < r1; n += kRowLanes) {
      const float dy = dout[n * C + c];
      if (inp) {
        const float xh = (widen(inp[n * C + c]) - (mean ? mean[n] : 0.0f)) * rstd[n];
        a += dy * xh;
        b += dy;
      } else {
        a += dy;
      }
    }
  }
  shm[ty * (kCols + 1) + tx] = a;
  shm[kRowLanes * (kCols + 1) + ty * (kCols + 1) + tx] = b;
  __syncthreads();
  if (ty == 0 && c < C) {
    float sa = 0.0f, sb = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) {
      sa += shm[k * (kCols + 1) + tx];
      sb += shm[kRowLanes * (kCols + 1) + k * (kCols + 1) + tx];
    }
    pa[part * C + c] = sa;
    if (pb) pb[part * C + c] = sb;
  }
}

// out[c] += sum over parts, in part order.
__global__ void colsum_final_k(float* oa, float* ob, const float* pa, const float* pb, int64_t parts, int64_t C) {
  MT_GRID_STRIDE(c, C) {
    if (oa) {
      float s = 0.0f;
      for (int64_t p = 0; p < parts; ++p) s += pa[p * C + c];
      oa[c] += s;
    }
    if (ob) {
      float s = 0.0f;
      for (int64_t p = 0; p < parts; ++p) s += pb[p * C + c];
      ob[c] += s;
    }
  }
}
}  // namespace

int64_t column_sum_parts(int64_t N) {
  int64_t parts = (N + kMinRowsPerPart - 1) / kMinRowsPerPart;
  if (parts < 1) parts = 1;
  if (parts > kMaxParts) parts = kMaxParts;
  const int64_t rows_per_part = (N + parts - 1) / parts;
  return (N + rows_per_part - 1) / rows_per_part;  // no empty slice
}

namespace {
template <class In>
void column_sums_of(float* out_a, float* out_b, const float* dout, const In* inp, const float* mean, const float* rstd,
                    int64_t N, int64_t C) {
  if (N <= 0 || C <= 0 || (!out_a && !out_b)) return;
  const int64_t parts = column_sum_parts(N);
  const int64_t rows_per_part = (N + parts - 1) / parts;
  float* pa = static_cast<float*>(scratch(kScratchColumnSums, static_cast<size_t>(2 * parts * C) * sizeof(float)));
  float* pb = inp ? pa + parts * C : nullptr;
  const dim3 grid(static_cast<unsigned>((C + kCols - 1) / kCols), static_cast<unsigned>(parts));
  void (*const k)(float*, float*, const float*, const In*, const float*, const float*, int64_t, int64_t, int64_t) =
      colsum_partials_k<In>;
  MT_LAUNCH(k, grid, kCols * kRowLanes, 0, stream())(pa, pb, dout, inp, mean, rstd, N, C, rows_per_part);
  check_launch("column sums (partials)");
  MT_LAUNCH(colsum_final_k, grid_for(C, 256), 256, 0, stream())(out_a, inp ? out_b : nullptr, pa, pb, parts, C);
  check_launch("column sums (final)");
}
}  // namespace

void column_sums(float* out_a, float* out_b, const float* dout, const float* inp, const float* mean, const float* rstd,
                 int64_t N, int64_t C) {
  column_sums_of(out_a, out_b, dout, inp, mean, rstd, N, C);
}
void column_sums_bf16(float* out_a, float* out_b, const float* dout, const uint16_t* inp, const float* mean,
                      const float* rstd, int64_t N, int64_t C) {
  column_sums_of(out_a, out_b, dout, inp, mean, rstd, N, C);
}

}  // namespace mt::kernels::cuda
