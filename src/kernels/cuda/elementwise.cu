// Elementwise kernels, casts and the deterministic reductions of the CUDA table (contracts:
// kernels/cpu/activation.h). Grid-stride kernels; the elementwise ones (GELU, SwiGLU and its bf16
// forms, accumulate, scale, the casts, the bias add) move 16 bytes per operand access where every
// pointer allows it.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
constexpr int kThreads = 256;

// The elementwise functions, one element each; the kernels below apply them one element per thread
// and step, or four when every pointer is 16-byte aligned (one 16-byte load or store per operand:
// the same arithmetic per element, so the results are bitwise those of the scalar form).
constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2/pi)
struct GeluFwd {
  __device__ __forceinline__ void operator()(float& out, float x) const {
    out = 0.5f * x * (1.0f + tanhf(kGeluS * (x + 0.044715f * x * x * x)));
  }
};
struct GeluBwd {
  __device__ __forceinline__ void operator()(float& dinp, float x, float dout) const {
    const float u = kGeluS * (x + 0.044715f * x * x * x);
    const float t = tanhf(u);
    const float du = kGeluS * (1.0f + 3.0f * 0.044715f * x * x);
    const float d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
    dinp += d * dout;
  }
};
struct SwigluFwd {
  __device__ __forceinline__ void operator()(float& out, float g, float up) const { out = g / (1.0f + expf(-g)) * up; }
};
struct Accumulate {
  __device__ __forceinline__ void operator()(float& y, float x) const { y += x; }
};
struct Scale {
  float s;
  __device__ __forceinline__ void operator()(float& x) const { x *= s; }
};


// out[i] op= f(in...[i]) for i < n; kVec: four elements per step through F4 (n4 = n / 4 vectors,
// then the last n % 4 elements one by one).
template <bool kVec, class F, class... In>
__global__ void map_k(F f, float* out, int64_t n, const In*... in) {
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    MT_GRID_STRIDE(i, n4) {
      F4 o = reinterpret_cast<const F4*>(out)[i];
      const F4 x[sizeof...(In) > 0 ? sizeof...(In) : 1] = {reinterpret_cast<const F4*>(in)[i]...};
      for (int k = 0; k < 4; ++k) {
        if constexpr (sizeof...(In) == 0) f(o.v[k]);
        else if constexpr (sizeof...(In) == 1) f(o.v[k], x[0].v[k]);
        else f(o.v[k], x[0].v[k], x[1].v[k]);
      }
      reinterpret_cast<F4*>(out)[i] = o;
    }
    MT_GRID_STRIDE(t, n - 4 * n4) {
      const int64_t i = 4 * n4 + t;
      f(out[i], in[i]...);
    }
  } else {
    MT_GRID_STRIDE(i, n) f(out[i], in[i]...);
  }
}
template <class F, class... In>
void map(const char* what, F f, float* out, int64_t n, const In*... in) {
  if (n <= 0) return;
  void (*const map_k_vec)(F, float*, int64_t, const In*...) = map_k<true, F, In...>;
  void (*const map_k_scalar)(F, float*, int64_t, const In*...) = map_k<false, F, In...>;
  if ((aligned16(out) && ... && aligned16(in)))
    MT_LAUNCH(map_k_vec, grid_for((n + 3) / 4, kThreads), kThreads, 0, stream())(f, out, n, in...);
  else
    MT_LAUNCH(map_k_scalar, grid_for(n, kThreads), kThreads, 0, stream())(f, out, n, in...);
  check_launch(what);
}

// SwiGLU's backward (fp32, accumulating), its bf16 forms (bf16 gate and up, bf16 results) and the
// casts: eight elements per step through load8 / store8 (vec8_k) where every pointer is 16-byte
// aligned, the same arithmetic per element either way.
struct SwigluBwd {
  float *dgate, *dup;
  const float *dout, *gate, *up;
  __device__ static void el(float& dg, float& du, float dy, float g, float u) {
    const float sg = 1.0f / (1.0f + expf(-g));
    const float silu = g * sg;
    dg += dy * u * sg * (1.0f + g * (1.0f - sg));
    du += dy * silu;
  }
  __device__ void one(int64_t j) const { el(dgate[j], dup[j], dout[j], gate[j], up[j]); }
  __device__ void vec(int64_t i) const {
    P8 dg = load8(dgate, i), du = load8(dup, i);
    const P8 dy = load8(dout, i), g = load8(gate, i), u = load8(up, i);
    for (int k = 0; k < 8; ++k) el(dg.v[k], du.v[k], dy.v[k], g.v[k], u.v[k]);
    store8(dgate, i, dg);
    store8(dup, i, du);
  }
};
struct SwigluFwdBf16 {
  uint16_t* out;
  const uint16_t *gate, *up;
  __device__ static float el(float g, float u) { return g / (1.0f + expf(-g)) * u; }
  __device__ void one(int64_t j) const { out[j] = f32_to_bf16_bits(el(bf16_bits_to_f32(gate[j]), bf16_bits_to_f32(up[j]))); }
  __device__ void vec(int64_t i) const {
    const P8 g = load8(gate, i), u = load8(up, i);
    P8 o;
    for (int k = 0; k < 8; ++k) o.v[k] = el(g.v[k], u.v[k]);
    store8(out, i, o);
  }
};
struct SwigluBwdBf16 {
  uint16_t *dgate, *dup;
  const float* dout;
  const uint16_t *gate, *up;
  __device__ static void el(float& dg, float& du, float dy, float g, float u) {
    const float sg = 1.0f / (1.0f + expf(-g));
    dg = dy * u * sg * (1.0f + g * (1.0f - sg));
    du = dy * (g * sg);
  }
  __device__ void one(int64_t j) const {
    float dg, du;
    el(dg, du, dout[j], bf16_bits_to_f32(gate[j]), bf16_bits_to_f32(up[j]));
    dgate[j] = f32_to_bf16_bits(dg);
    dup[j] = f32_to_bf16_bits(du);
  }
  __device__ void vec(int64_t i) const {
    const P8 dy = load8(dout, i), g = load8(gate, i), u = load8(up, i);
    P8 dg, du;
    for (int k = 0; k < 8; ++k) el(dg.v[k], du.v[k], dy.v[k], g.v[k], u.v[k]);
    store8(dgate, i, dg);
    store8(dup, i, du);
  }
};
struct CastToBf16 {
  uint16_t* out;
  const float* in;
  __device__ void one(int64_t j) const { out[j] = f32_to_bf16_bits(in[j]); }
  __device__ void vec(int64_t i) const { store8(out, i, load8(in, i)); }
};
struct CastToF32 {
  float* out;
  const uint16_t* in;
  __device__ void one(int64_t j) const { out[j] = bf16_bits_to_f32(in[j]); }
  __device__ void vec(int64_t i) const { store8(out, i, load8(in, i)); }
};
// x[r, c] += b[c]: four columns per 16-byte access where C is a multiple of 4 and both pointers
// are aligned (C4 = C / 4 vectors per row), else one element per thread.
template <bool kVec>
__global__ void add_bias_k(float* x, const float* b, int64_t N, int64_t C) {
  if constexpr (kVec) {
    const int64_t C4 = C / 4;
    MT_GRID_STRIDE(i, N * C4) {
      F4 v = reinterpret_cast<const F4*>(x)[i];
      const F4 w = reinterpret_cast<const F4*>(b)[i % C4];
      for (int k = 0; k < 4; ++k) v.v[k] += w.v[k];
      reinterpret_cast<F4*>(x)[i] = v;
    }
  } else {
    MT_GRID_STRIDE(i, N * C) x[i] += b[i % C];
  }
}
__global__ void copy_columns_k(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols) {
  MT_GRID_STRIDE(i, N * cols) {
    const int64_t r = i / cols, c = i % cols;
    out[i] = in[r * ld + c0 + c];
  }
}

// Deterministic reduction: a fixed grid of kRedBlocks blocks, each thread summing a fixed strided
// subset in double, blocks reduced in a fixed tree, then one block summing the partials in order.
// The result depends only on n and the data, never on timing.
constexpr int kRedBlocks = 264;
template <bool kSquares>
__global__ void reduce_partials_k(double* partial, const float* x, int64_t n) {
  MT_SHARED(shm, double[32]);
  double acc = 0.0;
  MT_GRID_STRIDE(i, n) {
    const double v = x[i];
    acc += kSquares ? v * v : v;
  }
  acc = warp_sum_d(acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shm[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    double v = lane < static_cast<int>(blockDim.x >> 5) ? shm[lane] : 0.0;
    v = warp_sum_d(v);
    if (lane == 0) partial[blockIdx.x] = v;
  }
}
__global__ void reduce_final_k(double* out, const double* partial, int nparts) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double s = 0.0;
    for (int i = 0; i < nparts; ++i) s += partial[i];
    *out = s;
  }
}

// The reduction's result into *out (device memory), queued: nothing waits.
template <bool kSquares>
void reduce_to(double* out, const float* x, int64_t n) {
  if (n <= 0) {
    mt::cuda::zero(out, sizeof(double));
    return;
  }
  double* part = static_cast<double*>(scratch(kScratchReduce, kRedBlocks * sizeof(double)));
  MT_LAUNCH(reduce_partials_k<kSquares>, kRedBlocks, kThreads, 0, stream())(part, x, n);
  check_launch(kSquares ? "sum_squares" : "sum");
  MT_LAUNCH(reduce_final_k, 1, 32, 0, stream())(out, part, kRedBlocks);
  check_launch("sum (final)");
}
template <bool kSquares>
double reduce(const float* x, int64_t n) {
  if (n <= 0) return 0.0;
  double* out = static_cast<double*>(scratch(kScratchReduceOut, sizeof(double)));
  reduce_to<kSquares>(out, x, n);
  double r = 0.0;
  mt::cuda::copy_to_host(&r, out, sizeof r);
  return r;
}
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) { map("gelu_forward", GeluFwd{}, out, n, inp); }
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  map("gelu_backward", GeluBwd{}, dinp, n, inp, dout);
}
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
  map("swiglu_forward", SwigluFwd{}, out, n, gate, up);
}
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n) {
  launch8("swiglu_backward", SwigluBwd{dgate, dup, dout, gate, up}, n, all_aligned16(dgate, dup, dout, gate, up),
          kThreads);
}
void swiglu_forward_bf16(bf16* out, const bf16* gate, const bf16* up, int64_t n) {
  const SwigluFwdBf16 b{reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t*>(gate),
                       reinterpret_cast<const uint16_t*>(up)};
  launch8("swiglu_forward_bf16", b, n, all_aligned16(out, gate, up), kThreads);
}
void swiglu_backward_bf16(bf16* dgate, bf16* dup, const float* dout, const bf16* gate, const bf16* up, int64_t n) {
  const SwigluBwdBf16 b{reinterpret_cast<uint16_t*>(dgate), reinterpret_cast<uint16_t*>(dup), dout,
                       reinterpret_cast<const uint16_t*>(gate), reinterpret_cast<const uint16_t*>(up)};
  launch8("swiglu_backward_bf16", b, n, all_aligned16(dgate, dup, dout, gate, up), kThreads);
}
void accumulate(float* y, const float* x, int64_t n) { map("accumulate", Accumulate{}, y, n, x); }
void scale(float* x, float s, int64_t n) { map("scale", Scale{s}, x, n); }
double sum_squares(const float* x, int64_t n) { return reduce<true>(x, n); }
double sum(const float* x, int64_t n) { return reduce<false>(x, n); }
void sum_squares_to(double* out, const float* x, int64_t n) { reduce_to<true>(out, x, n); }
void sum_to(double* out, const float* x, int64_t n) { reduce_to<false>(out, x, n); }
void cast_f32_to_bf16(bf16* out, const float* in, int64_t n) {
  launch8("cast_f32_to_bf16", CastToBf16{reinterpret_cast<uint16_t*>(out), in}, n, all_aligned16(out, in), kThreads);
}
void cast_bf16_to_f32(float* out, const bf16* in, int64_t n) {
  launch8("cast_bf16_to_f32", CastToF32{out, reinterpret_cast<const uint16_t*>(in)}, n, all_aligned16(out, in),
          kThreads);
}
void add_bias(float* x, const float* b, int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return;
  void (*const kvec)(float*, const float*, int64_t, int64_t) = add_bias_k<true>;
  void (*const kone)(float*, const float*, int64_t, int64_t) = add_bias_k<false>;
  if (C % 4 == 0 && all_aligned16(x, b))
    MT_LAUNCH(kvec, grid_for(N * C / 4, kThreads), kThreads, 0, stream())(x, b, N, C);
  else
    MT_LAUNCH(kone, grid_for(N * C, kThreads), kThreads, 0, stream())(x, b, N, C);
  check_launch("add_bias");
}
void copy_columns(float* out, const float* in, int64_t N, int64_t ld, int64_t c0, int64_t cols) {
  if (N <= 0 || cols <= 0) return;
  MT_LAUNCH(copy_columns_k, grid_for(N * cols, kThreads), kThreads, 0, stream())(out, in, N, ld, c0, cols);
  check_launch("copy_columns");
}

}  // namespace mt::kernels::cuda
