// `meshtrain bench comm`: collective benchmark in the style of nccl-tests, with plain MPI beside it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/arg_parser.h"
#include "cli/commands.h"
#include "comm/mpi_include.h"
#include "comm/world.h"
#include "runtime/memory.h"

namespace mt::cli {

using namespace mt::comm;

namespace {

const char* kHelp =
    "usage: meshtrain bench comm [options]\n"
    "       (run on several ranks: mpirun -np N meshtrain bench comm, or\n"
    "        meshtrain launch -n N -- bench comm)\n\n"
    "Times each collective of the world group over a range of sizes and prints, like nccl-tests,\n"
    "the time per operation (slowest rank), algorithm bandwidth (size / time) and bus bandwidth\n"
    "(algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter, x 1 for\n"
    "broadcast), with the same operation through plain MPI (MPI_Allreduce, MPI_Allgather,\n"
    "MPI_Reduce_scatter_block, MPI_Bcast) in the same run. The size is the whole buffer: the\n"
    "all_reduce buffer, the all_gather output, the reduce_scatter input.\n\n"
    "options:\n"
    "  --ops LIST         comma-separated: all_reduce,all_gather,reduce_scatter,broadcast (default all)\n"
    "  --min-bytes N      smallest size (default 1K; suffixes K, M, G)\n"
    "  --max-bytes N      largest size (default 256M)\n"
    "  --factor F         size multiplier between rows (default 2)\n"
    "  --dtype T          f32 | bf16 (default f32; MPI has no bf16 reduction, so its columns\n"
    "                     are empty for bf16 reductions)\n"
    "  --op OP            sum | avg | max (default sum)\n"
    "  --iters N          timed iterations per size (default: 50 for small sizes, fewer above\n"
    "                     4 MiB, at least 3)\n"
    "  --warmup N         untimed iterations per size (default 2)\n"
    "  --blocking         wait for each operation before issuing the next (latency of a\n"
    "                     dependent chain); default: issue all timed iterations, then wait\n"
    "  --no-mpi           skip the plain-MPI columns\n"
    "  --no-check         skip the correctness check of each size\n"
    "  --overlap          instead of the table, measure how much of an all_reduce is hidden\n"
    "                     behind computation (and the same with MPI_Iallreduce, no thread)\n"
    "  --overlap-bytes N  all_reduce size for --overlap (default 32M)\n"
    "  --help             this text\n";

size_t parse_size(const std::string& s) {
  if (s.empty()) throw ArgError("empty size");
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw ArgError("bad size '" + s + "'");
  }
  std::string suf = s.substr(pos);
  double mul = 1;
  if (suf == "K" || suf == "k" || suf == "KiB" || suf == "KB") mul = 1024.0;
  else if (suf == "M" || suf == "m" || suf == "MiB" || suf == "MB") mul = 1024.0 * 1024;
  else if (suf == "G" || suf == "g" || suf == "GiB" || suf == "GB") mul = 1024.0 * 1024 * 1024;
  else if (!suf.empty() && suf != "B") throw ArgError("bad size suffix in '" + s + "'");
  if (v <= 0) throw ArgError("size must be positive: '" + s + "'");
  return static_cast<size_t>(v * mul);
}

std::string size_str(size_t b) {
  char buf[32];
  if (b >= (1u << 30) && b % (1u << 30) == 0) std::snprintf(buf, sizeof buf, "%zuG", b >> 30);
  else if (b >= (1u << 20) && b % (1u << 20) == 0) std::snprintf(buf, sizeof buf, "%zuM", b >> 20);
  else if (b >= 1024 && b % 1024 == 0) std::snprintf(buf, sizeof buf, "%zuK", b >> 10);
  else std::snprintf(buf, sizeof buf, "%zu", b);
  return buf;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Register-only floating point work (no memory traffic), for the overlap measurement. noipa: the
// compiler must neither merge repeated calls nor drop them.
__attribute__((noipa)) double compute_for(long iters) {
  float acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = 1.0f + static_cast<float>(j);
  for (long i = 0; i < iters; ++i)
    for (int j = 0; j < 16; ++j) acc[j] = acc[j] * 0.9999999f + 0.0000001f;
  double s = 0;
  for (float a : acc) s += a;
  return s;
}

// Iterations of compute_for that take about `seconds` here (calibrated on a run that long).
long calibrate(double seconds) {
  long iters = 1 << 16;
  for (;;) {
    double t0 = now_s();
    volatile double sink = compute_for(iters);
    (void)sink;
    double t = now_s() - t0;
    if (t > 0.5 * seconds || iters > (1L << 40))
      return static_cast<long>(static_cast<double>(iters) * seconds / t);
    iters *= t > 0 ? std::max(2L, static_cast<long>(0.6 * seconds / t)) : 16;
  }
}

struct Buffers {
  void* a = nullptr;
  void* b = nullptr;
  size_t bytes = 0;
  explicit Buffers(size_t n) : bytes(n) {
    a = mem_alloc(n, MemCategory::Workspace);
    b = mem_alloc(n, MemCategory::Workspace);
    std::memset(a, 0, n);  // touch every page once, outside the timings
    std::memset(b, 0, n);
  }
  ~Buffers() {
    mem_free(a, bytes, MemCategory::Workspace);
    mem_free(b, bytes, MemCategory::Workspace);
  }
};

void fill_value(void* p, size_t count, DType dt, float v) {
  if (dt == DType::F32) {
    std::fill_n(static_cast<float*>(p), count, v);
  } else {
    bf16 x = float_to_bf16(v);
    std::fill_n(static_cast<bf16*>(p), count, x);
  }
}

size_t count_wrong(const void* p, size_t count, DType dt, float want) {
  size_t bad = 0;
  for (size_t i = 0; i < count; ++i) {
    float v = dt == DType::F32 ? static_cast<const float*>(p)[i]
                               : bf16_to_float(static_cast<const bf16*>(p)[i]);
    if (v != want) ++bad;
  }
  return bad;
}

struct Row {
  double us = 0, algbw = 0, busbw = 0;
  bool valid = false;
};

int run_overlap(ProcessGroup& g, size_t bytes, DType dt, MPI_Comm mpi_comm, bool no_mpi) {
  const int n = g.size();
  const size_t count = bytes / dtype_size(dt);
  Buffers buf(bytes);
  auto sync = [&] {
    if (mpi_comm != MPI_COMM_NULL) MPI_Barrier(mpi_comm);
  };
  auto max_all = [&](double v) {
    if (mpi_comm != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, mpi_comm);
    return v;
  };
  // Communication alone.
  for (int i = 0; i < 2; ++i) g.all_reduce(buf.a, count, dt)->wait();
  double comm = 1e30;
  for (int i = 0; i < 3; ++i) {
    sync();
    double t0 = now_s();
    g.all_reduce(buf.a, count, dt)->wait();
    comm = std::min(comm, now_s() - t0);
  }
  comm = max_all(comm);
  // Compute calibrated to about 2x the communication (the same work on every rank).
  long iters = calibrate(2.0 * comm);
  if (mpi_comm != MPI_COMM_NULL)
    MPI_Allreduce(MPI_IN_PLACE, &iters, 1, MPI_LONG, MPI_MIN, mpi_comm);
  volatile double sink = 0;
  double t0 = 0;
  double compute = 1e30;
  for (int i = 0; i < 3; ++i) {
    sync();
    t0 = now_s();
    sink = compute_for(iters);
    compute = std::min(compute, now_s() - t0);
  }
  compute = max_all(compute);
  // Best of three runs of: start a reduction, compute, wait for it; the run's total and its wait.
  auto overlapped = [&](auto start, auto finish, double* total, double* waited) {
    *total = 1e30;
    for (int i = 0; i < 3; ++i) {
      sync();
      t0 = now_s();
      auto h = start();
      sink = compute_for(iters);
      const double t1 = now_s();
      finish(h);
      const double t2 = now_s();
      if (t2 - t0 < *total) {
        *total = t2 - t0;
        *waited = t2 - t1;
      }
    }
    *total = max_all(*total);
    *waited = max_all(*waited);
  };
  // Both: issue, compute, wait.
  double both = 0, waited = 0;
  overlapped([&] { return g.all_reduce(buf.a, count, dt); }, [](auto& h) { h->wait(); }, &both, &waited);
  // The same with MPI_Iallreduce and no thread: progress only inside MPI_Wait.
  double mpi_both = 0, mpi_wait = 0, mpi_comm_t = 0;
  const bool mpi_ok = !no_mpi && mpi_comm != MPI_COMM_NULL && dt == DType::F32;
  if (mpi_ok) {
    mpi_comm_t = 1e30;
    for (int i = 0; i < 3; ++i) {
      sync();
      t0 = now_s();
      MPI_Allreduce(MPI_IN_PLACE, buf.a, static_cast<int>(count), MPI_FLOAT, MPI_SUM, mpi_comm);
      mpi_comm_t = std::min(mpi_comm_t, now_s() - t0);
    }
    mpi_comm_t = max_all(mpi_comm_t);
    overlapped(
        [&] {
          MPI_Request r;
          MPI_Iallreduce(MPI_IN_PLACE, buf.a, static_cast<int>(count), MPI_FLOAT, MPI_SUM, mpi_comm, &r);
          return r;
        },
        [](MPI_Request& r) { MPI_Wait(&r, MPI_STATUS_IGNORE); }, &mpi_both, &mpi_wait);
  }
  (void)sink;
  if (should_print()) {
    auto hidden = [](double c, double w) { return 100.0 * std::max(0.0, 1.0 - w / c); };
    std::printf("# meshtrain bench comm --overlap: %d ranks, all_reduce %s %s, compute ~2x comm\n", n,
                size_str(bytes).c_str(), dtype_name(dt));
    std::printf("# %-28s %10s %10s %10s %10s %8s %10s\n", "", "comm ms", "compute ms", "both ms",
                "wait ms", "hidden", "slowdown");
    std::printf("  %-28s %10.2f %10.2f %10.2f %10.2f %7.0f%% %9.2fx\n", "meshtrain (comm thread)",
                comm * 1e3, compute * 1e3, both * 1e3, waited * 1e3, hidden(comm, waited),
                (both - waited) / compute);
    if (mpi_ok)
      std::printf("  %-28s %10.2f %10.2f %10.2f %10.2f %7.0f%% %9.2fx\n",
                  "MPI_Iallreduce (no thread)", mpi_comm_t * 1e3, compute * 1e3, mpi_both * 1e3,
                  mpi_wait * 1e3, hidden(mpi_comm_t, mpi_wait), (mpi_both - mpi_wait) / compute);
    std::printf("# hidden = 1 - (wait after compute) / (comm alone); slowdown = compute time "
                "with the all_reduce in flight / compute alone\n");
  }
  return 0;
}

struct Options {
  size_t min_b = 0, max_b = 0, ov_bytes = 0;
  double factor = 2;
  DType dt = DType::F32;
  ReduceOp rop = ReduceOp::Sum;
  std::vector<std::string> ops;
  long iters = 0, warmup = 2;  // iters 0: chosen per size
  bool no_mpi = false, check = true, blocking = false, overlap = false;
};

// The options after `bench comm`; throws ArgError for a usage error.
Options parse_options(const ArgParser& ap) {
  Options o;
  if (!ap.positional().empty()) throw ArgError("unexpected argument '" + ap.positional()[0] + "'");
  o.min_b = parse_size(ap.get("min-bytes", "1K"));
  o.max_b = parse_size(ap.get("max-bytes", "256M"));
  o.ov_bytes = parse_size(ap.get("overlap-bytes", "32M"));
  o.factor = ap.get_double("factor", 2.0);
  if (o.factor <= 1.0) throw ArgError("--factor must be > 1");
  if (o.min_b > o.max_b) throw ArgError("--min-bytes is larger than --max-bytes");
  if (!parse_dtype(ap.get("dtype", "f32"), &o.dt) || is_integer(o.dt)) throw ArgError("--dtype must be f32 or bf16");
  const std::string op = ap.get("op", "sum");
  if (op == "sum") o.rop = ReduceOp::Sum;
  else if (op == "avg") o.rop = ReduceOp::Avg;
  else if (op == "max") o.rop = ReduceOp::Max;
  else throw ArgError("--op must be sum, avg or max");
  for (const std::string& item : split_list(ap.get("ops", "all_reduce,all_gather,reduce_scatter,broadcast"))) {
    if (item != "all_reduce" && item != "all_gather" && item != "reduce_scatter" && item != "broadcast")
      throw ArgError("unknown collective '" + item + "' in --ops");
    o.ops.push_back(item);
  }
  o.iters = ap.get_int("iters", 0);
  o.warmup = ap.get_int("warmup", 2);
  o.no_mpi = ap.flag("no-mpi");
  o.check = !ap.flag("no-check");
  o.blocking = ap.flag("blocking");
  o.overlap = ap.flag("overlap");
  return o;
}

// One row of the table: a collective at one size, on the world group `g` (MPI communicator mc).
struct Case {
  const Options& o;
  ProcessGroup& g;
  MPI_Comm mc;
  Buffers& buf;
  std::string op;
  int n, r;
  size_t es, bytes, count, part;  // count: whole-buffer elements; part: the per-rank count argument
  long iters;
  double busf;  // bus bandwidth / algorithm bandwidth
  bool split;   // all_gather / reduce_scatter: the buffer is n parts

  // Timing of `body(timed)`: warm-up calls, then one timed call of `iters` operations; slowest rank.
  template <class Body>
  Row time_it(Body&& body) const {
    for (long i = 0; i < o.warmup; ++i) body(false);
    if (mc != MPI_COMM_NULL) MPI_Barrier(mc);
    double t0 = now_s();
    body(true);
    double t = (now_s() - t0) / static_cast<double>(iters);
    if (mc != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, mc);
    Row row;
    row.valid = true;
    row.us = t * 1e6;
    row.algbw = static_cast<double>(bytes) / t / 1e9;
    row.busbw = row.algbw * busf;
    return row;
  }
};

Case make_case(const Options& o, ProcessGroup& g, MPI_Comm mc, Buffers& buf, const std::string& op, double sz) {
  const int n = g.size();
  const size_t es = dtype_size(o.dt);
  size_t bytes = static_cast<size_t>(sz);
  const bool split = op == "all_gather" || op == "reduce_scatter";
  const size_t unit = es * (split ? static_cast<size_t>(n) : 1);
  bytes = std::max(unit, bytes / unit * unit);
  const size_t count = bytes / es;
  const size_t part = split ? count / n : count;
  long iters = o.iters;
  if (iters <= 0) iters = std::clamp<long>(static_cast<long>((size_t(256) << 20) / bytes), 3, 50);
  double busf = 1;
  if (op == "all_reduce") busf = n > 1 ? 2.0 * (n - 1) / n : 0;
  else if (split) busf = n > 1 ? static_cast<double>(n - 1) / n : 0;
  return Case{o, g, mc, buf, op, n, g.rank(), es, bytes, count, part, iters, busf, split};
}

Row time_meshtrain(const Case& k) {
  auto issue = [&]() -> WorkHandle {
    if (k.op == "all_reduce") return k.g.all_reduce(k.buf.a, k.count, k.o.dt, k.o.rop);
    if (k.op == "all_gather")
      return k.g.all_gather(static_cast<char*>(k.buf.a) + k.r * k.part * k.es, k.buf.a, k.part, k.o.dt);
    if (k.op == "reduce_scatter") return k.g.reduce_scatter(k.buf.a, k.buf.b, k.part, k.o.dt, k.o.rop);
    return k.g.broadcast(k.buf.a, k.count, k.o.dt, 0);
  };
  return k.time_it([&](bool timed) {
    if (!timed) {
      issue()->wait();
      return;
    }
    WorkHandle last;
    for (long i = 0; i < k.iters; ++i) {
      last = issue();  // in order: the last done = all done
      if (k.o.blocking) last->wait();
    }
    last->wait();
  });
}

// Correctness: rank q contributes q+1 (sum n(n+1)/2, avg (n+1)/2, max n); broadcast root 0.
// Returns the wrong elements over all ranks.
long count_wrong_results(const Case& k) {
  const int n = k.n, r = k.r;
  const DType dt = k.o.dt;
  const ReduceOp rop = k.o.rop;
  Buffers& buf = k.buf;
  long wrong = 0;
  fill_value(buf.a, k.count, dt, static_cast<float>(r + 1));
  const float red = rop == ReduceOp::Sum   ? n * (n + 1) / 2.0f
                    : rop == ReduceOp::Avg ? (n * (n + 1) / 2.0f) / n
                                           : static_cast<float>(n);
  if (k.op == "all_reduce") {
    k.g.all_reduce(buf.a, k.count, dt, rop)->wait();
    wrong = static_cast<long>(count_wrong(buf.a, k.count, dt, round_to_bf16(red)));
    if (dt == DType::F32) wrong = static_cast<long>(count_wrong(buf.a, k.count, dt, red));
  } else if (k.op == "reduce_scatter") {
    k.g.reduce_scatter(buf.a, buf.b, k.part, dt, rop)->wait();
    wrong = static_cast<long>(count_wrong(buf.b, k.part, dt, dt == DType::F32 ? red : round_to_bf16(red)));
  } else if (k.op == "all_gather") {
    k.g.all_gather(static_cast<char*>(buf.a) + r * k.part * k.es, buf.b, k.part, dt)->wait();
    for (int q = 0; q < n; ++q)
      wrong += static_cast<long>(
          count_wrong(static_cast<char*>(buf.b) + q * k.part * k.es, k.part, dt, static_cast<float>(q + 1)));
  } else {
    k.g.broadcast(buf.a, k.count, dt, 0)->wait();
    wrong = static_cast<long>(count_wrong(buf.a, k.count, dt, 1.0f));
  }
  if (k.mc != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG, MPI_SUM, k.mc);
  return wrong;
}

// The same operation through plain MPI; not valid without MPI or for a bf16 reduction.
Row time_mpi(const Case& k) {
  const bool reduction = k.op == "all_reduce" || k.op == "reduce_scatter";
  if (k.o.no_mpi || k.mc == MPI_COMM_NULL || (reduction && k.o.dt != DType::F32)) return Row{};
  const MPI_Op mop = k.o.rop == ReduceOp::Max ? MPI_MAX : MPI_SUM;  // avg: sum (MPI has no avg)
  const MPI_Comm mc = k.mc;
  return k.time_it([&](bool timed) {
    for (long i = 0; i < (timed ? k.iters : 1); ++i) {
      if (k.op == "all_reduce")
        MPI_Allreduce(MPI_IN_PLACE, k.buf.a, static_cast<int>(k.count), MPI_FLOAT, mop, mc);
      else if (k.op == "all_gather")
        MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, k.buf.a, static_cast<int>(k.part * k.es), MPI_BYTE, mc);
      else if (k.op == "reduce_scatter")
        MPI_Reduce_scatter_block(k.buf.a, k.buf.b, static_cast<int>(k.part), MPI_FLOAT, mop, mc);
      else
        MPI_Bcast(k.buf.a, static_cast<int>(k.bytes), MPI_BYTE, 0, mc);
    }
  });
}

void print_header(const Options& o, int n, int nodes) {
  std::printf("# meshtrain bench comm: %d ranks on %d node(s), dtype %s, op %s; time = slowest "
              "rank, mean of the timed iterations (%s)\n",
              n, nodes, dtype_name(o.dt), reduce_op_name(o.rop),
              o.blocking ? "each waited before the next" : "issued back to back, then waited");
  std::printf("# %-14s %9s %11s | %10s %9s %9s %6s | %10s %9s %9s | %6s\n", "collective", "size", "count",
              "time(us)", "algbw", "busbw", "#wrong", "mpi(us)", "algbw", "busbw", "ratio");
  std::printf("# %-14s %9s %11s | %10s %9s %9s %6s | %10s %9s %9s | %6s\n", "", "(B)", "(elements)", "", "(GB/s)",
              "(GB/s)", "", "", "(GB/s)", "(GB/s)", "mt/mpi");
}

void print_row(const Case& k, const Row& mine, const Row& mpi, long wrong) {
  char mcol[64] = "         -         -         - |      -";
  if (mpi.valid)
    std::snprintf(mcol, sizeof mcol, "%10.1f %9.3f %9.3f | %6.2f", mpi.us, mpi.algbw, mpi.busbw, mpi.us / mine.us);
  std::printf("  %-14s %9s %11zu | %10.1f %9.3f %9.3f %6s | %s\n", k.op.c_str(), size_str(k.bytes).c_str(), k.count,
              mine.us, mine.algbw, mine.busbw, k.o.check ? std::to_string(wrong).c_str() : "-", mcol);
  std::fflush(stdout);
}

// The table: every collective of --ops at every size; 1 when a check found wrong elements.
int run_table(const Options& o, World& world, ProcessGroup& g, MPI_Comm mc) {
  const int n = g.size();
  const size_t es = dtype_size(o.dt);
  if (n == 1 && should_print())
    std::printf("# note: a world of 1 rank (start it with `meshtrain launch -n N -- bench comm` or "
                "mpirun); collectives are local copies\n");
  Buffers buf(std::max(o.max_b, es * static_cast<size_t>(n)));
  const bool print = should_print();
  if (print) print_header(o, n, world.num_nodes());
  int rc = 0;
  for (const std::string& op : o.ops) {
    for (double sz = static_cast<double>(o.min_b); sz <= static_cast<double>(o.max_b) * 1.0001; sz *= o.factor) {
      const Case k = make_case(o, g, mc, buf, op, sz);
      const Row mine = time_meshtrain(k);
      const long wrong = o.check ? count_wrong_results(k) : 0;
      const Row mpi = time_mpi(k);
      if (print) print_row(k, mine, mpi, wrong);
      if (wrong) rc = 1;
    }
  }
  if (print) {
    CommStats s = g.stats();
    std::printf("# world group totals: %llu calls, %s (algorithm volume per rank), %.1f ms\n",
                static_cast<unsigned long long>(s.total_calls()),
                format_bytes(static_cast<int64_t>(s.total_bytes())).c_str(), s.total_ms());
    std::printf("# ratio = MPI time / meshtrain time (> 1: meshtrain faster)\n");
  }
  return rc;
}

}  // namespace

int run_bench_comm_command(int argc, char** argv) {
  int first = 0;
  if (first < argc && !std::strcmp(argv[first], "bench")) ++first;
  if (first < argc && !std::strcmp(argv[first], "comm")) ++first;
  ArgParser ap({"ops", "min-bytes", "max-bytes", "factor", "dtype", "op", "iters", "warmup",
                "overlap-bytes"},
               {"no-mpi", "no-check", "overlap", "blocking", "help", "h"});
  Options o;
  try {
    ap.parse(argc, argv, first);
    if (ap.flag("help") || ap.flag("h")) {
      std::fputs(kHelp, stdout);
      return 0;
    }
    o = parse_options(ap);
  } catch (const ArgError& e) {
    std::fprintf(stderr, "meshtrain bench comm: %s\n", e.what());
    return 2;
  }

  const bool owned = !World::initialized();  // finalize only a world this command started
  World& world = World::init(&argc, &argv);
  auto g = world.world();
  MPI_Comm mc = MPI_COMM_NULL;
  if (world.uses_mpi()) MPI_Comm_dup(MPI_COMM_WORLD, &mc);
  const int rc = o.overlap ? run_overlap(*g, std::max(o.ov_bytes, dtype_size(o.dt) * g->size()), o.dt, mc, o.no_mpi)
                           : run_table(o, world, *g, mc);
  if (mc != MPI_COMM_NULL) MPI_Comm_free(&mc);
  if (owned) world.finalize();
  return rc;
}

}  // namespace mt::cli
