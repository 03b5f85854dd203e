// The set of ranks of a job (World), named n-dimensional arrangements of them (DeviceMesh), and
// rank-aware printing.
//
// A process started by mpirun (or any MPI launcher) initialises MPI with MPI_THREAD_MULTIPLE; a
// process started on its own runs without MPI as a world of one rank, whose groups all have size 1
// and complete every operation at once (still counted).
#pragma once
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"

namespace mt::comm {

class World {
 public:
  // Initialises the world once (later calls return the same object). Reads the environment knobs
  // MESHTRAIN_DEBUG, MESHTRAIN_TIMEOUT_S (see docs/comm.md) and starts the watchdog. Uses MPI when
  // the process was started by an MPI launcher or MESHTRAIN_MPI=1 (MESHTRAIN_MPI=0 forbids it); if
  // MPI is already initialised by the caller it is used as is (and not finalized by finalize()).
  static World& init(int* argc, char*** argv);
  // A count-only world of `size` ranks seen from rank `rank`, without MPI (the Meta backend of
  // `train --dry-run`): its groups have their real sizes and members but move no data; every
  // operation completes at once and is counted exactly as the MPI backend counts it (bytes, calls,
  // the staging buffers it would hold). Buffers of Meta tensors are left alone; host buffers get
  // what they would hold if every rank had passed this rank's values (all_gather replicates,
  // sum multiplies by the group size, avg / max / broadcast leave them, recv zero-fills).
  // Throws CommError if a world exists already.
  static World& init_meta(int size, int rank);
  static World& get();  // throws CommError before init()
  static bool initialized();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Rank and number of ranks on this node (ranks sharing memory), node index and node count.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int node() const { return node_; }
  int num_nodes() const { return num_nodes_; }
  const std::string& hostname() const { return hostname_; }
  bool uses_mpi() const { return mpi_; }
  bool is_meta() const { return meta_; }

  // All ranks, named "world".
  std::shared_ptr<ProcessGroup> world();
  // Collective over the world: ranks passing the same color form a group, ordered by key (then
  // world rank). Every rank must call it, in the same order relative to other group creations.
  std::shared_ptr<ProcessGroup> split(int color, int key, const std::string& name);
  // The same, with colour and key given for every world rank (`color_key(r)` = {colour, key} of
  // world rank r): a Meta world needs every rank's to know the members.
  std::shared_ptr<ProcessGroup> split_by(const std::function<std::pair<int, int>(int)>& color_key,
                                         const std::string& name);
  // A new group with the members of `g`, in the same order (its own communicator and counters).
  // Collective over the world, like split.
  std::shared_ptr<ProcessGroup> split_like(const ProcessGroup& g, const std::string& name);

  // Finishes outstanding operations, stops the communication threads and the watchdog, and
  // finalizes MPI (when init() initialised it). Call once at the end of a successful run; after an
  // error just exit with a non-zero code (mpirun then ends the other ranks).
  void finalize();
  bool finalized() const { return finalized_; }
  // Prints `msg` (with the rank) and the flight recorder to stderr and ends the whole job.
  [[noreturn]] void abort(const std::string& msg, int code = 1);

 private:
  World() = default;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1, node_ = 0, num_nodes_ = 1;
  bool mpi_ = false, own_mpi_ = false, finalized_ = false, meta_ = false;
  std::string hostname_;
  std::shared_ptr<ProcessGroup> world_;
};

// Ranks arranged on named dimensions, row-major (the last dimension varies fastest, so with the
// conventional order pp, dp_replicate, dp_shard, tp the ranks of a tp group are adjacent).
class DeviceMesh {
 public:
  // `dims`: (name, size) in order; a size of -1 (at most one) takes what the world size leaves.
  // Throws CommError if the product differs from the world size, naming the dimension at fault.
  // Collective over the world: creates the communicators of every dimension and every
  // combination of dimensions, so every rank must construct the same mesh at the same point.
  DeviceMesh(World& world, std::vector<std::pair<std::string, int>> dims);

  // Resolves -1 and validates against `world_size` without creating anything (throws CommError).
  static std::vector<std::pair<std::string, int>> resolve(
      std::vector<std::pair<std::string, int>> dims, int world_size);

  // The group of one dimension: ranks that differ only in that coordinate ("tp", "dp_shard", ...).
  // "dp" names the flattened {dp_replicate, dp_shard} when the mesh has both.
  std::shared_ptr<ProcessGroup> group(const std::string& dim);
  // Flattened group over several dimensions (any order given; ranks ordered row-major in mesh
  // order). Named "dp" for {dp_replicate, dp_shard}, "dp_cp" for {dp_replicate, dp_shard, cp},
  // "dp_shard_cp" for {dp_shard, cp}, "world" for every dimension, otherwise the
  // names joined with '+' in mesh order (e.g. "dp_shard+tp").
  std::shared_ptr<ProcessGroup> group(std::vector<std::string> dims);

  int coord(const std::string& dim) const;
  // Coordinates (mesh order) of any world rank.
  std::vector<int> coords_of(int world_rank) const;
  int size(const std::string& dim) const;
  bool has(const std::string& dim) const;
  const std::vector<std::pair<std::string, int>>& dims() const { return dims_; }
  // World rank at the given coordinates (one per dimension, mesh order).
  int rank_at(const std::vector<int>& coords) const;
  // "pp=1 x dp_replicate=1 x dp_shard=2 x tp=2"
  std::string describe() const;

 private:
  int index_of(const std::string& dim) const;  // throws CommError for an unknown dimension
  unsigned mask_of(std::vector<std::string> dims) const;
  std::vector<std::pair<std::string, int>> dims_;
  std::vector<int> coords_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;  // indexed by dimension bit mask
};

// True when rank `rank` should print progress output: rank 0 always; others when
// MESHTRAIN_LOG_RANKS is "all" or a comma-separated list containing the rank.
bool should_print(int rank);
// The same for this process (world rank once World::init ran, else the launcher's rank variable).
bool should_print();
// printf to `f` if should_print(); prefixes "[rank R] " when the world has more than one rank and
// every rank may print.
void log_printf(FILE* f, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace mt::comm
