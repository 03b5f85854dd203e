// The CUDA emulator (the build configured with -DMESHTRAIN_CUDA=EMU; docs/gpu.md, "The emulator"):
// its own interface, under the CUDA names the shim headers of this folder provide.
//
// The CUDA sources of src/kernels/cuda compile as host C++ against this folder. A kernel launch
// (MT_LAUNCH, kernels/cuda/launch.cuh) runs the whole grid before it returns, one block at a time:
// each thread of the block is a fiber with its own stack, and the synchronising intrinsics
// (__syncthreads*, warp shuffles and votes, __syncwarp) are the only points where a fiber gives way
// to another. Which thread runs next at such a point, and the order of the blocks, follow the
// schedule (forward, reverse or seeded random), so a missing barrier shows up as a wrong result
// under at least one schedule. Misuse the hardware would not report (a barrier reached by part of a
// block, a warp operation whose mask names lanes that are missing, exited or do not exist) aborts
// the process with a message naming the kernel, the block and the source line.
//
// Device memory is host memory handed out by the emulated cudaMalloc (runtime.cpp), filled with
// NaN bytes (0xFF) so that reads of memory no kernel wrote are visible; kernel pointer arguments
// must point into it. Built with AddressSanitizer, every access past the bytes a tensor asked for
// is reported with the kernel's source line.
#pragma once
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

namespace mt::emu {

// Where a synchronising intrinsic was called (for the emulator's messages and its checks that the
// threads meet at the same one).
struct Site {
  const char* file;
  int line;
};
#define MT_EMU_SITE \
  ::mt::emu::Site { __FILE__, __LINE__ }

// forward: the lowest-numbered runnable thread runs first at every switch point and blocks run in
// index order; reverse: the highest first, blocks from the last; random: a seeded random order of
// warps and of lanes within each warp, drawn again at every barrier, and a random block order.
// The default comes from MT_EMU_SCHEDULE (forward | reverse | random) and MT_EMU_SEED.
enum class Schedule : uint8_t { Forward, Reverse, Random };
void set_schedule(Schedule s, uint64_t seed);
Schedule schedule();
uint64_t schedule_seed();
const char* schedule_name(Schedule s);

// The built-in variables of the running thread, set by the scheduler at every switch.
inline uint3 g_thread_idx{0, 0, 0}, g_block_idx{0, 0, 0};
inline dim3 g_block_dim, g_grid_dim;

// --- launching a kernel ---
using AnyFn = void (*)();
struct LaunchSpec {
  const char* name;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  AnyFn fn;
  void (*invoke)(AnyFn fn, const void* params);  // calls fn with a copy of the parameters
  const void* params;
};
// Runs every block of the grid (or records the launch error cudaGetLastError reports).
void run(const LaunchSpec& s);
// Aborts unless p is null or points into memory a kernel may touch (emulated device memory or
// pinned host memory): argument `index` of `kernel`.
void check_kernel_pointer(const char* kernel, int index, const void* p);

template <class... P>
struct KernelCall {
  using Params = std::tuple<std::decay_t<P>...>;
  const char* name;
  void (*fn)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;

  template <class... A>
  void operator()(A&&... a) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
    const Params params(std::forward<A>(a)...);
    check_pointers(params, std::index_sequence_for<P...>{});
    run(LaunchSpec{name, grid, block, smem, stream, reinterpret_cast<AnyFn>(fn), &invoke, &params});
  }
  template <size_t... I>
  void check_pointers(const Params& p, std::index_sequence<I...>) const {
    (check_one(static_cast<int>(I), std::get<I>(p)), ...);
  }
  template <class T>
  void check_one(int i, const T& v) const {
    if constexpr (std::is_pointer_v<T>) check_kernel_pointer(name, i, v);
  }
  static void invoke(AnyFn f, const void* params) {
    std::apply(reinterpret_cast<void (*)(P...)>(f), *static_cast<const Params*>(params));
  }
};
template <class... P>
KernelCall<P...> launch(const char* name, void (*fn)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st) {
  return KernelCall<P...>{name, fn, grid, block, smem, st};
}

// --- shared memory: per block, filled with NaN bytes when the block starts ---
// The storage of one declaration (identified by the address `site`) in the running block.
void* block_shared(const void* site, size_t bytes, size_t align);
// The launch's dynamic shared memory (exactly the bytes the launch asked for).
void* dynamic_shared();
template <class T>
using type_t = T;
template <class T, class Tag>
T& shared_var(Tag) {
  static char site;  // one per declaration (Tag is the type of a lambda written at the declaration)
  return *static_cast<T*>(block_shared(&site, sizeof(T), alignof(T)));
}

// --- synchronising intrinsics (the switch points) ---
enum class BarrierKind : uint8_t { Plain, Count, And, Or };
int barrier(Site s, BarrierKind k, int pred);
enum class WarpOp : uint8_t { Idx, Up, Down, Xor, Sync, Ballot, All, Any, AddU, MinU, MaxU, MinI, MaxI };
// One lane's part in a warp operation; returns the lane's result once every lane named in mask
// has arrived (value: the lane's 8 bytes; arg: source lane, delta or lane mask; width: shuffle
// segment).
uint64_t warp_op(Site s, WarpOp op, const char* what, unsigned mask, uint64_t value, int arg, int width);
// The lanes of the calling thread's warp that have not exited.
unsigned active_mask();

// --- device memory (runtime.cpp) ---
// True when [p, p + bytes) lies inside one emulated device allocation.
bool is_device_range(const void* p, size_t bytes);
// The CUDA device's caching allocator hands out `bytes` of a block of `block_bytes`: the bytes
// are filled with NaN and, under AddressSanitizer, the rest of the block is made unaddressable.
void device_lend(void* p, size_t bytes, size_t block_bytes);
// The block goes back to the cache: unaddressable until lent again (AddressSanitizer builds).
void device_return(void* p, size_t block_bytes);

// --- test hooks: what was queued on which stream, and streams that have not caught up ---
// Every stream operation still runs when it is issued; these hooks let a test see the order in
// which the host queued work on the streams, and make a stream look busy to the host.
struct StreamOp {
  enum Kind : uint8_t { Kernel, CopyH2D, CopyD2H, CopyD2D, Memset, Record, WaitEvent, Sync } kind;
  cudaStream_t stream;
  cudaEvent_t event;  // Record and WaitEvent (Sync of an event: the event, stream null)
};
// Appends every later stream operation, in issue order, to *log (nullptr: stops).
void set_op_log(std::vector<StreamOp>* log);
// While s is held, an event recorded on s reports cudaErrorNotReady to cudaEventQuery (the work
// before it has not run yet, as far as the host can tell). Synchronising with the stream or with
// such an event ends the hold (the host waited for the work), as does hold_stream(s, false).
void hold_stream(cudaStream_t s, bool held);

}  // namespace mt::emu
