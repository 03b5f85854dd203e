// The pipeline's stage cut (pipeline_stages.h).
#include "parallel/layout/pipeline_stages.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace mt::parallel {

std::string StagePartition::describe() const {
  std::ostringstream o;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (i) o << " | ";
    o << "units " << stages[i].first << "-" << stages[i].second;
  }
  return o.str();
}

std::vector<double> unit_costs(const ModelConfig& c) {
  const double C = static_cast<double>(c.n_embd), T = static_cast<double>(c.seq_len);
  const double hd = static_cast<double>(c.head_dim());
  const double qkv = (static_cast<double>(c.n_head) + 2.0 * static_cast<double>(c.n_kv_head)) * hd;
  const double F = static_cast<double>(c.ffn_hidden) * (c.arch == Arch::Llama ? 3.0 : 2.0);
  // Per token, forward + backward = 3 x forward: 2 FLOPs per multiply-add.
  const double block = 3.0 * 2.0 * (C * qkv + static_cast<double>(c.n_head) * hd * C + C * F +
                                    2.0 * T * static_cast<double>(c.n_head) * hd / 2.0);
  const double head = 3.0 * 2.0 * C * static_cast<double>(c.padded_vocab) + 10.0 * C;
  const double embedding = 10.0 * C;  // a row copy and its scatter-add
  std::vector<double> cost;
  cost.push_back(embedding);
  for (int64_t l = 0; l < c.n_layer; ++l) cost.push_back(block);
  cost.push_back(head);
  return cost;
}

StagePartition partition_stages(const ModelConfig& c, int S, const std::string& manual) {
  const int U = static_cast<int>(c.n_layer) + 2;
  if (S < 1) throw std::invalid_argument("pipeline stages must be >= 1");
  if (S > U)
    throw std::invalid_argument(std::to_string(S) + " pipeline stages (pp x virtual stages) but the model has only " +
                                std::to_string(U) + " units (embedding, " + std::to_string(c.n_layer) +
                                " blocks, head): every stage needs at least one unit");
  StagePartition p;
  if (!manual.empty()) {
    std::vector<int> blocks;
    std::stringstream ss(manual);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        size_t used = 0;
        int v = std::stoi(item, &used);
        if (used != item.size() || v < 0) throw std::invalid_argument("");
        blocks.push_back(v);
      } catch (const std::exception&) {
        throw std::invalid_argument("parallel.pp_partition: '" + item + "' is not a block count (use e.g. \"3,3,2\")");
      }
    }
    if (static_cast<int>(blocks.size()) != S)
      throw std::invalid_argument("parallel.pp_partition lists " + std::to_string(blocks.size()) +
                                  " stages, the pipeline has " + std::to_string(S) + " (pp x virtual stages)");
    int64_t sum = 0;
    for (int b : blocks) sum += b;
    if (sum != c.n_layer)
      throw std::invalid_argument("parallel.pp_partition assigns " + std::to_string(sum) + " blocks, the model has " +
                                  std::to_string(c.n_layer));
    int u = 0;
    for (int i = 0; i < S; ++i) {
      const int first = u;
      int last = first + blocks[i] - 1 + (i == 0 ? 1 : 0) + (i == S - 1 ? 1 : 0);
      if (last < first)
        throw std::invalid_argument("parallel.pp_partition: stage " + std::to_string(i) +
                                    " has no unit (only the first and last stage may have 0 blocks)");
      p.stages.push_back({first, last});
      u = last + 1;
    }
    return p;
  }
  // Minimise the largest stage cost over contiguous cuts (dynamic programming over prefixes).
  const std::vector<double> cost = unit_costs(c);
  std::vector<double> pre(U + 1, 0.0);
  for (int u = 0; u < U; ++u) pre[u + 1] = pre[u] + cost[u];
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][u]: the smallest max-stage cost of the first u units in s stages; cut[s][u]: start of the last.
  std::vector<std::vector<double>> best(S + 1, std::vector<double>(U + 1, inf));
  std::vector<std::vector<int>> cut(S + 1, std::vector<int>(U + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= S; ++s)
    for (int u = s; u <= U; ++u)
      for (int k = s - 1; k < u; ++k) {
        const double v = std::max(best[s - 1][k], pre[u] - pre[k]);
        if (v < best[s][u] - 1e-9 * v) {  // ties: keep the earlier cut (fewer units up front)
          best[s][u] = v;
          cut[s][u] = k;
        }
      }
  std::vector<std::pair<int, int>> rev;
  int u = U;
  for (int s = S; s >= 1; --s) {
    const int k = cut[s][u];
    rev.push_back({k, u - 1});
    u = k;
  }
  p.stages.assign(rev.rbegin(), rev.rend());
  return p;
}

std::vector<char> stage_units_of_rank(const StagePartition& p, int pp, int r, int num_units, bool vshape) {
  std::vector<char> own(static_cast<size_t>(num_units), 0);
  for (size_t s = 0; s < p.stages.size(); ++s)
    if ((vshape ? (static_cast<int>(s) < pp ? static_cast<int>(s) : 2 * pp - 1 - static_cast<int>(s))
                : static_cast<int>(s) % pp) == r)
      for (int u = p.stages[s].first; u <= p.stages[s].second; ++u) own[u] = 1;
  return own;
}

}  // namespace mt::parallel
