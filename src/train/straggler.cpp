#include "train/straggler.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace mt {

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<Straggler> find_stragglers(const std::vector<RankTimes>& ranks, double ratio, double min_ms) {
  std::vector<double> busy, data, comp;
  for (const auto& r : ranks) {
    busy.push_back(r.busy());
    data.push_back(r.data_wait);
    comp.push_back(r.compute);
  }
  const double mb = median(busy), md = median(data), mc = median(comp);
  std::vector<Straggler> out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const double b = busy[i];
    if (!(b > ratio * mb && b - mb > min_ms)) continue;
    Straggler s;
    s.rank = static_cast<int>(i);
    s.part = data[i] - md >= comp[i] - mc ? "data_wait" : "compute";
    s.busy = b;
    s.median_busy = mb;
    out.push_back(s);
  }
  std::sort(out.begin(), out.end(), [](const Straggler& a, const Straggler& b) { return a.busy > b.busy; });
  return out;
}

std::vector<double> idle_at_collectives(const std::vector<RankTimes>& ranks) {
  double slowest = 0;
  for (const auto& r : ranks) slowest = std::max(slowest, r.busy());
  std::vector<double> idle;
  for (const auto& r : ranks) idle.push_back(std::clamp(slowest - r.busy(), 0.0, std::max(0.0, r.exposed)));
  return idle;
}

StragglerMonitor::StragglerMonitor(comm::ProcessGroup* g, const std::string& host, int64_t every,
                                   double ratio, double min_ms, int64_t first_step)
    : g_(g && g->size() > 1 && every > 0 ? g : nullptr), every_(every), first_step_(first_step),
      window_start_(first_step + 2), ratio_(ratio), min_ms_(min_ms) {
  if (!g_) return;
  // Every rank's host name, once (64 bytes each, sent as 16 int32).
  constexpr size_t kName = 64;
  std::vector<char> mine(kName, 0), all(kName * static_cast<size_t>(g_->size()), 0);
  std::memcpy(mine.data(), host.data(), std::min(host.size(), kName - 1));
  g_->all_gather(mine.data(), all.data(), kName / 4, DType::I32)->wait();
  for (int r = 0; r < g_->size(); ++r) hosts_.emplace_back(&all[static_cast<size_t>(r) * kName]);
}

nlohmann::json StragglerMonitor::add(int64_t step, const RankTimes& t, std::string* line) {
  line->clear();
  if (!g_) return nullptr;
  if (step > first_step_) {  // the run's first step pays warm-up costs
    sum_.step += t.step;
    sum_.data_wait += t.data_wait;
    sum_.compute += t.compute;
    sum_.exposed += t.exposed;
    ++n_;
  }
  if ((step + 1) % every_ != 0 || n_ == 0) return nullptr;  // the same decision on every rank
  const double n = static_cast<double>(n_);
  float mine[4] = {static_cast<float>(sum_.step / n), static_cast<float>(sum_.data_wait / n),
                   static_cast<float>(sum_.compute / n), static_cast<float>(sum_.exposed / n)};
  std::vector<float> all(4 * static_cast<size_t>(g_->size()));
  g_->all_gather(mine, all.data(), 4, DType::F32)->wait();
  const int64_t from = window_start_;
  window_start_ = step + 2;
  sum_ = RankTimes{};
  n_ = 0;
  std::vector<RankTimes> ranks;
  nlohmann::json step_ms = nlohmann::json::array(), busy = nlohmann::json::array(), data = nlohmann::json::array(),
                 idle = nlohmann::json::array();
  for (int r = 0; r < g_->size(); ++r) {
    const float* v = &all[4 * static_cast<size_t>(r)];
    ranks.push_back({v[0], v[1], v[2], v[3]});
    step_ms.push_back(ranks.back().step);
    busy.push_back(ranks.back().busy());
    data.push_back(ranks.back().data_wait);
  }
  const std::vector<double> idle_v = idle_at_collectives(ranks);
  for (double v : idle_v) idle.push_back(v);
  const double max_idle = *std::max_element(idle_v.begin(), idle_v.end());
  const std::vector<Straggler> slow = find_stragglers(ranks, ratio_, min_ms_);
  nlohmann::json named = nullptr;
  if (!slow.empty()) named = nlohmann::json::array();
  for (const auto& s : slow) {
    named.push_back({{"rank", s.rank}, {"host", hosts_[static_cast<size_t>(s.rank)]}, {"part", s.part}});
    const RankTimes& rt = ranks[static_cast<size_t>(s.rank)];
    char b[512];
    std::snprintf(b, sizeof b,
                  "%sstraggler: rank %d on %s (%s) over steps %lld-%lld: data wait %.1f ms + compute %.1f ms per step "
                  "against the ranks' median %.1f ms; the fastest rank waits about %.1f ms per step at collectives",
                  line->empty() ? "" : "\n", s.rank, hosts_[static_cast<size_t>(s.rank)].c_str(), s.part.c_str(),
                  static_cast<long long>(from), static_cast<long long>(step + 1), rt.data_wait, rt.compute,
                  s.median_busy, max_idle);
    *line += b;
  }
  if (named.is_array() && named.size() == 1) named = named[0];
  return {{"straggler", named},
          {"step_ms_per_rank", step_ms},
          {"busy_ms_per_rank", busy},
          {"data_wait_ms_per_rank", data},
          {"idle_ms_per_rank", idle}};
}

}  // namespace mt
