// A caching block allocator over a raw allocator (cudaMalloc / cudaFree for the CUDA device, see
// runtime/cuda/cuda_device.cpp): freed blocks are kept in bins by size class and handed out again,
// so a training step that allocates the same shapes as the last one makes no raw allocation at all.
//
// Size classes: requests are rounded up to a multiple of 512 bytes below 1 MiB and of 2 MiB from
// 1 MiB up, and a block is reused only for a request of the same class (no splitting, so no
// fragmentation bookkeeping; the rounding bounds the waste). When the raw allocator fails, every
// cached block is returned to it and the request is tried once more.
//
// Streams: each block belongs to the stream it was taken for (take's `stream`, an opaque handle;
// nullptr when the owner has one stream). Work queued on the owning stream is ordered, so a block
// freed by the host and handed out again for the same stream is only touched by work queued after
// the work that used it. A block that another stream also used (record_use, like PyTorch's
// record_stream) is not reusable when it is freed: give() records one event per such stream (the
// EventOps), and the block stays pending until every one of them has completed; only then does it
// go back to its bin. A block is handed out only for its own stream. Without EventOps,
// record_use() throws.
// Not thread-safe by itself: the owner holds a lock.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace mt {

class BlockCache {
 public:
  // raw_alloc returns nullptr when out of memory; raw_free gets only pointers raw_alloc returned.
  using RawAlloc = std::function<void*(size_t bytes)>;
  using RawFree = std::function<void(void* p)>;
  // Events on the owner's streams: record(stream) returns a new event recorded on `stream` after
  // the work queued so far; done(event) says whether it has completed (without waiting);
  // destroy(event) frees it.
  struct EventOps {
    std::function<void*(void* stream)> record;
    std::function<bool(void* event)> done;
    std::function<void(void* event)> destroy;
  };
  BlockCache(std::string name, RawAlloc raw_alloc, RawFree raw_free);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  void set_event_ops(EventOps ops) { events_ = std::move(ops); }

  // The size class of a request (what a block for it occupies).
  static size_t size_class(size_t bytes);

  // A block of at least `bytes` (0 is treated as 1) for work on `stream`; throws
  // std::runtime_error naming the device and the sizes when the raw allocator fails even after the
  // cache was emptied.
  void* take(size_t bytes, void* stream = nullptr);
  // Work on `stream` uses the live block that contains p (any address inside it); does nothing
  // for the block's own stream or for a pointer outside every live block (memory this cache does
  // not manage).
  void record_use(const void* p, void* stream);
  // Returns a block from take(bytes) (the same byte count) to the cache: at once when only its own
  // stream used it, else once the events of the other streams have completed. Throws on a pointer
  // this cache did not hand out or a byte count of another size class (double free, wrong size).
  void give(void* p, size_t bytes);
  // Hands every cached block back to the raw allocator (pending blocks whose events have not
  // completed stay).
  void release();

  int64_t cached_bytes() const { return cached_; }       // free blocks held, pending ones included
  int64_t pending_bytes() const { return pending_bytes_; }  // freed, waiting for other streams' events
  int64_t reserved_bytes() const { return reserved_; }   // obtained from the raw allocator, in total
  int64_t in_use_bytes() const { return reserved_ - cached_; }
  int64_t raw_allocations() const { return raw_allocs_; }  // calls to raw_alloc that succeeded
  int64_t raw_frees() const { return raw_frees_; }

 private:
  struct Live {
    size_t sc;
    void* stream;
    std::vector<void*> users;  // other streams that used it (record_use)
  };
  struct Free {
    void* p;
    void* stream;
  };
  struct Pending {
    void* p;
    size_t sc;
    void* stream;
    std::vector<void*> events;
  };
  // Moves pending blocks whose events have all completed to their bins.
  void collect_pending();
  std::string name_;
  RawAlloc raw_alloc_;
  RawFree raw_free_;
  EventOps events_;
  std::unordered_map<size_t, std::vector<Free>> free_;  // size class -> free blocks
  std::map<const void*, Live> live_;                    // handed-out block -> its class and streams
  std::vector<Pending> pending_;
  int64_t cached_ = 0, pending_bytes_ = 0, reserved_ = 0, raw_allocs_ = 0, raw_frees_ = 0;
};

}  // namespace mt
