// The planner's model of one training step: memory per GPU by category, bytes moved per link type,
// and time split into compute, exposed communication and pipeline bubble, for any layout
// (strategy x dp_replicate x dp_shard x tp x pp x schedule x checkpointing x offload) on any cluster.
//
// Every formula cites its source in docs/plan.md. Conventions:
//  * Psi = parameters held by one GPU's pipeline stage after tensor parallelism (the heaviest stage).
//  * Bytes per rank for a ring collective over n ranks of an S-byte buffer: all-reduce 2(n-1)/n*S,
//    all-gather / reduce-scatter (n-1)/n*S (nccl-tests doc/PERFORMANCE.md).
//  * Mesh order (innermost first): tp, cp, dp_shard, dp_replicate, pp (torchtitan's order), so tp groups
//    stay inside a node and pp is the outermost dimension. The cp ranks join the data-parallel
//    reduction and the sharding (dp_shard x cp), as the engine does.
#pragma once
#include <cstdint>
#include <string>

#include "model/config/model_config.h"
#include "parallel/layout/parallel_config.h"
#include "parallel/layout/parallel_plan.h"
#include "plan/cluster.h"

namespace mt::plan {

// The parallel configuration's vocabulary (parallel/layout/parallel_config.h) under the planner's names: one
// enum each with the engine, printed by mt::to_string in the config spellings (NO_SHARD, ...;
// none, gpipe, 1f1b, interleaved_1f1b; none, selective, full). The planner models every strategy
// but HYBRID_SHARD_ZERO2 (check_layout refuses it).
using Strategy = ShardingStrategy;
using Schedule = PipelineSchedule;  // None: no pipeline (pp = 1)
using Checkpointing = Recompute;
enum class AttentionImpl { Flash, Unfused };

// Human labels: DDP, ZeRO-1, ZeRO-2, ZeRO-3, HSDP (HSDP-ZeRO-2 for HYBRID_SHARD_ZERO2).
using mt::strategy_label;
// A modelled strategy from its label, its config spelling or a lower-case alias (ddp, zero1, zero-1,
// zero2, zero3, fsdp, hsdp); false for anything else, HYBRID_SHARD_ZERO2 included.
bool parse_strategy(const std::string& s, Strategy* out);
// "none" or a config spelling (gpipe, 1f1b, interleaved_1f1b), or "interleaved".
bool parse_schedule(const std::string& s, Schedule* out);
// A config spelling: none, selective, full.
bool parse_checkpointing(const std::string& s, Checkpointing* out);

// The training setup that does not depend on the layout.
struct TrainSetup {
  int64_t global_batch = 0;     // sequences per optimizer step, all replicas (0: ~1M tokens, >= 1 per GPU)
  int64_t micro_batch = 0;      // sequences per micro-batch per model replica (0: planner chooses)
  int64_t seq = 0;              // tokens per sequence (0: the model's seq_len)
  bool fp32 = false;            // false: bf16 mixed precision (bf16 params+grads, fp32 master+Adam)
  int reduce_bytes = 4;         // bytes per element of gradient reduction (4 fp32 as this engine reduces, 2 bf16)
  int residual_bytes = 0;       // bytes per element of the residual stream and the norm inputs (0: the activation
                                // size; 4 = the engine's fp32 stream in a bf16 run, model.residual_dtype = fp32)
  int logits_bytes = 4;         // bytes per element of the LM head's [tokens, vocab/t] logits (4: fp32; 2 = the
                                // engine's model.logits_dtype = bf16, its auto for bf16 on a GPU at tp = 1)
  int grad_bytes = 0;           // bytes per stored gradient (0: the param dtype, ZeRO's convention; 4 = fp32
                                // gradient accumulation as in Megatron and this engine: 18 B/param)
  AttentionImpl attention = AttentionImpl::Flash;
  bool dropout = false;         // dropout masks stored (Korthikanti's 34 assumes dropout)
  bool sequence_parallel = true;  // Megatron SP whenever tp > 1
  bool tp_comm_overlap = false;   // TP collectives hidden behind GEMMs (async TP); off = exposed
  bool overlap_param_gather = false;  // ZeRO-1/2: post-step all-gather hidden behind the next forward
  double bucket_bytes = 25.0 * 1024 * 1024;  // DDP / ZeRO-1/2 gradient bucket (PyTorch default 25 MiB)
  // Override the FLOPs recomputed in backward, as a fraction of the forward matmul FLOPs (used to
  // describe other systems' policies, e.g. torchtitan's op-level selective AC ~ every other matmul
  // = 0.5). Negative: derived from the checkpointing mode.
  double recompute_fraction = -1;

  int64_t seq_or(const ModelConfig& m) const { return seq > 0 ? seq : m.seq_len; }
  int act_bytes() const { return fp32 ? 4 : 2; }  // activation / param / grad element size
  int res_bytes() const { return residual_bytes > 0 ? residual_bytes : act_bytes(); }
};

// The planner's layout is the engine's plan (parallel/layout/parallel_plan.h): one type.
using Layout = ParallelPlan;

// ---- Model-state formulas (ZeRO paper, arXiv 1910.02054 §5) ----------------------------------
struct ModelStateBytes {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
// Bytes per parameter of params / grads / optimizer state: bf16 mixed precision 2 / 2 / 12 (fp32
// master + two fp32 Adam moments); fp32 training 4 / 4 / 8 (no master copy). Both total 16.
ModelStateBytes bytes_per_param(bool fp32, int grad_bytes = 0);
// Per-GPU model state for psi parameters under a strategy sharded `shard` ways:
// DDP 16psi; ZeRO-1 4psi + 12psi/N; ZeRO-2 2psi + 14psi/N; ZeRO-3 and HSDP 16psi/N (bf16 numbers).
// cpu_offload moves the optimizer term to host memory (0 here).
ModelStateBytes zero_model_state(double psi, Strategy s, int shard, bool fp32, bool cpu_offload = false,
                                 int grad_bytes = 0);
// The whole model's params + grads + optimizer state, unsharded (16 bytes x parameters).
double model_state_bytes(const ModelConfig& m, bool fp32);

// ---- Activation formulas (Korthikanti et al. 2022, arXiv 2205.05198, Table 2) -------------------
// Bytes of activations one transformer layer keeps for backward, 16-bit, GPT block with dropout:
// none: sbh(34 + 5as/h); TP only: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh/t (34 + 5as/h);
// selective recompute: s^2 terms dropped; full recompute: 2sbh (/t with SP).
double korthikanti_layer_activation_bytes(double s, double b, double h, double a, int t, bool sp,
                                          Checkpointing ckpt);
// The generalised per-layer count the planner uses: GPT-2 or Llama (SwiGLU, grouped-query K/V),
// flash or unfused attention, with or without dropout, any element size. With ckpt None it equals
// the Korthikanti formula for a GPT block with ffn = 4h, dropout, unfused attention, 2-byte elements;
// Full keeps the layer input only. Selective is *our engine's* policy (model/transformer.cpp, and
// torchtitan's "selective layer"): every second layer recomputed, so the per-layer average of the
// two. (Korthikanti's attention-only selective recompute is the formula above; with flash attention
// it equals None.)
double layer_activation_bytes(const ModelConfig& m, const TrainSetup& setup, int64_t micro_batch, int tp,
                              Checkpointing ckpt);

// ---- Collectives --------------------------------------------------------------------------------
struct GroupShape {
  int size = 1;   // ranks in the group
  int local = 1;  // of them on one node
  int nodes = 1;  // nodes the group spans
};
// Placement of a process group whose members are `stride` ranks apart, nodes of gpus_per_node.
GroupShape group_shape(int size, int stride, int gpus_per_node);
enum class Collective { AllReduce, ReduceScatter, AllGather };
struct CollCost {
  double time = 0;         // seconds
  double intra_bytes = 0;  // bytes this rank sends over intra-node links
  double inter_bytes = 0;  // bytes this rank sends over its NIC
};
// Ring cost of one collective on an S-byte buffer (the reduced tensor / the gathered output / the
// scatter input). Multi-node groups run NCCL-style multi-channel rings: each ring leaves a node once,
// so 1/local of the bytes cross the NIC, and the intra- and inter-node phases pipeline
// (time = max of the two) - hierarchical in bytes, overlapped in time. Latency: ring steps x alpha,
// capped by a tree's 2 log2(n) steps.
CollCost collective(Collective kind, double bytes, GroupShape g, const Cluster& c);

// ---- Pipeline -----------------------------------------------------------------------------------
// Idle fraction of a pipelined step: GPipe/1F1B (p-1)/(m+p-1); interleaved with v chunks the bubble
// shrinks to (p-1)/v micro-batch slots, i.e. ((p-1)/v)/(m + (p-1)/v) (arXiv 2104.04473 §2.2).
double bubble_fraction(int p, int64_t m, int v);

// ---- FLOPs ----------------------------------------------------------------------------------------
// Weights that take part in matmuls: the blocks' projections plus the output head (tied or not).
double matmul_params(const ModelConfig& m);
// Model FLOPs per token: 6 N + 12 L h s (PaLM App. B, torchtitan get_num_flop_per_token), N = all
// parameters except lookup-only embeddings (an untied input embedding, GPT-2's position table).
double flops_per_token(const ModelConfig& m, int64_t seq);
// Megatron's per-iteration FLOPs with full recompute (arXiv 2104.04473 §5.1), used to turn a step
// time into the "TFLOP/s per GPU" Megatron publishes: 96 B s L h^2 (1 + s/(6h) + V/(16 L h)).
double megatron_flops_per_iteration(const ModelConfig& m, int64_t global_batch, int64_t seq);

// ---- The estimate ---------------------------------------------------------------------------------
struct MemoryBytes {
  double params = 0, grads = 0, optimizer = 0, activations = 0, comm = 0;
  double total() const { return params + grads + optimizer + activations + comm; }
};
struct CommBytes {
  double intra_node = 0, inter_node = 0;  // bytes one GPU sends per step
};
// The same bytes per step by the group they travel on (what the engine counts per process group):
// dp = the data-parallel group of DDP / ZeRO-1/2/3 and HSDP's shard group, dp_replicate = HSDP's
// all-reduce across replicas, tp and pp.
struct GroupBytes {
  double dp = 0, dp_replicate = 0, tp = 0, pp = 0;
  double ep = 0;   // expert parallelism's token all-to-alls
  double edp = 0;  // the experts' gradient all-reduce over the ranks holding the same experts
  double cp = 0;  // ring attention's key / value blocks and their gradients (send and receive, as the engine counts)
};
struct StepTime {
  double compute = 0, exposed_comm = 0, bubble = 0;
  double total() const { return compute + exposed_comm + bubble; }
};

struct Estimate {
  Layout layout;
  int world = 1;
  double psi_stage = 0;   // parameters on the heaviest pipeline stage of one TP rank (experts included)
  double psi_experts = 0;  // of them, routed-expert parameters this GPU holds (MoE)
  double ep_comm_s = 0;    // expert-parallel all-to-alls per step (all exposed, as in this engine)
  MemoryBytes mem;        // per GPU, peak
  double mem_usable = 0;  // what the GPU offers the model (capacity minus reserve)
  bool fits = false;
  double host_bytes_per_node = 0;  // offloaded optimizer state (+ pinned gradient buffer) per node
  double host_usable = 0;          // host memory the job may use per node (80% of it); 0 without offload
  bool host_fits = true;
  CommBytes comm;
  GroupBytes group_bytes;
  StepTime time;
  double tokens_per_s = 0;
  double mfu = 0;
  // Details (seconds per step on the critical path) for explanations and validation.
  double recompute_s = 0;      // part of compute spent recomputing activations
  double elementwise_s = 0;    // part of compute bound by memory bandwidth
  double optimizer_s = 0;      // optimizer step (GPU or CPU Adam)
  double dp_comm_s = 0, dp_exposed_s = 0;   // data-parallel collectives (all, and not hidden)
  double tp_comm_s = 0, tp_exposed_s = 0;   // tensor-parallel collectives
  double pp_comm_s = 0;                     // pipeline sends (all exposed)
  double cp_comm_s = 0, cp_exposed_s = 0;   // context-parallel ring transfers (hidden behind attention)
  double offload_s = 0;                     // host<->device transfers of the offloaded shard
  bool dp_inter_node = false;               // the data-parallel collectives cross nodes
  std::string why;  // one sentence
  std::string device = "GPU";  // the cluster's word for one rank's device (Cluster::device)
};

// Empty when the layout is valid for the model and cluster, else the reason.
std::string check_layout(const ModelConfig& m, const Cluster& c, const TrainSetup& setup, const Layout& l);
// Throws std::invalid_argument (with check_layout's reason) for an invalid layout.
Estimate estimate(const ModelConfig& m, const Cluster& c, const TrainSetup& setup, const Layout& l);

// The bytes the cost model charges to memory bandwidth for one micro-batch of `micro_batch`
// sequences (forward + backward elementwise traffic, no recomputation) and one optimizer step, on
// one rank of a tp-way tensor-parallel job (`sp`: with sequence parallelism) with this engine's
// setup (fp32 gradients). A
// probe that times the engine's own kernels for that work divides this by their time to get the
// bandwidth at which estimate() reproduces them (train/compute_probe.cpp).
double elementwise_bytes(const ModelConfig& m, int64_t micro_batch, bool bf16, int tp = 1, bool sp = false);

}  // namespace mt::plan
