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
  // Collective over the group, like the set-up above.
  const int fake = config().fake_node_size;
  if (fake > 0) {
    node_local_ = true;
    for (int g : granks) node_local_ = node_local_ && g / fake == granks[0] / fake;
  } else {
    MPI_Comm shm = MPI_COMM_NULL;
    int n = 0;
    if (MPI_Comm_split_type(coll, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shm) == MPI_SUCCESS &&
        shm != MPI_COMM_NULL) {
      MPI_Comm_size(shm, &n);
      MPI_Comm_free(&shm);
    }
    node_local_ = n == size;
  }
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

namespace {
// Slot of rank q in a staging buffer packed in rank order without rank `me`.
char* packed(char* stage, size_t slot, int me, int q) { return stage + (q < me ? q : q - 1) * slot; }
}  // namespace

template <class RecvBlock, class SendBlock>
void MpiBackend::post_exchange(int n, int me, int tag, MPI_Comm comm, RecvBlock recv_block, SendBlock send_block) {
  for (int k = 1; k < n; ++k) {
    const int src = (me - k + n) % n;
    const Block b = recv_block(src);
    if (b.bytes) post(false, b.p, b.bytes, src, tag, comm, reqs);
  }
  for (int k = 1; k < n; ++k) {
    const int dst = (me + k) % n;
    const Block b = send_block(dst);
    if (b.bytes) post(true, b.p, b.bytes, dst, tag, comm, reqs);
  }
}

void MpiBackend::post_allgather(char* base, size_t len, size_t es, int n, int me, int tag, MPI_Comm comm) {
  const Seg mine = segment(len, n, me);
  post_exchange(
      n, me, tag, comm,
      [&](int src) {
        const Seg s = segment(len, n, src);
        return Block{base + s.off * es, s.len * es};
      },
      [&](int) { return Block{base + mine.off * es, mine.len * es}; });
}

void MpiBackend::post_reduce_scatter(char* base, size_t len, size_t es, char* stage, size_t slot, int n, int me,
                                     int tag, MPI_Comm comm) {
  post_exchange(
      n, me, tag, comm, [&](int src) { return Block{packed(stage, slot, me, src), slot}; },
      [&](int dst) {
        const Seg s = segment(len, n, dst);
        return Block{base + s.off * es, s.len * es};
      });
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
  int advanced = 0;
  for (;;) {
    switch (step(op)) {
      case Step::Posted: break;
      case Step::Advanced: advanced = 1; break;
      case Step::Waiting: return advanced;
      case Step::Done: return 2;
    }
  }
}

MpiBackend::Step MpiBackend::step(Op& op) {
  const OpKind kind = op.d.kind;
  switch (op.phase) {
    case kStart:
      if (kind == OpKind::Barrier) return start_barrier(op);
      if (kind == OpKind::Broadcast) return start_broadcast(op);
      if (kind == OpKind::AllToAllV) return start_all_to_all(op);
      if (kind == OpKind::AllGather) return start_all_gather(op);
      if (kind == OpKind::AllReduce && op.pos == 0 && op.d.count &&
          op.d.count * dtype_size(op.d.dt) <= config().oneshot_bytes && size <= 16)
        return start_one_shot(op);
      if (kind == OpKind::AllReduce && hier) {
        op.phase = kHStart;
        return Step::Posted;
      }
      if (kind == OpKind::AllReduce) return start_all_reduce_slice(op);
      return start_reduce_scatter_slice(op);
    case kRsWait:
      return when_done(op, "reduce-scatter step", &MpiBackend::reduce_own_segment);
    case kAgPost:  // all_reduce: send the reduced segment to every peer
      post_allgather(static_cast<char*>(op.rbuf) + op.pos * dtype_size(op.d.dt), op.len, dtype_size(op.d.dt), size,
                     rank, coll_tag(op, 1), coll);
      op.phase = kAgWait;
      return Step::Posted;
    case kAgWait:
      if (!test_all(reqs, "all-gather step", op)) return Step::Waiting;
      if (kind == OpKind::AllGather || kind == OpKind::AllToAllV) return Step::Done;
      op.pos += op.len;
      if (op.pos >= op.d.count) return Step::Done;
      op.phase = kStart;
      return Step::Advanced;
    case kBcRecvWait:
      return when_done(op, "broadcast receive", &MpiBackend::forward_broadcast);
    case kBcSendWait:
      return test_all(reqs, "broadcast send", op) ? Step::Done : Step::Waiting;
    case kBarrierWait:
      return test_all(reqs, "barrier", op) ? Step::Done : Step::Waiting;
    case kOneShotWait:
      return when_done(op, "all-reduce exchange", &MpiBackend::finish_one_shot);
    case kHStart:
      return start_two_level_slice(op);
    case kHIntraRsWait:
      return when_done(op, "intra-node reduce-scatter step", &MpiBackend::reduce_inside_node);
    case kHInterRsWait:
      return when_done(op, "inter-node reduce-scatter step", &MpiBackend::reduce_across_nodes);
    case kHInterAgWait:
      return when_done(op, "inter-node all-gather step", &MpiBackend::gather_inside_node);
    case kHIntraAgWait:
      if (!test_all(reqs, "intra-node all-gather step", op)) return Step::Waiting;
      op.pos += op.len;
      op.phase = kHStart;
      return Step::Advanced;
    default:
      throw CommError("group " + name + ": internal error (phase " + std::to_string(op.phase) + ")");
  }
}

MpiBackend::Step MpiBackend::when_done(Op& op, const char* what, Step (MpiBackend::*next)(Op&)) {
  if (!test_all(reqs, what, op)) return Step::Waiting;
  return (this->*next)(op);
}

MpiBackend::Step MpiBackend::start_barrier(Op& op) {
  MPI_Request req;
  int rc = MPI_Ibarrier(coll, &req);
  if (rc != MPI_SUCCESS) throw CommError("group " + name + ": MPI_Ibarrier failed: " + mpi_error_string(rc));
  reqs.push_back(req);
  op.phase = kBarrierWait;
  return Step::Posted;
}

// Binomial tree from the root: receive from the parent here, forward_broadcast() sends on.
MpiBackend::Step MpiBackend::start_broadcast(Op& op) {
  const int n = size;
  const int vr = (rank - static_cast<int>(op.d.peer) + n) % n;
  if (vr != 0 && op.d.count) {
    int mask = 1;
    while (!(vr & mask)) mask <<= 1;
    const int parent = (vr - mask + static_cast<int>(op.d.peer)) % n;
    post(false, op.rbuf, op.d.count * dtype_size(op.d.dt), parent, coll_tag(op, 2), coll, reqs);
  }
  op.phase = kBcRecvWait;
  return Step::Posted;
}

MpiBackend::Step MpiBackend::forward_broadcast(Op& op) {
  const int n = size, root = op.d.peer;
  const int vr = (rank - root + n) % n;
  int mask = 1;
  while (mask < n && !(vr & mask)) mask <<= 1;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < n && op.d.count)
      post(true, op.rbuf, op.d.count * dtype_size(op.d.dt), (vr + mask + root) % n, coll_tag(op, 2), coll, reqs);
  }
  op.phase = kBcSendWait;
  return Step::Advanced;
}

// One message per peer with elements, our own part copied.
MpiBackend::Step MpiBackend::start_all_to_all(Op& op) {
  const int n = size, r = rank;
  const size_t es = dtype_size(op.d.dt);
  char* send = const_cast<char*>(static_cast<const char*>(op.sbuf));
  char* recv = static_cast<char*>(op.rbuf);
  std::vector<size_t> so(static_cast<size_t>(n)), ro(static_cast<size_t>(n));
  for (int q = 1; q < n; ++q) {
    so[q] = so[q - 1] + op.scounts[q - 1] * es;
    ro[q] = ro[q - 1] + op.rcounts[q - 1] * es;
  }
  if (op.scounts[r]) std::memcpy(recv + ro[r], send + so[r], op.scounts[r] * es);
  post_exchange(
      n, r, coll_tag(op, 1), coll, [&](int src) { return Block{recv + ro[src], op.rcounts[src] * es}; },
      [&](int dst) { return Block{send + so[dst], op.scounts[dst] * es}; });
  op.phase = kAgWait;
  return Step::Posted;
}

MpiBackend::Step MpiBackend::start_all_gather(Op& op) {
  const int r = rank;
  char* recv = static_cast<char*>(op.rbuf);
  const size_t part = op.d.count * dtype_size(op.d.dt);
  char* own = recv + static_cast<size_t>(r) * part;
  if (part && op.sbuf != own) std::memcpy(own, op.sbuf, part);
  post_exchange(
      size, r, coll_tag(op, 1), coll, [&](int src) { return Block{recv + static_cast<size_t>(src) * part, part}; },
      [&](int) { return Block{own, part}; });
  op.phase = kAgWait;
  return Step::Posted;
}

// Small all_reduce: one round. Every rank sends its whole buffer to every peer and reduces all n
// in rank order itself (the same inputs in the same order on every rank).
MpiBackend::Step MpiBackend::start_one_shot(Op& op) {
  const int n = size, r = rank;
  const size_t bytes = op.d.count * dtype_size(op.d.dt);
  char* stage = static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * bytes));
  post_exchange(
      n, r, coll_tag(op, 3), coll, [&](int src) { return Block{packed(stage, bytes, r, src), bytes}; },
      [&](int) { return Block{static_cast<char*>(op.rbuf), bytes}; });
  op.phase = kOneShotWait;
  return Step::Posted;
}

MpiBackend::Step MpiBackend::finish_one_shot(Op& op) {
  const int n = size, r = rank;
  SourceList srcs(n);
  const void** sp = srcs.data;
  const size_t bytes = op.d.count * dtype_size(op.d.dt);
  char* stage = static_cast<char*>(staging);
  for (int q = 0; q < n; ++q) sp[q] = q == r ? op.rbuf : packed(stage, bytes, r, q);
  reduce_into(op.d.dt, op.d.op, n, sp, op.rbuf, op.d.count);
  return Step::Done;
}

// all_reduce: the reduce-scatter step of the slice at op.pos.
MpiBackend::Step MpiBackend::start_all_reduce_slice(Op& op) {
  const int n = size;
  const size_t es = dtype_size(op.d.dt);
  if (op.pos >= op.d.count) return Step::Done;
  const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
  op.len = std::min(slice_elems, op.d.count - op.pos);
  const size_t slot = segment(op.len, n, rank).len * es;
  char* stage = static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * slot));
  post_reduce_scatter(static_cast<char*>(op.rbuf) + op.pos * es, op.len, es, stage, slot, n, rank, coll_tag(op, 0),
                      coll);
  op.phase = kRsWait;
  return Step::Posted;
}

// reduce_scatter: slice [pos, pos+len) of every segment.
MpiBackend::Step MpiBackend::start_reduce_scatter_slice(Op& op) {
  const int n = size, r = rank;
  const size_t es = dtype_size(op.d.dt);
  const size_t rc = op.d.count;
  if (op.pos >= rc) return Step::Done;
  const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(n));
  const size_t seg_slice = std::max<size_t>(slice_elems / n, 1);
  op.len = std::min(seg_slice, rc - op.pos);
  const size_t slot = op.len * es;
  char* stage = static_cast<char*>(ensure_staging(static_cast<size_t>(n - 1) * slot));
  char* send = const_cast<char*>(static_cast<const char*>(op.sbuf));
  post_exchange(
      n, r, coll_tag(op, 0), coll, [&](int src) { return Block{packed(stage, slot, r, src), slot}; },
      [&](int dst) { return Block{send + (dst * rc + op.pos) * es, slot}; });
  op.phase = kRsWait;
  return Step::Posted;
}

// The reduce-scatter step's contributions have arrived: reduce them in rank order.
MpiBackend::Step MpiBackend::reduce_own_segment(Op& op) {
  const int n = size, r = rank;
  const size_t es = dtype_size(op.d.dt);
  SourceList srcs(n);
  const void** sp = srcs.data;
  char* stage = static_cast<char*>(staging);
  if (op.d.kind == OpKind::AllReduce) {
    const Seg mine = segment(op.len, n, r);
    char* own = static_cast<char*>(op.rbuf) + (op.pos + mine.off) * es;
    const size_t slot = mine.len * es;
    for (int q = 0; q < n; ++q) sp[q] = q == r ? own : packed(stage, slot, r, q);
    reduce_into(op.d.dt, op.d.op, n, sp, own, mine.len);
    op.phase = kAgPost;
  } else {
    const size_t rc = op.d.count, slot = op.len * es;
    const char* send = static_cast<const char*>(op.sbuf);
    for (int q = 0; q < n; ++q) sp[q] = q == r ? send + (r * rc + op.pos) * es : packed(stage, slot, r, q);
    reduce_into(op.d.dt, op.d.op, n, sp, static_cast<char*>(op.rbuf) + op.pos * es, op.len);
    op.pos += op.len;
    if (op.pos >= rc) return Step::Done;
    op.phase = kStart;
  }
  return Step::Advanced;
}

// Two-level all_reduce, per slice [pos, pos+len): (1) reduce-scatter inside the node: local rank l
// owns local segment ls; (2) its partial sums (fp32 for floating types, the integer type itself
// for integers: partial_dtype) are reduce-scattered and all-gathered across nodes among the ranks
// with local index l (sub-segment ss per node), the final values rounded once; (3) all-gather
// inside the node. Staging: the node peers' contributions, then the partial sums of ls, then the
// other nodes' contributions to ss.
MpiBackend::Step MpiBackend::start_two_level_slice(Op& op) {
  if (op.pos >= op.d.count) return Step::Done;
  const size_t es = dtype_size(op.d.dt);
  const size_t slice_elems = std::max<size_t>(config().slice_bytes / es, size_t(size));
  op.len = std::min(slice_elems, op.d.count - op.pos);
  const int L = local_n, l = local_r;
  const Seg ls = segment(op.len, L, l);
  const Seg ss = segment(ls.len, nodes_n, node_r);
  const size_t ps = dtype_size(partial_dtype(op.d.dt));
  const size_t a_bytes = static_cast<size_t>(L - 1) * ls.len * es;
  const size_t p_bytes = ls.len * ps;
  const size_t b_bytes = static_cast<size_t>(nodes_n - 1) * ss.len * ps;
  char* stage = static_cast<char*>(ensure_staging(a_bytes + p_bytes + b_bytes));
  post_reduce_scatter(static_cast<char*>(op.rbuf) + op.pos * es, op.len, es, stage, ls.len * es, L, l,
                      coll_tag(op, 0), intra);
  op.phase = kHIntraRsWait;
  return Step::Posted;
}

MpiBackend::TwoLevelSlice MpiBackend::two_level_slice(const Op& op) const {
  TwoLevelSlice t;
  t.es = dtype_size(op.d.dt);
  t.ls = segment(op.len, local_n, local_r);
  t.ss = segment(t.ls.len, nodes_n, node_r);
  t.part = static_cast<char*>(staging) + static_cast<size_t>(local_n - 1) * t.ls.len * t.es;
  t.pdt = partial_dtype(op.d.dt);
  t.ps = dtype_size(t.pdt);
  t.recv_part = t.part + t.ls.len * t.ps;
  return t;
}

MpiBackend::Step MpiBackend::reduce_inside_node(Op& op) {
  const TwoLevelSlice t = two_level_slice(op);
  const size_t es = t.es;
  const int L = local_n, l = local_r, N = nodes_n;
  char* stage = static_cast<char*>(staging);
  char* base = static_cast<char*>(op.rbuf) + op.pos * es;
  SourceList srcs(std::max(L, N));
  const void** sp = srcs.data;
  for (int q = 0; q < L; ++q) sp[q] = q == l ? base + t.ls.off * es : packed(stage, t.ls.len * es, l, q);
  const ReduceOp partial = op.d.op == ReduceOp::Max ? ReduceOp::Max : ReduceOp::Sum;
  reduce_mixed(op.d.dt, t.pdt, partial, L, sp, t.part, t.ls.len, 1);
  post_reduce_scatter(t.part, t.ls.len, t.ps, t.recv_part, t.ss.len * t.ps, N, node_r, coll_tag(op, 1), inter);
  op.phase = kHInterRsWait;
  return Step::Advanced;
}

MpiBackend::Step MpiBackend::reduce_across_nodes(Op& op) {
  const TwoLevelSlice t = two_level_slice(op);
  const size_t es = t.es;
  const int N = nodes_n, k0 = node_r;
  char* seg = static_cast<char*>(op.rbuf) + (op.pos + t.ls.off) * es;
  SourceList srcs(N);
  const void** sp = srcs.data;
  for (int q = 0; q < N; ++q)
    sp[q] = q == k0 ? t.part + t.ss.off * t.ps : packed(t.recv_part, t.ss.len * t.ps, k0, q);
  reduce_mixed(t.pdt, op.d.dt, op.d.op, N, sp, seg + t.ss.off * es, t.ss.len, size);
  post_allgather(seg, t.ls.len, es, N, k0, coll_tag(op, 2), inter);
  op.phase = kHInterAgWait;
  return Step::Advanced;
}

MpiBackend::Step MpiBackend::gather_inside_node(Op& op) {
  const size_t es = dtype_size(op.d.dt);
  post_allgather(static_cast<char*>(op.rbuf) + op.pos * es, op.len, es, local_n, local_r, coll_tag(op, 3), intra);
  op.phase = kHIntraAgWait;
  return Step::Advanced;
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
