// The Meta backend of the process groups (count-only, see World::init_meta): operations complete
// on the calling thread without moving data.
#include <cstring>

#include "comm/detail.h"
#include "runtime/device.h"

namespace mt::comm::detail {

// The operation has been counted (GroupImpl::issue); its staging is accounted on the Meta device
// as the MPI backend would hold it, host buffers get their as-if-replicated values (see
// World::init_meta), and it is complete when this returns.
void MetaBackend::run(Op& op_) {
  Op* op = &op_;
  const size_t need = MpiBackend::staging_bytes(op->d, size, rank);
  if (need > staging_bytes) {
    if (staging) device_free(Device::Meta, staging, staging_bytes, MemCategory::Comm);
    staging = device_alloc(Device::Meta, need, MemCategory::Comm);
    staging_bytes = need;
  }
  const size_t es = dtype_size(op->d.dt), part = op->d.count * es;
  const bool host_recv = op->rbuf && !is_meta_pointer(op->rbuf);
  auto times_n = [&](void* buf, size_t count) {
    if (op->d.op != ReduceOp::Sum) return;
    if (op->d.dt == DType::F32) {
      float* f = static_cast<float*>(buf);
      for (size_t i = 0; i < count; ++i) f[i] *= static_cast<float>(size);
    } else if (op->d.dt == DType::I32) {
      int32_t* v = static_cast<int32_t*>(buf);
      for (size_t i = 0; i < count; ++i) v[i] = static_cast<int32_t>(static_cast<uint32_t>(v[i]) * static_cast<uint32_t>(size));
    } else if (op->d.dt == DType::I64) {
      int64_t* v = static_cast<int64_t*>(buf);
      for (size_t i = 0; i < count; ++i) v[i] = static_cast<int64_t>(static_cast<uint64_t>(v[i]) * static_cast<uint64_t>(size));
    }
  };
  if (host_recv && part) {
    switch (op->d.kind) {
      case OpKind::AllGather: {
        char* recv = static_cast<char*>(op->rbuf);
        const char* mine = recv + static_cast<size_t>(rank) * part;
        if (op->sbuf != mine) std::memmove(recv + static_cast<size_t>(rank) * part, op->sbuf, part);
        for (int q = 0; q < size; ++q)
          if (q != rank) std::memcpy(recv + static_cast<size_t>(q) * part, recv + static_cast<size_t>(rank) * part, part);
        break;
      }
      case OpKind::ReduceScatter: {
        const char* seg = static_cast<const char*>(op->sbuf) + static_cast<size_t>(rank) * part;
        if (seg != op->rbuf) std::memmove(op->rbuf, seg, part);
        times_n(op->rbuf, op->d.count);
        break;
      }
      case OpKind::AllReduce:
        times_n(op->rbuf, op->d.count);
        break;
      case OpKind::Recv:
        std::memset(op->rbuf, 0, part);
        break;
      default:
        break;
    }
  }
}

void MetaBackend::shutdown() {
  if (staging) device_free(Device::Meta, staging, staging_bytes, MemCategory::Comm);
  staging = nullptr;
  staging_bytes = 0;
}

}  // namespace mt::comm::detail
