// Pins the host pool's slabs for CUDA with cudaHostRegister.
//
// Portable: the registration is visible to every GPU of the process, so one pool
// serves copies to any device. The driver must be initialised first; the Python
// HostPool touches the device before constructing the native pool.
#include <cuda_runtime_api.h>

#include <c10/cuda/CUDAException.h>

#include "offload/checks.h"
#include "offload/host_memory.h"

namespace offload {
namespace {

class CudaHostMemoryPinner final : public HostMemoryPinner {
 public:
  void pin(void* ptr, size_t bytes) override {
    cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky error so later calls work
      TORCH_CHECK_WITH(OutOfMemoryError, false, "offload.HostPool: cudaHostRegister of ", human_bytes(bytes),
                       " failed: ", cudaGetErrorString(err),
                       ". The locked-memory limit (ulimit -l) or the system's memory may be too small; "
                       "lower HostPool(limit_bytes=...) / OFFLOAD_HOST_POOL_LIMIT or slab_bytes");
    }
  }
  void unpin(void* ptr) noexcept override {
    if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
  }
};

struct Register {
  Register() {
    static CudaHostMemoryPinner pinner;
    set_host_memory_pinner(c10::DeviceType::CUDA, &pinner);
  }
} register_cuda_pinner;

}  // namespace
}  // namespace offload
