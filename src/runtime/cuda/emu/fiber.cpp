#include "fiber.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's context switch (runtime/cuda/emu/fiber.cpp) is written for x86-64"
#endif

// mt_emu_switch(save, to): saves the callee-saved registers and the stack pointer (into *save),
// then continues on the stack `to` saved by an earlier switch (or made by fiber_init). The SSE and
// x87 control words are not switched: every fiber runs in the launching thread's floating-point
// environment and kernels do not change it. mt_emu_start: where a new fiber's first switch returns
// to; calls r13(r12).
asm(R"(
  .text
  .p2align 4
  .globl mt_emu_switch
  .hidden mt_emu_switch
  .type mt_emu_switch, @function
mt_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mt_emu_switch, .-mt_emu_switch

  .p2align 4
  .globl mt_emu_start
  .hidden mt_emu_start
  .type mt_emu_start, @function
mt_emu_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size mt_emu_start, .-mt_emu_start
)");

extern "C" void mt_emu_switch(void** save, void* to);
extern "C" void mt_emu_start();

namespace mt::emu {
namespace {

// Kernel frames are small; AddressSanitizer's redzones make them several times larger.
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStackBytes = size_t(512) << 10;
#else
constexpr size_t kStackBytes = size_t(128) << 10;
#endif

struct Pool {
  std::vector<char*> stacks;  // usable range [p, p + kStackBytes), a guard page below
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  char* get(int index) {
    while (stacks.size() <= static_cast<size_t>(index)) {
      void* m =
          mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED || mprotect(m, page, PROT_NONE) != 0) {
        std::fprintf(stderr, "meshtrain cuda emulator: could not map a %zu KiB fiber stack\n", kStackBytes >> 10);
        std::abort();
      }
      stacks.push_back(static_cast<char*>(m) + page);
    }
    return stacks[static_cast<size_t>(index)];
  }
};
Pool& pool() {
  static Pool* p = new Pool();  // never unmapped: a launch may run during static teardown
  return *p;
}

void* g_scheduler_sp = nullptr;
#if defined(__SANITIZE_ADDRESS__)
const void* g_scheduler_stack = nullptr;
size_t g_scheduler_stack_bytes = 0;
#endif

}  // namespace

void fiber_init(Fiber& f, int index, void (*entry)(void*), void* arg) {
  f.stack = pool().get(index);
  f.stack_bytes = kStackBytes;
  // The first switch to f pops the frame mt_emu_switch pushes (r15..r12, rbx, rbp) and returns
  // into mt_emu_start with a 16-byte aligned stack.
  auto* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(f.stack + f.stack_bytes) & ~uintptr_t(15));
  uint64_t* sp = top - 9;
  sp[0] = 0;                                          // r15
  sp[1] = 0;                                          // r14
  sp[2] = reinterpret_cast<uint64_t>(entry);          // r13
  sp[3] = reinterpret_cast<uint64_t>(arg);            // r12
  sp[4] = 0;                                          // rbx
  sp[5] = 0;                                          // rbp
  sp[6] = reinterpret_cast<uint64_t>(&mt_emu_start);  // return address
  sp[7] = 0;
  sp[8] = 0;
  f.sp = sp;
}

void fiber_run(Fiber& first) {
#if defined(__SANITIZE_ADDRESS__)
  if (!g_scheduler_stack) {  // the launching thread's stack, where fibers switch back to
    pthread_attr_t attr;
    void* addr = nullptr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      pthread_attr_getstack(&attr, &addr, &g_scheduler_stack_bytes);
      pthread_attr_destroy(&attr);
    }
    g_scheduler_stack = addr;
  }
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, first.stack, first.stack_bytes);
  mt_emu_switch(&g_scheduler_sp, first.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  mt_emu_switch(&g_scheduler_sp, first.sp);
#endif
}

void fiber_started() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
}

void fiber_switch(Fiber& from, Fiber* to, bool finished) {
  void* const target = to ? to->sp : g_scheduler_sp;
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  if (to) __sanitizer_start_switch_fiber(finished ? nullptr : &fake, to->stack, to->stack_bytes);
  else __sanitizer_start_switch_fiber(finished ? nullptr : &fake, g_scheduler_stack, g_scheduler_stack_bytes);
  mt_emu_switch(&from.sp, target);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)finished;
  mt_emu_switch(&from.sp, target);
#endif
}

}  // namespace mt::emu
