// TOML run configs (`train --config F`): RunConfig::load, then the model the config describes.
// Only load's errors come from the file and must name it; the model's are about keys it names.
#include <cstdint>

#include "fuzz_contract.h"
#include "train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::write_file("run.toml", data, size);
  mt::RunConfig c;
  const bool loaded = mt::fuzz::expect_clear("toml_config_fuzz", path, [&] { c = mt::RunConfig::load(path, {}); });
  if (!loaded) return 0;
  // The fuzzer must not make the engine read other files.
  if (!c.model.hf_config.empty()) return 0;
  mt::fuzz::expect_clear("toml_config_fuzz", "", [&] { (void)c.model_config(); });
  return 0;
}
