// Cluster descriptions for the planner: what one GPU (or CPU rank) can compute, hold and move.
//
// Every number is per GPU unless its name says otherwise. Bandwidths are *achievable* bus bandwidth
// (what nccl-tests reports as busbw for a large all-reduce), not the marketing link rate, so the
// ring formulas in cost_model.h use them directly. Sources and the reasoning behind each preset are
// in docs/plan.md ("Cluster presets").
#pragma once
#include <string>
#include <vector>

namespace mt::plan {

struct Link {
  double bw = 0;         // achievable bytes/s per GPU per direction on this link type
  double latency_s = 0;  // per ring step (alpha)
};

struct Cluster {
  std::string name = "custom";
  std::string description;
  int gpus = 0;                    // GPUs (ranks) in the job; the planner needs it, presets leave it 0
  int gpus_per_node = 8;
  double mem_per_gpu = 0;          // bytes of device memory
  double mem_reserved = 0;         // bytes the model cannot use: context, library workspaces, fragmentation
  double peak_flops_bf16 = 0;      // dense, per GPU
  double peak_flops_fp32 = 0;      // dense fp32 (no TF32), per GPU
  double compute_efficiency = 0;   // achievable fraction of peak on the matmul / attention FLOPs
  double mem_bw = 0;               // device memory bandwidth, bytes/s (elementwise ops, optimizer)
  double mem_bw_efficiency = 0.8;  // achievable fraction of mem_bw for streaming kernels
  Link intra;                      // inside a node (NVLink / shared memory)
  Link inter;                      // between nodes, per GPU (one NIC per GPU, rail-optimised)
  // Inside a node for collectives every rank of the group enters at once and waits for (tensor
  // parallelism's, context parallelism's ring), when they see another link than the overlapped
  // data-parallel ones: on CPUs those run on the caller's thread with the cores otherwise idle,
  // the overlapped ones on a communication thread competing with compute. bw 0: use `intra`.
  Link intra_sync;
  double overlap_efficiency = 1.0; // fraction of a collective that can hide behind compute
  double kernel_overhead_s = 4e-6; // fixed cost per kernel (launch gap, wave tail); ~36 kernels per layer per
                                   // micro-batch (12 forward, 24 backward) - what makes tiny micro-batches slow
  double host_link_bw = 0;         // host<->device bytes/s per GPU (PCIe), for CPU offload
  double host_mem_per_node = 0;    // bytes of host RAM per node (offloaded optimizer state)
  double host_mem_bw_per_node = 0; // host memory bandwidth CPU Adam achieves per node (~40% of DRAM peak)
  // CPU "devices": ranks on one node share its cores, memory and memory bandwidth. Then peak_flops_*,
  // mem_per_gpu and mem_bw hold the whole node's figures and per_rank() divides them.
  bool shared_node = false;
  // CPUs, per-rank figures measured with every rank computing at once: the cores each rank has
  // (cores / ranks). Below 1 the ranks time-share cores, and a rank that waits (its pipeline bubble,
  // exposed communication) lends its share to the others (estimate()). 0: a device of its own.
  double cores_per_rank = 0;
  std::string efficiency_note;     // one line: where compute_efficiency comes from
  std::string device = "GPU";      // what one rank runs on, in the planner's sentences ("GPU"; "rank" on CPUs)

  double peak_flops(bool fp32) const { return fp32 ? peak_flops_fp32 : peak_flops_bf16; }
  double usable_mem() const { return mem_per_gpu - mem_reserved; }
  // The per-rank view for a job of `world` ranks: identity for GPUs; for shared CPU nodes the node's
  // compute, memory and bandwidth are split between the ranks placed on it.
  Cluster per_rank(int world) const;
  // Throws std::invalid_argument naming the field when a value is missing or non-positive.
  void validate() const;
};

// This machine as measured by the engine's own probes (train/compute_probe.h), per rank with
// `ranks_per_node` ranks running at once.
struct CpuMeasurement {
  std::string description;     // e.g. "2 cores of AMD EPYC 9B14 (family 25 model 17), isa avx512_bf16, ..."
  int ranks_per_node = 1;
  double peak_flops_fp32 = 0;  // FMA peak per rank, FLOP/s (measured: independent vector FMA chains)
  double peak_flops_bf16 = 0;  // bf16 peak per rank (the fp32 peak x the ISA's bf16 factor)
  double model_flops = 0;      // the engine's matmul + attention rate at the model's shapes, per rank
  bool model_flops_bf16 = false;  // the dtype model_flops was measured in
  double mem_bw = 0;           // streaming bytes/s per rank
  double node_mem = 0;         // bytes of memory of the node (shared by its ranks)
};
// The this-cpu preset (links, overlap, per-kernel overhead) with the measured compute, bandwidth,
// memory and description: the planner's step times then follow this machine, not a reference one.
Cluster measured_cpu_cluster(const CpuMeasurement& m);

// Presets: a100-80g-ib400, a100-80g-ib200, h100-80g-ib400, h100-80g-roce100, h200-141g-ib400, this-cpu.
// Throws std::invalid_argument for an unknown name, listing the known ones.
Cluster cluster_preset(const std::string& name);
std::vector<std::string> cluster_preset_names();

constexpr double GiB = 1024.0 * 1024.0 * 1024.0;
constexpr double GB = 1e9;

}  // namespace mt::plan
