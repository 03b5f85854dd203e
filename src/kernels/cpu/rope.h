// Rotary embedding's shared pieces (private to the CPU kernels): attention.cpp's rope over
// positions 0..T-1 and attention_block.cpp's rope over given positions build their cos / sin
// tables with rope_rate and rotate with rope_rotate. Defined in attention.cpp.
#pragma once
#include <cstdint>

#include "kernels/cpu/isa.h"

MT_CPU_NS_BEGIN

// Throws std::invalid_argument naming `fn` unless hd is even.
void rope_check_head_dim(int64_t hd, const char* fn);
// The angle per position of frequency i: inv_freq[i] when given, else theta^(-2i/hd) (double).
double rope_rate(int64_t i, int64_t hd, float theta, const float* inv_freq);
// Rotates the q and k heads of every row of qkv [B, T, (nh + 2 nkv) hd] in place (dimension i
// pairs with i + hd/2) by the angles whose cos and sin tables [T, hd/2] are cs and sn; sign -1
// rotates back (the gradient of a rotation).
void rope_rotate(float* qkv, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float* cs,
                 const float* sn, float sign);

MT_CPU_NS_END  // namespace mt::kernels::cpu
