// The emulated tensor-core instruction (kernels/cuda/mma.cuh: mma.sync m16n8k16, bf16 in, fp32
// accumulate) against a host matrix product. The test kernel places every element in the
// registers the PTX ISA assigns it ("Matrix fragments for mma.m16n8k16 with floating point
// type"), written out here independently of mma.cuh, so an emulator that reads or writes another
// register layout fails. It also checks the register reuse the attention kernels rely on: two
// accumulator tiles rounded to bf16 are the A operand of the next product (P V after Q K^T).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/mma.cuh"

namespace {

using namespace mt::kernels::cuda;

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// a: 16x16 row-major bf16; b: 16x16 (k by n) row-major bf16, two 8-column tiles; c: 16x16 fp32
// row-major accumulator in, d = a b + c out; e: d's two tiles rounded to bf16 as the A operand
// of a second product with b2 (16x8): e = bf16(d) b2.
__global__ void mma_k(float* d, float* e, const uint16_t* a, const uint16_t* b, const float* c, const uint16_t* b2) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const auto pair = [](const uint16_t* p, int i, int j) { return mma::pack_bits(p[i], p[j]); };
  mma::FragA fa;
  fa.x[0] = pair(a, g * 16 + 2 * t, g * 16 + 2 * t + 1);
  fa.x[1] = pair(a, (g + 8) * 16 + 2 * t, (g + 8) * 16 + 2 * t + 1);
  fa.x[2] = pair(a, g * 16 + 2 * t + 8, g * 16 + 2 * t + 9);
  fa.x[3] = pair(a, (g + 8) * 16 + 2 * t + 8, (g + 8) * 16 + 2 * t + 9);
  mma::FragC acc[2];
  for (int n = 0; n < 2; ++n) {
    mma::FragB fb;  // b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g] of tile n
    fb.x[0] = pair(b, (2 * t) * 16 + n * 8 + g, (2 * t + 1) * 16 + n * 8 + g);
    fb.x[1] = pair(b, (2 * t + 8) * 16 + n * 8 + g, (2 * t + 9) * 16 + n * 8 + g);
    acc[n].x[0] = c[g * 16 + n * 8 + 2 * t];
    acc[n].x[1] = c[g * 16 + n * 8 + 2 * t + 1];
    acc[n].x[2] = c[(g + 8) * 16 + n * 8 + 2 * t];
    acc[n].x[3] = c[(g + 8) * 16 + n * 8 + 2 * t + 1];
    mma::mma(acc[n], fa, fb);
    d[g * 16 + n * 8 + 2 * t] = acc[n].x[0];
    d[g * 16 + n * 8 + 2 * t + 1] = acc[n].x[1];
    d[(g + 8) * 16 + n * 8 + 2 * t] = acc[n].x[2];
    d[(g + 8) * 16 + n * 8 + 2 * t + 1] = acc[n].x[3];
  }
  const mma::FragA fe = mma::a_from_c(acc[0], acc[1]);
  mma::FragB f2;
  f2.x[0] = pair(b2, (2 * t) * 8 + g, (2 * t + 1) * 8 + g);
  f2.x[1] = pair(b2, (2 * t + 8) * 8 + g, (2 * t + 9) * 8 + g);
  mma::FragC r;
  mma::zero(r);
  mma::mma(r, fe, f2);
  e[g * 8 + 2 * t] = r.x[0];
  e[g * 8 + 2 * t + 1] = r.x[1];
  e[(g + 8) * 8 + 2 * t] = r.x[2];
  e[(g + 8) * 8 + 2 * t + 1] = r.x[3];
}

template <class T>
T* to_device(const std::vector<T>& h) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, h.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(p);
}

TEST(EmuMma, FragmentLayoutOfM16n8k16Bf16) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> a(256), b(256), b2(128);
  std::vector<float> c(256);
  for (auto& x : a) x = to_bf16(nd(rng));
  for (auto& x : b) x = to_bf16(nd(rng));
  for (auto& x : b2) x = to_bf16(nd(rng));
  for (auto& x : c) x = nd(rng);
  uint16_t *da = to_device(a), *db = to_device(b), *db2 = to_device(b2);
  float* dc = to_device(c);
  float *dd = to_device(std::vector<float>(256, 0.0f)), *de = to_device(std::vector<float>(128, 0.0f));
  (void)cudaGetLastError();  // an earlier test's deliberate error
  MT_LAUNCH(mma_k, 1, 32, 0, nullptr)(dd, de, da, db, dc, db2);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> d(256), e(128);
  ASSERT_EQ(cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(e.data(), de, e.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> want_d(256);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      double s = c[i * 16 + j];
      for (int k = 0; k < 16; ++k) s += static_cast<double>(from_bf16(a[i * 16 + k])) * from_bf16(b[k * 16 + j]);
      want_d[i * 16 + j] = static_cast<float>(s);
      EXPECT_NEAR(d[i * 16 + j], s, 1e-5 * (1.0 + std::fabs(s))) << "D[" << i << "][" << j << "]";
    }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double s = 0;  // from the kernel's own D, rounded as the kernel rounds it
      for (int k = 0; k < 16; ++k) s += static_cast<double>(from_bf16(to_bf16(d[i * 16 + k]))) * from_bf16(b2[k * 8 + j]);
      EXPECT_NEAR(e[i * 8 + j], s, 1e-5 * (1.0 + std::fabs(s))) << "E[" << i << "][" << j << "]";
    }
  for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(db2), static_cast<void*>(dc),
                  static_cast<void*>(dd), static_cast<void*>(de)})
    cudaFree(p);
}

}  // namespace
