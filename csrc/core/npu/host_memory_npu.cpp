// Pins the host pool's slabs for Ascend NPUs with aclrtHostRegisterV2(ACL_HOST_REG_PINNED).
//
// The twin of cuda/host_memory_cuda.cpp: the pool allocates and first-touches a
// slab itself (allocate_touched), and ACL page-locks that memory in place, so
// copies between it and the NPU run as DMA. The runtime must be initialised first;
// the Python HostPool touches the device before constructing the native pool.
// See Note [ACL host registration] for which call and why, and what happens
// where ACL cannot pin.
//
// Note [ACL host registration]
// CANN has two registration calls. aclrtHostRegister(ptr, size,
// ACL_HOST_REGISTER_MAPPED, &dev_ptr) maps host memory into the device's address
// space for access from the device side; ACL documents that the mapped address is
// not for memory copies, so it does not make a copy buffer. aclrtHostRegisterV2(ptr,
// size, ACL_HOST_REG_PINNED) registers memory from the C library as page-locked
// memory: the counterpart of cudaHostRegister, and the call used here. Headers
// without ACL_HOST_REG_PINNED (older CANN) build no pinner. aclrtMallocHost is not
// a substitute: it allocates, and the pool allocates and touches slabs itself.
//
// ACL documents two limits of aclrtHostRegisterV2: the Atlas A2/A3 and later parts
// support it (the Atlas training and inference series do not), and on Linux 5.10
// and older, registering memory that is not already page-locked fails. usable()
// checks the kernel and registers one small slab once; where either fails, or no
// pinner is built, the pool's own slabs would stay pageable, so the Python HostPool
// takes its blocks from torch_npu's pinned allocator instead (copies stay
// asynchronous; growth is slower).
#include <cstdio>
#include <mutex>
#include <string>

#include <sys/utsname.h>

#include <acl/acl.h>

#include <c10/util/Exception.h>

#include "offload/checks.h"
#include "offload/host_memory.h"

#ifdef ACL_HOST_REG_PINNED

namespace offload {
namespace {

std::string acl_error(aclError err) {
  const char* msg = aclGetRecentErrMsg();
  return "ACL error " + std::to_string(err) + (msg != nullptr && *msg != '\0' ? std::string(": ") + msg : "");
}

// ACL registers memory from the C library only on kernels after 5.10 (Note [ACL host registration]).
bool kernel_registers_pageable_memory() {
  utsname name{};
  int major = 0, minor = 0;
  if (uname(&name) != 0 || std::sscanf(name.release, "%d.%d", &major, &minor) != 2) return false;
  return major > 5 || (major == 5 && minor > 10);
}

class NpuHostMemoryPinner final : public HostMemoryPinner {
 public:
  void pin(void* ptr, size_t bytes) override {
    const aclError err = aclrtHostRegisterV2(ptr, bytes, ACL_HOST_REG_PINNED);
    TORCH_CHECK_WITH(OutOfMemoryError, err == ACL_SUCCESS, "offload.HostPool: aclrtHostRegisterV2 of ",
                     human_bytes(bytes), " failed: ", acl_error(err),
                     ". The locked-memory limit (ulimit -l) or the system's memory may be too small; "
                     "lower HostPool(limit_bytes=...) / OFFLOAD_HOST_POOL_LIMIT or slab_bytes");
  }
  void unpin(void* ptr) noexcept override { (void)aclrtHostUnregister(ptr); }

  bool usable() noexcept override {
    std::call_once(probed_, [this] { usable_ = probe(); });
    return usable_;
  }

 private:
  // One registration of a 2 MiB slab, undone at once: whether this device and
  // kernel accept the call at all. Warns once with ACL's reason when they do not.
  static bool probe() noexcept {
    constexpr size_t kProbeBytes = size_t(2) << 20;
    try {
      if (!kernel_registers_pageable_memory()) {
        TORCH_WARN("offload.HostPool: ACL cannot page-lock memory from the C library on Linux 5.10 or older; "
                   "host buffers come from torch_npu's pinned allocator");
        return false;
      }
      void* ptr = allocate_touched(kProbeBytes, 1);
      const aclError err = aclrtHostRegisterV2(ptr, kProbeBytes, ACL_HOST_REG_PINNED);
      if (err == ACL_SUCCESS) (void)aclrtHostUnregister(ptr);
      free_touched(ptr);
      if (err != ACL_SUCCESS) {
        TORCH_WARN("offload.HostPool: aclrtHostRegisterV2 cannot page-lock host memory on this device (",
                   acl_error(err), "); host buffers come from torch_npu's pinned allocator");
      }
      return err == ACL_SUCCESS;
    } catch (...) {  // a warning turned into an error, or no memory for the probe
      return false;
    }
  }

  std::once_flag probed_;
  bool usable_ = false;
};

struct Register {
  Register() {
    static NpuHostMemoryPinner pinner;
    set_host_memory_pinner(c10::DeviceType::PrivateUse1, &pinner);
  }
} register_npu_pinner;

}  // namespace
}  // namespace offload

#endif  // ACL_HOST_REG_PINNED
