// Fibers for the CUDA emulator: one per thread of the running block, each on its own stack, and a
// context switch of a few instructions from a fiber to the next one (or to the scheduler, the host
// thread that launched the kernel). x86-64 only. AddressSanitizer is told about every stack switch.
#pragma once
#include <cstddef>

namespace mt::emu {

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  char* stack = nullptr;
  size_t stack_bytes = 0;
};

// Gives f stack number `index` of the pool (made on first use, kept for later launches) and
// prepares it to call entry(arg) the next time it is switched to.
void fiber_init(Fiber& f, int index, void (*entry)(void*), void* arg);
// Scheduler side (the host thread that launched the kernel): runs `first`, and whatever it switches
// to, until a fiber switches back to the scheduler.
void fiber_run(Fiber& first);
// Fiber side: the first thing entry() calls.
void fiber_started();
// Fiber side: continues `to` (the scheduler when null); `finished` when `from` is never resumed.
void fiber_switch(Fiber& from, Fiber* to, bool finished);

}  // namespace mt::emu
