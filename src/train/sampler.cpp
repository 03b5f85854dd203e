#include "train/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "model/rng.h"
#include "runtime/device.h"

namespace mt {

std::vector<int32_t> generate(Transformer& model, std::vector<int32_t> seq, const SampleOptions& opts,
                              int32_t stop_token) {
  const ModelConfig& c = model.config();
  Rng rng(opts.seed);
  std::vector<std::pair<float, int32_t>> cand;
  std::vector<float> last(static_cast<size_t>(c.vocab_size));
  for (int64_t i = 0; i < opts.tokens; ++i) {
    int64_t T = std::min<int64_t>(static_cast<int64_t>(seq.size()), c.seq_len);
    const int32_t* ctx = seq.data() + (seq.size() - T);
    model.forward(ctx, nullptr, 1, T, false);
    // The last position's logits, read into host memory (the model may live on a GPU).
    model.logits_row_to_host(T - 1, static_cast<int64_t>(last.size()), last.data());
    const float* row = last.data();
    int32_t next = 0;
    if (opts.temperature <= 0.0f) {
      next = static_cast<int32_t>(std::max_element(row, row + c.vocab_size) - row);
    } else {
      cand.clear();
      for (int32_t v = 0; v < c.vocab_size; ++v) cand.emplace_back(row[v] / opts.temperature, v);
      if (opts.top_k > 0 && opts.top_k < c.vocab_size) {
        std::partial_sort(cand.begin(), cand.begin() + opts.top_k, cand.end(),
                          [](auto& a, auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
        cand.resize(opts.top_k);
      }
      float mx = -INFINITY;
      for (auto& p : cand) mx = std::max(mx, p.first);
      double sum = 0.0;
      for (auto& p : cand) sum += std::exp(static_cast<double>(p.first - mx));
      double r = rng.uniform() * sum, acc = 0.0;
      next = cand.back().second;
      for (auto& p : cand) {
        acc += std::exp(static_cast<double>(p.first - mx));
        if (acc >= r) {
          next = p.second;
          break;
        }
      }
    }
    seq.push_back(next);
    if (next == stop_token) break;
  }
  return seq;
}

}  // namespace mt
