// Command-line parsing shared by every subcommand: value and bare flags, `--a=b`, dotted config
// overrides, positional arguments, what follows `--`, errors that name the flag.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/arg_parser.h"

namespace mt {
namespace {

void parse(ArgParser& p, std::vector<std::string> args) {
  std::vector<char*> argv;
  args.insert(args.begin(), "prog");
  for (auto& a : args) argv.push_back(a.data());
  p.parse(static_cast<int>(argv.size()), argv.data());
}

TEST(ArgParser, FlagsValuesDottedPositionalAndRest) {
  ArgParser p({"out", "n", "train.*"}, {"verbose"});
  parse(p, {"--out", "a.svg", "--n=3", "--verbose", "--train.steps", "50", "--train.lr=0.1", "file", "--", "x", "--y"});
  EXPECT_EQ(p.get("out"), "a.svg");
  EXPECT_EQ(p.get_int("n", 0), 3);
  EXPECT_TRUE(p.flag("verbose"));
  EXPECT_EQ(p.get("missing", "fallback"), "fallback");
  ASSERT_EQ(p.dotted().size(), 2u);
  EXPECT_EQ(p.dotted()[0], (std::pair<std::string, std::string>{"train.steps", "50"}));
  EXPECT_EQ(p.dotted()[1], (std::pair<std::string, std::string>{"train.lr", "0.1"}));
  EXPECT_EQ(p.positional(), std::vector<std::string>{"file"});
  EXPECT_EQ(p.rest(), (std::vector<std::string>{"x", "--y"}));
}

TEST(ArgParser, ErrorsNameTheFlag) {
  ArgParser p({"out"}, {"verbose"});
  try {
    parse(p, {"--bogus", "1"});
    ADD_FAILURE() << "no error";
  } catch (const ArgError& e) {
    EXPECT_NE(std::string(e.what()).find("bogus"), std::string::npos) << e.what();
  }
  ArgParser q({"out"}, {});
  EXPECT_THROW(parse(q, {"--out"}), ArgError);  // value missing
}

}  // namespace
}  // namespace mt
