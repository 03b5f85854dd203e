// String helpers: comma lists.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime/strings.h"

namespace mt {
namespace {

TEST(SplitList, DropsEmptyItems) {
  EXPECT_EQ(split_list("a,b,,c"), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(split_list(""), std::vector<std::string>{});
  EXPECT_EQ(split_list(",x,"), std::vector<std::string>{"x"});
  EXPECT_EQ(split_list("1:2", ':'), (std::vector<std::string>{"1", "2"}));
}

}  // namespace
}  // namespace mt
