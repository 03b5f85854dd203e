// Context parallelism's attention of a rank's queries against one block of keys and values, merged
// into the running result by log-sum-exp, and its backward (contracts: kernels/cpu/attention_block.h).
// The same simple scheme as attention.cu, NOT a performance kernel: one warp per query row with an
// online softmax over the visible keys of every chunk (modes, host memory, copied to the device per
// call), fp32, head_dim <= 256. Backward recomputes the probabilities from the final lse and is
// deterministic without atomics: one warp per query row for dq, one warp per key row (its query-head
// group and query chunks in order) for dk and dv. Document masking (doc_start, device; key_start,
// host, passed by value): a query row skips the keys before its document's start.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace mt::kernels::cuda {

namespace {
using attn::Geo;
using attn::kMaxPerLane;
using attn::kWarpsPerBlock;
using attn::warp_blocks;
using attn::warp_dot;

// Geo plus the chunking: chunks of c tokens per sequence, modes[a * chunks + b] (device), rows of
// kv are ldkv floats; document masking: doc_start (device, null: none) and each key chunk's global
// start (device, uploaded with the modes).
struct Blk {
  Geo g;
  int64_t chunks, c, ldkv;
  const int8_t* modes;
  const int32_t* doc_start;
  const int32_t* key_start;
};

// With document masking: the first key of chunk bk (within the chunk) that query row qt (its
// [B T] row) sees; 0 without.
__device__ __forceinline__ int64_t first_key(const Blk& k, int64_t qt, int64_t bk) {
  if (!k.doc_start) return 0;
  const int64_t v = static_cast<int64_t>(k.doc_start[qt]) - k.key_start[bk];
  return v < 0 ? 0 : v;
}

// Keys of chunk bk that query i (within chunk a) sees: all c (mode 1), 0..i (mode 2) or none.
__device__ __forceinline__ int64_t keys_seen(int8_t mode, int64_t c, int64_t i) {
  return mode == 1 ? c : (mode == 2 ? i + 1 : 0);
}
// Queries of chunk a that see key jj of a chunk: all c (mode 1), jj..c-1 (mode 2) or none; the
// first of them in *first.
__device__ __forceinline__ int64_t queries_seeing(int8_t mode, int64_t c, int64_t jj, int64_t* first) {
  *first = mode == 2 ? jj : 0;
  return mode == 1 ? c : (mode == 2 ? c - jj : 0);
}

// A query row's place: sequence b, head h (kv head kvh), token t = chunk a x c + i; q its query.
struct QRow {
  int64_t b, h, kvh, t, a, i;
  const float* q;
};
__device__ __forceinline__ QRow qrow(const Blk& k, int64_t row, const float* qkv) {
  const Geo& g = k.g;
  const int64_t t = row % g.T, h = (row / g.T) % g.nh, b = row / (g.T * g.nh);
  return QRow{b, h, h / (g.nh / g.nkv), t, t / k.c, t % k.c, qkv + (b * g.T + t) * g.ld + h * g.hd};
}

// Calls f(kr, vr) for every key the query row sees, chunk by chunk in order; false if none.
template <class F>
__device__ __forceinline__ bool for_each_key(const Blk& k, const QRow& r, const float* kv, F f) {
  bool seen = false;
  for (int64_t bk = 0; bk < k.chunks; ++bk) {
    const int64_t n = keys_seen(k.modes[r.a * k.chunks + bk], k.c, r.i);
    const int64_t j0 = first_key(k, r.b * k.g.T + r.t, bk);
    seen = seen || n > j0;
    for (int64_t j = j0; j < n; ++j) {
      const float* kr = kv + (r.b * k.g.T + bk * k.c + j) * k.ldkv + r.kvh * k.g.hd;
      f(kr, kr + k.g.nkv * k.g.hd);
    }
  }
  return seen;
}

// One warp per (b, h, t): the block's softmax over its visible keys (online), merged into out / lse.
__global__ void blk_fwd_k(float* out, float* lse, const float* qkv, const float* kv, Blk k, bool first) {
  const Geo& g = k.g;
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= g.B * g.nh * g.T) return;
  const QRow r = qrow(k, row, qkv);
  attn::Online on;
  const bool seen = for_each_key(k, r, kv, [&](const float* kr, const float* vr) {
    on.add(warp_dot(r.q, kr, g.hd, lane) * g.scale, vr, g.hd, lane);
  });
  float* o = out + (r.b * g.T + r.t) * (g.nh * g.hd) + r.h * g.hd;
  float* lr = lse + (r.b * g.nh + r.h) * g.T + r.t;
  if (!seen) {  // nothing of this block: the running result stays (first: nothing seen yet)
    if (first) {
      attn::store(o, attn::zero_row(), 0.0f, g.hd, lane);
      if (lane == 0) *lr = -INFINITY;
    }
    return;
  }
  const float lb = on.m + logf(on.l), old = *lr;
  float ln = lb;
  if (first || old == -INFINITY) {  // nothing seen before: the block's result as it is
    attn::store(o, on.acc, 1.0f / on.l, g.hd, lane);
  } else {  // lse' = log(e^old + e^lb); out' = out e^(old - lse') + block e^(lb - lse')
    const float m2 = fmaxf(old, lb);
    ln = m2 + logf(expf(old - m2) + expf(lb - m2));
    const float wa = expf(old - ln), wb = expf(lb - ln) / on.l;
#pragma unroll
    for (int d = 0; d < kMaxPerLane; ++d)
      if (lane + 32 * d < g.hd) o[lane + 32 * d] = o[lane + 32 * d] * wa + on.acc.v[d] * wb;
  }
  __syncwarp();  // every lane has read *lr before lane 0 overwrites it
  if (lane == 0) *lr = ln;
}

// dq[t] += scale * sum over visible keys j of p_tj (dout_t . v_j - D_t) k_j; one warp per (b, h, t).
__global__ void blk_dq_k(float* dqkv, const float* dout, const float* qkv, const float* kv, const float* lse,
                         const float* Dd, Blk k) {
  const Geo& g = k.g;
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= g.B * g.nh * g.T) return;
  const QRow r = qrow(k, row, qkv);
  const float* dy = dout + (r.b * g.T + r.t) * (g.nh * g.hd) + r.h * g.hd;
  const float L = lse[row], D = Dd[row];
  attn::Row acc = attn::zero_row();
  const bool seen = for_each_key(k, r, kv, [&](const float* kr, const float* vr) {
    const float p = expf(warp_dot(r.q, kr, g.hd, lane) * g.scale - L);
    attn::add_scaled(acc, p * (warp_dot(dy, vr, g.hd, lane) - D), kr, g.hd, lane);
  });
  if (seen) attn::store_add(dqkv + (r.b * g.T + r.t) * g.ld + r.h * g.hd, acc, g.scale, g.hd, lane);
}

// dk[j] += scale * sum ds_tj q_t, dv[j] += sum p_tj dout_t over the query heads of kv head kvh and
// the query rows that see key j (heads, then query chunks, then rows in order); one warp per
// (b, kvh, j).
__global__ void blk_dkv_k(float* dkv, const float* dout, const float* qkv, const float* kv, const float* lse,
                          const float* Dd, Blk k) {
  const Geo& g = k.g;
  const int lane = threadIdx.x & 31;
  const int64_t row = attn::warp_row();
  if (row >= g.B * g.nkv * g.T) return;
  const int64_t j = row % g.T, kvh = (row / g.T) % g.nkv, b = row / (g.T * g.nkv);
  const int64_t bk = j / k.c, jj = j % k.c, group = g.nh / g.nkv;
  const float* kr = kv + (b * g.T + j) * k.ldkv + kvh * g.hd;
  const float* vr = kr + g.nkv * g.hd;
  attn::Row ak = attn::zero_row(), av = attn::zero_row();
  bool seen = false;
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
    for (int64_t a = 0; a < k.chunks; ++a) {
      int64_t i0 = 0;
      const int64_t n = queries_seeing(k.modes[a * k.chunks + bk], k.c, jj, &i0);
      for (int64_t i = i0; i < i0 + n; ++i) {
        const int64_t t = a * k.c + i, r = (b * g.nh + h) * g.T + t;
        if (jj < first_key(k, b * g.T + t, bk)) continue;  // document masking: before the query's document
        seen = true;
        const float* q = qkv + (b * g.T + t) * g.ld + h * g.hd;
        const float* dy = dout + (b * g.T + t) * (g.nh * g.hd) + h * g.hd;
        const float p = expf(warp_dot(q, kr, g.hd, lane) * g.scale - lse[r]);
        attn::add_scaled(ak, p * (warp_dot(dy, vr, g.hd, lane) - Dd[r]), q, g.hd, lane);
        attn::add_scaled(av, p, dy, g.hd, lane);
      }
    }
  if (!seen) return;
  float* dk = dkv + (b * g.T + j) * k.ldkv + kvh * g.hd;
  attn::store_add(dk, ak, g.scale, g.hd, lane);
  attn::store_add(dk + g.nkv * g.hd, av, 1.0f, g.hd, lane);
}

// Checks as the CPU does (std::invalid_argument naming fn); modes copied to the device.
Blk blk(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes,
        const int32_t* doc_start, const int32_t* key_start, const char* fn) {
  const Geo g = attn::geo(B, T, nh, nkv, hd, fn);
  if (chunks <= 0 || T % chunks != 0)
    throw std::invalid_argument(std::string("meshtrain: ") + fn + ": " + std::to_string(T) +
                                " tokens do not split into " + std::to_string(chunks) + " equal chunks");
  if (B <= 0 || T <= 0 || hd <= 0) return Blk{g, chunks, T / chunks, 2 * nkv * hd, nullptr, nullptr, nullptr};
  // One upload: the modes, then (4-byte aligned) the key chunks' starts.
  const int64_t mb = (chunks * chunks + 3) / 4 * 4;
  std::vector<int8_t> args(static_cast<size_t>(mb + (doc_start ? 4 * chunks : 0)), 0);
  std::memcpy(args.data(), modes, static_cast<size_t>(chunks * chunks));
  if (doc_start) std::memcpy(args.data() + mb, key_start, static_cast<size_t>(4 * chunks));
  const int8_t* dm = upload(kScratchHostArgs, args.data(), static_cast<int64_t>(args.size()));
  return Blk{g, chunks, T / chunks, 2 * nkv * hd, dm, doc_start,
             doc_start ? reinterpret_cast<const int32_t*>(dm + mb) : nullptr};
}
}  // namespace

void attention_block_forward(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                             int64_t nh, int64_t nkv, int64_t hd, int64_t chunks, const int8_t* modes, bool first,
                             const int32_t* doc_start, const int32_t* key_start) {
  const Blk k = blk(B, T, nh, nkv, hd, chunks, modes, doc_start, key_start, "attention_block_forward");
  if (!k.modes) return;
  MT_LAUNCH(blk_fwd_k, warp_blocks(B * nh * T), 32 * kWarpsPerBlock, 0, stream())(out, lse, qkv, kv, k, first);
  check_launch("attention_block_forward");
}

void attention_block_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                              int64_t hd, int64_t chunks, const int8_t* modes, const int32_t* doc_start,
                              const int32_t* key_start) {
  const Blk k = blk(B, T, nh, nkv, hd, chunks, modes, doc_start, key_start, "attention_block_backward");
  if (!k.modes) return;
  float* Dd = static_cast<float*>(scratch(kScratchTmp, static_cast<size_t>(B * nh * T) * sizeof(float)));
  attn::launch_delta(Dd, dout, out, lse, k.g, "attention_block_backward (delta)");
  MT_LAUNCH(blk_dq_k, warp_blocks(B * nh * T), 32 * kWarpsPerBlock, 0, stream())(dqkv, dout, qkv, kv, lse, Dd, k);
  check_launch("attention_block_backward (dq)");
  MT_LAUNCH(blk_dkv_k, warp_blocks(B * nkv * T), 32 * kWarpsPerBlock, 0, stream())(dkv, dout, qkv, kv, lse, Dd, k);
  check_launch("attention_block_backward (dk, dv)");
}

}  // namespace mt::kernels::cuda
