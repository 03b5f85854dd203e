// Saving sharded checkpoints from a running job: every rank writes its own file at once, then the
// ranks agree (a collective) and rank 0 writes metadata.json and swaps the step directory into
// place. With train.checkpoint_async the rank's state is first copied into a staging buffer
// (category workspace) and its file written by a background thread while training continues;
// the commit happens at the first step boundary after every rank's write has finished (a one-float
// all-reduce per step while a save is in flight), before the next save, or at the end.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/model_state.h"
#include "comm/process_group.h"

namespace mt {

struct SaverStats {
  int64_t saves = 0;
  double stall_ms = 0;       // main-thread time spent in checkpoint code during training, over all saves
  double final_wait_ms = 0;  // async: the end of the run waiting for the last save to be written
  double write_ms = 0;       // time the rank's file took to write (background thread when async)
  int64_t staging_bytes = 0; // async: the staging buffer (peak)
  int64_t bytes_written = 0; // this rank's files, over all saves
};

class CheckpointSaver {
 public:
  // `group`: the whole world. `root`: train.checkpoint_dir. `async`: train.checkpoint_async.
  // `layout`: recorded in metadata.json. `file_meta`: this rank's coordinates, recorded in its
  // file's header.
  CheckpointSaver(ModelState& state, const Transformer& ref, comm::ProcessGroup& group, int rank, std::string root,
                  bool async, RunRecord run, nlohmann::json layout, std::map<std::string, std::string> file_meta);
  ~CheckpointSaver();
  // Collective. Starts (async) or does (sync) the checkpoint of state `st`; an async save waits for
  // the previous one first.
  void save(const TrainerState& st);
  // Collective, at every step boundary: commits an async save once every rank's file is written.
  void poll();
  // Collective: waits for and commits the save in flight (at_end: the run's end, counted apart
  // from the stalls during training).
  void finish(bool at_end = false);
  const SaverStats& stats() const { return stats_; }
  static std::string rank_file_name(int rank);

 private:
  void commit();  // gather, rank 0 writes metadata and swaps in; collective
  void write_file(const float* staging);  // this rank's file (background thread when async)
  ModelState& state_;
  const Transformer& ref_;
  comm::ProcessGroup& g_;
  int rank_;
  std::string root_;
  bool async_;
  RunRecord run_;
  nlohmann::json layout_;
  std::map<std::string, std::string> file_meta_;
  SaverStats stats_;
  // The save in flight.
  bool pending_ = false;
  TrainerState st_;
  std::string tmp_dir_;
  std::vector<std::vector<LocalPiece>> pieces_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::string error_;
  nlohmann::json result_;
  float* staging_ = nullptr;
  size_t staging_size_ = 0;
  double write_ms_ = 0;
};

}  // namespace mt
