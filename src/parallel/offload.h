// CPU offload of the optimizer state (train.offload = "optimizer"): the strategy of a one-rank
// GPU run whose fp32 master weights and Adam moments live in page-locked host memory.
//
// The device keeps the weights in the compute dtype (fp32, or bf16 without an fp32 master) and the
// fp32 gradients. When backward finishes a unit in the step's last micro-batch, that unit's
// gradients are queued to the host on the device's copy stream, so the copies run while backward
// computes the units before it. The optimizer step waits for the copies, runs AdamW on the CPU with
// the engine's own vectorised kernel (OpenMP over each tensor's elements, every compute thread),
// one unit at a time, and queues each unit's updated weights in the compute dtype back to the
// device as soon as the unit is done, while the CPU updates the next. The gradient norm is computed
// on the device, as without offload.
//
// Host memory is counted in pinned_memory_tracker() (runtime/host_transfer.h) by category: master
// weights and moments as optimizer, the gradient copies as grads, the bf16 upload copy as params.
// On the Meta device (train --dry-run) the same bytes are counted without being allocated and the
// step does nothing.
#pragma once
#include <memory>

#include "parallel/strategy.h"

namespace mt::parallel {

// How the model is built for offload: the device holds the weights in the compute dtype and the
// gradients, no fp32 master.
ModelStorage offload_model_storage();

// Host bytes per category the offload keeps for a model of `flat` elements (what the strategy
// counts in pinned_memory_tracker()).
StateBytes offload_host_bytes(DType compute, int64_t flat);

std::unique_ptr<Strategy> make_offload_strategy(const StrategySpec& spec, Transformer& model,
                                                std::shared_ptr<comm::ProcessGroup> dp);

}  // namespace mt::parallel
