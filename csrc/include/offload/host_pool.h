// The pinned host-memory pool.
//
// Blocks are carved from slabs (host_memory.h) by size class and cached on free
// lists. Small requests round up to a power of two; requests above 1 MiB round
// up to 2 MiB only, so 1.25 GiB costs 1.25 GiB (PyTorch's pinned cache rounds it
// to 2 GiB). A block handed out lives in a tensor whose deleter gives it back;
// it returns to a free list only once every event recorded on it (the copies
// that read or wrote it) has completed, so reuse never corrupts data in flight.
// All methods are thread-safe.
#pragma once

#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "offload/event_cache.h"

namespace offload {

struct HostPoolStats {
  size_t reserved_bytes = 0;     // held in slabs
  size_t in_use_bytes = 0;       // handed out (by size class) and not yet returned
  size_t peak_in_use_bytes = 0;
  size_t free_bytes = 0;         // on free lists, ready for reuse
  size_t pending_blocks = 0;     // returned but waiting for their copies to finish
  size_t limit_bytes = 0;        // 0: no limit
  uint64_t requests = 0;
  uint64_t cache_hits = 0;
  uint64_t slabs = 0;
  uint64_t recycled_slabs = 0;  // wholly free slabs cut afresh for other sizes instead of growing
  double allocation_seconds = 0;    // allocating and touching slabs
  double registration_seconds = 0;  // pinning slabs with the driver
};

class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  static std::shared_ptr<HostPool> create(c10::DeviceType device_type, size_t limit_bytes, size_t slab_bytes,
                                          int touch_threads);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A uint8 host tensor of `nbytes` bytes backed by a pooled block.
  at::Tensor allocate(size_t nbytes);
  // The block under `tensor` is not reused before `stream` reaches this point.
  // Returns false when `tensor` is not from this pool. `at`: an event the caller
  // recorded on `stream` at this point (a copy's completion), kept instead of
  // recording another.
  bool record_stream(const at::Tensor& tensor, const c10::Stream& stream, const SharedEvent& at = nullptr);
  bool owns(const at::Tensor& tensor) const;
  // Grows the pool so that `nbytes` more can be carved without growing later.
  void reserve(size_t nbytes);
  // reserve() in two steps, for a growth another thread runs while this one
  // allocates (the stager's first save): begin_reserve() announces it and returns
  // the bytes to grow (0: none); from then on an allocation that finds no room
  // waits for the next of its slabs instead of growing beside it. grow_reserved()
  // then grows them, slab by slab, touching the next while the driver pins the
  // current one; an error ends the reservation (waiting allocations then grow
  // the pool themselves) and is raised. Each begin_reserve() that returned
  // bytes needs exactly one grow_reserved(bytes) or cancel_reserve(bytes).
  // `largest_block`: the largest request expected, so no slab is smaller.
  size_t begin_reserve(size_t nbytes, size_t largest_block = 0);
  void grow_reserved(size_t bytes);
  void cancel_reserve(size_t bytes);
  size_t trim();
  // Counts a block whose recorded copies have completed as free (it polls their events).
  HostPoolStats stats();
  bool pinned() const { return pinner_ != nullptr; }
  c10::DeviceType device_type() const { return device_type_; }
  size_t limit() const;
  void set_limit(size_t limit_bytes);

  static size_t size_class(size_t nbytes);

 private:
  struct Slab;
  struct Block {
    char* ptr = nullptr;
    size_t size = 0;
    Slab* slab = nullptr;
    bool handed_out = false;
    bool pending = false;
    // One event per stream that used the block (the stream with its device: a
    // stream id is unique only per device); replaced by the later one on reuse of the
    // stream, because later work on one stream implies the earlier work.
    std::vector<std::pair<c10::Stream, SharedEvent>> events;
  };
  struct Slab {
    char* base = nullptr;
    size_t bytes = 0;
    size_t carved = 0;  // bump pointer: bytes already cut into blocks
    size_t live = 0;    // blocks handed out or pending
    std::vector<std::unique_ptr<Block>> blocks;
  };

  HostPool(c10::DeviceType device_type, size_t limit_bytes, size_t slab_bytes, int touch_threads);
  void release(Block* block);
  Block* find_free_locked(size_t cls);
  Block* carve_locked(size_t cls, size_t nbytes);
  Slab* grow_locked(size_t bytes);
  // Adds a touched (and pinned) slab to the pool; part of a reservation.
  Slab* add_slab_locked(char* base, size_t bytes);
  bool has_room_locked(size_t cls) const;
  // allocate(): while a reservation is being grown, waits for room for `cls`.
  void wait_for_reserve_locked(std::unique_lock<std::mutex>& lock, size_t cls);
  void process_pending_locked(bool wait);
  size_t trim_locked();
  // A wholly free slab of at least `cls` bytes, its cached blocks dropped, to carve
  // from instead of growing; nullptr if none.
  Slab* recycle_locked(size_t cls);
  // Drops every block of `slab` from the free lists and the address map.
  void forget_blocks_locked(Slab* slab);
  Block* block_of_locked(const void* ptr) const;
  [[noreturn]] void fail_limit_locked(size_t nbytes, size_t cls) const;

  const c10::DeviceType device_type_;
  const size_t slab_bytes_;
  const int touch_threads_;
  class HostMemoryPinner* const pinner_;

  mutable std::mutex mutex_;
  size_t limit_bytes_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  Slab* current_ = nullptr;  // the slab new blocks are carved from
  std::map<size_t, std::vector<Block*>> free_;  // by size class
  std::deque<Block*> pending_;
  std::map<uintptr_t, Block*> by_address_;  // every carved block, for record_stream
  HostPoolStats stats_;
  size_t reserving_ = 0;      // bytes begin_reserve() announced that are not in slabs yet
  size_t reserve_slab_ = 0;   // the size of those slabs: larger requests do not wait for them
  std::condition_variable grown_;  // a reserved slab was added, or the reservation ended
};

}  // namespace offload
