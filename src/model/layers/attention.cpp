#include "model/layers/attention.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "kernels/backend.h"

namespace mt {

namespace {
constexpr int kTagKv = 1, kTagKvBackward = 2, kTagDkv = 3;  // ring transfers of one block's K/V and dK/dV
}

Attention::Attention(const ModelConfig& cfg, DType compute, Device dev, const kernels::KernelTable* kt,
                     TpContext& tpc, int64_t heads, int64_t kv_heads, CpComm* cp, bool cp_allgather, bool flash)
    : cfg_(cfg),
      compute_(compute),
      dev_(dev),
      kt_(kt),
      tpc_(tpc),
      heads_(heads),
      kv_heads_(kv_heads),
      cp_(cp),
      cp_allgather_(cp_allgather),
      flash_(flash) {
  if (cfg_.rope_scaled()) rope_inv_freq_ = cfg_.rope_inv_freq();  // Llama 3.1 scaled frequencies
}

void Attention::release() { ws_ = Workspace{}; }

void Attention::allocate(int64_t N) {
  const int64_t C = cfg_.n_embd, QKV = (heads_ + 2 * kv_heads_) * cfg_.head_dim();
  auto W = MemCategory::Workspace;
  ws_.dqkv = Tensor::empty({N, QKV}, DType::F32, W);
  ws_.datty = Tensor::empty({N, C}, DType::F32, W);
  if (flash_) ws_.qkv32 = Tensor::empty({N, QKV}, DType::F32, W);
}

// Context parallelism: the travelling key / value blocks and their gradients (after the other
// layers' workspace, as it is sized by the cp group).
void Attention::allocate_cp(int64_t N) {
  if (!cp_) return;
  const int64_t KVW = 2 * kv_heads_ * cfg_.head_dim(), n = cp_->size();
  auto W = MemCategory::Workspace;
  if (cp_allgather_) {  // every rank's blocks at once
    ws_.kv_all = Tensor::empty({n * N, KVW}, DType::F32, W);
    ws_.dkv_all = Tensor::empty({n * N, KVW}, DType::F32, W);
    ws_.dkv_mine = Tensor::empty({N, KVW}, DType::F32, W);
  } else {
    for (Tensor* t : {&ws_.kv_cur, &ws_.kv_next, &ws_.dkv_acc, &ws_.dkv_in, &ws_.dkv_step})
      *t = Tensor::empty({N, KVW}, DType::F32, W);
  }
}

void Attention::rope(float* x, TokenShape ts, bool backward) {
  if (cfg_.arch == Arch::GPT2) return;  // learned positions (the embedding's)
  const int64_t nh = heads_, nkv = kv_heads_, hd = cfg_.head_dim();
  // Positions per token: the [B, T] tokens as one row of B*T (rotation is per token).
  const int64_t B = ts.pos_per_token ? 1 : ts.B, T = ts.pos_per_token ? ts.B * ts.T : ts.T;
  const float* freq = rope_inv_freq_.empty() ? nullptr : rope_inv_freq_.data();
  if (ts.pos && backward)
    kt_->rope_backward_pos(x, B, T, nh, nkv, hd, cfg_.rope_theta, freq, ts.pos);
  else if (ts.pos)
    kt_->rope_forward_pos(x, B, T, nh, nkv, hd, cfg_.rope_theta, freq, ts.pos);
  else if (!freq && backward)
    kt_->rope_backward(x, B, T, nh, nkv, hd, cfg_.rope_theta);
  else if (!freq)
    kt_->rope_forward(x, B, T, nh, nkv, hd, cfg_.rope_theta);
  else if (backward)
    kt_->rope_backward_freq(x, B, T, nh, nkv, hd, freq);
  else
    kt_->rope_forward_freq(x, B, T, nh, nkv, hd, freq);
}

void Attention::forward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* ln1, TokenShape ts,
                        float* out) {
  const int64_t N = ts.B * ts.T, C = cfg_.n_embd, hd = cfg_.head_dim();
  const int64_t nh = heads_, nkv = kv_heads_, QKV = (nh + 2 * nkv) * hd;  // this tp rank's share
  const bool bf = compute_ == DType::BF16;
  float* qkv = flash_ ? ws_.qkv32.f32() : a.qkv.f32();
  ColumnParallelLinear(tpc_, C).forward(a.ln1, ln1, {{qkv, P.qkv_weight(p, QKV, false)}});
  rope(qkv, ts, false);
  if (cp_) {
    cp_forward(a, ts);
  } else if (flash_) {  // q, k, v rounded to bf16 (kept for the backward); out bf16 only, lse fp32
    store_compute(kt_, a.qkv_bf, qkv, N * QKV);
    kt_->attention_forward_bf16(a.atty_bf.bf(), a.lse.f32(), a.qkv_bf.bf(), ts.B, ts.T, nh, nkv, hd, ts.doc_start);
  } else {
    kt_->attention_forward(a.atty.f32(), a.lse.f32(), qkv, ts.B, ts.T, nh, nkv, hd, ts.doc_start);
  }
  if (bf && !flash_) store_compute(kt_, a.atty_bf, a.atty.f32(), N * nh * hd);
  RowParallelLinear(tpc_, nh * hd, P.weight(p.proj_w, p.proj_b, C, false)).forward(out, bf ? a.atty_bf : a.atty);
}

const float* Attention::backward(LayerParams& P, const BlockParams& p, BlockActivations& a, const float* dres,
                                 float* dnorm, TokenShape ts) {
  const int64_t N = ts.B * ts.T, C = cfg_.n_embd, hd = cfg_.head_dim();
  const int64_t nh = heads_, nkv = kv_heads_, QKV = (nh + 2 * nkv) * hd;
  const bool bf = compute_ == DType::BF16;
  float* datty = ws_.datty.f32();
  // Split backward: q|k|v's output gradient (which W reads) goes straight into a held buffer.
  float* dqkv = (tpc_.defer ? tpc_.defer->lend(ws_.dqkv) : ws_.dqkv).f32();
  RowParallelLinear(tpc_, nh * hd, P.weight(p.proj_w, p.proj_b, C, true)).backward(datty, dres, bf ? a.atty_bf : a.atty);
  dev::zero(dev_, dqkv, static_cast<size_t>(N * QKV) * sizeof(float));
  if (cp_)
    cp_backward(a, datty, dqkv, ts);
  else if (flash_)
    kt_->attention_backward_bf16(dqkv, datty, a.qkv_bf.bf(), a.atty_bf.bf(), a.lse.f32(), ts.B, ts.T, nh, nkv, hd,
                                 ts.doc_start);
  else
    kt_->attention_backward(dqkv, datty, a.qkv.f32(), a.atty.f32(), a.lse.f32(), ts.B, ts.T, nh, nkv, hd, ts.doc_start);
  rope(dqkv, ts, true);
  return ColumnParallelLinear(tpc_, C).backward(a.ln1, {{dqkv, P.qkv_weight(p, QKV, true)}}, dnorm);
}

void Attention::cp_modes(int src, TokenShape ts, int8_t modes[4], int32_t key_start[2]) const {
  const int n = cp_->size(), r = cp_->rank();
  cp_block_modes(r, src, modes);
  const int64_t c = ts.T / 2;
  key_start[0] = static_cast<int32_t>(src * c);
  key_start[1] = static_cast<int32_t>((2 * static_cast<int64_t>(n) - 1 - src) * c);
  if (!ts.doc_start_host) return;
  for (int a = 0; a < 2; ++a) {  // the earliest document start of query chunk a (every sequence)
    int64_t first = std::numeric_limits<int64_t>::max();
    for (int64_t b = 0; b < ts.B; ++b)
      for (int64_t t = a * c; t < (a + 1) * c; ++t) first = std::min<int64_t>(first, ts.doc_start_host[b * ts.T + t]);
    for (int k = 0; k < 2; ++k)
      if (first >= key_start[k] + c) modes[a * 2 + k] = 0;  // every key before every query's document
  }
}

// Ring attention (forward): step s computes this rank's queries against the key / value block of
// cp rank (rank - s) mod cp while that block travels on to the next rank; the partial results are
// merged by log-sum-exp inside the kernel. Entirely masked chunk pairs are skipped (modes).
void Attention::cp_forward(BlockActivations& a, TokenShape ts) {
  const int64_t B = ts.B, T = ts.T, N = B * T, hd = cfg_.head_dim(), nh = heads_, nkv = kv_heads_;
  const int64_t QKV = (nh + 2 * nkv) * hd, KVW = 2 * nkv * hd;
  const int n = cp_->size(), r = cp_->rank();
  int8_t modes[4];
  int32_t ks[2];
  if (cp_allgather_) {
    float* all = ws_.kv_all.f32();
    kt_->copy_columns(all + r * N * KVW, a.qkv.f32(), N, QKV, nh * hd, KVW);
    cp_->all_gather(all + r * N * KVW, all, N * KVW);
    for (int s = 0; s < n; ++s) {
      const int src = (r - s + n) % n;
      cp_modes(src, ts, modes, ks);
      kt_->attention_block_forward(a.atty.f32(), a.lse.f32(), a.qkv.f32(), all + src * N * KVW, B, T, nh, nkv, hd, 2,
                                   modes, s == 0, ts.doc_start, ks);
    }
    return;
  }
  float* cur = ws_.kv_cur.f32();
  float* nxt = ws_.kv_next.f32();
  kt_->copy_columns(cur, a.qkv.f32(), N, QKV, nh * hd, KVW);
  for (int s = 0; s < n; ++s) {
    const int h = s + 1 < n ? cp_->start_ring_exchange(cur, nxt, N * KVW, kTagKv) : -1;
    const int src = (r - s + n) % n;
    cp_modes(src, ts, modes, ks);
    kt_->attention_block_forward(a.atty.f32(), a.lse.f32(), a.qkv.f32(), cur, B, T, nh, nkv, hd, 2, modes, s == 0,
                                 ts.doc_start, ks);
    if (h >= 0) {
      cp_->wait(h);
      std::swap(cur, nxt);
    }
  }
}

// Ring attention (backward): the key / value blocks go around the ring again, each with the
// gradient of its keys and values accumulated by the ranks it has visited. The owner's own
// contribution (step 0) stays home; the accumulation starts at the next rank (step 1) and after
// the last step travels one more hop, home: cp - 1 transfers of each block's gradient, as a
// reduce-scatter would move. Each step's contribution is computed into a fresh buffer while the
// block's accumulated gradient is still on its way, then added to it.
void Attention::cp_backward(BlockActivations& a, const float* datty, float* dqkv, TokenShape ts) {
  if (cp_allgather_) {
    cp_backward_allgather(a, datty, dqkv, ts);
    return;
  }
  const int64_t B = ts.B, T = ts.T, N = B * T, hd = cfg_.head_dim(), nh = heads_, nkv = kv_heads_;
  const int64_t QKV = (nh + 2 * nkv) * hd, KVW = 2 * nkv * hd;
  const size_t block_bytes = static_cast<size_t>(N * KVW) * sizeof(float);
  const int n = cp_->size(), r = cp_->rank();
  int8_t modes[4];
  int32_t ks[2];
  float* cur = ws_.kv_cur.f32();
  float* nxt = ws_.kv_next.f32();
  float* dacc = ws_.dkv_acc.f32();  // gradient of the block held now, accumulated along the ring
  float* dinc = ws_.dkv_in.f32();  // the next block's accumulated gradient, arriving
  float* dloc = ws_.dkv_step.f32();  // this step's contribution
  kt_->copy_columns(cur, a.qkv.f32(), N, QKV, nh * hd, KVW);
  int hkv = -1, hd_in = -1;
  for (int s = 0; s < n; ++s) {
    if (hkv >= 0) {
      cp_->wait(hkv);
      std::swap(cur, nxt);
    }
    hkv = s + 1 < n ? cp_->start_ring_exchange(cur, nxt, N * KVW, kTagKvBackward) : -1;
    const int src = (r - s + n) % n;
    cp_modes(src, ts, modes, ks);
    float* into = s == 1 ? dacc : dloc;
    dev::zero(dev_, into, block_bytes);
    kt_->attention_block_backward(dqkv, into, datty, a.qkv.f32(), cur, a.atty.f32(), a.lse.f32(), B, T, nh, nkv, hd, 2,
                                  modes, ts.doc_start, ks);
    if (s == 0) {  // this rank's own block: its own queries' part stays here
      kt_->add_columns(dqkv, dloc, N, QKV, nh * hd, KVW);
      continue;
    }
    if (s > 1) {
      cp_->wait(hd_in);  // the block's gradient so far (and the previous send) are through
      kt_->accumulate(dinc, dloc, N * KVW);
      std::swap(dacc, dinc);
    }
    hd_in = cp_->start_ring_exchange(dacc, dinc, N * KVW, kTagDkv);
  }
  cp_->wait(hd_in);  // dinc: this rank's own block's gradient from every other rank
  kt_->add_columns(dqkv, dinc, N, QKV, nh * hd, KVW);
}

// The all-gather variant: every rank's blocks at once; their gradients reduce-scattered home.
void Attention::cp_backward_allgather(BlockActivations& a, const float* datty, float* dqkv, TokenShape ts) {
  const int64_t B = ts.B, T = ts.T, N = B * T, hd = cfg_.head_dim(), nh = heads_, nkv = kv_heads_;
  const int64_t QKV = (nh + 2 * nkv) * hd, KVW = 2 * nkv * hd;
  const size_t block_bytes = static_cast<size_t>(N * KVW) * sizeof(float);
  const int n = cp_->size(), r = cp_->rank();
  int8_t modes[4];
  int32_t ks[2];
  float* all = ws_.kv_all.f32();  // shared by the layers: gathered again
  float* dall = ws_.dkv_all.f32();
  kt_->copy_columns(all + r * N * KVW, a.qkv.f32(), N, QKV, nh * hd, KVW);
  cp_->all_gather(all + r * N * KVW, all, N * KVW);
  dev::zero(dev_, dall, static_cast<size_t>(n) * block_bytes);
  for (int s = 0; s < n; ++s) {
    const int src = (r - s + n) % n;
    cp_modes(src, ts, modes, ks);
    kt_->attention_block_backward(dqkv, dall + src * N * KVW, datty, a.qkv.f32(), all + src * N * KVW, a.atty.f32(),
                                  a.lse.f32(), B, T, nh, nkv, hd, 2, modes, ts.doc_start, ks);
  }
  cp_->reduce_scatter_sum(dall, ws_.dkv_mine.f32(), N * KVW);
  kt_->add_columns(dqkv, ws_.dkv_mine.f32(), N, QKV, nh * hd, KVW);
}

}  // namespace mt
