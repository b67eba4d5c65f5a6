// The pinned host pool (include/offload/host_pool.h): size classes, free lists,
// slabs and the events that hold a returned block back until its copies end.
//
// Hands out: uint8 host tensors over blocks carved from slabs (host_memory.cpp),
// each 512-byte aligned at least. Layout: a slab is one contiguous, pinned (where
// the backend can pin) range; blocks are carved from it by a bump pointer and never
// split or merged again, only cached by size class or dropped with their slab when
// the slab is wholly free (trim, recycle). Limits: limit_bytes caps the bytes held
// in slabs (0: none); a block serves only its own class, or a large class at most
// 1/8 larger. Thread-safe: one mutex guards the pool's state; slabs are touched
// and pinned outside it where a reservation grows the pool (grow_reserved).
#include "offload/host_pool.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "offload/checks.h"
#include "offload/event_cache.h"
#include "offload/host_memory.h"

namespace offload {
namespace {

constexpr size_t kMinBlock = 512;                 // keeps every block 16-byte aligned for vector copies
constexpr size_t kSmallLimit = size_t(1) << 20;   // up to here: power-of-two classes
constexpr size_t kLargeGranule = size_t(2) << 20; // above: 2 MiB steps (a huge page)

size_t round_up(size_t value, size_t granule) { return (value + granule - 1) / granule * granule; }

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

size_t HostPool::size_class(size_t nbytes) {
  if (nbytes <= kMinBlock) return kMinBlock;
  if (nbytes <= kSmallLimit) {
    size_t cls = kMinBlock;
    while (cls < nbytes) cls <<= 1;
    return cls;
  }
  return round_up(nbytes, kLargeGranule);
}

std::shared_ptr<HostPool> HostPool::create(c10::DeviceType device_type, size_t limit_bytes, size_t slab_bytes,
                                           int touch_threads) {
  TORCH_CHECK_VALUE(slab_bytes > 0, "offload.HostPool: slab_bytes must be > 0, got 0");
  TORCH_CHECK_VALUE(touch_threads >= 1, "offload.HostPool: touch_threads must be >= 1, got ", touch_threads);
  return std::shared_ptr<HostPool>(new HostPool(device_type, limit_bytes, slab_bytes, touch_threads));
}

HostPool::HostPool(c10::DeviceType device_type, size_t limit_bytes, size_t slab_bytes, int touch_threads)
    : device_type_(device_type),
      slab_bytes_(round_up(slab_bytes, kLargeGranule)),
      touch_threads_(touch_threads),
      pinner_(host_memory_pinner(device_type)),
      limit_bytes_(limit_bytes) {}

HostPool::~HostPool() {
  // Every tensor holds a reference to the pool, so no block is handed out here;
  // but the last tensor may have died while a copy still reads or writes its
  // block (pending). Wait for those copies before the memory goes back to the
  // system. At exit the driver may already be gone, and nothing runs any more.
  try {
    process_pending_locked(/*wait=*/true);
  } catch (...) {
  }
  for (auto& slab : slabs_) {
    if (pinner_ != nullptr) pinner_->unpin(slab->base);
    free_touched(slab->base);
  }
}

at::Tensor HostPool::allocate(size_t nbytes) {
  const size_t cls = size_class(nbytes);
  Block* block = nullptr;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    stats_.requests += 1;
    process_pending_locked(/*wait=*/false);
    block = find_free_locked(cls);
    if (block != nullptr) {
      stats_.cache_hits += 1;
    } else {
      wait_for_reserve_locked(lock, cls);
      block = carve_locked(cls, nbytes);
    }
    block->handed_out = true;
    block->slab->live += 1;
    stats_.in_use_bytes += block->size;
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  }
  // The deleter keeps the pool alive until the last tensor on this block dies.
  auto self = shared_from_this();
  auto options = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  return at::for_blob(block->ptr, {static_cast<int64_t>(nbytes)})
      .deleter([self, block](void*) { self->release(block); })
      .options(options)
      .target_device(c10::Device(at::kCPU))
      .make_tensor();
}

void HostPool::release(Block* block) {
  std::lock_guard<std::mutex> lock(mutex_);
  block->handed_out = false;
  stats_.in_use_bytes -= block->size;
  if (block->events.empty()) {
    block->slab->live -= 1;
    free_[block->size].push_back(block);
  } else {
    block->pending = true;
    pending_.push_back(block);
  }
}

HostPool::Block* HostPool::find_free_locked(size_t cls) {
  auto it = free_.lower_bound(cls);
  // Large blocks may serve a slightly smaller class (at most 1/8 wasted) rather
  // than growing the pool; small classes must match exactly.
  while (it != free_.end() && it->second.empty()) ++it;
  if (it == free_.end()) return nullptr;
  if (it->first != cls && (cls <= kSmallLimit || it->first > cls + cls / 8)) return nullptr;
  Block* block = it->second.back();
  it->second.pop_back();
  return block;
}

HostPool::Block* HostPool::carve_locked(size_t cls, size_t nbytes) {
  if (current_ == nullptr || current_->bytes - current_->carved < cls) {
    // An older slab's uncarved tail (left when a larger request or reserve()
    // started a new slab) serves before the pool grows: otherwise that memory
    // stays reserved, counts against the limit, and is never handed out.
    for (const auto& slab : slabs_) {
      if (slab->bytes - slab->carved >= cls) {
        current_ = slab.get();
        break;
      }
    }
  }
  if (current_ == nullptr || current_->bytes - current_->carved < cls) {
    // A slab whose blocks are all back on the free lists, cached for other sizes
    // (a closed stager's, a previous model's), is cut afresh before the pool
    // grows: pinning new memory takes the driver far longer than re-cutting idle memory.
    if (Slab* idle = recycle_locked(cls)) current_ = idle;
  }
  if (current_ == nullptr || current_->bytes - current_->carved < cls) {
    size_t want = std::max(cls, slab_bytes_);
    if (limit_bytes_ != 0 && stats_.reserved_bytes + want > limit_bytes_) {
      // Before refusing, within the limit: wait for blocks whose copies are in
      // flight, give wholly free slabs back, then grow only by what is needed.
      process_pending_locked(/*wait=*/true);
      if (Block* block = find_free_locked(cls)) return block;
      trim_locked();
      const size_t room = limit_bytes_ > stats_.reserved_bytes
                              ? (limit_bytes_ - stats_.reserved_bytes) / kLargeGranule * kLargeGranule
                              : 0;
      if (room < cls) fail_limit_locked(nbytes, cls);
      want = std::min(want, room);
    }
    current_ = grow_locked(want);
  }
  auto block = std::make_unique<Block>();
  block->ptr = current_->base + current_->carved;
  block->size = cls;
  block->slab = current_;
  current_->carved += cls;
  Block* raw = block.get();
  by_address_[reinterpret_cast<uintptr_t>(raw->ptr)] = raw;
  current_->blocks.push_back(std::move(block));
  return raw;
}

HostPool::Slab* HostPool::grow_locked(size_t bytes) {
  bytes = round_up(bytes, kLargeGranule);
  const auto t0 = std::chrono::steady_clock::now();
  char* base = static_cast<char*>(allocate_touched(bytes, touch_threads_));
  if (pinner_ != nullptr) {
    const auto t1 = std::chrono::steady_clock::now();
    try {
      pinner_->pin(base, bytes);
    } catch (...) {
      free_touched(base);
      throw;
    }
    stats_.registration_seconds += seconds_since(t1);
  }
  stats_.allocation_seconds += seconds_since(t0);
  return add_slab_locked(base, bytes);
}

HostPool::Slab* HostPool::add_slab_locked(char* base, size_t bytes) {
  auto slab = std::make_unique<Slab>();
  slab->base = base;
  slab->bytes = bytes;
  stats_.reserved_bytes += bytes;
  stats_.slabs += 1;
  slabs_.push_back(std::move(slab));
  return slabs_.back().get();
}

bool HostPool::has_room_locked(size_t cls) const {
  for (const auto& slab : slabs_) {
    if (slab->bytes - slab->carved >= cls) return true;
  }
  return false;
}

void HostPool::wait_for_reserve_locked(std::unique_lock<std::mutex>& lock, size_t cls) {
  while (reserving_ > 0 && cls <= reserve_slab_ && !has_room_locked(cls)) grown_.wait(lock);
}

void HostPool::process_pending_locked(bool wait) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    Block* block = *it;
    bool done = true;
    for (auto& entry : block->events) {
      if (wait) entry.second->synchronize();
      if (!entry.second->query()) {
        done = false;
        break;
      }
    }
    if (!done) {
      ++it;
      continue;
    }
    block->events.clear();
    block->pending = false;
    block->slab->live -= 1;
    free_[block->size].push_back(block);
    it = pending_.erase(it);
  }
}

void HostPool::forget_blocks_locked(Slab* slab) {
  for (auto& block : slab->blocks) {
    auto& list = free_[block->size];
    list.erase(std::remove(list.begin(), list.end(), block.get()), list.end());
    by_address_.erase(reinterpret_cast<uintptr_t>(block->ptr));
  }
  slab->blocks.clear();
  slab->carved = 0;
}

HostPool::Slab* HostPool::recycle_locked(size_t cls) {
  // The smallest wholly free slab that holds `cls`: larger ones stay cached for
  // the larger requests they may yet serve.
  Slab* best = nullptr;
  for (const auto& slab : slabs_) {
    if (slab->live == 0 && slab->carved > 0 && slab->bytes >= cls && (best == nullptr || slab->bytes < best->bytes)) {
      best = slab.get();
    }
  }
  if (best == nullptr) return nullptr;
  forget_blocks_locked(best);
  for (auto it = free_.begin(); it != free_.end();) it = it->second.empty() ? free_.erase(it) : std::next(it);
  stats_.recycled_slabs += 1;
  return best;
}

size_t HostPool::trim_locked() {
  size_t released = 0;
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    Slab* slab = it->get();
    if (slab->live != 0) {
      ++it;
      continue;
    }
    forget_blocks_locked(slab);
    if (pinner_ != nullptr) pinner_->unpin(slab->base);
    free_touched(slab->base);
    released += slab->bytes;
    stats_.reserved_bytes -= slab->bytes;
    stats_.slabs -= 1;
    if (current_ == slab) current_ = nullptr;
    it = slabs_.erase(it);
  }
  for (auto it = free_.begin(); it != free_.end();) it = it->second.empty() ? free_.erase(it) : std::next(it);
  return released;
}

void HostPool::fail_limit_locked(size_t nbytes, size_t cls) const {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "offload.HostPool: cannot allocate ", human_bytes(nbytes), " (a ",
                   human_bytes(cls), " block): ", human_bytes(stats_.in_use_bytes), " are in use and ",
                   human_bytes(stats_.reserved_bytes), " reserved of the ", human_bytes(limit_bytes_),
                   " limit. Raise it with HostPool(limit_bytes=...), pool.limit_bytes = ..., or "
                   "OFFLOAD_HOST_POOL_LIMIT, or release host tensors from the pool");
}

HostPool::Block* HostPool::block_of_locked(const void* ptr) const {
  auto address = reinterpret_cast<uintptr_t>(ptr);
  auto it = by_address_.upper_bound(address);
  if (it == by_address_.begin()) return nullptr;
  --it;
  Block* block = it->second;
  return address < it->first + block->size ? block : nullptr;
}

bool HostPool::record_stream(const at::Tensor& tensor, const c10::Stream& stream, const SharedEvent& at) {
  if (stream.device_type() == c10::DeviceType::CPU) return owns(tensor);  // CPU work is synchronous
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = block_of_locked(tensor.storage().data());
  if (block == nullptr || !block->handed_out) return false;
  for (auto& entry : block->events) {
    if (entry.first == stream) {  // the same stream of the same device: later work implies earlier
      if (at != nullptr) {
        entry.second = at;
      } else if (entry.second.use_count() == 1) {  // the pool's own: no one else reads its point
        entry.second->record_again(stream);
      } else {
        entry.second = record_event(stream);
      }
      return true;
    }
  }
  block->events.emplace_back(stream, at != nullptr ? at : record_event(stream));
  return true;
}

bool HostPool::owns(const at::Tensor& tensor) const {
  if (!tensor.defined() || !tensor.has_storage()) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = block_of_locked(tensor.storage().data());
  return block != nullptr && block->handed_out;
}

void HostPool::reserve(size_t nbytes) { grow_reserved(begin_reserve(nbytes)); }

size_t HostPool::begin_reserve(size_t nbytes, size_t largest_block) {
  if (nbytes == 0) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  size_t spare = current_ != nullptr ? current_->bytes - current_->carved : 0;
  if (spare >= nbytes) return 0;
  const size_t bytes = round_up(nbytes, kLargeGranule);
  if (limit_bytes_ != 0 && stats_.reserved_bytes + reserving_ + bytes > limit_bytes_) {
    process_pending_locked(/*wait=*/false);
    trim_locked();
    if (stats_.reserved_bytes + reserving_ + bytes > limit_bytes_) fail_limit_locked(nbytes, bytes);
  }
  reserving_ += bytes;
  // Slabs of twice the pool's slab size, or of the largest block expected, so
  // copies into the first slabs run while the next are touched and pinned (Note
  // [reservation in slabs]).
  reserve_slab_ = std::max(2 * slab_bytes_, size_class(largest_block));
  return bytes;
}

void HostPool::cancel_reserve(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    reserving_ -= std::min(bytes, reserving_);
  }
  grown_.notify_all();
}

// Note [reservation in slabs]
// A first checkpoint save needs gigabytes of pinned memory at once. Grown as one
// slab, its copies wait for the whole slab to be touched and pinned; grown in
// slabs of a few hundred MiB, the first copies start after the first slab, and
// the driver pins the pieces about as fast as the whole (benchmarks/RESULTS.md).
// The next slab is touched on a second thread while the driver pins the current.
void HostPool::grow_reserved(size_t bytes) {
  if (bytes == 0) return;
  size_t slab_bytes;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slab_bytes = reserve_slab_;
  }
  // A last slab of at most half the others joins the one before it: fewer, larger slabs.
  std::vector<size_t> slabs;
  for (size_t left = bytes; left > 0;) {
    const size_t take = left <= slab_bytes + slab_bytes / 2 ? left : slab_bytes;
    slabs.push_back(take);
    left -= take;
  }
  size_t left = bytes;  // announced bytes not in slabs yet
  char* next = nullptr;
  std::exception_ptr touch_error;
  double touch_seconds = 0;
  auto touch = [&](size_t n) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      next = static_cast<char*>(allocate_touched(n, touch_threads_));
    } catch (...) {
      next = nullptr;
      touch_error = std::current_exception();
    }
    touch_seconds = seconds_since(t0);
  };
  try {
    touch(slabs[0]);
    for (size_t k = 0; k < slabs.size(); ++k) {
      if (touch_error) std::rethrow_exception(touch_error);
      char* base = next;
      next = nullptr;
      const double touched = touch_seconds;
      // The next slab is touched while the driver pins this one: both are the
      // kernel's page work, and they overlap on the host's cores.
      std::thread toucher;
      double pinned = 0;
      try {
        if (k + 1 < slabs.size()) toucher = std::thread(touch, slabs[k + 1]);
        const auto t0 = std::chrono::steady_clock::now();
        if (pinner_ != nullptr) pinner_->pin(base, slabs[k]);
        pinned = seconds_since(t0);
      } catch (...) {
        if (toucher.joinable()) toucher.join();
        free_touched(base);
        if (next != nullptr) free_touched(next);
        throw;
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        Slab* slab = add_slab_locked(base, slabs[k]);
        if (current_ == nullptr || current_->bytes - current_->carved < kMinBlock) current_ = slab;
        stats_.allocation_seconds += touched + pinned;
        stats_.registration_seconds += pinned;
        reserving_ -= std::min(slabs[k], reserving_);
        left -= slabs[k];
      }
      grown_.notify_all();
      if (toucher.joinable()) toucher.join();
    }
  } catch (...) {
    cancel_reserve(left);
    throw;
  }
}

size_t HostPool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  process_pending_locked(/*wait=*/false);
  return trim_locked();
}

HostPoolStats HostPool::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Blocks whose copies are done are free to serve the next acquire: callers that
  // size a reserve() from free_bytes (the stager's first save) must see them.
  process_pending_locked(/*wait=*/false);
  HostPoolStats out = stats_;
  out.limit_bytes = limit_bytes_;
  out.pending_blocks = pending_.size();
  out.free_bytes = 0;
  for (const auto& entry : free_) out.free_bytes += entry.first * entry.second.size();
  return out;
}

size_t HostPool::limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_bytes_;
}

void HostPool::set_limit(size_t limit_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_bytes_ = limit_bytes;
}

}  // namespace offload
