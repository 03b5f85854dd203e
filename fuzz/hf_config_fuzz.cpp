// Hugging Face config.json (`model.hf_config`, `model-info --hf-config`, the planner): the strict
// reader training uses and the planner's dimensions-only reader; an accepted config is written
// back out (hf_config_json) and must read back the same.
#include <cstdint>

#include "fuzz_contract.h"
#include "model/config/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::write_file("config.json", data, size);
  for (bool strict : {true, false}) {
    mt::fuzz::expect_clear("hf_config_fuzz", path, [&] {
      const mt::ModelConfig m = mt::model_from_hf_config(path, strict);
      if (!strict) return;
      std::string again;
      try {
        again = mt::hf_config_json(m);
      } catch (const std::invalid_argument&) {
        return;  // a config with no Hugging Face form (refused with a message, fine)
      }
      (void)mt::model_from_hf_json(again, "written back", true);
    });
  }
  return 0;
}
