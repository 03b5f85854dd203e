// Sharded checkpoints (format 2): every rank writes only what it holds, all at once, and any
// layout reads them back, each rank reading only the bytes of its own new share.
//
//   CHECKPOINT_DIR/step_NNNNNNNN/
//     rank_00000.safetensors ...  one per rank of the job that saved: the pieces of the logical
//                                 tensors this rank owned (its ZeRO shard of each unit, its tp
//                                 slice, its pipeline stage's units), fp32 weights and both AdamW
//                                 moments; header metadata: rank, step, data position
//     metadata.json               every logical tensor (name, full shape, dtype) -> the pieces
//                                 that hold it: (file, byte offset, rows, cols, CRC32C); every
//                                 file's size and CRC32C; the layout, step and data position
//     trainer.json, config.toml   as in format 1 (trainer.json says "format": "sharded")
//
// A logical tensor is a parameter in the engine's layout ([out, in], real vocabulary rows only;
// Conv1D weights are marked hf_transposed, which export applies) or one of its moments
// ("exp_avg.<name>", "exp_avg_sq.<name>"). Viewed as a matrix [rows, cols] (1-D: cols = 1), a
// piece is a box [row0, row0 + rows) x [col0, col0 + cols) stored row-major at its offset.
// docs/checkpoints.md describes the format and the commit protocol.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "comm/process_group.h"
#include "model/transformer.h"

namespace mt {

// Host memory for checkpoint I/O (what files are written from and read into), counted under the
// workspace category like the other checkpoint buffers. Grow-only; contents unspecified.
class HostBuffer {
 public:
  HostBuffer() = default;
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  float* reserve(size_t floats);  // at least `floats` elements; returns data()
  float* data() const { return p_; }

 private:
  float* p_ = nullptr;
  size_t bytes_ = 0;
};

struct Box {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
};

// One contiguous run of a rank's buffer that is one box of a logical parameter.
struct LocalPiece {
  int param = 0;      // index into the unsplit model's params()
  int64_t local = 0;  // element offset of the run, relative to the range it was cut from
  Box box;            // in the parameter's logical [rows, cols] (real vocabulary rows only)
};

// The elements [begin, end) of unit u of `model` (relative to the unit's start, in model's layout:
// tp-split, padded) as boxes of the unsplit `ref`'s parameters; padding is in no piece. With
// `dedup`, elements this rank does not write are left out: replicated (TpSplit::None) parameters
// on tp ranks other than 0.
std::vector<LocalPiece> unit_pieces(const Transformer& model, const Transformer& ref, int u, int64_t begin,
                                    int64_t end, bool dedup);

// With expert parallelism (experts apart): unit u's local experts, the whole of their range of the
// expert buffers (offsets relative to its start), as boxes of ref's parameters; `dedup` as above.
std::vector<LocalPiece> expert_unit_pieces(const Transformer& model, const Transformer& ref, int u, bool dedup);

// The logical tensors of a model: the parameter's name, or the moment's prefix + name.
std::string logical_name(const ParamInfo& p, int kind);  // kind 0 weights, 1 exp_avg, 2 exp_avg_sq
std::vector<int64_t> logical_shape(const ParamInfo& p, const ModelConfig& c);
int64_t logical_cols(const ParamInfo& p);

// Writes one rank's file: the entries of `pieces` (per unit, three kinds each) in order; data
// comes from fill(u, kind) (host pointer to the unit's range the pieces were cut from).
struct RankFileResult {
  uint64_t bytes = 0;
  uint32_t crc = 0;
  nlohmann::json pieces;  // [[tensor, offset, row0, rows, col0, cols, crc], ...]
};
class RankFileWriter {
 public:
  RankFileWriter(const std::string& path, const Transformer& ref, const std::vector<std::vector<LocalPiece>>& pieces,
                 const std::map<std::string, std::string>& metadata);
  ~RankFileWriter();
  // Unit u's three host buffers (weights, exp_avg, exp_avg_sq) of the range its pieces index.
  void write_unit(int u, const float* w, const float* m, const float* v);
  RankFileResult finish();

 private:
  const Transformer& ref_;
  std::vector<std::vector<LocalPiece>> pieces_;
  std::unique_ptr<class SafetensorsWriter> out_;
  RankFileResult res_;
};

// A sharded checkpoint opened for reading: metadata.json parsed and checked for consistency.
class ShardedCheckpoint {
 public:
  explicit ShardedCheckpoint(const std::string& dir);
  ~ShardedCheckpoint();
  static bool is_sharded(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const nlohmann::json& meta() const { return meta_; }
  int num_files() const { return static_cast<int>(files_.size()); }
  const std::string& file_name(int i) const { return files_[static_cast<size_t>(i)].name; }
  // The model's tensors (with moments: also both moments) are present with its shapes and dtype
  // F32; throws naming metadata.json and the tensor.
  // adapters_only (a LoRA checkpoint): the frozen base parameters are not expected.
  void check_model(const Transformer& ref, bool moments, bool adapters_only = false) const;
  // Files index % stride == first: present, of the recorded size, their headers agreeing with the
  // metadata (every piece's entry, offset and shape, the step); with `verify` also every piece's
  // and the file's CRC32C. Returns "" or the first problem (naming file and tensor).
  std::string check_files(int first, int stride, bool verify) const;
  // The elements of `box` of logical tensor `name` into dst (row-major, box.numel()), reading only
  // the overlapping byte ranges; throws naming the tensor if the pieces do not cover the box.
  void read_box(const std::string& name, const Box& box, float* dst) const;
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct Piece {
    int file = 0;
    uint64_t offset = 0;
    Box box;
    uint32_t crc = 0;
  };
  struct Tensor_ {
    std::vector<int64_t> shape;
    std::vector<Piece> pieces;
  };
  struct File {
    std::string name;
    uint64_t bytes = 0;
    uint32_t crc = 0;
  };
  int fd(int file) const;
  std::string dir_;
  nlohmann::json meta_;
  std::map<std::string, Tensor_> tensors_;
  std::vector<File> files_;
  mutable std::map<int, int> fds_;
  mutable int64_t bytes_read_ = 0;
};

// Every rank's string, on every rank (collective over `g`).
std::vector<std::string> all_gather_strings(comm::ProcessGroup& g, const std::string& mine);
// Collective over `g`: "" when every rank passed "", else "rank R: <its message>" for the lowest
// such rank, the same on every rank.
std::string agree_on_error(comm::ProcessGroup& g, const std::string& mine);

// Writes metadata.json, trainer.json and config.toml into tmp_dir and swaps it into place as
// root/step_N (then `latest`): rank 0's part of the commit, after every rank's file is complete.
// `files`: per rank {"name", "bytes", "crc32c", "pieces"}.
void commit_sharded(const std::string& root, const std::string& tmp_dir, int64_t step, const Transformer& ref,
                    const std::vector<nlohmann::json>& files, const nlohmann::json& layout, const TrainerState& st,
                    const RunRecord& run);
std::string step_dir_name(int64_t step);

}  // namespace mt
