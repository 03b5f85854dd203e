// `plan --validate`'s harness (plan_validate.h): runs the engine's real jobs, dry runs and probes
// of the machine's ceilings, and checks them against each other and against the planner.
#include "validate/plan_validate.h"

#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <sched.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "comm/launch.h"
#include "plan/planner.h"
#include "plan/text_table.h"
#include "runtime/memory.h"
#include "runtime/tensor.h"

extern char** environ;

namespace mt::validate {

using namespace mt::plan;

namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
double secs_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

// ---- ceilings ----------------------------------------------------------------------------------------------

// ---- processes ---------------------------------------------------------------------------------------------

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& s, size_t n) { return s.size() <= n ? s : "..." + s.substr(s.size() - n); }

// A child process (in our process group, so that an interrupt reaches it too), stdout and stderr
// to `log`.
struct Child {
  pid_t pid = -1;
  std::string log;
};

Child spawn(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env_set,
            const std::string& log) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    const std::string k = kv.substr(0, kv.find('='));
    bool overridden = false;
    for (const auto& [n, v] : env_set) overridden |= n == k;
    if (!overridden) env.push_back(kv);
  }
  for (const auto& [n, v] : env_set) env.push_back(n + "=" + v);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& a : env) cenv.push_back(const_cast<char*>(a.c_str()));
  cenv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t at;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawnattr_init(&at);
  Child c;
  c.log = log;
  const int rc = posix_spawn(&c.pid, cargv[0], &fa, &at, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&at);
  if (rc != 0) throw std::runtime_error("cannot start " + argv[0] + ": " + std::strerror(rc));
  return c;
}

// Waits for the child; after `timeout_s` it is ended (mpirun passes the signal on to its ranks).
// Returns the exit code (128 + signal when it died of one, 124 on the timeout).
int wait_child(const Child& c, double timeout_s) {
  const auto t0 = Clock::now();
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) break;
    if (r < 0) return 127;
    if (secs_since(t0) > timeout_s) {
      kill(c.pid, SIGTERM);
      for (int i = 0; i < 100 && waitpid(c.pid, &status, WNOHANG) == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      return 124;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

int run_child(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env,
              const std::string& log, double timeout_s) {
  return wait_child(spawn(argv, env, log), timeout_s);
}

// What `meshtrain launch` gives every rank.
std::vector<std::pair<std::string, std::string>> rank_env(int threads) {
  return {{"OMP_NUM_THREADS", std::to_string(threads)}, {"GLIBC_TUNABLES", comm::rank_glibc_tunables()}};
}

int threads_per_rank(int ranks, int cores) { return std::max(1, cores / std::max(1, ranks)); }

// Places process `pid`, the i-th of `ranks` with `threads` threads each, where `meshtrain launch`
// places rank i of a job: on the i-th block of `threads` CPUs this process may use, when all the
// ranks' threads fit (comm::build_launch_plan binds them then). The probes run beside or instead of
// the jobs' ranks and should see the cores the way the ranks do.
void place_like_rank(pid_t pid, int i, int ranks, int threads) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (static_cast<int64_t>(ranks) * threads > static_cast<int64_t>(cpus.size())) return;
  cpu_set_t mine;
  CPU_ZERO(&mine);
  for (int k = 0; k < threads; ++k) CPU_SET(cpus[static_cast<size_t>(i * threads + k)], &mine);
  sched_setaffinity(pid, sizeof mine, &mine);  // best effort: unplaced, the probe still measures
}

// N probe processes at once, as the N ranks of a job will run.
ComputeCeiling probe_compute(const ValidateOptions& o, const std::string& dir, const EngineLayout& e, int cores) {
  const int threads = threads_per_rank(e.ranks, cores);
  std::vector<Child> kids;
  std::vector<std::string> argv = {o.binary, "plan", "--probe-compute", "--model", e.model, "--micro-batch",
                                   std::to_string(e.micro_batch), "--dtype", e.bf16 ? "bf16" : "fp32", "--tp",
                                   std::to_string(e.tp), "--probe-seconds", fmt("%g", o.probe_seconds)};
  if (e.sequence_parallel) argv.push_back("--sequence-parallel");
  for (int i = 0; i < e.ranks; ++i) kids.push_back(spawn(argv, rank_env(threads), dir + "/probe" + std::to_string(i) + ".log"));
  for (int i = 0; i < e.ranks; ++i) place_like_rank(kids[static_cast<size_t>(i)].pid, i, e.ranks, threads);
  // A step waits for its slowest rank at every collective. With every rank on CPUs of its own
  // (launch binds them) that rank's CPUs stay the slowest, and the job runs at the pace of the
  // slowest probe (on a VM one vCPU can run the probe measurably slower than another, alone). Ranks
  // that time-share cores even out over a step: the mean of the probes.
  const bool own_cpus = static_cast<int64_t>(e.ranks) * threads <= cores;
  ComputeCeiling sum;
  bool first = true;
  auto combine = [&](double& into, double v) { into = first ? v : own_cpus ? std::min(into, v) : into + v; };
  std::string err;
  for (const auto& k : kids) {
    const int rc = wait_child(k, 60 + 10 * o.probe_seconds);
    const std::string out = read_file(k.log);
    if (rc != 0) {
      err = "compute probe exited with " + std::to_string(rc) + ": " + tail(out, 800);
      continue;
    }
    try {
      const json j = json::parse(out.substr(out.find('{')));
      combine(sum.flops_per_s, j.at("flops_per_s").get<double>());
      combine(sum.gemm_flops_per_s, j.at("gemm_flops_per_s").get<double>());
      combine(sum.mem_bw, j.at("mem_bw").get<double>());
      combine(sum.elem_bw, j.value("elem_bw", 0.0));
      first = false;
    } catch (const std::exception& ex) {
      err = std::string("compute probe output unreadable (") + ex.what() + "): " + tail(out, 400);
    }
  }
  if (!err.empty()) throw std::runtime_error(err);
  if (!own_cpus) {
    const double n = static_cast<double>(e.ranks);
    sum.flops_per_s /= n;
    sum.gemm_flops_per_s /= n;
    sum.mem_bw /= n;
    sum.elem_bw /= n;
  }
  sum.procs = e.ranks;
  sum.threads = threads;
  return sum;
}

// `meshtrain launch -n N -- bench comm` over the sizes the layouts use, fitted to the planner's
// collective time t = bytes_per_rank / bw + steps x alpha by least squares on relative error.
CommCeiling probe_comm(const ValidateOptions& o, const std::string& dir, int ranks, const EngineLayout* busy_like,
                       int cores) {
  CommCeiling c;
  c.ranks = ranks;
  c.busy = busy_like != nullptr;
  const std::string tag = std::to_string(ranks) + (c.busy ? "_busy" : "");
  const std::string log = dir + "/bench_comm_" + tag + ".log";
  std::vector<std::string> argv = {o.binary,      "launch",    "-n",          std::to_string(ranks), "--",
                                   "bench",       "comm",      "--ops",       "all_gather,reduce_scatter,all_reduce",
                                   "--min-bytes", "32K",       "--max-bytes", "4M",
                                   "--factor",    "4",         "--no-mpi",    "--no-check"};
  // Busy: 20 timed iterations per point. Where ranks time-share cores an operation takes whatever
  // the scheduler gives it, whatever its size, and with 5 iterations the fitted latency swung
  // several-fold from run to run; 20 keep it steady (docs/plan.md).
  if (c.busy) argv.insert(argv.end(), {"--iters", "20", "--warmup", "2"});
  // Idle: the link the blocking collectives see (tensor parallelism's, the context-parallel ring):
  // each is waited for before the next is issued, so the fit is to a dependent chain (--blocking),
  // not to back-to-back operations, whose per-operation costs overlap.
  else argv.push_back("--blocking");
  // Busy: the collectives measured while one single-threaded compute process per rank keeps a core
  // busy the way every rank's compute thread will (on a CPU the communication threads then compete
  // with the compute threads for the cores; with more cores than ranks they find idle ones).
  struct Load {  // ended however this function is left
    std::vector<Child> kids;
    void stop() {
      for (const Child& k : kids) {
        kill(k.pid, SIGKILL);
        int st = 0;
        waitpid(k.pid, &st, 0);
      }
      kids.clear();
    }
    ~Load() { stop(); }
  } guard;
  std::vector<Child>& load = guard.kids;
  if (busy_like)
    for (int i = 0; i < ranks; ++i)
      load.push_back(spawn({o.binary, "plan", "--probe-compute", "--model", busy_like->model, "--micro-batch",
                            std::to_string(busy_like->micro_batch), "--dtype", busy_like->bf16 ? "bf16" : "fp32",
                            "--tp", std::to_string(busy_like->tp), "--probe-seconds", "20"},
                           rank_env(1), dir + "/load" + tag + std::to_string(i) + ".log"));
  for (int i = 0; i < static_cast<int>(load.size()); ++i) place_like_rank(load[static_cast<size_t>(i)].pid, i, ranks, 1);
  const int rc = run_child(argv, {}, log, 120);
  guard.stop();
  const std::string out = read_file(log);
  if (rc != 0) throw std::runtime_error("bench comm on " + std::to_string(ranks) + " ranks failed (exit " +
                                        std::to_string(rc) + "): " + tail(out, 800));
  // Rows: "  <op> <size> <count> | <time us> <algbw> <busbw> ...".
  double a11 = 0, a12 = 0, a22 = 0, b1 = 0, b2 = 0;
  int rows = 0;
  std::istringstream in(out);
  std::string line;
  const double n = ranks;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string op, size, bar;
    double count = 0, us = 0;
    if (!(ls >> op >> size >> count >> bar >> us) || bar != "|") continue;
    Collective k;
    if (op == "all_reduce") k = Collective::AllReduce;
    else if (op == "all_gather") k = Collective::AllGather;
    else if (op == "reduce_scatter") k = Collective::ReduceScatter;
    else continue;
    const double passes = k == Collective::AllReduce ? 2 : 1;
    const double x = passes * (n - 1) / n * count * 4;  // bytes per rank (f32)
    const double y = passes * (n - 1);                   // ring steps
    const double t = us * 1e-6;
    // Minimise sum ((x u + y a) / t - 1)^2 over u = 1/bw, a = alpha.
    const double X = x / t, Y = y / t;
    a11 += X * X, a12 += X * Y, a22 += Y * Y, b1 += X, b2 += Y;
    ++rows;
  }
  const double det = a11 * a22 - a12 * a12;
  double u = 0, a = 0;
  if (rows >= 2 && det > 0) {
    u = (b1 * a22 - a12 * b2) / det;
    a = (a11 * b2 - a12 * b1) / det;
  }
  if (!(u > 0) || !(a >= 0)) {  // degenerate: bandwidth from the volume alone
    u = b1 / std::max(a11, 1e-30);
    a = 0;
  }
  if (!(u > 0)) throw std::runtime_error("bench comm on " + std::to_string(ranks) + " ranks: no usable rows: " + tail(out, 400));
  c.bw = 1.0 / u;
  c.latency_s = a;
  c.source = "meshtrain launch -n " + std::to_string(ranks) + " -- bench comm, " + std::to_string(rows) +
             " points 32K-4M of all_gather, reduce_scatter, all_reduce" +
             (c.busy ? ", with " + std::to_string(ranks) + " single-threaded compute probes running"
                     : ", each waited for before the next (--blocking), machine otherwise idle");
  return c;
}

// A few hundred KB of deterministic text, turned into token shards by `meshtrain prepare`.
std::string prepare_data(const ValidateOptions& o, const std::string& dir) {
  const std::string text = dir + "/corpus.txt";
  {
    std::ofstream f(text);
    static const char* words[] = {"the", "model", "shards", "its", "state", "over", "ranks", "and", "gathers",
                                  "each", "unit", "before", "compute", "gradient", "reduce", "scatter", "memory",
                                  "bytes", "step", "time", "planner", "predicts", "measured", "layout"};
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    for (int i = 0; i < 60000; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      f << words[s % (sizeof words / sizeof *words)] << ((i % 13 == 12) ? ".\n" : " ");
    }
  }
  const std::string out = dir + "/data";
  const int rc = run_child({o.binary, "prepare", "--tokenizer", "byte", "--input", text, "--out", out}, {},
                           dir + "/prepare.log", 120);
  if (rc != 0) throw std::runtime_error("meshtrain prepare failed: " + tail(read_file(dir + "/prepare.log"), 600));
  return out + "/train.bin";
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The cluster the measured ceilings describe: one node holding the job's ranks, per-rank compute
// and memory bandwidth as the probes saw them with all ranks running, the collectives as bench comm
// saw them. Overlap efficiency and per-kernel overhead stay the `this-cpu` preset's.
Cluster measured_cluster(const ComputeCeiling& cc, const CommCeiling& comm, int ranks, int cores) {
  Cluster c = cluster_preset("this-cpu");
  c.name = "this-cpu (measured)";
  c.description = "this machine as measured just before the job";
  c.gpus = ranks;
  c.gpus_per_node = ranks;
  c.shared_node = false;  // the probes already ran N at once: their figures are per rank
  c.cores_per_rank = static_cast<double>(cores) / std::max(1, ranks * cc.threads);
  c.mem_per_gpu /= ranks;
  c.mem_reserved /= ranks;
  c.peak_flops_fp32 = c.peak_flops_bf16 = cc.flops_per_s;
  c.compute_efficiency = 1.0;  // measured at the model's own shapes
  c.mem_bw = cc.elem_bw > 0 ? cc.elem_bw : cc.mem_bw;  // the engine's elementwise kernels, as the planner counts them
  c.mem_bw_efficiency = 1.0;
  c.intra = {comm.bw, comm.latency_s};
  c.inter = c.intra;
  if (comm.sync_bw > 0) c.intra_sync = {comm.sync_bw, comm.sync_latency_s};
  return c;
}

// A job's metrics file: the per-step records and the final object.
struct Metrics {
  std::vector<json> steps;
  json fin;
};

Metrics read_metrics(const std::string& path) {
  Metrics m;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    json x = json::parse(line);
    if (x.value("final", false)) m.fin = x;
    else m.steps.push_back(x);
  }
  return m;
}

// The final object's figures for one rank: its own (a dry run), or `rank`'s row of a real run's
// per-rank tables (comm bytes are rank 0's in a real run).
EngineFigures figures_of(const json& fin, int rank) {
  EngineFigures f;
  f.rank = rank;
  const bool per_rank = fin.contains("mem_resident_by_category_per_rank");
  const json& peak = per_rank ? fin["mem_peak_by_category_per_rank"][static_cast<size_t>(rank)] : fin["mem_peak_by_category"];
  const json& res =
      per_rank ? fin["mem_resident_by_category_per_rank"][static_cast<size_t>(rank)] : fin["mem_resident_by_category"];
  for (const auto& [k, v] : peak.items()) f.peak[k] = v.get<int64_t>();
  for (const auto& [k, v] : res.items()) f.resident[k] = v.get<int64_t>();
  for (const auto& [k, v] : fin["comm_bytes_by_group"].items()) f.comm[k] = v.get<uint64_t>();
  f.flat_size = fin.value("flat_size", int64_t{0});
  f.shard_group_size = fin.value("shard_group_size", 0);
  f.pp_stages = fin.value("pp_stages", std::string());
  f.pp_slots = fin.value("pp_peak_activation_slots", 0);
  return f;
}

// What the dry run and the one-step real job are given besides the layout.
std::vector<std::string> one_step_args() {
  return {"--train.steps", "1", "--train.warmup_steps", "1"};
}

// `meshtrain launch -n N -- train` of the layout on the prepared data (no evaluation, checkpoint or
// sample), with `extra` arguments; its metrics. Throws std::runtime_error with the log's tail when
// the job fails.
Metrics run_train_job(const ValidateOptions& o, const std::string& dir, const std::string& data, const EngineLayout& e,
                      const std::string& name, const std::vector<std::string>& extra) {
  const std::string metrics = dir + "/" + name + ".jsonl", log = dir + "/" + name + ".log";
  std::vector<std::string> argv = {o.binary, "launch", "-n", std::to_string(e.ranks), "--", "train",
                                   "--data.train", data, "--data.val", "", "--train.sample_tokens", "0",
                                   "--train.checkpoint_dir", "", "--log.print_every", "1000",
                                   "--log.metrics_out", metrics};
  argv.insert(argv.end(), extra.begin(), extra.end());
  for (const auto& a : e.train_args()) argv.push_back(a);
  const int rc = run_child(argv, {}, log, 300);
  if (rc != 0) throw std::runtime_error("the job exited with " + std::to_string(rc) + ": " + tail(read_file(log), 1500));
  Metrics m = read_metrics(metrics);
  if (m.fin.is_null()) throw std::runtime_error("no final metrics in " + metrics);
  return m;
}

// The machine's CPU time so far, from the aggregate line of /proc/stat (jiffies): all of it and the
// part the hypervisor gave other guests (steal). False where there is no such file (not Linux).
bool cpu_times(double* total, double* steal) {
  std::ifstream f("/proc/stat");
  std::string tag;
  if (!(f >> tag) || tag != "cpu") return false;
  double v[8] = {0};  // user nice system idle iowait irq softirq steal
  for (double& x : v)
    if (!(f >> x)) return false;
  *total = 0;
  for (double x : v) *total += x;
  *steal = v[7];
  return true;
}

// One timed run of a layout: the compute ceiling measured just before and just after the job (their
// mean is the ceiling the prediction uses; their spread shows how much the machine's load moved),
// the job, its metrics, and the share of the machine's CPU time the hypervisor took while the job
// ran (steal; -1: not measurable here).
struct JobRun {
  std::string error;
  ComputeCeiling before, after, mean;
  std::vector<json> steps;
  json fin;
  double steal = -1;
};

JobRun run_job(const ValidateOptions& o, const std::string& dir, const std::string& data, const EngineLayout& e,
               const std::string& tag, int cores) {
  JobRun j;
  Metrics m;
  try {
    j.before = probe_compute(o, dir, e, cores);
    double t0 = 0, s0 = 0, t1 = 0, s1 = 0;
    const bool stat0 = cpu_times(&t0, &s0);
    m = run_train_job(o, dir, data, e, "train" + tag, {"--train.steps", std::to_string(o.steps)});
    if (stat0 && cpu_times(&t1, &s1) && t1 > t0) j.steal = (s1 - s0) / (t1 - t0);
    j.after = probe_compute(o, dir, e, cores);
  } catch (const std::exception& ex) {
    j.error = ex.what();
    return j;
  }
  j.mean = j.before;
  j.mean.flops_per_s = 0.5 * (j.before.flops_per_s + j.after.flops_per_s);
  j.mean.gemm_flops_per_s = 0.5 * (j.before.gemm_flops_per_s + j.after.gemm_flops_per_s);
  j.mean.mem_bw = 0.5 * (j.before.mem_bw + j.after.mem_bw);
  j.mean.elem_bw = 0.5 * (j.before.elem_bw + j.after.elem_bw);
  j.steps = std::move(m.steps);
  j.fin = std::move(m.fin);
  if (static_cast<int>(j.steps.size()) != o.steps) j.error = "incomplete metrics of job " + tag;
  return j;
}

// estimate() as it stands, on the measured cluster: compute, exposed communication (its
// tensor-parallel part shown on its own) and, with a pipeline, its bubble.
void time_check(const ValidateOptions& o, const ModelConfig& m, const EngineLayout& e, const CommCeiling& cc,
                const JobRun& j, LayoutResult& r, int cores) {
  const Cluster cl = measured_cluster(j.mean, cc, e.ranks, cores);
  const Layout l = planner_layout(e);
  const Estimate est = estimate(m, cl, planner_setup(m, e), l);
  TimeRow& t = r.time;
  t.predicted_s = est.time.total();
  t.compute_s = est.time.compute;
  t.exposed_s = est.time.exposed_comm;
  t.tp_exposed_s = est.tp_exposed_s;
  t.bubble_s = est.time.bubble;
  t.bubble_predicted = e.pp > 1 ? bubble_fraction(l.pp, l.microbatches, l.virtual_stages) : 0.0;
  t.bubble_measured = j.fin.value("pp_bubble", 0.0);
  std::vector<double> ms, ex;
  for (size_t i = 1; i < j.steps.size(); ++i) {
    ms.push_back(j.steps[i].value("step_ms", 0.0) / 1e3);
    ex.push_back(j.steps[i].value("exposed_comm_ms", 0.0) / 1e3);
  }
  t.measured_exposed_s = median(ex);
  t.measured_s = median(ms);
  if (!ms.empty()) {
    t.measured_min_s = *std::min_element(ms.begin(), ms.end());
    t.measured_max_s = *std::max_element(ms.begin(), ms.end());
  }
  t.error = t.measured_s > 0 ? t.predicted_s / t.measured_s - 1 : 0;
  t.checked = o.check_time;
  t.ok = std::fabs(t.error) <= o.time_tolerance;
  t.ceiling_drift = j.before.flops_per_s > 0 ? j.after.flops_per_s / j.before.flops_per_s - 1 : 0;
  t.steal = j.steal;
  r.compute = j.mean;
}

// The ranks whose dry runs the planner is compared with: the first rank of the first and of the last
// pipeline stage.
std::vector<int> stage_ranks(const EngineLayout& e) {
  if (e.pp <= 1) return {0};
  return {0, (e.pp - 1) * (e.ranks / e.pp)};
}

// The real one-step job against the dry runs of all its ranks: resident bytes by category on every
// rank, rank 0's bytes by group, flat size, stage cut and activation slots.
void engine_check(const EngineLayout& e, const json& fin, const std::vector<EngineFigures>& dry, LayoutResult& r) {
  const EngineFigures real0 = figures_of(fin, 0);
  r.flat_dry = dry[0].flat_size;
  r.flat_measured = real0.flat_size;
  r.stages_dry = dry[0].pp_stages;
  r.stages_measured = real0.pp_stages;
  r.slots_dry = dry[0].pp_slots;
  r.slots_measured = real0.pp_slots;
  for (int stage = 0; stage < e.pp; ++stage) {
    for (const auto& [cat, unused] : dry[0].resident) {
      MemRow row;
      row.category = cat;
      row.pp_rank = e.pp > 1 ? stage : -1;
      const bool routed = e.routing_dependent() && e.ep > 1 &&
                          (cat == "activations" || cat == "workspace" || cat == "comm");
      row.check = cat == "scratch" || routed ? MemCheck::Info : MemCheck::Exact;
      row.ok = true;
      bool first = true;
      for (int rank = 0; rank < e.ranks; ++rank) {
        if (e.pp_rank_of(rank) != stage) continue;
        const EngineFigures real = figures_of(fin, rank);
        const double want = static_cast<double>(dry[static_cast<size_t>(rank)].resident.at(cat));
        const double got = static_cast<double>(real.resident.count(cat) ? real.resident.at(cat) : -1);
        if (first || std::fabs(got - want) > std::fabs(row.measured - row.dry)) row.dry = want, row.measured = got;
        first = false;
        if (row.check == MemCheck::Exact) row.ok = row.ok && got == want;
      }
      r.mem.push_back(row);
    }
  }
  std::vector<std::string> groups;
  for (const auto& [g, b] : dry[0].comm) groups.push_back(g);
  for (const auto& [g, b] : real0.comm)
    if (!dry[0].comm.count(g)) groups.push_back(g);
  for (const std::string& g : groups) {
    CommRow row;
    row.group = g;
    row.dry = dry[0].comm.count(g) ? dry[0].comm.at(g) : 0;
    row.measured = real0.comm.count(g) ? real0.comm.at(g) : 0;
    row.info = g == "ep" && e.routing_dependent();
    row.ok = row.info || row.dry == row.measured;
    if (row.dry == 0 && row.measured == 0) continue;  // groups of one rank
    r.comm.push_back(row);
  }
}

LayoutResult run_layout(const ValidateOptions& o, const std::string& dir, const std::string& data,
                        const EngineLayout& e, int index, int cores, const CommCeiling& cc) {
  LayoutResult r;
  r.layout = e;
  r.comm_ceiling = cc;
  const ModelConfig m = engine_model(e);
  const std::string tag = std::to_string(index);
  try {
    std::vector<EngineFigures> dry;
    for (int rank = 0; rank < e.ranks; ++rank) dry.push_back(dry_run(o.binary, e, rank, dir + "/dry" + tag));
    engine_check(e, run_train_job(o, dir, data, e, "real" + tag, one_step_args()).fin, dry, r);
    std::vector<EngineFigures> stages;
    for (int rank : stage_ranks(e)) stages.push_back(dry[static_cast<size_t>(rank)]);
    r.gaps = compare_with_planner(m, e, stages);
  } catch (const std::exception& ex) {
    r.error = ex.what();
    return r;
  }
  if (o.measure_time) {
    // Step time; on a miss, one more run (a shared machine's load can move between the ceiling probes
    // and the job: the spread of the two probes shows it).
    JobRun j = run_job(o, dir, data, e, tag, cores);
    if (!j.error.empty()) {
      r.error = j.error;
      return r;
    }
    time_check(o, m, e, cc, j, r, cores);
    r.attempts = 1;
    // The engine's bytes per step: the timed job's minus the one-step job's, per extra step.
    for (GapRow& row : r.gaps.rows) {
      if (row.what.rfind("bytes ", 0) != 0) continue;
      const std::string g = row.what.substr(6);
      uint64_t one = 0;
      for (const CommRow& c : r.comm)
        if (c.group == g) one = c.measured;
      const double total = j.fin["comm_bytes_by_group"].value(g, 0.0);
      row.engine = (total - static_cast<double>(one)) / (o.steps - 1);
    }
    r.gaps.bytes_per_step = true;
    for (int k = 0; o.check_time && k < o.retries && !r.time.ok; ++k) {
      r.first_time_error = r.first_time_error == 0 ? r.time.error : r.first_time_error;
      JobRun again = run_job(o, dir, data, e, tag + "r" + std::to_string(k + 1), cores);
      if (!again.error.empty()) break;
      ++r.attempts;
      time_check(o, m, e, cc, again, r, cores);
    }
  }
  r.ok = r.flat_dry == r.flat_measured && r.stages_dry == r.stages_measured && r.slots_dry == r.slots_measured;
  for (const auto& x : r.mem) r.ok = r.ok && x.ok;
  for (const auto& x : r.comm) r.ok = r.ok && x.ok;
  if (o.measure_time && o.check_time) r.ok = r.ok && r.time.ok;
  return r;
}

ScaleResult run_scale_layout(const ValidateOptions& o, const std::string& dir, const EngineLayout& e, int index) {
  ScaleResult r;
  r.layout = e;
  const auto t0 = Clock::now();
  try {
    std::vector<EngineFigures> dry;
    for (int rank : stage_ranks(e)) dry.push_back(dry_run(o.binary, e, rank, dir + "/scale" + std::to_string(index)));
    r.gaps = compare_with_planner(engine_model(e), e, dry);
  } catch (const std::exception& ex) {
    r.error = ex.what();
  }
  r.seconds = secs_since(t0);
  return r;
}

}  // namespace

EngineFigures dry_run(const std::string& binary, const EngineLayout& e, int rank, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string base = dir + "/rank" + std::to_string(rank);
  std::vector<std::string> argv = {binary, "train", "--dry-run", "--world", std::to_string(e.ranks), "--rank",
                                   std::to_string(rank), "--data.train", "", "--data.val", "", "--train.threads", "1",
                                   "--train.sample_tokens", "0", "--log.print_every", "1000",
                                   "--log.metrics_out", base + ".jsonl"};
  for (const auto& a : one_step_args()) argv.push_back(a);
  for (const auto& a : e.train_args()) argv.push_back(a);
  const int rc = run_child(argv, {{"OMP_NUM_THREADS", "1"}}, base + ".log", 120);
  if (rc != 0)
    throw std::runtime_error("dry run of rank " + std::to_string(rank) + " of " + e.label() + " exited with " +
                             std::to_string(rc) + ": " + tail(read_file(base + ".log"), 1200));
  const Metrics m = read_metrics(base + ".jsonl");
  if (m.fin.is_null() || !m.fin.value("dry_run", false)) throw std::runtime_error("no dry-run metrics in " + base + ".jsonl");
  return figures_of(m.fin, rank);
}

ValidationReport run_validation(const ValidateOptions& in) {
  ValidateOptions o = in;
  if (o.binary.empty()) o.binary = comm::self_exe();
  if (o.layouts.empty()) o.layouts = default_validation_layouts();
  if (o.scale_layouts.empty() && o.run_scale) o.scale_layouts = default_scale_layouts();
  if (!o.run_scale) o.scale_layouts.clear();
  if (o.steps < 2) throw std::invalid_argument("--validate needs at least 2 steps (the first pays warm-up)");
  for (const auto& e : o.layouts) check_engine_layout(e);
  for (const auto& e : o.scale_layouts) check_engine_layout(e);
  const auto t0 = Clock::now();
  ValidationReport rep;
  rep.cores = comm::detect_cores();

  std::string dir = o.work_dir;
  bool made = false;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/meshtrain-validate-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back(0);
    if (!mkdtemp(buf.data())) throw std::runtime_error("cannot create a work directory under " + templ);
    dir = buf.data();
    made = true;
  } else {
    std::filesystem::create_directories(dir);
  }
  struct Cleanup {
    std::string dir;
    bool on;
    ~Cleanup() {
      if (on) {
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
      }
    }
  } cleanup{dir, made && !o.keep};
  if (o.progress && o.keep) *o.progress << "work directory " << dir << "\n";

  const std::string data = prepare_data(o, dir);
  // Ceilings first: the collectives on every rank count used.
  std::vector<int> counts;
  for (const auto& e : o.layouts)
    if (e.ranks > 1 && std::find(counts.begin(), counts.end(), e.ranks) == counts.end()) counts.push_back(e.ranks);
  for (int n : o.measure_time ? counts : std::vector<int>{}) {  // not needed without timed jobs
    const EngineLayout* like = nullptr;
    for (const auto& e : o.layouts)
      if (e.ranks == n && !like) like = &e;
    for (const EngineLayout* busy : {static_cast<const EngineLayout*>(nullptr), like}) {
      rep.comm_ceilings.push_back(probe_comm(o, dir, n, busy, rep.cores));
      const CommCeiling& c = rep.comm_ceilings.back();
      if (o.progress)
        *o.progress << "ceiling: collectives on " << n << " ranks" << (c.busy ? " (cores busy)" : "") << ": "
                    << fmt("%.2f GB/s", c.bw / 1e9) << " per rank, " << fmt("%.0f us", c.latency_s * 1e6)
                    << " per ring step\n";
    }
  }
  int i = 0;
  for (const auto& e : o.layouts) {
    CommCeiling cc;  // a single rank never communicates; unmeasured: the this-cpu preset's link
    cc.ranks = e.ranks;
    cc.bw = cluster_preset("this-cpu").intra.bw;
    cc.latency_s = cluster_preset("this-cpu").intra.latency_s;
    cc.busy = true;
    cc.source = "this-cpu preset (not measured)";
    for (const auto& c : rep.comm_ceilings)  // the job's conditions: its ranks computing
      if (c.ranks == e.ranks && c.busy) cc = c;
    for (const auto& c : rep.comm_ceilings)  // blocking collectives: all ranks waiting, cores idle
      if (c.ranks == e.ranks && !c.busy) cc.sync_bw = c.bw, cc.sync_latency_s = c.latency_s;
    const auto tj = Clock::now();
    LayoutResult r = run_layout(o, dir, data, e, i++, rep.cores, cc);
    if (o.progress) {
      *o.progress << (r.ok ? "ok    " : "FAIL  ") << e.label() << fmt(" (%.1f s)", secs_since(tj));
      if (r.error.empty() && r.attempts > 0)
        *o.progress << ": compute ceiling " << fmt("%.1f GFLOP/s", r.compute.flops_per_s / 1e9) << " per rank, step "
                    << fmt("%.0f ms", r.time.measured_s * 1e3) << " measured vs " << fmt("%.0f ms", r.time.predicted_s * 1e3)
                    << " predicted" << (r.time.steal >= 0 ? fmt(", steal %.0f%%", 100 * r.time.steal) : std::string());
      else if (!r.error.empty())
        *o.progress << ": " << r.error;
      *o.progress << "\n";
      o.progress->flush();
    }
    rep.results.push_back(std::move(r));
  }
  int k = 0;
  for (const auto& e : o.scale_layouts) {
    ScaleResult r = run_scale_layout(o, dir, e, k++);
    if (o.progress) {
      *o.progress << (r.error.empty() ? "dry   " : "FAIL  ") << e.label() << " on " << e.ranks << " ranks"
                  << fmt(" (%.1f s)", r.seconds) << (r.error.empty() ? "" : ": " + r.error) << "\n";
      o.progress->flush();
    }
    rep.scale.push_back(std::move(r));
  }
  rep.ok = !rep.results.empty() || !rep.scale.empty();
  for (const auto& r : rep.results) rep.ok = rep.ok && r.error.empty() && r.ok;
  for (const auto& r : rep.scale) rep.ok = rep.ok && r.error.empty();
  rep.seconds = secs_since(t0);
  return rep;
}

}  // namespace mt::validate
