// Text generation from a trained model: temperature and top-k sampling, one token at a time.
#pragma once
#include <cstdint>
#include <vector>

#include "model/transformer.h"

namespace mt {

struct SampleOptions {
  int64_t tokens = 256;
  float temperature = 1.0f;  // 0 = greedy
  int64_t top_k = 0;         // 0 = whole vocabulary
  uint64_t seed = 42;
};

// Extends `prompt` (at least one token) by opts.tokens tokens. The context is the last seq_len
// tokens. Stops early at `stop_token` when it is >= 0.
std::vector<int32_t> generate(Transformer& model, std::vector<int32_t> prompt, const SampleOptions& opts,
                              int32_t stop_token = -1);

}  // namespace mt
