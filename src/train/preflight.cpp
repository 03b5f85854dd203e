#include "train/preflight.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/world.h"
#include "plan/auto_layout.h"
#include "plan/cluster.h"
#include "runtime/process.h"


namespace mt {

namespace fs = std::filesystem;

namespace {

// The last non-empty line of a file (the child's error message).
std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

int64_t meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kb * 1024;
  }
  return -1;
}

std::string categories_text(const std::array<int64_t, kNumMemCategories>& c) {
  std::string s;
  for (int i = 0; i < kNumMemCategories; ++i) {
    if (static_cast<MemCategory>(i) == MemCategory::Scratch) continue;  // 0 in a dry run
    s += (s.empty() ? "" : ", ") + std::string(mem_category_name(static_cast<MemCategory>(i))) + " " +
         format_bytes(c[static_cast<size_t>(i)]);
  }
  return s;
}

// "--parallel.strategy FULL_SHARD --train.activation_checkpointing full ..." for a planner's plan.
std::string plan_flags(const RunConfig& cfg, const ParallelPlan& p) {
  RunConfig c = cfg;
  c.set_parallel_plan(p);
  std::string s = "--parallel.strategy " + c.parallel.strategy;
  if (c.parallel.dp_replicate > 1)
    s += " --parallel.dp_replicate " + std::to_string(c.parallel.dp_replicate) + " --parallel.dp_shard " +
         std::to_string(c.parallel.dp_shard);
  s += " --train.activation_checkpointing " + c.train.activation_checkpointing + " --train.micro_batch " +
       std::to_string(c.train.micro_batch) + " --train.grad_accum " + std::to_string(c.train.grad_accum);
  return s;
}

}  // namespace

namespace {
std::string& binary_path() {
  static std::string p;
  return p;
}
}  // namespace

void set_dry_run_binary(const std::string& path) { binary_path() = path; }
const std::string& dry_run_binary() { return binary_path(); }

std::array<int64_t, kNumMemCategories> dry_run_peak(const RunConfig& cfg, int world, int rank) {
  if (binary_path().empty()) throw std::runtime_error("no meshtrain binary to run the dry run (set_dry_run_binary)");
  std::error_code ec;
  const std::string self = fs::canonical(binary_path(), ec).string();
  if (ec) throw std::runtime_error("cannot find the meshtrain binary (" + binary_path() + "): " + ec.message());
  const fs::path dir = fs::temp_directory_path() / ("meshtrain_preflight_" + std::to_string(::getpid()));
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error("cannot create " + dir.string() + ": " + ec.message());
  struct Cleanup {
    fs::path d;
    ~Cleanup() {
      std::error_code e;
      fs::remove_all(d, e);
    }
  } cleanup{dir};
  const std::string toml = (dir / "config.toml").string(), metrics = (dir / "dry.jsonl").string(),
                    log = (dir / "dry.log").string();
  RunConfig c = cfg;  // the job as it is (after --auto), all of it in the file
  c.log.metrics_out = metrics;
  c.log.tensorboard_dir.clear();
  c.log.print_every = 1000000;
  std::ofstream(toml) << c.to_toml();
  std::vector<std::string> args = {self, "train", "--config", toml, "--dry-run", "--world", std::to_string(world),
                                   "--rank", std::to_string(rank)};
  std::string why;
  const int status = run_logged(args, log, &why);
  if (status < 0) throw std::runtime_error("cannot start the dry run: " + why);
  if (status != 0) throw std::runtime_error("the dry run failed: " + last_line(log));
  std::ifstream in(metrics);
  nlohmann::json fin;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("final", false)) fin = j;
  }
  if (!fin.contains("mem_peak_by_category")) throw std::runtime_error("the dry run wrote no memory figures");
  std::array<int64_t, kNumMemCategories> peak{};
  for (int i = 0; i < kNumMemCategories; ++i)
    peak[static_cast<size_t>(i)] = fin["mem_peak_by_category"].value(mem_category_name(static_cast<MemCategory>(i)),
                                                                      static_cast<int64_t>(0));
  return peak;
}

int64_t available_bytes(Device d, int local_ranks, const std::string& host, std::string* source) {
  const char* test = std::getenv("MESHTRAIN_TEST_AVAILABLE_BYTES");  // test-only
  const int ranks = std::max(1, local_ranks);
  if (d == Device::CUDA) {
    const int64_t free_b = test ? std::atoll(test) : device_free_bytes(Device::CUDA);
    *source = std::string(test ? "MESHTRAIN_TEST_AVAILABLE_BYTES " : "free GPU memory ") + format_bytes(free_b);
    return free_b;
  }
  const int64_t avail = test ? std::atoll(test) : meminfo_available();
  if (avail < 0) {
    *source = "MemAvailable not found in /proc/meminfo";
    return -1;
  }
  *source = std::string(test ? "MESHTRAIN_TEST_AVAILABLE_BYTES " : "MemAvailable ") + format_bytes(avail) +
            (ranks > 1 ? " shared by " + std::to_string(ranks) + " ranks" : "") + " on host " + host;
  return avail / ranks;
}

std::string fitting_layout_advice(const RunConfig& cfg, const ModelConfig& mc, int world, int local_ranks,
                                  double node_bytes, bool shared_node, int64_t tokens) {
  plan::Cluster c = plan::cluster_preset("this-cpu");
  c.gpus_per_node = std::max(1, local_ranks);
  c.shared_node = shared_node;
  c.mem_reserved = 0;  // free memory already leaves out what the system uses
  const double per_rank = shared_node ? node_bytes / c.gpus_per_node : node_bytes;
  plan::AutoLayoutOptions o;
  o.fp32 = cfg.train.dtype != "bf16";
  int checks = 0;  // dry runs of candidate layouts, at most kMaxChecks (each takes a fraction of a second)
  constexpr int kMaxChecks = 6;
  try {
    for (int w = world; w <= (1 << 20); w *= 2) {
      // The planner's memory model is close to the engine's but not exact: its choice is checked by
      // the dry run (rank 0 of that layout), and while the engine needs more than the planner said,
      // the planner is asked again with its budget shrunk by that factor.
      double budget = node_bytes;
      for (int attempt = 0; attempt < 4; ++attempt) {
        c.mem_per_gpu = budget;
        o.cluster_model = c;
        const plan::AutoLayout a = plan::auto_layout(mc, w, c.gpus_per_node, tokens, o);
        if (!a.fits) break;
        if (checks++ == kMaxChecks)
          return "the planner suggests " + std::string(w == world ? "on these ranks " : "on " + std::to_string(w) + " ranks ") +
                 a.plan.describe() + " (predicted peak " + format_bytes(static_cast<int64_t>(a.estimate.mem.total())) +
                 " per rank, not checked by a dry run)";
        RunConfig lc = cfg;
        lc.set_parallel_plan(a.plan);
        const auto peak = dry_run_peak(lc, w, 0);
        double need = 0;
        for (int64_t b : peak) need += static_cast<double>(b);
        if (need <= per_rank) {
          const std::string fig = format_bytes(static_cast<int64_t>(need)) + " at its peak on rank 0 (dry run)";
          if (w == world)
            return "the planner's best layout that fits on these " + std::to_string(world) + " ranks: " +
                   a.plan.describe() + ", " + fig + ": " + plan_flags(cfg, a.plan);
          return "no data-parallel layout fits on " + std::to_string(world) + " rank" + (world > 1 ? "s" : "") +
                 "; the planner needs " + std::to_string(w) + " ranks like these (" + std::to_string(c.gpus_per_node) +
                 " per host), e.g. " + a.plan.describe() + ", " + fig;
        }
        budget *= std::min(0.97, a.estimate.mem.total() / need);
      }
    }
  } catch (const std::exception& e) {
    return std::string("the planner found no layout (") + e.what() + ")";
  }
  return "the planner found no layout that fits on up to 1048576 ranks";
}

void memory_preflight(const RunConfig& cfg, const ModelConfig& mc, comm::ProcessGroup& g, const PreflightInput& in) {
  // This rank: [peak by category..., available bytes, status (0 fits, 1 does not, 2 unknown)].
  constexpr int K = kNumMemCategories;
  std::vector<int64_t> mine(K + 2, 0);
  std::string source, why;
  if (in.count_only) {
    mine[K + 1] = 2;
  } else try {
    const auto peak = dry_run_peak(cfg, in.world, in.rank);
    std::copy(peak.begin(), peak.end(), mine.begin());
    const int64_t avail = available_bytes(in.device, in.local_ranks, in.host, &source);
    int64_t total = 0;
    for (int i = 0; i < K; ++i) total += peak[static_cast<size_t>(i)];
    mine[K] = avail;
    mine[K + 1] = avail < 0 ? 2 : (total > avail ? 1 : 0);
    if (avail < 0) why = source;
  } catch (const std::exception& e) {
    mine[K + 1] = 2;
    why = e.what();
  }
  std::vector<int64_t> every(mine.size() * static_cast<size_t>(g.size()));
  if (g.size() > 1)
    g.all_gather(mine.data(), every.data(), mine.size(), DType::I64)->wait();
  else
    every = mine;
  int worst = -1, misses = 0, unknown = 0;
  int64_t worst_over = 0;
  for (int r = 0; r < g.size(); ++r) {
    const int64_t* v = &every[static_cast<size_t>(r) * (K + 2)];
    if (v[K + 1] == 2) ++unknown;
    if (v[K + 1] != 1) continue;
    ++misses;
    int64_t total = 0;
    for (int i = 0; i < K; ++i) total += v[i];
    if (worst < 0 || total - v[K] > worst_over) worst = r, worst_over = total - v[K];
  }
  if (misses == 0) {
    if (unknown && !in.count_only && comm::should_print(in.rank))
      std::printf("memory preflight skipped on %d rank%s: %s\n", unknown, unknown > 1 ? "s" : "",
                  why.empty() ? "the dry run failed there" : why.c_str());
    return;
  }
  const int64_t* v = &every[static_cast<size_t>(worst) * (K + 2)];
  std::array<int64_t, K> peak{};
  int64_t total = 0;
  for (int i = 0; i < K; ++i) total += (peak[static_cast<size_t>(i)] = v[i]);
  const int64_t avail = v[K];
  const bool shared = in.device != Device::CUDA;
  // Per host: what the ranks there share (every rank's own figure on a GPU).
  const double node_bytes = shared ? static_cast<double>(avail) * std::max(1, in.local_ranks) : static_cast<double>(avail);
  std::string where = "rank " + std::to_string(worst);
  if (worst == in.rank) where += " (" + source + ")";
  char head[512];
  const std::string how_many =
      g.size() > 1 ? " (" + std::to_string(misses) + " of " + std::to_string(g.size()) + " ranks do not fit)" : "";
  std::snprintf(head, sizeof head, "memory preflight: %s needs %s at its peak but has %s free%s; its peak by category: ",
                where.c_str(), format_bytes(total).c_str(), format_bytes(avail).c_str(), how_many.c_str());
  // Only rank 0 prints the message: only it asks the planner (and checks its choice by dry runs).
  const std::string advice =
      in.rank == 0 ? fitting_layout_advice(cfg, mc, g.size(), in.local_ranks, node_bytes, shared, in.tokens_per_step)
                   : std::string("(the planner's advice is on rank 0)");
  throw JobConfigError(std::string(head) + categories_text(peak) + " (the engine's dry run); " + advice +
                       "; train.preflight = false skips this check");
}

}  // namespace mt
