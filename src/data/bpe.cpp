#include "data/bpe.h"

#include <functional>
#include <queue>

namespace mt {

void bpe_merge(std::vector<int32_t> id, const BpeMerges& merges, std::vector<int32_t>& out) {
  const int m = static_cast<int>(id.size());
  if (m == 0) return;
  // Symbols form a linked list over the initial positions; a merged symbol lives at its first one.
  std::vector<int> next(static_cast<size_t>(m)), prev(static_cast<size_t>(m));
  std::vector<char> alive(static_cast<size_t>(m), 1);
  for (int k = 0; k < m; ++k) {
    next[k] = k + 1 < m ? k + 1 : -1;
    prev[k] = k - 1;
  }
  struct Cand {
    int32_t rank, left, right, left_id, right_id, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int l) {
    if (l < 0 || next[l] < 0) return;
    const int r = next[l];
    auto it = merges.find(bpe_pair(id[l], id[r]));
    if (it != merges.end()) heap.push(Cand{it->second.rank, l, r, id[l], id[r], it->second.id});
  };
  for (int k = 0; k + 1 < m; ++k) push(k);
  // Stale candidates (a side merged since, or no longer adjacent) are skipped.
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || id[c.left] != c.left_id ||
        id[c.right] != c.right_id)
      continue;
    id[c.left] = c.merged;
    alive[c.right] = 0;
    next[c.left] = next[c.right];
    if (next[c.right] >= 0) prev[next[c.right]] = c.left;
    push(prev[c.left]);
    push(c.left);
  }
  for (int k = 0; k >= 0; k = next[k]) out.push_back(id[k]);
}

}  // namespace mt
