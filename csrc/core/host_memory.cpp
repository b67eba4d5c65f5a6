// Slab memory for the host pool: aligned, huge-page-advised, touched in parallel,
// and the table of each backend's pinner (include/offload/host_memory.h).
//
// Layout: a slab is one posix_memalign'd range, 2 MiB aligned, its size a multiple
// of 2 MiB (the caller rounds), advised to use transparent huge pages. Limits:
// the C library's memory only; an allocation that fails raises OutOfMemoryError.
#include "offload/host_memory.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include "offload/checks.h"

namespace offload {
namespace {

constexpr size_t kSlabAlignment = size_t(2) << 20;  // a transparent huge page

std::mutex& pinner_mutex() {
  static std::mutex mu;
  return mu;
}

std::array<HostMemoryPinner*, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>& pinners() {
  static std::array<HostMemoryPinner*, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)> table{};
  return table;
}

}  // namespace

HostMemoryPinner* host_memory_pinner(c10::DeviceType type) {
  HostMemoryPinner* pinner = nullptr;
  {
    std::lock_guard<std::mutex> lock(pinner_mutex());
    pinner = pinners()[static_cast<size_t>(type)];
  }
  // Outside the lock: usable() may call into the driver.
  return pinner != nullptr && pinner->usable() ? pinner : nullptr;
}

bool host_memory_pinner_registered(c10::DeviceType type) {
  std::lock_guard<std::mutex> lock(pinner_mutex());
  return pinners()[static_cast<size_t>(type)] != nullptr;
}

void set_host_memory_pinner(c10::DeviceType type, HostMemoryPinner* pinner) {
  std::lock_guard<std::mutex> lock(pinner_mutex());
  pinners()[static_cast<size_t>(type)] = pinner;
}

void* allocate_touched(size_t bytes, int threads) {
  void* ptr = nullptr;
  if (bytes == 0) return nullptr;
  if (posix_memalign(&ptr, kSlabAlignment, bytes) != 0 || ptr == nullptr) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "offload.HostPool: the system could not provide ",
                     human_bytes(bytes), " of host memory for a new slab; lower the pool's slab_bytes or "
                     "free host memory");
  }
#ifdef MADV_HUGEPAGE
  // Fewer, larger pages: faster first touch and far fewer pages for the driver to pin.
  madvise(ptr, bytes, MADV_HUGEPAGE);
#endif
  // First touch from several threads: page faults are the slow part of a large
  // allocation, and the kernel serves them in parallel.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t workers = std::max<size_t>(1, std::min<size_t>(threads, bytes / (size_t(64) << 20) + 1));
  const size_t per_worker = (bytes / workers + page - 1) / page * page;
  auto touch = [ptr, bytes, page](size_t begin, size_t end) {
    volatile char* base = static_cast<char*>(ptr);
    for (size_t offset = begin; offset < std::min(end, bytes); offset += page) base[offset] = 0;
  };
  std::vector<std::thread> pool;
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(touch, w * per_worker, (w + 1) * per_worker);
  touch(0, per_worker);
  for (auto& t : pool) t.join();
  return ptr;
}

void free_touched(void* ptr) noexcept { std::free(ptr); }

}  // namespace offload
