// Runs a subcommand function in-process (argv[0] = the subcommand's name), capturing its output.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

// Returns the exit code; stdout / stderr go to *out / *err when given.
inline int run_cmd(int (*cmd)(int, char**), std::vector<std::string> args, std::string* out = nullptr,
                   std::string* err = nullptr) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = cmd(static_cast<int>(argv.size()), argv.data());
  std::string o = ::testing::internal::GetCapturedStdout();
  std::string e = ::testing::internal::GetCapturedStderr();
  if (out) *out = o;
  if (err) *err = e;
  return rc;
}
