// CRC32C against the standard check value and the incremental form; hardware and table paths
// must agree (the table path is exercised through odd lengths and offsets on any machine).
#include "runtime/crc32c.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace mt {
namespace {

TEST(Crc32c, StandardCheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(0, s.data(), s.size()), 0xE3069283u);  // RFC 3720 / iSCSI check value
  EXPECT_EQ(crc32c(0, nullptr, 0), 0u);
  const std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
}

TEST(Crc32c, IncrementalEqualsWhole) {
  std::vector<unsigned char> b(1000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>(i * 37 + 11);
  const uint32_t whole = crc32c(0, b.data(), b.size());
  for (size_t cut : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    const uint32_t a = crc32c(0, b.data(), cut);
    EXPECT_EQ(crc32c(a, b.data() + cut, b.size() - cut), whole) << cut;
  }
  b[123] ^= 1;
  EXPECT_NE(crc32c(0, b.data(), b.size()), whole);  // a flipped bit changes it
}

}  // namespace
}  // namespace mt
