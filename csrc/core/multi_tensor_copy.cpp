// Device dispatch and the generic paths of multi_tensor_copy (include/offload/multi_tensor_copy.h).
//
// Moves: raw bytes between ranges that are contiguous at both ends. On the CPU
// a parallel memcpy, across ranges (small ranges dominate); on a device with a
// registered implementation (core/cuda/multi_tensor_copy.cu) that one; on any
// other accelerator torch's _foreach_copy_ over byte views.
#include "offload/multi_tensor_copy.h"

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace offload {
namespace {

using ImplTable = std::array<MultiTensorCopyFn, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>;

ImplTable& impls() {
  static ImplTable table{};
  return table;
}

using BytesTable = std::array<CopyBytesFn, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>;

BytesTable& bytes_impls() {
  static BytesTable table{};
  return table;
}

using RangesTable = std::array<CopyRangesFn, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>;

RangesTable& ranges_impls() {
  static RangesTable table{};
  return table;
}

std::atomic<bool>& batching() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

void copy_on_cpu(const std::vector<ByteRange>& ranges) {
  // Small ranges dominate, so parallelise across ranges, not within one.
  at::parallel_for(0, static_cast<int64_t>(ranges.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(ranges[i].dst, ranges[i].src, ranges[i].nbytes);
  });
}

void copy_with_foreach(const std::vector<ByteRange>& ranges, const c10::Device& device) {
  std::vector<at::Tensor> srcs, dsts;
  srcs.reserve(ranges.size());
  dsts.reserve(ranges.size());
  auto options = at::TensorOptions().dtype(at::kByte).device(device);
  for (const auto& r : ranges) {
    srcs.push_back(at::from_blob(const_cast<void*>(r.src), {r.nbytes}, options));
    dsts.push_back(at::from_blob(r.dst, {r.nbytes}, options));
  }
  at::_foreach_copy_(dsts, srcs);
}

}  // namespace

void set_multi_tensor_copy_impl(c10::DeviceType type, MultiTensorCopyFn fn) {
  impls()[static_cast<size_t>(type)] = fn;
}

void set_copy_bytes_impl(c10::DeviceType type, CopyBytesFn fn) { bytes_impls()[static_cast<size_t>(type)] = fn; }

void set_copy_ranges_impl(c10::DeviceType type, CopyRangesFn fn) { ranges_impls()[static_cast<size_t>(type)] = fn; }

void set_batched_copies(bool enabled) { batching().store(enabled, std::memory_order_relaxed); }

bool batched_copies() { return batching().load(std::memory_order_relaxed); }

void copy_ranges_async(const std::vector<ByteRange>& ranges, bool dst_on_host, bool src_on_host,
                       const c10::Device& device) {
  if (ranges.empty()) return;
  if (ranges.size() > 1 && !device.is_cpu() && batching().load(std::memory_order_relaxed)) {
    if (CopyRangesFn fn = ranges_impls()[static_cast<size_t>(device.type())]) {
      if (fn(ranges, device)) return;
    }
  }
  for (const auto& r : ranges) copy_bytes_async(r.dst, dst_on_host, r.src, src_on_host, r.nbytes, device);
}

void copy_bytes_async(void* dst, bool dst_on_host, const void* src, bool src_on_host, int64_t nbytes,
                      const c10::Device& device) {
  if (nbytes == 0) return;
  if (device.is_cpu()) {
    std::memcpy(dst, src, static_cast<size_t>(nbytes));
    return;
  }
  if (CopyBytesFn fn = bytes_impls()[static_cast<size_t>(device.type())]) {
    fn(dst, src, nbytes, device);
    return;
  }
  auto host = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  auto on_device = at::TensorOptions().dtype(at::kByte).device(device);
  at::Tensor d = at::from_blob(dst, {nbytes}, dst_on_host ? host : on_device);
  at::Tensor s = at::from_blob(const_cast<void*>(src), {nbytes}, src_on_host ? host : on_device);
  d.copy_(s, /*non_blocking=*/true);
}

void multi_tensor_copy(const std::vector<ByteRange>& ranges, const c10::Device& device) {
  if (ranges.empty()) return;
  if (device.is_cpu()) {
    copy_on_cpu(ranges);
    return;
  }
  if (MultiTensorCopyFn fn = impls()[static_cast<size_t>(device.type())]) {
    fn(ranges, device);
    return;
  }
  copy_with_foreach(ranges, device);
}

}  // namespace offload
