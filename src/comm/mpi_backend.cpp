// The MPI backend of the process groups: the group's communication thread drives each operation
// with non-blocking MPI point-to-point calls (OpenMPI has no background progress), polled by
// GroupImpl::thread_main with exponential back-off.
//
// Algorithms (n ranks, buffer of B bytes; see docs/comm.md):
//   all_reduce      up to MESHTRAIN_COMM_ONESHOT_KB: one round, every rank sends B to every peer
//                   and reduces all n itself. Larger: direct reduce-scatter then direct
//                   all-gather, in slices of at most MESHTRAIN_COMM_SLICE_KB: rank r owns segment
//                   r of each slice, receives the n-1 other contributions to it, reduces all n in
//                   rank order in fp32, and sends the result to every peer. Each rank sends
//                   (n-1)/n B twice = the ring volume, in 2 steps instead of 2(n-1).
//                   Groups spanning several nodes (same number >= 2 of ranks on each): two-level,
//                   intra-node reduce-scatter -> inter-node reduce-scatter + all-gather of fp32
//                   partials -> intra-node all-gather.
//   reduce_scatter  the first half of the direct all_reduce.
//   all_gather      every rank sends its part to every peer.
//   broadcast       binomial tree.
//   barrier         MPI_Ibarrier.

#include <algorithm>
#include <climits>
#include <cstring>

#include "comm/detail.h"
#include "runtime/memory.h"

namespace mt::comm::detail {

namespace {
// The source pointers of a local reduction: on the stack up to 64 ranks, on the heap beyond.
struct SourceList {
  const void* small[64];
  std::vector<const void*> big;
  const void** data = small;
  explicit SourceList(size_t n) {
    if (n > 64) {
      big.resize(n);
      data = big.data();
    }
  }
  SourceList(const SourceList&) = delete;
  SourceList& operator=(const SourceList&) = delete;
};
}  // namespace

enum Phase : int {
  kStart = 0,
  kRsWait = 1,
  kAgPost = 2,
  kAgWait = 3,
  kBcRecvWait = 4,
  kBcSendWait = 5,
  kBarrierWait = 6,
  kOneShotWait = 7,
  kHStart = 8,
  kHIntraRsWait = 9,
  kHInterRsWait = 10,
  kHInterAgWait = 11,
  kHIntraAgWait = 12,
};

static std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<size_t>(len));
}

MpiBackend::MpiBackend(const std::string& group_name, MPI_Comm comm) : name(group_name) {
  coll = comm;
  MPI_Comm_set_errhandler(coll, MPI_ERRORS_RETURN);
  MPI_Comm_rank(coll, &rank);
  MPI_Comm_size(coll, &size);
  MPI_Comm_dup(coll, &p2p);
  MPI_Comm_dup(coll, &ctrl);
  MPI_Comm_set_errhandler(p2p, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(ctrl, MPI_ERRORS_RETURN);
  MPI_Group g, wg;
  MPI_Comm_group(coll, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  std::vector<int> mine(size);
  for (int i = 0; i < size; ++i) mine[i] = i;
  granks.resize(size);
  MPI_Group_translate_ranks(g, size, mine.data(), wg, granks.data());
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  int* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
  long tag_ub = (flag && ub) ? *ub : 32767;
  int bits = 0;
  while (bits < 20 && ((1L << (bits + 3)) - 1) <= tag_ub) ++bits;
  tag_bits = bits;
  setup_hierarchy();
}

// Collective over the group (part of its creation).
void MpiBackend::setup_hierarchy() {
  if (size < 4 || !config().hierarchical) return;
  MPI_Comm local = MPI_COMM_NULL;
  const int fake = config().fake_node_size;
  if (fake > 0)
    MPI_Comm_split(coll, granks[rank] / fake, rank, &local);
  else
    MPI_Comm_split_type(coll, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  int l = 0, nl = 1;
  MPI_Comm_rank(local, &l);
  MPI_Comm_size(local, &nl);
  int mn = nl, mx = nl;
  MPI_Allreduce(MPI_IN_PLACE, &mn, 1, MPI_INT, MPI_MIN, coll);
  MPI_Allreduce(MPI_IN_PLACE, &mx, 1, MPI_INT, MPI_MAX, coll);
  if (mn != mx || nl < 2 || size / nl < 2) {
    MPI_Comm_free(&local);
    return;
  }
  intra = local;
  MPI_Comm_split(coll, l, rank, &inter);
  MPI_Comm_set_errhandler(intra, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(inter, MPI_ERRORS_RETURN);
  local_n = nl;
  local_r = l;
  MPI_Comm_size(inter, &nodes_n);
  MPI_Comm_rank(inter, &node_r);
  hier = true;
}

void MpiBackend::shutdown() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) {
    for (MPI_Comm* c : {&coll, &p2p, &ctrl, &intra, &inter})
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
  if (staging) {
    mem_free(staging, staging_bytes_, MemCategory::Comm);
    staging = nullptr;
    staging_bytes_ = 0;
  }
}

bool MpiBackend::p2p_done(Op& op) { return test_all(op.reqs, "transfer", op); }


void* MpiBackend::ensure_staging(size_t bytes) {
  if (bytes > staging_bytes_) {
    if (staging) mem_free(staging, staging_bytes_, MemCategory::Comm);
    staging = mem_alloc(bytes, MemCategory::Comm);
    staging_bytes_ = bytes;
  }
  return staging;
}

void MpiBackend::post(bool is_send, void* buf, size_t bytes, int peer, int tag, MPI_Comm comm,
                     std::vector<MPI_Request>& into) {
  // Messages over 1 GiB go as several (MPI counts are int); the receiver splits identically.
  constexpr size_t kMax = size_t(1) << 30;
  char* p = static_cast<char*>(buf);
  do {
    const size_t n = std::min(bytes, kMax);
    MPI_Request r;
    int rc = is_send ? MPI_Isend(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm, &r)
                     : MPI_Irecv(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm, &r);
    if (rc != MPI_SUCCESS)
      throw CommError("group " + name + ": " + (is_send ? "MPI_Isend" : "MPI_Irecv") +
                      " failed: " + mpi_error_string(rc));
    into.push_back(r);
    p += n;
    bytes -= n;
  } while (bytes > 0);
}

void MpiBackend::post_allgather(char* base, size_t len, size_t es, int n, int me, int tag, MPI_Comm comm,
                               std::vector<MPI_Request>& into) {
  for (int k = 1; k < n; ++k) {
    const int src = (me - k + n) % n;
    const Seg s = segment(len, n, src);
    if (s.len) post(false, base + s.off * es, s.len * es, src, tag, comm, into);
  }
  const Seg mine = segment(len, n, me);
  if (mine.len)
    for (int k = 1; k < n; ++k) post(true, base + mine.off * es, mine.len * es, (me + k) % n, tag, comm, into);
}

bool MpiBackend::test_all(std::vector<MPI_Request>& r, const char* what, Op& op) {
  if (r.empty()) return true;
  int flag = 0;
  statuses.resize(r.size());
  int rc = MPI_Testall(static_cast<int>(r.size()), r.data(), &flag, statuses.data());
  if (rc != MPI_SUCCESS) {
    int code = rc;
    if (rc == MPI_ERR_IN_STATUS) {
      for (auto& s : statuses)
        if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) code = s.MPI_ERROR;
    }
    throw CommError("group " + name + ": " + what + " of " + describe(op.d, true, &granks) +
                    (is_p2p(op.d.kind) ? "" : " (collective #" + std::to_string(op.d.seq) + ")") +
                    " failed: " + mpi_error_string(code));
  }
  if (flag) r.clear();
  return flag != 0;
}

int MpiBackend::coll_tag(const Op& op, int phase) const {
  const uint64_t mask = (uint64_t(1) << tag_bits) - 1;
  return static_cast<int>(((op.d.seq & mask) << 2) | static_cast<uint64_t>(phase));
}

void MpiBackend::start(Op& op) {
  if (is_p2p(op.d.kind)) {
    const size_t bytes = op.d.count * dtype_size(op.d.dt);
    if (op.d.kind == OpKind::Send)
      post(true, const_cast<void*>(op.sbuf), bytes, op.d.peer, op.d.tag, p2p, op.reqs);
    else
      post(false, op.rbuf, bytes, op.d.peer, op.d.tag, p2p, op.reqs);
    return;
  }
  op.phase = kStart;
}

void MpiBackend::post_fingerprints(Op& op) {
  fp_all.resize(static_cast<size_t>(size));
  MPI_Request r;
  int rc = MPI_Iallgather(&op.fp, sizeof(Fingerprint), MPI_BYTE, fp_all.data(), sizeof(Fingerprint), MPI_BYTE, ctrl,
                          &r);
  if (rc != MPI_SUCCESS) throw CommError("group " + name + ": fingerprint exchange failed: " + mpi_error_string(rc));
  reqs.push_back(r);
}

bool MpiBackend::fingerprints_ready(Op& op) {
  if (!test_all(reqs, "fingerprint exchange", op)) return false;
  op.fps = fp_all;
  return true;
}

// Advances `op`; returns 0 when waiting on MPI, 1 when it moved to a later phase, 2 when done.
int MpiBackend::progress(Op& op) {
  const int n = size, r = rank;
  const size_t es = dtype_size(op.d.dt);
  const OpKind kind = op.d.kind;
  int advanced = 0;
  for (;;) {
    switch (op.phase) {
      case kStart: {
        if (kind == OpKind::Barrier) {
          MPI_Request req;
          int rc = MPI_Ibarrier(coll, &req);
          if (rc != MPI_SUCCESS)
            throw CommError("group " + name + ": MPI_Ibarrier failed: " + mpi_error_string(rc));
          reqs.push_back(req);
          op.phase = kBarrierWait;
          break;
        }
        if (kind == OpKind::Broadcast) {
          const int vr = (r - static_cast<int>(op.d.peer) + n) % n;
          if (vr != 0 && op.d.count) {
            int mask = 1;
            while (!(vr & mask)) mask <<= 1;
            const int parent = (vr - mask + static_cast<int>(op.d.peer)) % n;
            post(false, op.rbuf, op.d.count * es, parent, coll_tag(op, 2), coll, reqs);
          }
          op.phase = kBcRecvWait;
          break;
        }
        if (kind == OpKind::AllToAllV) {  // one message per peer with elements, our own part copied
          const char* send = static_cast<const char*>(op.sbuf);
          char* recv = static_cast<char*>(op.rbuf);
          std::vector<size_t> so(static_cast<size_t>(n)), ro(static_cast<size_t>(n));
          for (int q = 1; q < n; ++q) {
            so[q] = so[q - 1] + op.scounts[q - 1] * es;
            ro[q] = ro[q - 1] + op.rcounts[q - 1] * es;
          }
          if (op.scounts[r]) std::memcpy(recv + ro[r], send + so[r], op.scounts[r] * es);
          for (int k = 1; k < n; ++k) {
            const int src = (r - k + n) % n;
            if (op.rcounts[src]) post(false, recv + ro[src], op.rcounts[src] * es, src, coll_tag(op, 1), coll, reqs);
          }
          for (int k = 1; k < n; ++k) {
            const int dst = (r + k) % n;
            if (op.scounts[dst])
              post(true, const_cast<char*>(send) + so[dst], op.scounts[dst] * es, dst, coll_tag(op, 1), coll, reqs);
          }
          op.phase = kAgWait;
          break;
        }
        if (kind == OpKind::AllGather) {
          char* recv = static_cast<char*>(op.rbuf);
          const size_t part = op.d.count * es;
          if (part && op.sbuf != recv + static_cast<size_t>(r) * part)
            std::memcpy(recv + static_cast<size_t>(r) * part, op.sbuf, part);
          if (part) {
            for (int k = 1; k < n; ++k) {
              const int src = (r - k + n) % n;
              post(false, recv + static_cast<size_t>(src) * part, part, src, coll_tag(op, 1), coll,
                   reqs);
            }
            for (int k = 1; k < n; ++k) {
              const int dst = (r + k) % n;
              post(true, recv + static_cast<size_t>(r) * part, part, dst, coll_tag(op, 1), coll,
                   reqs);
            }
          }
          op.phase = kAgWait;
          break;
        }
        // all_reduce / reduce_scatter: reduce-scatter step of the slice at op.pos.
        const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
        if (kind == OpKind::AllReduce && op.pos == 0 && op.d.count &&
            op.d.count * es <= config().oneshot_bytes && n <= 16) {
          // Small: one round. Every rank sends its whole buffer to every peer and reduces all n
          // in rank order itself (the same inputs in the same order on every rank).
          const size_t bytes = op.d.count * es;
          char* stage =
              static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * bytes));
          for (int k = 1; k < n; ++k) {
            const int src = (r - k + n) % n;
            post(false, stage + (src < r ? src : src - 1) * bytes, bytes, src, coll_tag(op, 3),
                 coll, reqs);
          }
          for (int k = 1; k < n; ++k)
            post(true, op.rbuf, bytes, (r + k) % n, coll_tag(op, 3), coll, reqs);
          op.phase = kOneShotWait;
          break;
        }
        if (kind == OpKind::AllReduce && hier) {
          op.phase = kHStart;
          break;
        }
        if (kind == OpKind::AllReduce) {
          if (op.pos >= op.d.count) return 2;
          op.len = std::min(slice_elems, op.d.count - op.pos);
          const Seg mine = segment(op.len, n, r);
          char* base = static_cast<char*>(op.rbuf) + op.pos * es;
          const size_t slot = mine.len * es;
          char* stage = static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * slot));
          if (slot) {
            for (int k = 1; k < n; ++k) {
              const int src = (r - k + n) % n;
              const int idx = src < r ? src : src - 1;
              post(false, stage + idx * slot, slot, src, coll_tag(op, 0), coll, reqs);
            }
          }
          for (int k = 1; k < n; ++k) {
            const int dst = (r + k) % n;
            const Seg s = segment(op.len, n, dst);
            if (s.len) post(true, base + s.off * es, s.len * es, dst, coll_tag(op, 0), coll, reqs);
          }
        } else {  // reduce_scatter: slice [pos, pos+len) of every segment
          const size_t rc = op.d.count;
          if (op.pos >= rc) return 2;
          const size_t seg_slice = std::max<size_t>(slice_elems / n, 1);
          op.len = std::min(seg_slice, rc - op.pos);
          const size_t slot = op.len * es;
          char* stage = static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * slot));
          const char* send = static_cast<const char*>(op.sbuf);
          for (int k = 1; k < n; ++k) {
            const int src = (r - k + n) % n;
            const int idx = src < r ? src : src - 1;
            post(false, stage + idx * slot, slot, src, coll_tag(op, 0), coll, reqs);
          }
          for (int k = 1; k < n; ++k) {
            const int dst = (r + k) % n;
            post(true, const_cast<char*>(send) + (dst * rc + op.pos) * es, slot, dst,
                 coll_tag(op, 0), coll, reqs);
          }
        }
        op.phase = kRsWait;
        break;
      }

      case kRsWait: {
        if (!test_all(reqs, "reduce-scatter step", op)) return advanced;
        SourceList srcs(n);
        const void** sp = srcs.data;
        const char* stage = static_cast<const char*>(staging);
        if (kind == OpKind::AllReduce) {
          const Seg mine = segment(op.len, n, r);
          char* own = static_cast<char*>(op.rbuf) + (op.pos + mine.off) * es;
          const size_t slot = mine.len * es;
          for (int q = 0; q < n; ++q) sp[q] = q == r ? own : stage + (q < r ? q : q - 1) * slot;
          reduce_into(op.d.dt, op.d.op, n, sp, own, mine.len);
          op.phase = kAgPost;
        } else {
          const size_t rc = op.d.count, slot = op.len * es;
          const char* send = static_cast<const char*>(op.sbuf);
          for (int q = 0; q < n; ++q)
            sp[q] = q == r ? send + (r * rc + op.pos) * es : stage + (q < r ? q : q - 1) * slot;
          reduce_into(op.d.dt, op.d.op, n, sp, static_cast<char*>(op.rbuf) + op.pos * es, op.len);
          op.pos += op.len;
          if (op.pos >= rc) return 2;
          op.phase = kStart;
        }
        advanced = 1;
        break;
      }

      case kAgPost: {  // all_reduce: send the reduced segment to every peer
        post_allgather(static_cast<char*>(op.rbuf) + op.pos * es, op.len, es, n, r, coll_tag(op, 1), coll, reqs);
        op.phase = kAgWait;
        break;
      }

      case kAgWait:
        if (!test_all(reqs, "all-gather step", op)) return advanced;
        if (kind == OpKind::AllGather || kind == OpKind::AllToAllV) return 2;
        op.pos += op.len;
        if (op.pos >= op.d.count) return 2;
        op.phase = kStart;
        advanced = 1;
        break;

      case kBcRecvWait: {
        if (!test_all(reqs, "broadcast receive", op)) return advanced;
        const int root = op.d.peer;
        const int vr = (r - root + n) % n;
        int mask = 1;
        while (mask < n && !(vr & mask)) mask <<= 1;
        for (mask >>= 1; mask > 0; mask >>= 1) {
          if (vr + mask < n && op.d.count)
            post(true, op.rbuf, op.d.count * es, (vr + mask + root) % n, coll_tag(op, 2), coll,
                 reqs);
        }
        op.phase = kBcSendWait;
        advanced = 1;
        break;
      }

      case kBcSendWait:
        if (!test_all(reqs, "broadcast send", op)) return advanced;
        return 2;

      case kBarrierWait:
        if (!test_all(reqs, "barrier", op)) return advanced;
        return 2;

      // Two-level all_reduce, per slice [pos, pos+len): (1) reduce-scatter inside the node: local
      // rank l owns local segment ls; (2) its partial sums (fp32 for floating types, ps bytes
      // each: partial_dtype) are reduce-scattered and all-gathered across nodes among the ranks
      // with local index l (sub-segment ss per node), the final values rounded once; (3) all-gather
      // inside the node.
      case kHStart: {
        if (op.pos >= op.d.count) return 2;
        const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
        op.len = std::min(slice_elems, op.d.count - op.pos);
        const int L = local_n, l = local_r;
        const Seg ls = segment(op.len, L, l);
        const Seg ss = segment(ls.len, nodes_n, node_r);
        const size_t ps = dtype_size(partial_dtype(op.d.dt));
        const size_t a_bytes = static_cast<size_t>(L - 1) * ls.len * es;
        const size_t p_bytes = ls.len * ps;
        const size_t b_bytes = static_cast<size_t>(nodes_n - 1) * ss.len * ps;
        char* stage = static_cast<char*>(ensure_staging(a_bytes + p_bytes + b_bytes));
        char* base = static_cast<char*>(op.rbuf) + op.pos * es;
        if (ls.len) {
          for (int k = 1; k < L; ++k) {
            const int src = (l - k + L) % L;
            post(false, stage + (src < l ? src : src - 1) * ls.len * es, ls.len * es, src,
                 coll_tag(op, 0), intra, reqs);
          }
        }
        for (int k = 1; k < L; ++k) {
          const int dst = (l + k) % L;
          const Seg s2 = segment(op.len, L, dst);
          if (s2.len) post(true, base + s2.off * es, s2.len * es, dst, coll_tag(op, 0), intra, reqs);
        }
        op.phase = kHIntraRsWait;
        break;
      }

      case kHIntraRsWait: {
        if (!test_all(reqs, "intra-node reduce-scatter step", op)) return advanced;
        const int L = local_n, l = local_r, N = nodes_n, k0 = node_r;
        const Seg ls = segment(op.len, L, l);
        const Seg ss = segment(ls.len, N, k0);
        const DType pdt = partial_dtype(op.d.dt);
        const size_t ps = dtype_size(pdt);
        char* stage = static_cast<char*>(staging);
        char* part = stage + static_cast<size_t>(L - 1) * ls.len * es;  // partial sums
        char* recv_part = part + ls.len * ps;
        char* base = static_cast<char*>(op.rbuf) + op.pos * es;
        SourceList srcs(std::max(L, N));
        const void** sp = srcs.data;
        for (int q = 0; q < L; ++q)
          sp[q] = q == l ? base + ls.off * es : stage + (q < l ? q : q - 1) * ls.len * es;
        const ReduceOp partial = op.d.op == ReduceOp::Max ? ReduceOp::Max : ReduceOp::Sum;
        reduce_mixed(op.d.dt, pdt, partial, L, sp, part, ls.len, 1);
        if (ss.len) {
          for (int k = 1; k < N; ++k) {
            const int src = (k0 - k + N) % N;
            post(false, recv_part + (src < k0 ? src : src - 1) * ss.len * ps, ss.len * ps, src,
                 coll_tag(op, 1), inter, reqs);
          }
        }
        for (int k = 1; k < N; ++k) {
          const int dst = (k0 + k) % N;
          const Seg s2 = segment(ls.len, N, dst);
          if (s2.len) post(true, part + s2.off * ps, s2.len * ps, dst, coll_tag(op, 1), inter, reqs);
        }
        op.phase = kHInterRsWait;
        advanced = 1;
        break;
      }

      case kHInterRsWait: {
        if (!test_all(reqs, "inter-node reduce-scatter step", op)) return advanced;
        const int L = local_n, l = local_r, N = nodes_n, k0 = node_r;
        const Seg ls = segment(op.len, L, l);
        const Seg ss = segment(ls.len, N, k0);
        const DType pdt = partial_dtype(op.d.dt);
        const size_t ps = dtype_size(pdt);
        char* part = static_cast<char*>(staging) + static_cast<size_t>(L - 1) * ls.len * es;
        char* recv_part = part + ls.len * ps;
        char* seg = static_cast<char*>(op.rbuf) + (op.pos + ls.off) * es;
        SourceList srcs(N);
        const void** sp = srcs.data;
        for (int q = 0; q < N; ++q)
          sp[q] = q == k0 ? part + ss.off * ps : recv_part + (q < k0 ? q : q - 1) * ss.len * ps;
        reduce_mixed(pdt, op.d.dt, op.d.op, N, sp, seg + ss.off * es, ss.len, n);
        post_allgather(seg, ls.len, es, N, k0, coll_tag(op, 2), inter, reqs);
        op.phase = kHInterAgWait;
        advanced = 1;
        break;
      }

      case kHInterAgWait: {
        if (!test_all(reqs, "inter-node all-gather step", op)) return advanced;
        const int L = local_n, l = local_r;
        post_allgather(static_cast<char*>(op.rbuf) + op.pos * es, op.len, es, L, l, coll_tag(op, 3), intra, reqs);
        op.phase = kHIntraAgWait;
        advanced = 1;
        break;
      }

      case kHIntraAgWait:
        if (!test_all(reqs, "intra-node all-gather step", op)) return advanced;
        op.pos += op.len;
        op.phase = kHStart;
        advanced = 1;
        break;

      case kOneShotWait: {
        if (!test_all(reqs, "all-reduce exchange", op)) return advanced;
        SourceList srcs(n);
        const void** sp = srcs.data;
        const size_t bytes = op.d.count * es;
        const char* stage = static_cast<const char*>(staging);
        for (int q = 0; q < n; ++q) sp[q] = q == r ? op.rbuf : stage + (q < r ? q : q - 1) * bytes;
        reduce_into(op.d.dt, op.d.op, n, sp, op.rbuf, op.d.count);
        return 2;
      }

      default:
        throw CommError("group " + name + ": internal error (phase " + std::to_string(op.phase) +
                        ")");
    }
  }
}

size_t MpiBackend::staging_bytes(const OpDesc& d, int n, int r) {
  if (n <= 1 || d.count == 0) return 0;
  const size_t es = dtype_size(d.dt);
  const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
  if (d.kind == OpKind::AllReduce) {
    if (d.count * es <= config().oneshot_bytes && n <= 16) return static_cast<size_t>(n - 1) * d.count * es;
    const size_t len = std::min(slice_elems, static_cast<size_t>(d.count));
    return static_cast<size_t>(n - 1) * segment(len, n, r).len * es;
  }
  if (d.kind == OpKind::ReduceScatter) {
    const size_t len = std::min(std::max<size_t>(slice_elems / n, 1), static_cast<size_t>(d.count));
    return static_cast<size_t>(n - 1) * len * es;
  }
  return 0;
}

}  // namespace mt::comm::detail
