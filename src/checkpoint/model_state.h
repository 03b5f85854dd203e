// Model state between the unsplit layout of checkpoints and initialisation (`ref`: every unit,
// tp = 1) and one rank's share under its strategy, tensor-parallel split and pipeline stage, one
// unit at a time, so no rank ever holds the whole model's full state.
#pragma once
#include <cstdint>

#include "checkpoint/checkpoint.h"
#include "checkpoint/sharded_checkpoint.h"
#include "comm/process_group.h"
#include "model/transformer.h"
#include "parallel/expert_parallel.h"
#include "parallel/strategy.h"
#include "runtime/tensor.h"

namespace mt {

class ModelState {
 public:
  // `tp_aux` joins the tensor-parallel ranks' parts, `pp_aux` (null without a pipeline) sums the
  // stages' disjoint units.
  ModelState(Transformer& model, const Transformer& ref, parallel::Strategy& strategy, comm::ProcessGroup& tp_aux,
             comm::ProcessGroup* pp_aux);

  // Expert parallelism: the local experts' state moves through `ep` (not the strategy).
  void set_expert_parallel(parallel::ExpertParallel* ep) { ep_ = ep; }
  // Loads every unit this rank owns into the strategy: from `reader` (its weights, and the Adam
  // moments when it has them) or, without one, the initial weights of `seed` (one random stream
  // over the whole model; on the Meta device only the buffers are made).
  // base_layout (LoRA, initialised from a base model): the layout `reader` was opened with (the
  // model without adapters); the base parameters are read by name from it and the adapters start
  // as initialised with `seed`.
  void load(CheckpointReader* reader, uint64_t seed, const Transformer* base_layout = nullptr);
  // LoRA: after load, lora_base_unit_crc of every unit this rank loaded (0 for the others: a
  // maximum over the ranks completes it).
  const std::vector<uint32_t>& base_unit_crcs() const { return base_crcs_; }
  // Unit u's full fp32 state in `ref` layout: weights, and with `moments` the two Adam moments
  // (out[0..2]). Collective over the world: every rank calls it for every unit.
  void gather_full_unit(int u, bool moments, Tensor* out);
  // Every unit gathered; `writer` (rank 0's, null elsewhere) writes them.
  void save(CheckpointWriter* writer);

  // ---- sharded checkpoints: only what this rank holds, no communication ----
  // The pieces this rank writes, per unit, with offsets relative to the start of its owned range
  // (the strategy's owned_span, followed with expert parallelism by the unit's local experts on
  // the first rank of each edp group): of elements several ranks hold (replicas, tp ranks for
  // replicated parameters, edp ranks for experts) each is written by exactly one of them.
  std::vector<std::vector<LocalPiece>> owned_pieces() const;
  // Elements of unit u's owned range and local experts (the size of the host buffers snapshot_unit fills).
  int64_t owned_numel(int u) const;
  // Copies unit u's owned fp32 weights and moments (then its experts') to host buffers of owned_numel(u) elements.
  void snapshot_unit(int u, float* w, float* m, float* v);
  // Loads this rank's owned ranges of every unit (and a tied replica) from `ck`, whatever layout
  // wrote it, reading only the bytes they need; then end_load_owned (collective).
  void load_owned(const ShardedCheckpoint& ck, bool moments, int64_t adam_steps);

 private:
  Transformer& model_;
  const Transformer& ref_;
  parallel::Strategy& strategy_;
  comm::ProcessGroup& tp_aux_;
  comm::ProcessGroup* pp_aux_;
  parallel::ExpertParallel* ep_ = nullptr;
  std::vector<uint32_t> base_crcs_;
  // Unit u's part of this rank's file: the strategy's owned range, then (expert parallelism, on the
  // ranks that write them) the local experts.
  int64_t strategy_numel(int u) const;
  int64_t expert_numel(int u) const;
};

}  // namespace mt
