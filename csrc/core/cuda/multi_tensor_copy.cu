// multi_tensor_copy on CUDA: one launch copies up to kMaxRanges byte ranges.
//
// Moves: raw bytes, any dtype (packing does not look at values).
// Layout: each range is a contiguous run of bytes at src and at dst.
// Limits: ranges are passed by value as the kernel's parameter (apex's
// multi_tensor_apply idea; our own code), so a launch needs no metadata copy and
// no host synchronisation; CUDA 12.1+ allows 32 KB of parameters, older
// toolkits 4 KB, which sets kMaxRanges. The parameter struct is sized for the
// call (32, 128 or kMaxRanges ranges): the driver copies all of it per launch,
// and a copy engine group of 32 ranges should not pay for 900 (~29 KB).
// Each block copies one 16 KiB tile of one range with 16-byte loads and stores when both ends are 16-byte aligned
// (always true for the engine's staging offsets and allocator blocks), and byte
// by byte otherwise.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "offload/multi_tensor_copy.h"

namespace offload {
namespace {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxRanges = 900;  // 900 * 32 B + header < 32764 B of kernel parameters
#else
constexpr int kMaxRanges = 110;  // under the classic 4 KB parameter limit
#endif
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kTileBytes = int64_t(kThreads) * kUnroll * 16;  // 16 KiB per block

template <int N>
struct RangeBatch {
  const char* src[N];
  char* dst[N];
  int64_t nbytes[N];
  int64_t first_tile[N + 1];  // prefix sum of tiles; block b serves the range r with first_tile[r] <= b
  int count;
};

template <int N>
__global__ void __launch_bounds__(kThreads) multi_tensor_copy_kernel(const __grid_constant__ RangeBatch<N> batch) {
  const int64_t tile = blockIdx.x;
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {  // the last range whose first tile is <= this block's tile
    const int mid = (lo + hi + 1) / 2;
    if (batch.first_tile[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int r = lo;
  const int64_t begin = (tile - batch.first_tile[r]) * kTileBytes;
  const int64_t end = min(begin + kTileBytes, batch.nbytes[r]);
  const char* src = batch.src[r];
  char* dst = batch.dst[r];
  const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
  if (aligned) {
    const int64_t vec_end = begin + (end - begin) / 16 * 16;
    uint4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: several in flight per thread
      const int64_t at = begin + (int64_t(u) * kThreads + threadIdx.x) * 16;
      if (at < vec_end) values[u] = *reinterpret_cast<const uint4*>(src + at);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = begin + (int64_t(u) * kThreads + threadIdx.x) * 16;
      if (at < vec_end) *reinterpret_cast<uint4*>(dst + at) = values[u];
    }
    for (int64_t at = vec_end + threadIdx.x; at < end; at += kThreads) dst[at] = src[at];
  } else {
    for (int64_t at = begin + threadIdx.x; at < end; at += kThreads) dst[at] = src[at];
  }
}

template <int N>
void launch(RangeBatch<N>& batch, int64_t tiles, cudaStream_t stream) {
  batch.first_tile[batch.count] = tiles;
  multi_tensor_copy_kernel<N><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(batch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies `ranges` in launches of at most N ranges each.
template <int N>
void copy_ranges(const std::vector<ByteRange>& ranges, cudaStream_t stream) {
  RangeBatch<N> batch;
  batch.count = 0;
  int64_t tiles = 0;
  for (const auto& range : ranges) {
    if (range.nbytes == 0) continue;
    const int64_t range_tiles = (range.nbytes + kTileBytes - 1) / kTileBytes;
    if (batch.count == N || tiles + range_tiles > int64_t(1) << 30) {
      launch(batch, tiles, stream);
      batch.count = 0;
      tiles = 0;
    }
    batch.src[batch.count] = static_cast<const char*>(range.src);
    batch.dst[batch.count] = static_cast<char*>(range.dst);
    batch.nbytes[batch.count] = range.nbytes;
    batch.first_tile[batch.count] = tiles;
    batch.count += 1;
    tiles += range_tiles;
  }
  if (batch.count > 0) launch(batch, tiles, stream);
}

constexpr int kFewRanges = kMaxRanges < 32 ? kMaxRanges : 32;
constexpr int kSomeRanges = kMaxRanges < 128 ? kMaxRanges : 128;

void multi_tensor_copy_cuda(const std::vector<ByteRange>& ranges, const c10::Device& device) {
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  if (ranges.size() <= static_cast<size_t>(kFewRanges)) {
    copy_ranges<kFewRanges>(ranges, stream);
  } else if (ranges.size() <= static_cast<size_t>(kSomeRanges)) {
    copy_ranges<kSomeRanges>(ranges, stream);
  } else {
    copy_ranges<kMaxRanges>(ranges, stream);
  }
}

void copy_bytes_cuda(void* dst, const void* src, int64_t nbytes, const c10::Device& device) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDefault, stream));
}

// copy_ranges_async on CUDA: one cudaMemcpyBatchAsync for all the ranges. Each
// cudaMemcpyAsync is a driver call of a few microseconds of host time; a group of
// activations is tens of spans, so its copy out was tens of calls. The batch
// reads its sources in stream order (the copy stream has waited for their
// writers) and asks for copies that overlap compute, which is what an offload's
// copies are for. A driver without the call (it says so once) leaves the copies
// to copy_bytes_cuda, range by range.
bool copy_ranges_cuda(const std::vector<ByteRange>& ranges, const c10::Device& device) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  static std::atomic<bool> unsupported{false};
  if (unsupported.load(std::memory_order_relaxed)) return false;
  // The call takes separate arrays of destinations, sources and sizes: kept per thread, so
  // filling them from the caller's ranges costs no allocation once they have grown.
  thread_local std::vector<void*> dsts;
  thread_local std::vector<const void*> srcs;
  thread_local std::vector<size_t> sizes;
  dsts.clear();
  srcs.clear();
  sizes.clear();
  for (const auto& range : ranges) {
    if (range.nbytes == 0) continue;
    dsts.push_back(range.dst);
    srcs.push_back(range.src);
    sizes.push_back(static_cast<size_t>(range.nbytes));
  }
  if (sizes.empty()) return true;
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t first_copy = 0;  // the one set of attributes applies from copy 0 on
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
#if CUDART_VERSION >= 13000
  cudaError_t status = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attributes,
                                            &first_copy, 1, stream);
#else
  size_t failed_copy = SIZE_MAX;
  cudaError_t status = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), sizes.size(),
                                            &attributes, &first_copy, 1, &failed_copy, stream);
#endif
  if (status == cudaErrorNotSupported || status == cudaErrorCallRequiresNewerDriver) {
    (void)cudaGetLastError();  // clear it: the copies go one by one instead
    unsupported.store(true, std::memory_order_relaxed);
    return false;
  }
  C10_CUDA_CHECK(status);
  return true;
#else
  (void)ranges;
  (void)device;
  return false;
#endif
}

struct Register {
  Register() {
    set_multi_tensor_copy_impl(c10::DeviceType::CUDA, &multi_tensor_copy_cuda);
    set_copy_bytes_impl(c10::DeviceType::CUDA, &copy_bytes_cuda);
    set_copy_ranges_impl(c10::DeviceType::CUDA, &copy_ranges_cuda);
  }
} register_cuda_multi_tensor_copy;

}  // namespace
}  // namespace offload
