// Fibers for the CUDA emulator: one per thread of the running block, each on its own stack, and a
// context switch of a few instructions between a fiber and the scheduler (the host thread that
// launched the kernel). x86-64 only. AddressSanitizer is told about every stack switch.
#pragma once
#include <cstddef>

namespace mt::emu {

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  char* stack = nullptr;
  size_t stack_bytes = 0;
};

// Gives f stack number `index` of the pool (made on first use, kept for later launches) and
// prepares it to call entry(arg) the next time it is resumed.
void fiber_init(Fiber& f, int index, void (*entry)(void*), void* arg);
// Scheduler side: runs f until it yields.
void fiber_resume(Fiber& f);
// Fiber side: the first thing entry() calls.
void fiber_started();
// Fiber side: back to the scheduler; `finished` when the fiber will never be resumed.
void fiber_yield(Fiber& f, bool finished);

}  // namespace mt::emu
