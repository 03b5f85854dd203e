// For the backends' table files only: a KernelTable generated from the op registry.
//
// A backend's table file makes every op's name visible as its kernel (a function, or a constexpr
// function pointer where the kernel has another name) or as an `Unsupported` placeholder:
//
//   namespace { constexpr table_builder::Unsupported moe_combine; }   // no kernel on this device
//   #define MT_TABLE_DEVICE_ Device::CUDA
//   static const KernelTable t =
//   #include "kernels/table_init.inc"
//       ;
//   #undef MT_TABLE_DEVICE_
//
// An unsupported op's entry is a generated function that throws the registry's error (never null),
// and the table's supports(op) is false for it. An op with neither a kernel nor a placeholder
// does not compile; a placeholder next to a real kernel of the same name is ambiguous and does
// not compile either.
#pragma once
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "kernels/ops.h"

namespace mt::kernels::table_builder {

struct Unsupported {};

// The error of an unsupported entry called anyway. Inline: a backend's table needs nothing of the
// kernels library but this header (the CUDA table is a library of its own).
[[noreturn]] inline void throw_unsupported(const char* op, Device d) {
  throw std::runtime_error(std::string("meshtrain: device ") + device_name(d) + " has no kernel for " + op +
                           " (check KernelTable::supports before calling it; `meshtrain check-ops --device " +
                           device_name(d) + " --list` lists what the device supports)");
}

template <Op O, Device D, class Fn>
struct Thunk;
template <Op O, Device D, class R, class... A>
struct Thunk<O, D, R (*)(A...)> {
  static R call(A...) { throw_unsupported(OpSignature<O>::kName, D); }
};

// The kernel itself (an overloaded name resolves to the op's signature), or the throwing entry.
template <Op O, Device D>
constexpr OpFn<O> entry(OpFn<O> f) {
  return f;
}
template <Op O, Device D>
constexpr OpFn<O> entry(Unsupported) {
  return &Thunk<O, D, OpFn<O>>::call;
}
template <Op O>
constexpr bool implemented(OpFn<O>) {
  return true;
}
template <Op O>
constexpr bool implemented(Unsupported) {
  return false;
}

}  // namespace mt::kernels::table_builder

// kernels/table_init.inc expands these into a KernelTable initialiser for MT_TABLE_DEVICE_.
#define MT_TABLE_SUPPORTED_(name, flags, dtypes, needs, ret, params) \
  ::mt::kernels::table_builder::implemented<::mt::kernels::Op::name>(name),
#define MT_TABLE_ENTRY_(name, flags, dtypes, needs, ret, params) \
  .name = ::mt::kernels::table_builder::entry<::mt::kernels::Op::name, MT_TABLE_DEVICE_>(name),
