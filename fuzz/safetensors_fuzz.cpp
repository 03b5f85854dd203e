// safetensors files (header and tensor bytes): read_safetensors, what `train.init_from`, export and
// the checkpoint readers go through.
#include <cstdint>

#include "checkpoint/safetensors.h"
#include "fuzz_contract.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::write_file("model.safetensors", data, size);
  mt::fuzz::expect_clear("safetensors_fuzz", path, [&] {
    std::map<std::string, std::string> meta;
    (void)mt::read_safetensors(path, &meta);
  });
  return 0;
}
