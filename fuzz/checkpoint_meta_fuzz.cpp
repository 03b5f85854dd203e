// Checkpoint metadata: a checkpoint directory's trainer.json (read_trainer_state, what resume and
// `sample` read first) and a sharded checkpoint's metadata.json index (ShardedCheckpoint). The same
// bytes are tried as each.
#include <cstdint>
#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "checkpoint/sharded_checkpoint.h"
#include "fuzz_contract.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string trainer = mt::fuzz::write_file("trainer.json", data, size);
  const std::string meta = mt::fuzz::write_file("metadata.json", data, size);
  const std::string dir = mt::fuzz::work_dir();
  mt::fuzz::expect_clear("checkpoint_meta_fuzz", trainer, [&] { (void)mt::read_trainer_state(dir); });
  mt::fuzz::expect_clear("checkpoint_meta_fuzz", meta, [&] { mt::ShardedCheckpoint s(dir); });
  return 0;
}
