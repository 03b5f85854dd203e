// The Meta backend's kernel table: every op of the registry (kernels/ops.def) accepts its arguments
// and does nothing (a dry run counts memory and communication, not values); reductions to the host
// return 0. Every op is supported.
#include "kernels/backend.h"

namespace mt::kernels::meta {

namespace {
// A no-op with any signature (returns a value-initialised result).
template <typename R, typename... A>
R nop(A...) {
  return R();
}
template <typename R, typename... A>
constexpr auto as_nop(R (*)(A...)) -> R (*)(A...) {
  return &nop<R, A...>;
}
}  // namespace

const KernelTable& meta_table() {
  static const KernelTable t = [] {
    KernelTable k{};
    k.device = Device::Meta;
    k.supported.fill(true);
#define MT_OP(name, flags, dtypes, needs, ret, params) k.name = as_nop(k.name);
#include "kernels/ops.def"
#undef MT_OP
    return k;
  }();
  return t;
}

}  // namespace mt::kernels::meta
