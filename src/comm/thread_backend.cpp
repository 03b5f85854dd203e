// The thread backend: a group's ranks are threads of one process (see detail.h, ThreadBackend).
//
// The members agree on what collective s is before it starts (the front end's desync check, whose
// fingerprints this backend exchanges in shared memory before every collective).
//
// A collective of sequence number s: each member's communication thread registers its buffers
// (start), waits until every member has (progress, phase 0), computes its own output from all
// inputs into a private buffer, waits until every member has computed (phase 1: until then others
// may still read its inputs), then writes the output and leaves; the last to leave forgets s.
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "comm/detail.h"

namespace mt::comm {
namespace detail {

struct ThreadShared {
  struct Slot {
    OpDesc d;
    const void* sbuf = nullptr;
    void* rbuf = nullptr;
    const std::vector<size_t>* scounts = nullptr;  // all_to_all_v
  };
  struct Collective {
    std::vector<Slot> slots;
    int arrived = 0, computed = 0, left = 0;
  };
  explicit ThreadShared(std::string n, int size) : name(std::move(n)), size(size) {}
  std::string name;
  int size;
  std::mutex mu;
  struct Fingerprints {  // the desync check's exchange of one collective
    std::vector<Fingerprint> fps;
    int posted = 0, read = 0;
  };
  std::map<uint64_t, Collective> colls;                                       // by sequence number
  std::map<uint64_t, Fingerprints> fingerprints;                             // by sequence number
  std::map<std::tuple<int, int, int>, std::vector<std::vector<unsigned char>>> mail;  // (src, dst, tag)
};

namespace {
enum : int { kArrive = 0, kCompute = 1, kWrite = 2 };

size_t out_bytes(const OpDesc& d, int n) {
  const size_t b = d.count * dtype_size(d.dt);
  return d.kind == OpKind::AllGather ? b * static_cast<size_t>(n) : b;
}
}  // namespace

void ThreadBackend::post_fingerprints(Op& op) {
  std::lock_guard<std::mutex> lk(shared_->mu);
  ThreadShared::Fingerprints& f = shared_->fingerprints[op.d.seq];
  if (f.fps.empty()) f.fps.resize(static_cast<size_t>(size));
  f.fps[static_cast<size_t>(rank)] = op.fp;
  ++f.posted;
}

bool ThreadBackend::fingerprints_ready(Op& op) {
  std::lock_guard<std::mutex> lk(shared_->mu);
  auto it = shared_->fingerprints.find(op.d.seq);
  if (it == shared_->fingerprints.end() || it->second.posted < size) return false;
  op.fps = it->second.fps;
  if (++it->second.read == size) shared_->fingerprints.erase(it);
  return true;
}

void ThreadBackend::start(Op& op) {
  std::lock_guard<std::mutex> lk(shared_->mu);
  if (is_p2p(op.d.kind)) {
    if (op.d.kind == OpKind::Send) {
      const auto* p = static_cast<const unsigned char*>(op.sbuf);
      shared_->mail[{rank, op.d.peer, op.d.tag}].emplace_back(p, p + op.d.count * dtype_size(op.d.dt));
    }
    return;
  }
  ThreadShared::Collective& c = shared_->colls[op.d.seq];
  if (c.slots.empty()) c.slots.resize(static_cast<size_t>(size));
  c.slots[static_cast<size_t>(rank)] = {op.d, op.sbuf, op.rbuf, &op.scounts};
  ++c.arrived;
  op.phase = kArrive;
}

bool ThreadBackend::p2p_done(Op& op) {
  if (op.d.kind == OpKind::Send) return true;  // copied into the mailbox at start
  std::vector<unsigned char> msg;
  {
    std::lock_guard<std::mutex> lk(shared_->mu);
    auto it = shared_->mail.find({op.d.peer, rank, op.d.tag});
    if (it == shared_->mail.end() || it->second.empty()) return false;
    msg = std::move(it->second.front());
    it->second.erase(it->second.begin());
  }
  const size_t want = op.d.count * dtype_size(op.d.dt);
  if (msg.size() != want)
    throw CommError("group " + shared_->name + ": recv of " + std::to_string(want) + " bytes from rank " +
                    std::to_string(op.d.peer) + " tag " + std::to_string(op.d.tag) + " matched a send of " +
                    std::to_string(msg.size()) + " bytes");
  if (want) std::memcpy(op.rbuf, msg.data(), want);
  return true;
}

int ThreadBackend::progress(Op& op) {
  const int n = size;
  if (op.phase == kArrive) {
    std::vector<ThreadShared::Slot> slots;
    {
      std::lock_guard<std::mutex> lk(shared_->mu);
      ThreadShared::Collective& c = shared_->colls[op.d.seq];
      if (c.arrived < n) return 0;
      slots = c.slots;
    }
    const size_t es = dtype_size(op.d.dt), len = op.d.count;
    result_.resize(out_bytes(op.d, n));
    std::vector<const void*> srcs(static_cast<size_t>(n));
    switch (op.d.kind) {
      case OpKind::AllReduce:
        for (int q = 0; q < n; ++q) srcs[static_cast<size_t>(q)] = slots[static_cast<size_t>(q)].rbuf;
        if (len) reduce_into(op.d.dt, op.d.op, n, srcs.data(), result_.data(), len);
        break;
      case OpKind::ReduceScatter:
        for (int q = 0; q < n; ++q)
          srcs[static_cast<size_t>(q)] =
              static_cast<const char*>(slots[static_cast<size_t>(q)].sbuf) + static_cast<size_t>(rank) * len * es;
        if (len) reduce_into(op.d.dt, op.d.op, n, srcs.data(), result_.data(), len);
        break;
      case OpKind::AllGather:
        for (int q = 0; q < n; ++q)
          if (len) std::memcpy(result_.data() + static_cast<size_t>(q) * len * es, slots[static_cast<size_t>(q)].sbuf, len * es);
        break;
      case OpKind::Broadcast:
        if (len) std::memcpy(result_.data(), slots[static_cast<size_t>(op.d.peer)].rbuf, len * es);
        break;
      case OpKind::AllToAllV: {  // each member's part for this rank, in member order
        result_.clear();
        for (int q = 0; q < n; ++q) {
          const std::vector<size_t>& sc = *slots[static_cast<size_t>(q)].scounts;
          size_t off = 0;
          for (int j = 0; j < rank; ++j) off += sc[static_cast<size_t>(j)];
          const size_t m = sc[static_cast<size_t>(rank)];
          if (m != op.rcounts[static_cast<size_t>(q)])
            throw CommError("group " + shared_->name + ": all_to_all_v: rank " + std::to_string(q) + " sends " +
                            std::to_string(m) + " elements to rank " + std::to_string(rank) + ", which expects " +
                            std::to_string(op.rcounts[static_cast<size_t>(q)]));
          const auto* p = static_cast<const unsigned char*>(slots[static_cast<size_t>(q)].sbuf) + off * es;
          result_.insert(result_.end(), p, p + m * es);
        }
        break;
      }
      default:  // barrier
        break;
    }
    std::lock_guard<std::mutex> lk(shared_->mu);
    ++shared_->colls[op.d.seq].computed;
    op.phase = kCompute;
  }
  if (op.phase == kCompute) {
    {
      std::lock_guard<std::mutex> lk(shared_->mu);
      if (shared_->colls[op.d.seq].computed < n) return 0;
    }
    if (!result_.empty() && op.d.kind != OpKind::Barrier) std::memcpy(op.rbuf, result_.data(), result_.size());
    std::lock_guard<std::mutex> lk(shared_->mu);
    if (++shared_->colls[op.d.seq].left == n) shared_->colls.erase(op.d.seq);
    op.phase = kWrite;
  }
  return 2;
}

}  // namespace detail

std::vector<std::shared_ptr<ProcessGroup>> make_thread_group(const std::string& name, int n) {
  if (n < 1) throw CommError("make_thread_group: n must be >= 1");
  auto shared = std::make_shared<detail::ThreadShared>(name, n);
  std::vector<int> granks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) granks[static_cast<size_t>(r)] = r;
  std::vector<std::shared_ptr<ProcessGroup>> out;
  for (int r = 0; r < n; ++r) {
    auto impl = std::make_shared<detail::GroupImpl>(name, detail::next_group_uid(), r, granks,
                                                    std::make_unique<detail::ThreadBackend>(shared, r, n));
    detail::register_group(impl);
    out.push_back(std::make_shared<ProcessGroup>(impl));
  }
  return out;
}

}  // namespace mt::comm
