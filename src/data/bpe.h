// Byte-pair merging, shared by the GPT-2 and the Hugging Face tokenizers: a word's symbols are
// merged pair by pair, the pair of lowest merge rank first.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace mt {

struct BpeMerge {
  int32_t rank;  // lower merges first
  int32_t id;    // the token the pair becomes
};
// (left id, right id) as bpe_pair() packs it -> its merge.
using BpeMerges = std::unordered_map<uint64_t, BpeMerge>;

inline uint64_t bpe_pair(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right);
}

// Merges the symbols `ids` of one word and appends the resulting tokens to `out`. Lowest rank
// first, leftmost first among equal ranks: the result of the reference loop that merges every
// occurrence of the best pair, left to right.
void bpe_merge(std::vector<int32_t> ids, const BpeMerges& merges, std::vector<int32_t>& out);

}  // namespace mt
