// Slab memory for the host pool: aligned, huge-page-advised, touched in parallel.
#include "offload/host_memory.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <system_error>
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
constexpr size_t kSmallPage = 4096;                  // no Linux target has smaller pages
constexpr size_t kMinTouchChunk = size_t(8) << 20;   // the least a touch thread is started for

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
  std::lock_guard<std::mutex> lock(pinner_mutex());
  return pinners()[static_cast<size_t>(type)];
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
  // Fewer, larger pages: one fault and one zeroing pass per 2 MiB instead of per
  // 4 KiB (about 5x faster first touch on the CPU here), and 512x fewer pages for
  // the driver to pin. Advice only: where THP is off or the kernel lacks it this
  // fails (EINVAL) and the slab keeps small pages, which is slower but correct,
  // so a failure is deliberately not an error.
  (void)madvise(ptr, bytes, MADV_HUGEPAGE);
#endif
  // First touch from several threads: the kernel zeroes each page on its first
  // write, which is the slow part of a large allocation, and it serves faults on
  // different pages in parallel. Workers get whole 2 MiB pages (a huge page is
  // never split between threads) and at least kMinTouchChunk each, so a thread's
  // start (tens of microseconds) stays small against its work; more workers than
  // cores would only take turns.
  const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t workers = std::max<size_t>(
      1, std::min({static_cast<size_t>(std::max(threads, 1)), hardware, bytes / kMinTouchChunk}));
  const size_t per_worker = (bytes / workers + kSlabAlignment - 1) / kSlabAlignment * kSlabAlignment;
  auto touch = [ptr, bytes](size_t begin, size_t end) {
    end = std::min(end, bytes);
    if (begin >= end) return;
    char* first = static_cast<char*>(ptr) + begin;
#ifdef MADV_POPULATE_WRITE
    // Linux >= 5.14: one call faults the whole range in, writable, without a trap
    // per page. Older kernels refuse it (EINVAL): touch every page instead.
    if (madvise(first, end - begin, MADV_POPULATE_WRITE) == 0) return;
#endif
    // One write per 4 KiB page faults it in (a huge page's first write faults all
    // of it; later writes into it cost a store each).
    volatile char* base = first;
    for (size_t offset = 0; offset < end - begin; offset += kSmallPage) base[offset] = 0;
  };
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (size_t w = 1; w < workers; ++w) {
    try {
      pool.emplace_back(touch, w * per_worker, (w + 1) * per_worker);
    } catch (const std::system_error&) {  // no thread to be had: this thread touches the rest
      touch(w * per_worker, bytes);
      break;
    }
  }
  touch(0, per_worker);
  for (auto& t : pool) t.join();
  return ptr;
}

void free_touched(void* ptr) noexcept { std::free(ptr); }

}  // namespace offload
