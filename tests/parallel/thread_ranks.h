// In-process ranks for the parallel tests: f(rank) on n threads (one OpenMP thread each), joined.
#pragma once
#include <omp.h>

#include <functional>
#include <thread>
#include <vector>

namespace mt::test {

inline void on_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back([&f, r] {
    omp_set_num_threads(1);
    f(r);
  });
  for (auto& t : ts) t.join();
}

}  // namespace mt::test
