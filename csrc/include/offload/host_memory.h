// Where the pool's slabs come from and how they are made DMA-capable.
//
// A slab is ordinary memory from the C library, first-touched by several threads
// (page faults are the slow part of a large allocation and parallelise well) and
// then registered ("pinned") with the accelerator's driver: several times faster
// than torch.empty(pin_memory=True), which asks the driver to allocate and fault
// in the memory itself (benchmarks/RESULTS.md).
//
// Each accelerator backend registers its pinning calls at load time
// (cuda/host_memory_cuda.cpp, npu/host_memory_npu.cpp); a CPU build has none and
// its slabs stay pageable, so every other part of the pool still runs and is
// tested in CI.
#pragma once

#include <cstddef>

#include <c10/core/DeviceType.h>

namespace offload {

class HostMemoryPinner {
 public:
  virtual ~HostMemoryPinner() = default;
  // Page-lock [ptr, ptr + bytes) for DMA by every device of this type; throws on failure.
  virtual void pin(void* ptr, size_t bytes) = 0;
  // Undo pin(); must not throw (it runs from destructors, possibly at exit).
  virtual void unpin(void* ptr) noexcept = 0;
  // Whether pin() works in this process: a runtime may declare the call and still
  // refuse it on some devices or kernels. Asked when a pool is made, after the
  // device runtime is initialised; a pinner says false rather than let every slab fail.
  virtual bool usable() noexcept { return true; }
};

// The pinner for `type`, or nullptr when host memory for it cannot be pinned
// (none registered, or the registered one is not usable here).
HostMemoryPinner* host_memory_pinner(c10::DeviceType type);
// Whether this build registered a pinner for `type`; asks the driver nothing.
bool host_memory_pinner_registered(c10::DeviceType type);
void set_host_memory_pinner(c10::DeviceType type, HostMemoryPinner* pinner);

// Allocates `bytes` (a multiple of the huge-page size) aligned to 2 MiB and
// faults every page in from up to `threads` threads; throws c10::OutOfMemoryError.
void* allocate_touched(size_t bytes, int threads);
void free_touched(void* ptr) noexcept;

}  // namespace offload
