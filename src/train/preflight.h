// Memory preflight (train.preflight, on by default): before a job allocates its model, every rank
// learns its exact peak memory by category from the engine's own dry run (`train --dry-run`, run as
// a child process of this binary for this rank of this job) and compares it with the memory free for
// it: on CPU ranks the host's MemAvailable divided among the ranks on that host, on a GPU the
// device's free memory (cudaMemGetInfo). When any rank does not fit, every rank throws the same
// JobConfigError (one all-gather decides): the figures of the rank that misses by the most, and the
// planner's best data-parallel layout that fits on the same ranks, or the ranks it needs.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "comm/process_group.h"
#include "model/config/model_config.h"
#include "runtime/device_mem_info.h"
#include "runtime/memory.h"
#include "train/config.h"

namespace mt {

// The meshtrain binary that runs `train --dry-run` (meshtrain's main() names itself). Empty (the
// default): this process is not meshtrain - a test calling train() in-process - and the trainer
// skips the preflight.
void set_dry_run_binary(const std::string& path);
const std::string& dry_run_binary();

// Rank `rank` of a `world`-rank job of `cfg` as a dry run in a child process of dry_run_binary(): its
// peak bytes by category (mem_peak_by_category of the dry run's final object). Throws
// std::runtime_error with the child's last output line when the dry run fails.
std::array<int64_t, kNumMemCategories> dry_run_peak(const RunConfig& cfg, int world, int rank);

// The bytes one rank may use on device `d`: free GPU memory on CUDA; on the CPU MemAvailable of
// /proc/meminfo divided by the ranks on this host (`local_ranks`). MESHTRAIN_TEST_AVAILABLE_BYTES
// (test-only) stands in for the host's MemAvailable or the GPU's free bytes. `*source` says where the
// figure came from ("MemAvailable 21.3 GiB shared by 2 ranks on host x").
int64_t available_bytes(Device d, int local_ranks, const std::string& host, std::string* source);

// The planner's advice for a job that does not fit: its best data-parallel layout (what `train
// --auto` can run) on `world` ranks, `local_ranks` per host, given `node_bytes` free per host (per
// GPU when !shared_node), training `tokens` tokens per step; else the number of such ranks it needs.
// The layout is checked by the dry run of its rank 0 (the planner asked again with a smaller budget
// while the engine needs more than it predicted).
std::string fitting_layout_advice(const RunConfig& cfg, const ModelConfig& mc, int world, int local_ranks,
                                  double node_bytes, bool shared_node, int64_t tokens);

struct PreflightInput {
  int rank = 0, world = 1, local_ranks = 1;
  std::string host;
  Device device = Device::CPU;
  int64_t tokens_per_step = 0;  // global batch in tokens (the planner's advice keeps it)
  // A dry run: only the collective, so the dry run's bytes per group are a real run's.
  bool count_only = false;
};

// Collective over `g` (every rank of the job). Returns when every rank fits; otherwise throws the
// same JobConfigError on every rank. A dry run that fails on some rank skips the check (a warning on
// rank 0): the real build then reports the cause itself.
void memory_preflight(const RunConfig& cfg, const ModelConfig& mc, comm::ProcessGroup& g, const PreflightInput& in);

}  // namespace mt
