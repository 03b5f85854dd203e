// Token shards (train.bin / val.bin): the header checks and every reader (the memory-mapped
// TokenShard the data loader uses, the uint16 and uint32 copies, the header-only readers).
#include <cstdint>

#include "data/token_shards.h"
#include "fuzz_contract.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::write_file("train.bin", data, size);
  const char* t = "token_shard_fuzz";
  mt::fuzz::expect_clear(t, path, [&] { (void)mt::read_token_shard_header(path); });
  mt::fuzz::expect_clear(t, path, [&] { (void)mt::read_token_shard_info(path); });
  for (int64_t vocab : {int64_t{0}, int64_t{50257}, int64_t{300}, int64_t{128256}}) {
    mt::fuzz::expect_clear(t, path, [&] {
      mt::TokenShard s(path, vocab);
      int32_t out[8];
      const size_t n = s.size() < 8 ? s.size() : 8;
      s.copy(0, n, out);
      uint64_t sum = 0;
      for (size_t i = 0; i < s.size(); ++i) sum += s[i];
      if (vocab > 0)
        for (size_t i = 0; i < s.size(); ++i)
          if (s[i] >= static_cast<uint64_t>(vocab)) mt::fuzz::crash(t, "a token id past the vocabulary was accepted", "", "");
      (void)sum;
    });
    mt::fuzz::expect_clear(t, path, [&] { (void)mt::read_token_shard(path, vocab); });
    mt::fuzz::expect_clear(t, path, [&] { (void)mt::read_token_shard32(path, vocab); });
  }
  return 0;
}
