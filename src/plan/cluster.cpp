#include "plan/cluster.h"

#include <algorithm>
#include <stdexcept>

namespace mt::plan {

namespace {

// Device memory the model cannot use: ~1 GiB of CUDA context, cuBLAS/NCCL workspaces, plus 5% for
// caching-allocator fragmentation (pytorch/pytorch#137151, torchtitan#735 show real runs above their
// formulas by this much).
double gpu_reserve(double mem) { return 1.0 * GiB + 0.05 * mem; }

Cluster a100(const std::string& name, double inter_bw, const std::string& net) {
  Cluster c;
  c.name = name;
  c.description = "8x A100-80GB SXM per node, NVLink3 inside, " + net + " per GPU between nodes";
  c.gpus_per_node = 8;
  c.mem_per_gpu = 80 * GiB;
  c.mem_reserved = gpu_reserve(c.mem_per_gpu);
  c.peak_flops_bf16 = 312e12;
  c.peak_flops_fp32 = 19.5e12;
  c.compute_efficiency = 0.70;
  c.efficiency_note =
      "A100: cuBLAS bf16 GEMMs at transformer shapes reach 75-85% of 312 TF, FlashAttention-2 50-73%; "
      "a layer is ~80% GEMM FLOPs -> 0.70";
  c.mem_bw = 2.039e12;
  c.intra = {230 * GB, 1.5e-6};  // NVLink3 600 GB/s bidirectional; nccl-tests all_reduce busbw ~230
  c.inter = {inter_bw, 5e-6};
  c.host_link_bw = 22 * GB;      // PCIe Gen4 x16
  c.host_mem_per_node = 2e12;    // DGX A100 (80 GB) system memory
  c.host_mem_bw_per_node = 165 * GB;  // CPU Adam: ~40% of 2x EPYC 7742 DDR4-3200 (410 GB/s peak)
  return c;
}

Cluster h100_like(const std::string& name, const std::string& gpu, double mem, double hbm_bw,
                  double inter_bw, double inter_lat, const std::string& net) {
  Cluster c;
  c.name = name;
  c.description = "8x " + gpu + " per node, NVLink4 inside, " + net + " per GPU between nodes";
  c.gpus_per_node = 8;
  c.mem_per_gpu = mem;
  c.mem_reserved = gpu_reserve(mem);
  c.peak_flops_bf16 = 989e12;
  c.peak_flops_fp32 = 67e12;
  c.compute_efficiency = 0.60;
  c.efficiency_note =
      "H100: cuBLAS bf16 GEMMs reach 60-75% of 989 TF, FlashAttention-2 35-50% (FA3 higher) -> 0.60";
  c.mem_bw = hbm_bw;
  c.intra = {360 * GB, 1.5e-6};  // NVLink4 900 GB/s bidirectional; ring all_reduce busbw ~360
  c.inter = {inter_bw, inter_lat};
  c.host_link_bw = 40 * GB;      // PCIe Gen5 x16
  c.host_mem_per_node = 2e12;    // DGX H100 system memory
  c.host_mem_bw_per_node = 245 * GB;  // CPU Adam: ~40% of 2x Xeon 8480C DDR5-4800 (614 GB/s peak)
  return c;
}

Cluster this_cpu() {
  Cluster c;
  c.name = "this-cpu";
  c.description = "a reference machine: 2 AMD EPYC (Zen 3, AVX2) cores (one rank per core), ~23 GiB shared, MPI over "
                  "shared memory (train --auto measures the machine it runs on instead)";
  c.device = "rank";
  c.gpus_per_node = 2;
  c.shared_node = true;
  // Whole-node figures (per_rank() splits them), from probes of that machine.
  c.mem_per_gpu = 23 * GiB;
  c.mem_reserved = 2 * GiB;          // OS, MPI, page cache the job needs
  // /proc/cpuinfo shows AVX2 and no AVX-512: 2 FMA units x 8 floats x 2 flops x ~3 GHz per core.
  // No bf16 arithmetic: bf16 matmuls are widened to fp32 (docs/bench-notes/gemm.md).
  c.peak_flops_fp32 = 2 * 96e9;
  c.peak_flops_bf16 = 2 * 96e9;
  c.compute_efficiency = 0.20;
  c.efficiency_note =
      "this-cpu: `plan --validate` measured the engine at 0.1-0.25 of peak on the tiny validation "
      "models (attention, softmax and elementwise code dominate at these shapes)";
  c.mem_bw = 46 * GB;                // STREAM triad, 2 threads
  c.mem_bw_efficiency = 1.0;         // already a measured figure
  c.intra = {5 * GB, 1.0e-6};        // OpenMPI shared memory, between its mid-size and large-message rates
  c.inter = {0.07 * GB, 50e-6};      // network namespaces over a 1 Gbit/s veth, all-reduce bus bandwidth
  c.overlap_efficiency = 0.7;        // no MPI background progress: about what polling hides at most
  c.kernel_overhead_s = 5e-6;        // OpenMP fork/join per parallel kernel
  c.host_link_bw = 0;                // host memory *is* device memory: offload frees nothing
  c.host_mem_per_node = 0;
  c.host_mem_bw_per_node = 0;
  return c;
}

std::vector<Cluster> all_clusters() {
  return {
      a100("a100-80g-ib400", 45 * GB, "400 Gb/s InfiniBand NDR"),
      a100("a100-80g-ib200", 22 * GB, "200 Gb/s InfiniBand HDR (DGX A100 SuperPOD)"),
      h100_like("h100-80g-ib400", "H100-80GB SXM", 80 * GiB, 3.35e12, 45 * GB, 5e-6,
                "400 Gb/s InfiniBand NDR"),
      h100_like("h100-80g-roce100", "H100-80GB SXM", 80 * GiB, 3.35e12, 10 * GB, 8e-6,
                "100 Gb/s RoCE"),
      h100_like("h200-141g-ib400", "H200-141GB SXM", 140 * GiB, 4.8e12, 45 * GB, 5e-6,
                "400 Gb/s InfiniBand NDR"),
      this_cpu(),
  };
}

}  // namespace

Cluster Cluster::per_rank(int world) const {
  if (!shared_node) return *this;
  Cluster c = *this;
  const int ranks = std::max(1, std::min(world, gpus_per_node));
  c.mem_per_gpu /= ranks;
  c.mem_reserved /= ranks;
  c.peak_flops_bf16 /= ranks;
  c.peak_flops_fp32 /= ranks;
  c.mem_bw /= ranks;
  c.shared_node = false;
  return c;
}

void Cluster::validate() const {
  auto need = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("cluster: ") + what);
  };
  need(gpus_per_node > 0, "--gpus-per-node must be positive");
  need(mem_per_gpu > 0, "--mem-per-gpu must be positive");
  need(mem_reserved >= 0 && mem_reserved < mem_per_gpu, "reserved memory must be below --mem-per-gpu");
  need(peak_flops_bf16 > 0 && peak_flops_fp32 > 0, "--peak-tflops must be positive");
  need(compute_efficiency > 0 && compute_efficiency <= 1, "--compute-efficiency must be in (0, 1]");
  need(mem_bw > 0, "--mem-bw must be positive");
  need(intra.bw > 0, "--intra-bw must be positive");
  need(inter.bw > 0, "--inter-bw must be positive");
  need(intra.latency_s >= 0 && inter.latency_s >= 0, "latencies must not be negative");
  need(overlap_efficiency >= 0 && overlap_efficiency <= 1, "overlap efficiency must be in [0, 1]");
  need(kernel_overhead_s >= 0, "kernel overhead must not be negative");
}

Cluster cluster_preset(const std::string& name) {
  for (Cluster& c : all_clusters())
    if (c.name == name) return c;
  std::string known;
  for (const auto& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown cluster preset '" + name + "' (known: " + known + ")");
}

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> v;
  for (const auto& c : all_clusters()) v.push_back(c.name);
  return v;
}

Cluster measured_cpu_cluster(const CpuMeasurement& m) {
  if (m.ranks_per_node < 1 || !(m.peak_flops_fp32 > 0) || !(m.peak_flops_bf16 > 0) || !(m.model_flops > 0) ||
      !(m.mem_bw > 0) || !(m.node_mem > 0))
    throw std::invalid_argument("measured_cpu_cluster: every measured figure must be positive");
  Cluster c = this_cpu();
  c.name = "this-cpu (measured)";
  c.description = m.description;
  c.device = "rank";
  c.gpus_per_node = m.ranks_per_node;
  c.shared_node = false;  // measured with all ranks running: the figures are per rank already
  c.mem_per_gpu = m.node_mem / m.ranks_per_node;
  c.mem_reserved = std::min(2 * GiB, 0.1 * m.node_mem) / m.ranks_per_node;
  c.peak_flops_fp32 = m.peak_flops_fp32;
  c.peak_flops_bf16 = m.peak_flops_bf16;
  const double peak = m.model_flops_bf16 ? m.peak_flops_bf16 : m.peak_flops_fp32;
  c.compute_efficiency = std::min(1.0, m.model_flops / peak);
  c.efficiency_note = "this-cpu (measured): the engine's matmuls and attention at the model's shapes ran at " +
                      std::to_string(static_cast<int>(m.model_flops / 1e9)) + " GFLOP/s per rank, " +
                      std::to_string(static_cast<int>(100 * c.compute_efficiency)) + "% of the " +
                      (m.model_flops_bf16 ? "bf16" : "fp32") + " peak";
  c.mem_bw = m.mem_bw;
  c.mem_bw_efficiency = 1.0;
  return c;
}

}  // namespace mt::plan
