// Files for the tests that write them: a directory of the running test's own, token shards whose
// every token tells where it came from, and the batches a loader makes of them. Included as "../test_files.h" from tests/<folder>/.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/token_shards.h"

namespace mt::test {

// An empty directory named after the process and the running test (created here, removed with
// everything in it at the end of the scope).
struct TestDir {
  std::filesystem::path path;
  TestDir() {
    const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
    path = std::filesystem::temp_directory_path() /
           ("mt_" + std::string(t->test_suite_name()) + "_" + t->name() + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TestDir() { std::filesystem::remove_all(path); }
  TestDir(const TestDir&) = delete;
  TestDir& operator=(const TestDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// The final summary object of a metrics file (the line with "final"; null if there is none).
inline nlohmann::json final_metrics(const std::string& metrics) {
  std::ifstream f(metrics);
  std::string line;
  nlohmann::json last;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (j.contains("final")) last = j;
  }
  return last;
}

// One batch of a loader: inputs and targets, B x T each.
struct Batch {
  std::vector<int32_t> x, y;
};

// The next batch of a loader (BatchLoader, BlendLoader).
template <class Loader>
Batch take(Loader& l) {
  const size_t n = static_cast<size_t>(l.B() * l.T());
  Batch b{std::vector<int32_t>(n), std::vector<int32_t>(n)};
  l.next(b.x.data(), b.y.data());
  return b;
}

// A token shard whose token i is first + i.
inline void write_ramp(const std::string& path, int first, int count) {
  std::vector<int32_t> t(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) t[static_cast<size_t>(i)] = first + i;
  write_token_shard(path, t);
}

}  // namespace mt::test
