// The emulator's grid runner (emu.h): blocks one at a time in the schedule's order, the threads of
// a block as fibers, switched at the synchronising intrinsics only, and the checks that abort on
// misuse of barriers and warp operations.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "fiber.h"
#include "internal.h"

namespace mt::emu {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kWarp = 32;
constexpr size_t kSharedDefault = size_t(48) << 10;  // per block without an opt-in
constexpr size_t kSharedOptin = size_t(227) << 10;   // an H100's per-block maximum

enum class Wait : uint8_t { None, Barrier, Warp, Exited };

struct Thread {
  Fiber fiber;
  uint3 idx{};
  int tid = 0, lane = 0, warp = 0;
  Wait wait = Wait::None;
  Site site{};
  // The barrier or warp operation it waits at.
  BarrierKind bkind = BarrierKind::Plain;
  WarpOp op = WarpOp::Sync;
  const char* what = "";
  unsigned mask = 0;
  int arg = 0, width = 32;
  uint64_t value = 0, result = 0;
};

struct WarpState {
  unsigned present = 0;  // lanes that exist (a partial last warp has fewer)
  unsigned arrived = 0;  // lanes waiting at a warp operation
  unsigned exited = 0;
};

struct SharedSlot {
  const void* site;
  void* p;
  size_t bytes, align;
};

struct Block {
  const LaunchSpec* spec = nullptr;
  int n = 0, nwarps = 0;
  int at_barrier = 0, exited = 0;
  std::vector<Thread> threads = std::vector<Thread>(kMaxThreads);
  WarpState warps[kMaxThreads / kWarp];
  // Runnable threads as bits indexed by rank (the schedule's priority: lowest rank runs first).
  uint64_t runnable[kMaxThreads / 64] = {};
  int rank_of[kMaxThreads] = {}, by_rank[kMaxThreads] = {};
  Thread* cur = nullptr;
  std::vector<SharedSlot> shared;
  size_t shared_bytes = 0;
  void* dynamic = nullptr;
};

struct Emulator {
  std::mutex mu;  // one launch at a time
  Schedule schedule = Schedule::Forward;
  uint64_t seed = 1;
  uint64_t rng = 1;
  Block block;
};

Schedule schedule_from_env(uint64_t* seed) {
  Schedule s = Schedule::Forward;
  if (const char* v = std::getenv("MT_EMU_SCHEDULE"); v && *v) {
    const std::string x = v;
    if (x == "forward") s = Schedule::Forward;
    else if (x == "reverse") s = Schedule::Reverse;
    else if (x == "random") s = Schedule::Random;
    else {
      std::fprintf(stderr, "meshtrain cuda emulator: MT_EMU_SCHEDULE must be forward, reverse or random (got '%s')\n",
                   v);
      std::exit(2);
    }
  }
  if (const char* v = std::getenv("MT_EMU_SEED"); v && *v) {
    char* end = nullptr;
    *seed = std::strtoull(v, &end, 10);
    if (*end != '\0') {
      std::fprintf(stderr, "meshtrain cuda emulator: MT_EMU_SEED must be a non-negative integer (got '%s')\n", v);
      std::exit(2);
    }
  }
  return s;
}

Emulator& emu() {
  static Emulator* e = [] {
    auto* x = new Emulator();  // never destroyed: a launch may run during static teardown
    x->schedule = schedule_from_env(&x->seed);
    return x;
  }();
  return *e;
}
Block& blk() { return emu().block; }

uint64_t next_random() {  // splitmix64
  uint64_t z = (emu().rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t random_below(uint64_t n) { return next_random() % n; }

std::string where(Site s) { return std::string(s.file) + ":" + std::to_string(s.line); }
bool same_site(Site a, Site b) { return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0); }
std::string hex(unsigned v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}
// "lane 5", "lanes 8-31", "lanes 0,2-3": the set bits of a lane mask.
std::string lanes(unsigned m) {
  std::string s;
  for (int l = 0; l < kWarp;) {
    if (!(m & (1u << l))) {
      ++l;
      continue;
    }
    int e = l;
    while (e + 1 < kWarp && (m & (1u << (e + 1)))) ++e;
    s += (s.empty() ? "" : ",") + std::to_string(l) + (e > l ? "-" + std::to_string(e) : "");
    l = e + 1;
  }
  return (__builtin_popcount(m) == 1 ? "lane " : "lanes ") + s;
}

[[noreturn]] void fail(const std::string& msg) {
  const Block& b = blk();
  std::fprintf(stderr,
               "meshtrain cuda emulator: kernel %s, block (%u,%u,%u) of (%u,%u,%u) [schedule %s, seed %llu]: %s\n",
               b.spec ? b.spec->name : "?", g_block_idx.x, g_block_idx.y, g_block_idx.z, g_grid_dim.x, g_grid_dim.y,
               g_grid_dim.z, schedule_name(emu().schedule), static_cast<unsigned long long>(emu().seed), msg.c_str());
  std::fflush(stderr);
  std::abort();
}

// --- ranks and the runnable set ---
void assign_ranks(Block& b) {
  const Schedule s = emu().schedule;
  if (s == Schedule::Random) {
    std::vector<int> warp_order(static_cast<size_t>(b.nwarps));
    for (int w = 0; w < b.nwarps; ++w) warp_order[static_cast<size_t>(w)] = w;
    for (int i = b.nwarps - 1; i > 0; --i)
      std::swap(warp_order[static_cast<size_t>(i)], warp_order[random_below(static_cast<uint64_t>(i) + 1)]);
    int r = 0;
    for (int w : warp_order) {
      const int lo = w * kWarp, cnt = std::min(kWarp, b.n - lo);
      int lane_order[kWarp];
      for (int l = 0; l < cnt; ++l) lane_order[l] = l;
      for (int i = cnt - 1; i > 0; --i)
        std::swap(lane_order[i], lane_order[random_below(static_cast<uint64_t>(i) + 1)]);
      for (int l = 0; l < cnt; ++l) b.by_rank[r++] = lo + lane_order[l];
    }
  } else {
    for (int r = 0; r < b.n; ++r) b.by_rank[r] = s == Schedule::Forward ? r : b.n - 1 - r;
  }
  for (int r = 0; r < b.n; ++r) b.rank_of[b.by_rank[r]] = r;
}
void set_runnable(Block& b, int tid) {
  const int r = b.rank_of[tid];
  b.runnable[r >> 6] |= uint64_t(1) << (r & 63);
}
int take_runnable(Block& b) {
  for (int w = 0; w < kMaxThreads / 64; ++w)
    if (b.runnable[w]) {
      const int bit = __builtin_ctzll(b.runnable[w]);
      b.runnable[w] &= b.runnable[w] - 1;
      return b.by_rank[w * 64 + bit];
    }
  return -1;
}

// --- running one block ---
// A switch point: the next runnable thread of the schedule runs (the scheduler when none is left).
void yield(Thread& t, bool finished) {
  Block& b = blk();
  const int next = take_runnable(b);
  if (next == t.tid) return;  // t itself is next
  Thread* u = next < 0 ? nullptr : &b.threads[static_cast<size_t>(next)];
  b.cur = u;
  if (u) g_thread_idx = u->idx;
  fiber_switch(t.fiber, u ? &u->fiber : nullptr, finished);
}

void thread_main(void* arg) {
  fiber_started();
  Thread& t = *static_cast<Thread*>(arg);
  Block& b = blk();
  b.spec->invoke(b.spec->fn, b.spec->params);
  t.wait = Wait::Exited;
  ++b.exited;
  b.warps[t.warp].exited |= 1u << t.lane;
  yield(t, true);
  std::abort();  // never resumed
}

// What a thread does, after "N threads" or "lanes ...".
std::string describe_wait(const Thread& t) {
  switch (t.wait) {
    case Wait::Exited: return "exited";
    case Wait::Barrier: return "wait at __syncthreads at " + where(t.site);
    case Wait::Warp: return std::string("wait at ") + t.what + " at " + where(t.site) + " (mask " + hex(t.mask) + ")";
    case Wait::None: break;
  }
  return "can run";
}

// Nothing can run but not every thread has exited: say who waits where, then abort.
[[noreturn]] void stall(Block& b) {
  const Thread* first_barrier = nullptr;
  for (int i = 0; i < b.n && !first_barrier; ++i)
    if (b.threads[static_cast<size_t>(i)].wait == Wait::Barrier) first_barrier = &b.threads[static_cast<size_t>(i)];
  if (first_barrier) {
    int here = 0;
    std::vector<std::pair<std::string, std::vector<int>>> others;  // what the others do, and who
    for (int i = 0; i < b.n; ++i) {
      const Thread& t = b.threads[static_cast<size_t>(i)];
      if (t.wait == Wait::Barrier && same_site(t.site, first_barrier->site)) {
        ++here;
        continue;
      }
      const std::string d = describe_wait(t);
      auto it = std::find_if(others.begin(), others.end(), [&](const auto& o) { return o.first == d; });
      if (it == others.end()) it = others.insert(others.end(), {d, {}});
      it->second.push_back(i);
    }
    std::string msg = "__syncthreads at " + where(first_barrier->site) + " reached by " + std::to_string(here) +
                      " of " + std::to_string(b.n) + " threads;";
    for (const auto& [what, who] : others)
      msg += " " + std::to_string(who.size()) + " " + what +
             (who.size() > 1 ? " (threads " + std::to_string(who.front()) + " to " + std::to_string(who.back()) + ");"
                             : " (thread " + std::to_string(who.front()) + ");");
    fail(msg + " a barrier must be reached by every thread of the block");
  }
  for (int i = 0; i < b.n; ++i) {
    const Thread& t = b.threads[static_cast<size_t>(i)];
    if (t.wait != Wait::Warp) continue;
    std::string msg = std::string(t.what) + " at " + where(t.site) + " in warp " + std::to_string(t.warp) + " (mask " +
                      hex(t.mask) + ") cannot complete:";
    std::vector<std::pair<std::string, unsigned>> missing;  // what the missing lanes do, and which
    for (int l = 0; l < kWarp; ++l) {
      const Thread& u = b.threads[static_cast<size_t>(t.warp * kWarp + l)];
      if (!(t.mask & (1u << l)) || (u.wait == Wait::Warp && u.mask == t.mask && same_site(u.site, t.site))) continue;
      const std::string d = describe_wait(u);
      auto it = std::find_if(missing.begin(), missing.end(), [&](const auto& m) { return m.first == d; });
      if (it == missing.end()) it = missing.insert(missing.end(), {d, 0u});
      it->second |= 1u << l;
    }
    for (const auto& [what, m] : missing) msg += " " + lanes(m) + ": " + what + ";";
    fail(msg + " every lane named in the mask must call the same warp operation");
  }
  fail("no thread can run (internal error)");
}

void run_block(Block& b, uint3 bidx) {
  g_block_idx = bidx;
  b.at_barrier = b.exited = 0;
  for (int w = 0; w < b.nwarps; ++w) {
    const int cnt = std::min(kWarp, b.n - w * kWarp);
    b.warps[w] = WarpState{cnt == kWarp ? ~0u : (1u << cnt) - 1u, 0, 0};
  }
  assign_ranks(b);
  std::fill(std::begin(b.runnable), std::end(b.runnable), 0);
  const dim3 bd = b.spec->block;
  for (int i = 0; i < b.n; ++i) {
    Thread& t = b.threads[static_cast<size_t>(i)];
    const unsigned u = static_cast<unsigned>(i);
    t.idx = uint3{u % bd.x, (u / bd.x) % bd.y, u / (bd.x * bd.y)};
    t.tid = i;
    t.lane = i % kWarp;
    t.warp = i / kWarp;
    t.wait = Wait::None;
    fiber_init(t.fiber, i, &thread_main, &t);
    set_runnable(b, i);
  }
  b.dynamic = ::operator new(std::max<size_t>(b.spec->smem, 1), std::align_val_t(16));
  std::memset(b.dynamic, 0xFF, b.spec->smem);
  b.shared_bytes = b.spec->smem;
  Thread& first = b.threads[static_cast<size_t>(take_runnable(b))];
  b.cur = &first;
  g_thread_idx = first.idx;
  fiber_run(first.fiber);  // returns when no thread can run
  b.cur = nullptr;
  if (b.exited != b.n) stall(b);
  for (const SharedSlot& s : b.shared) ::operator delete(s.p, std::align_val_t(s.align));
  b.shared.clear();
  ::operator delete(b.dynamic, std::align_val_t(16));
  b.dynamic = nullptr;
}

// The launch's error, as the runtime reports a bad configuration (nothing runs); "" when it may run.
cudaError_t check_config(const LaunchSpec& s) {
  const dim3 g = s.grid, k = s.block;
  if (!valid_stream(s.stream)) return cudaErrorInvalidResourceHandle;
  const uint64_t threads = uint64_t(k.x) * k.y * k.z;
  if (threads == 0 || threads > kMaxThreads || k.x > 1024 || k.y > 1024 || k.z > 64)
    return cudaErrorInvalidConfiguration;
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535)
    return cudaErrorInvalidConfiguration;
  if (s.smem > std::max(kSharedDefault, dynamic_shared_limit(reinterpret_cast<const void*>(s.fn))))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

// The i-th block of the schedule's order among nb: forward, reverse, or a random permutation
// (Fisher-Yates up to 2^22 blocks, a random affine bijection beyond).
struct BlockOrder {
  uint64_t nb = 0, start = 0, stride = 1;
  std::vector<uint32_t> perm;
  explicit BlockOrder(uint64_t n) : nb(n) {
    if (emu().schedule != Schedule::Random || nb < 2) return;
    if (nb <= (uint64_t(1) << 22)) {
      perm.resize(nb);
      for (uint64_t i = 0; i < nb; ++i) perm[i] = static_cast<uint32_t>(i);
      for (uint64_t i = nb - 1; i > 0; --i) std::swap(perm[i], perm[random_below(i + 1)]);
      return;
    }
    start = random_below(nb);
    stride = random_below(nb) | 1;
    while (std::gcd(stride, nb) != 1) stride += 2;
  }
  uint64_t operator[](uint64_t i) const {
    if (!perm.empty()) return perm[i];
    if (emu().schedule == Schedule::Reverse) return nb - 1 - i;
    if (emu().schedule == Schedule::Random) return (start + i * stride) % nb;
    return i;
  }
};

}  // namespace

void set_schedule(Schedule s, uint64_t seed) {
  std::lock_guard<std::mutex> lk(emu().mu);
  emu().schedule = s;
  emu().seed = seed;
}
Schedule schedule() { return emu().schedule; }
const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::Forward: return "forward";
    case Schedule::Reverse: return "reverse";
    case Schedule::Random: return "random";
  }
  return "?";
}
uint64_t schedule_seed() { return emu().seed; }

void run(const LaunchSpec& s) {
  const cudaError_t err = check_config(s);
  if (err != cudaSuccess) {
    record_error(err);
    return;
  }
  log_op(StreamOp::Kernel, s.stream, nullptr);
  Emulator& e = emu();
  std::lock_guard<std::mutex> lk(e.mu);
  Block& b = e.block;
  // The random orders of a launch depend only on the seed, the kernel and its configuration, so a
  // failure reproduces when the test runs alone.
  uint64_t h = e.seed * 0x2545f4914f6cdd1dull;
  for (const char* c = s.name; *c; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 0x100000001b3ull;
  for (unsigned v : {s.grid.x, s.grid.y, s.grid.z, s.block.x, s.block.y, s.block.z}) h = (h ^ v) * 0x100000001b3ull;
  e.rng = h;
  b.spec = &s;
  b.n = static_cast<int>(s.block.x * s.block.y * s.block.z);
  b.nwarps = (b.n + kWarp - 1) / kWarp;
  g_block_dim = s.block;
  g_grid_dim = s.grid;
  const uint64_t gx = s.grid.x, gy = s.grid.y, nb = gx * gy * s.grid.z;
  const BlockOrder order(nb);
  for (uint64_t i = 0; i < nb; ++i) {
    const uint64_t id = order[i];
    run_block(b, uint3{static_cast<unsigned>(id % gx), static_cast<unsigned>((id / gx) % gy),
                       static_cast<unsigned>(id / (gx * gy))});
  }
  b.spec = nullptr;
}

// --- shared memory ---
void* block_shared(const void* site, size_t bytes, size_t align) {
  Block& b = blk();
  if (!b.cur) fail("shared memory declared outside a kernel");
  for (const SharedSlot& s : b.shared)
    if (s.site == site) return s.p;
  b.shared_bytes += bytes;
  const size_t limit =
      dynamic_shared_limit(reinterpret_cast<const void*>(b.spec->fn)) > 0 ? kSharedOptin : kSharedDefault;
  if (b.shared_bytes > limit)
    fail(std::to_string(b.shared_bytes) + " bytes of shared memory per block (static and dynamic) exceed the " +
         std::to_string(limit >> 10) + " KiB limit");
  align = std::max<size_t>(align, 16);
  void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(align));
  std::memset(p, 0xFF, bytes);
  b.shared.push_back(SharedSlot{site, p, bytes, align});
  return p;
}
void* dynamic_shared() {
  if (!blk().cur) fail("dynamic shared memory used outside a kernel");
  return blk().dynamic;
}

// --- barriers ---
int barrier(Site s, BarrierKind k, int pred) {
  Block& b = blk();
  Thread& t = *b.cur;
  t.wait = Wait::Barrier;
  t.site = s;
  t.bkind = k;
  t.value = static_cast<uint64_t>(pred);
  if (++b.at_barrier == b.n) {  // the last thread: check that all met at one barrier, release them
    int count = 0;
    for (int i = 0; i < b.n; ++i) {
      const Thread& u = b.threads[static_cast<size_t>(i)];
      if (!same_site(u.site, s) || u.bkind != k)
        fail("threads meet at different barriers: thread " + std::to_string(i) + " at " + where(u.site) + ", thread " +
             std::to_string(t.tid) + " at " + where(s) +
             " (every thread of the block must reach the same __syncthreads)");
      count += u.value ? 1 : 0;
    }
    const int r = k == BarrierKind::Count ? count
                  : k == BarrierKind::And ? (count == b.n ? 1 : 0)
                                          : (count > 0 ? 1 : 0);
    b.at_barrier = 0;
    if (emu().schedule == Schedule::Random) assign_ranks(b);
    for (int i = 0; i < b.n; ++i) {
      Thread& u = b.threads[static_cast<size_t>(i)];
      u.wait = Wait::None;
      u.result = static_cast<uint64_t>(r);
      set_runnable(b, i);
    }
  }
  yield(t, false);
  return static_cast<int>(t.result);
}

// --- warp operations ---
namespace {
// The lane whose value lane `l` receives from a shuffle.
int shuffle_source(const Thread& u) {
  const int l = u.lane, w = u.width, base = l & ~(w - 1);
  switch (u.op) {
    case WarpOp::Idx: return base + (u.arg & (w - 1));
    case WarpOp::Up: return (l - base) >= u.arg ? l - u.arg : l;
    case WarpOp::Down: return (l - base) + u.arg < w ? l + u.arg : l;
    case WarpOp::Xor: {
      const int src = l ^ (u.arg & (kWarp - 1));
      return src >= base + w ? l : src;  // a later segment: the lane's own value
    }
    default: return l;
  }
}

// Every lane named in `mask` of warp `w` has arrived: check they meet at one operation, give each its result.
void complete_warp_op(Block& b, int w, unsigned mask, const Thread& last) {
  Thread* lane[kWarp] = {};
  uint64_t votes = 0, acc = 0;
  bool first = true;
  for (int l = 0; l < kWarp; ++l) {
    if (!(mask & (1u << l))) continue;
    Thread& u = b.threads[static_cast<size_t>(w * kWarp + l)];
    lane[l] = &u;
    if (u.op != last.op || u.mask != mask || !same_site(u.site, last.site))
      fail(std::string("lanes of warp ") + std::to_string(w) + " meet at different warp operations: lane " +
           std::to_string(l) + " at " + u.what + " " + where(u.site) + " (mask " + hex(u.mask) + "), lane " +
           std::to_string(last.lane) + " at " + last.what + " " + where(last.site) + " (mask " + hex(mask) + ")");
    if (u.value) votes |= uint64_t(1) << l;
    const uint32_t v = static_cast<uint32_t>(u.value);
    const auto sv = static_cast<int32_t>(v), sa = static_cast<int32_t>(static_cast<uint32_t>(acc));
    switch (last.op) {
      case WarpOp::AddU: acc = static_cast<uint32_t>(acc + v); break;
      case WarpOp::MinU: acc = first || v < acc ? v : acc; break;
      case WarpOp::MaxU: acc = first || v > acc ? v : acc; break;
      case WarpOp::MinI: acc = static_cast<uint32_t>(first || sv < sa ? sv : sa); break;
      case WarpOp::MaxI: acc = static_cast<uint32_t>(first || sv > sa ? sv : sa); break;
      default: break;
    }
    first = false;
  }
  for (int l = 0; l < kWarp; ++l) {
    Thread* u = lane[l];
    if (!u) continue;
    switch (last.op) {
      case WarpOp::Idx:
      case WarpOp::Up:
      case WarpOp::Down:
      case WarpOp::Xor: {
        const int src = shuffle_source(*u);
        if (!(mask & (1u << src)))
          fail(std::string(u->what) + " at " + where(u->site) + ": lane " + std::to_string(l) + " of warp " +
               std::to_string(w) + " reads lane " + std::to_string(src) + ", which is not in the mask " + hex(mask));
        u->result = lane[src]->value;
        break;
      }
      case WarpOp::Ballot: u->result = votes; break;
      case WarpOp::All: u->result = votes == mask ? 1 : 0; break;
      case WarpOp::Any: u->result = votes != 0 ? 1 : 0; break;
      case WarpOp::Sync: u->result = 0; break;
      default: u->result = acc; break;
    }
    u->wait = Wait::None;
    set_runnable(b, u->tid);
  }
  b.warps[w].arrived &= ~mask;
}
}  // namespace

uint64_t warp_op(Site s, WarpOp op, const char* what, unsigned mask, uint64_t value, int arg, int width) {
  Block& b = blk();
  if (!b.cur) fail(std::string(what) + " called outside a kernel");
  Thread& t = *b.cur;
  WarpState& ws = b.warps[t.warp];
  const unsigned me = 1u << t.lane;
  const auto at = [&] {
    return std::string(what) + " at " + where(s) + " (warp " + std::to_string(t.warp) + ", lane " +
           std::to_string(t.lane) + ", mask " + hex(mask) + "): ";
  };
  if (!(mask & me)) fail(at() + "the mask does not name the calling lane");
  if (mask & ~ws.present)
    fail(at() + "the mask names " + lanes(mask & ~ws.present) + ", which do not exist (the block has " +
         std::to_string(b.n) + " threads, so its last warp is partial)");
  if (mask & ws.exited) fail(at() + "the mask names " + lanes(mask & ws.exited) + ", which exited");
  if (width < 1 || width > kWarp || (width & (width - 1)) != 0)
    fail(at() + "width " + std::to_string(width) + " is not a power of two up to 32");
  t.wait = Wait::Warp;
  t.site = s;
  t.op = op;
  t.what = what;
  t.mask = mask;
  t.value = value;
  t.arg = arg;
  t.width = width;
  ws.arrived |= me;
  if ((ws.arrived & mask) == mask) complete_warp_op(b, t.warp, mask, t);
  yield(t, false);
  return t.result;
}

unsigned active_mask() {
  Block& b = blk();
  if (!b.cur) fail("__activemask called outside a kernel");
  const WarpState& ws = b.warps[b.cur->warp];
  return ws.present & ~ws.exited;
}

}  // namespace mt::emu
