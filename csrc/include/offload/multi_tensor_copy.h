// Copies many byte ranges on one device with as few launches as possible.
//
// The copy engine packs many small tensors into one staging buffer (and unpacks
// it again) with this, so that one DMA moves what would otherwise be thousands
// of small copies, each paying several microseconds of latency. On CUDA it is
// one kernel launch per table of up to 900 ranges (core/cuda/multi_tensor_copy.cu); on the CPU a
// parallel memcpy; on other accelerators torch's _foreach_copy_.
#pragma once

#include <cstdint>
#include <vector>

#include <c10/core/Device.h>

namespace offload {

struct ByteRange {
  const void* src;
  void* dst;
  int64_t nbytes;
};

// Enqueues the copies on the current stream of `device`.
void multi_tensor_copy(const std::vector<ByteRange>& ranges, const c10::Device& device);

using MultiTensorCopyFn = void (*)(const std::vector<ByteRange>&, const c10::Device&);
void set_multi_tensor_copy_impl(c10::DeviceType type, MultiTensorCopyFn fn);

// One asynchronous copy of `nbytes` between host and `device` (either way, or
// within the device) on the device's current stream. On CUDA it is a bare
// cudaMemcpyAsync: a few microseconds less per call than Tensor::copy_, which
// is what a small transfer's latency is made of.
void copy_bytes_async(void* dst, bool dst_on_host, const void* src, bool src_on_host, int64_t nbytes,
                      const c10::Device& device);
using CopyBytesFn = void (*)(void*, const void*, int64_t, const c10::Device&);
void set_copy_bytes_impl(c10::DeviceType type, CopyBytesFn fn);

// Many such copies, each of one range, in one direction, enqueued at once on the
// device's current stream: complete, as a whole, in stream order, but in no order
// among themselves, so the ranges must not overlap. On CUDA 12.8 and later one
// cudaMemcpyBatchAsync (one driver call for a group's spans instead of one each,
// the copy engines still doing the moving); elsewhere copy_bytes_async per range.
void copy_ranges_async(const std::vector<ByteRange>& ranges, bool dst_on_host, bool src_on_host,
                       const c10::Device& device);
// Returns false where it enqueued nothing (the runtime or driver has no batch
// call): copy_ranges_async then copies range by range.
using CopyRangesFn = bool (*)(const std::vector<ByteRange>&, const c10::Device&);
void set_copy_ranges_impl(c10::DeviceType type, CopyRangesFn fn);
// Whether copy_ranges_async may batch (on by default). Off, it copies range by
// range: the host section's side-by-side of the two, and a check that both land
// the same bytes.
void set_batched_copies(bool enabled);
bool batched_copies();

}  // namespace offload
