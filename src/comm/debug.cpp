// Configuration from the environment, logging, the desync check's comparison, the flight recorder,
// fatal-error handling and the group registry.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>

#include "comm/detail.h"

namespace mt::comm::detail {

namespace {
const int64_t g_t0 = now_ns();

Config read_config() {
  Config c;
  if (const char* d = std::getenv("MESHTRAIN_DEBUG")) {
    std::string s = d;
    std::transform(s.begin(), s.end(), s.begin(), ::tolower);
    c.trace = s.find("trace") != std::string::npos || s == "all" || s == "detail";
    c.desync = s.find("desync") != std::string::npos || s == "all" || s == "detail";
  }
  if (const char* t = std::getenv("MESHTRAIN_TIMEOUT_S")) {
    char* end = nullptr;
    double v = std::strtod(t, &end);
    if (end != t && v >= 0) c.timeout_s = v;
  }
  if (const char* k = std::getenv("MESHTRAIN_FLIGHT_RECORDER")) {
    int v = std::atoi(k);
    if (v > 0) c.flight_recorder = std::min(v, 100000);
  }
  if (const char* p = std::getenv("MESHTRAIN_COMM_POLL_US")) {
    int v = std::atoi(p);
    if (v >= 0) c.poll_max_us = std::min(v, 100000);
  }
  if (const char* p = std::getenv("MESHTRAIN_COMM_POLL_IDLE_US")) {
    int v = std::atoi(p);
    if (v >= 0) c.poll_idle_us = std::min(v, 100000);
  }
  if (const char* h = std::getenv("MESHTRAIN_COMM_HIER")) c.hierarchical = std::strcmp(h, "0") != 0;
  if (const char* f = std::getenv("MESHTRAIN_COMM_FAKE_NODE_SIZE")) c.fake_node_size = std::atoi(f);
  if (const char* v = std::getenv("MESHTRAIN_COMM_NICE")) c.nice = std::clamp(std::atoi(v), -20, 19);
  if (const char* s = std::getenv("MESHTRAIN_COMM_SPIN_US")) {
    int v = std::atoi(s);
    if (v >= 0) c.spin_us = std::min(v, 1000000);
  }
  if (const char* s = std::getenv("MESHTRAIN_COMM_INLINE_KB")) {
    long v = std::atol(s);
    if (v >= 0) c.inline_bytes = static_cast<size_t>(v) << 10;
  }
  if (const char* s = std::getenv("MESHTRAIN_COMM_ONESHOT_KB")) {
    long v = std::atol(s);
    if (v >= 0) c.oneshot_bytes = static_cast<size_t>(v) << 10;
  }
  if (const char* s = std::getenv("MESHTRAIN_COMM_SLICE_KB")) {
    long v = std::atol(s);
    if (v >= 4) c.slice_bytes = static_cast<size_t>(v) << 10;
  }
  return c;
}

Config& mutable_config() {
  static Config c = read_config();
  return c;
}

std::atomic<int> g_log_rank{0};
std::atomic<int> g_log_size{1};
}  // namespace

const Config& config() { return mutable_config(); }
void reload_config() { mutable_config() = read_config(); }

int log_rank() { return g_log_rank.load(); }
void set_log_rank(int rank, int size) {
  g_log_rank = rank;
  g_log_size = size;
}

void log_line(const std::string& msg) {
  std::string line = "meshtrain[rank " + std::to_string(log_rank()) + "]: " + msg;
  if (line.empty() || line.back() != '\n') line += '\n';
  // One write so lines of different ranks and threads do not interleave.
  ssize_t off = 0, len = static_cast<ssize_t>(line.size());
  while (off < len) {
    ssize_t w = ::write(2, line.data() + off, len - off);
    if (w <= 0) break;
    off += w;
  }
}

bool is_p2p(OpKind k) { return k == OpKind::Send || k == OpKind::Recv; }

std::string describe(const OpDesc& d, bool extras, const std::vector<int>* granks) {
  std::string s = op_kind_name(d.kind);
  if (d.kind == OpKind::Barrier) return s + "()";
  if (d.kind == OpKind::AllToAllV) return s + "(" + dtype_name(d.dt) + ", sizes per rank)";
  s += "(";
  s += dtype_name(d.dt);
  s += ", " + std::to_string(d.count);
  if (extras) {
    if (d.kind == OpKind::AllReduce || d.kind == OpKind::ReduceScatter)
      s += std::string(", ") + reduce_op_name(d.op);
    if (d.kind == OpKind::Broadcast) s += ", root " + std::to_string(d.peer);
  }
  s += ")";
  if (is_p2p(d.kind)) {
    int peer = d.peer;
    if (granks && peer >= 0 && peer < static_cast<int>(granks->size())) peer = (*granks)[peer];
    s += d.kind == OpKind::Send ? " to rank " : " from rank ";
    s += std::to_string(peer) + " tag " + std::to_string(d.tag);
  }
  return s;
}

void check_fingerprints(const std::vector<Fingerprint>& fps, uint64_t seq, const std::string& group,
                        const std::vector<int>& granks) {
  std::string msg;
  int bad = 0;
  for (size_t q = 1; q < fps.size(); ++q) {
    if (fps[q] == fps[0]) continue;
    const bool extras = fps[q].same_basic(fps[0]);
    std::string line = "rank " + std::to_string(granks[q]) + " called " + describe(fps[q].desc(), extras) +
                       " as collective #" + std::to_string(seq) + " of group " + group + " while rank " +
                       std::to_string(granks[0]) + " called " + describe(fps[0].desc(), extras);
    if (bad == 0) msg = "collective desync: " + line;
    else msg += "; " + line;
    ++bad;
  }
  if (bad) throw CommError(msg);
}

// ---------------------------------------------------------------------------------------------
// Flight recorder

namespace {
struct FrEntry {
  uint64_t id = 0;  // 0: empty
  char group[40] = {0};
  OpDesc d;
  int64_t t_issue = 0, t_start = 0, t_end = 0;
  int state = 0;  // 0 issued, 1 started, 2 done, 3 failed
};
struct FlightRecorder {
  std::mutex mu;
  std::vector<FrEntry> ring;
  uint64_t next = 1;
};
FlightRecorder& fr() {
  static FlightRecorder* f = new FlightRecorder();
  return *f;
}
FrEntry* fr_slot(FlightRecorder& f, uint64_t id) {
  if (f.ring.empty()) return nullptr;
  FrEntry& e = f.ring[id % f.ring.size()];
  return e.id == id ? &e : nullptr;
}
}  // namespace

uint64_t fr_issue(const std::string& group, const OpDesc& d, int64_t t) {
  FlightRecorder& f = fr();
  std::lock_guard<std::mutex> lk(f.mu);
  if (f.ring.empty()) f.ring.resize(static_cast<size_t>(std::max(1, config().flight_recorder)));
  uint64_t id = f.next++;
  FrEntry& e = f.ring[id % f.ring.size()];
  e = FrEntry{};
  e.id = id;
  std::snprintf(e.group, sizeof e.group, "%s", group.c_str());
  e.d = d;
  e.t_issue = t;
  return id;
}

void fr_start(uint64_t id, int64_t t) {
  FlightRecorder& f = fr();
  std::lock_guard<std::mutex> lk(f.mu);
  if (FrEntry* e = fr_slot(f, id)) {
    e->t_start = t;
    e->state = 1;
  }
}

void fr_end(uint64_t id, int64_t t, bool ok) {
  FlightRecorder& f = fr();
  std::lock_guard<std::mutex> lk(f.mu);
  if (FrEntry* e = fr_slot(f, id)) {
    if (!e->t_start) e->t_start = t;
    e->t_end = t;
    e->state = ok ? 2 : 3;
  }
}

void fr_dump(FILE* out, const std::string& reason) {
  FlightRecorder& f = fr();
  std::vector<FrEntry> entries;
  uint64_t total;
  {
    std::lock_guard<std::mutex> lk(f.mu);
    for (const FrEntry& e : f.ring)
      if (e.id) entries.push_back(e);
    total = f.next - 1;
  }
  std::sort(entries.begin(), entries.end(),
            [](const FrEntry& a, const FrEntry& b) { return a.id < b.id; });
  const int64_t now = now_ns();
  auto ms = [](int64_t t) { return t ? static_cast<double>(t - g_t0) / 1e6 : -1.0; };
  std::string s = "meshtrain[rank " + std::to_string(log_rank()) + "]: flight recorder (" + reason +
                  "): last " + std::to_string(entries.size()) + " of " + std::to_string(total) +
                  " operations, oldest first, times in ms since start (now " +
                  std::to_string(static_cast<long long>(ms(now))) + ")\n";
  char line[512];
  std::snprintf(line, sizeof line, "  %8s  %-14s %-6s %-44s %10s %10s %10s  %s\n", "op", "group",
                "seq", "operation", "issued", "started", "ended", "state");
  s += line;
  static const char* states[] = {"queued", "RUNNING", "done", "FAILED"};
  for (const FrEntry& e : entries) {
    char seq[24];
    if (is_p2p(e.d.kind))
      std::snprintf(seq, sizeof seq, "p%llu", static_cast<unsigned long long>(e.d.seq));
    else
      std::snprintf(seq, sizeof seq, "#%llu", static_cast<unsigned long long>(e.d.seq));
    char st[12] = "-", en[12] = "-";
    if (e.t_start) std::snprintf(st, sizeof st, "%.3f", ms(e.t_start));
    if (e.t_end) std::snprintf(en, sizeof en, "%.3f", ms(e.t_end));
    std::string what = describe(e.d, true);
    std::string extra;
    if (e.state == 1) {
      char buf[48];
      std::snprintf(buf, sizeof buf, " for %.1f ms", static_cast<double>(now - e.t_start) / 1e6);
      extra = buf;
    }
    std::snprintf(line, sizeof line, "  %8llu  %-14s %-6s %-44s %10.3f %10s %10s  %s%s\n",
                  static_cast<unsigned long long>(e.id), e.group, seq, what.c_str(), ms(e.t_issue),
                  st, en, states[e.state], extra.c_str());
    s += line;
  }
  std::fwrite(s.data(), 1, s.size(), out);
  std::fflush(out);
}

// ---------------------------------------------------------------------------------------------
// Fatal errors

namespace {
std::atomic<bool> g_failed{false};
std::once_flag g_abort_once;
}  // namespace

bool job_failed() { return g_failed.load(); }

[[noreturn]] void abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (inited && !fin) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void report_fatal(const std::string& msg, double grace_s) {
  bool first = !g_failed.exchange(true);
  log_line("ERROR: " + msg);
  if (first) fr_dump(stderr, "error");
  for (auto& g : live_groups()) g->fail(msg);
  std::call_once(g_abort_once, [grace_s] {
    std::thread([grace_s] {
      std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
      log_line("ending the job after a communication error");
      abort_job(1);
    }).detach();
  });
}

// ---------------------------------------------------------------------------------------------
// Registry

namespace {
struct Registry {
  std::mutex mu;
  int next_uid = 1;
  std::vector<std::weak_ptr<GroupImpl>> groups;
  std::vector<std::shared_ptr<StatsBlock>> stats;
};
Registry& reg() {
  static Registry* r = new Registry();
  return *r;
}
}  // namespace

int next_group_uid() {
  std::lock_guard<std::mutex> lk(reg().mu);
  return reg().next_uid++;
}

void register_group(const std::shared_ptr<GroupImpl>& g) {
  Registry& r = reg();
  std::lock_guard<std::mutex> lk(r.mu);
  r.groups.erase(std::remove_if(r.groups.begin(), r.groups.end(),
                                [](const std::weak_ptr<GroupImpl>& w) { return w.expired(); }),
                 r.groups.end());
  r.groups.push_back(g);
}

std::vector<std::shared_ptr<GroupImpl>> live_groups() {
  Registry& r = reg();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::shared_ptr<GroupImpl>> out;
  for (auto& w : r.groups)
    if (auto g = w.lock()) out.push_back(std::move(g));
  return out;
}

std::shared_ptr<GroupImpl> find_group(int uid) {
  for (auto& g : live_groups())
    if (g->uid == uid) return g;
  return nullptr;
}

void register_stats(const std::shared_ptr<StatsBlock>& s) {
  std::lock_guard<std::mutex> lk(reg().mu);
  reg().stats.push_back(s);
}

std::vector<std::shared_ptr<StatsBlock>> all_stats() {
  std::lock_guard<std::mutex> lk(reg().mu);
  return reg().stats;
}

}  // namespace mt::comm::detail
