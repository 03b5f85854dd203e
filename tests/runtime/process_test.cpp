#include "runtime/process.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace mt {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string log_path(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string("mt_process_") + name + "_" +
                                                     std::to_string(::getpid()) + ".log"))
      .string();
}

TEST(RunLogged, ReturnsTheExitStatusAndWritesBothStreamsToTheLog) {
  const std::string log = log_path("status");
  EXPECT_EQ(run_logged({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"}, log), 3);
  const std::string text = read_all(log);
  EXPECT_NE(text.find("out"), std::string::npos);
  EXPECT_NE(text.find("err"), std::string::npos);
  EXPECT_EQ(run_logged({"/bin/sh", "-c", "echo again"}, log), 0);
  EXPECT_EQ(read_all(log), "again\n");  // truncated, not appended
  std::filesystem::remove(log);
}

TEST(RunLogged, ASignalIsReportedAs128PlusItsNumber) {
  const std::string log = log_path("signal");
  EXPECT_EQ(run_logged({"/bin/sh", "-c", "kill -9 $$"}, log), 128 + 9);
  std::filesystem::remove(log);
}

TEST(RunLogged, AProgramThatCannotStartSaysWhy) {
  std::string why;
  const std::string log = log_path("missing");
  EXPECT_EQ(run_logged({"/nonexistent/meshtrain"}, log, &why), -1);
  EXPECT_FALSE(why.empty());
  why.clear();
  EXPECT_EQ(run_logged({}, log, &why), -1);
  EXPECT_FALSE(why.empty());
  std::filesystem::remove(log);
}

}  // namespace
}  // namespace mt
