// Context parallelism (ring attention; see docs/context_parallel.md): the layout of a rank's
// tokens and the communication attention needs between the cp ranks.
//
// A sequence of T tokens is cut into 2 x cp chunks of T / (2 cp); cp rank i holds chunks i and
// 2 cp - 1 - i, in that order, as its T / cp local tokens (so under the causal mask every rank does
// the same attention work). Everything outside attention is per token and runs on the local tokens
// unchanged; positions (GPT-2's learned table, Llama's rotary angles) are the original indices.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace mt {

// The transfers of context-parallel attention (implemented over the cp process group by the parallel
// layer; the model layer does not depend on the comm layer).
class CpComm {
 public:
  virtual ~CpComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sends n floats of `send` to the next rank of the ring (rank + 1 mod size) and receives n floats
  // from the previous one into `recv`, asynchronously: both buffers belong to the transfer until
  // wait(handle). Transfers with the same tag match in the order they are started.
  virtual int start_ring_exchange(const float* send, float* recv, int64_t n, int tag) = 0;
  virtual void wait(int handle) = 0;
  // parallel.cp_mode = allgather: every rank's n floats, rank order (size() x n into out); and the
  // sum over ranks of segment rank() of `in` (size() x n) into out (n).
  virtual void all_gather(const float* in, float* out, int64_t n) = 0;
  virtual void reduce_scatter_sum(const float* in, float* out, int64_t n) = 0;
};

// Original position of each of the T_local = T / cp tokens of cp rank `rank`.
inline std::vector<int32_t> cp_positions(int rank, int size, int64_t T_local) {
  const int64_t c = T_local / 2;
  std::vector<int32_t> pos(static_cast<size_t>(T_local));
  for (int64_t t = 0; t < T_local; ++t)
    pos[static_cast<size_t>(t)] =
        static_cast<int32_t>(t < c ? rank * c + t : (2 * static_cast<int64_t>(size) - 1 - rank) * c + (t - c));
  return pos;
}

// How rank `rank`'s two query chunks see the two key chunks of rank `src` (modes of
// kernels::KernelTable::attention_block_forward: [query chunk][key chunk], 0 masked, 1 full, 2
// causal). Query chunk 0 is global chunk rank, 1 is 2 cp - 1 - rank; the same for the keys of src.
inline void cp_block_modes(int rank, int src, int8_t modes[4]) {
  modes[0] = src < rank ? 1 : src == rank ? 2 : 0;  // chunk rank vs chunk src
  modes[1] = 0;                                      // chunk rank (< cp) vs chunk 2cp-1-src (>= cp): later
  modes[2] = 1;                                      // chunk 2cp-1-rank (>= cp) vs chunk src (< cp): earlier
  modes[3] = src > rank ? 1 : src == rank ? 2 : 0;  // chunk 2cp-1-rank vs chunk 2cp-1-src
}

// This cp rank's tokens of B sequences of T tokens ([B, T] -> [B, T / cp]).
inline void cp_take_local(const int32_t* full, int32_t* local, int64_t B, int64_t T, int rank, int size) {
  const int64_t Tl = T / size, c = Tl / 2;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* f = full + b * T;
    int32_t* l = local + b * Tl;
    for (int64_t t = 0; t < c; ++t) l[t] = f[rank * c + t];
    for (int64_t t = 0; t < c; ++t) l[c + t] = f[(2 * static_cast<int64_t>(size) - 1 - rank) * c + t];
  }
}

}  // namespace mt
