// Multi-tensor copy with cast: the CUDA half of bucket packing (csrc/core/buckets.cpp).
//
// What it moves: a list of spans, each `numel` contiguous elements read from `src`
// as type S and written to `dst` as type D (S == D: raw bytes, any dtype, fp8 and
// int and bool included; otherwise a cast between fp64/fp32/fp16/bf16 with
// c10::convert, the same rounding as tensor.to(dtype)). Every source element is
// read once and every destination element written once.
//
// Layout and launch: spans are grouped by (S, D); each launch takes a table of up
// to kMaxSpans spans by value (apex's multi_tensor_apply idea: pointers and sizes
// as kernel parameters, no table in device memory, under the 4 KiB parameter
// limit of every CUDA version). A span is cut into tiles of kTileUnits units;
// blocks walk the tiles of the whole table grid-stride and find a tile's span by
// binary search over the tiles' prefix sums. A unit is one 16-byte vector of the
// source (V = 16 / sizeof(S) elements) when the host found an element count
// `head` after which both pointers are vector aligned; the `head` and the short
// tail are copied element by element by the span's first tile. A span that
// cannot be aligned is copied element by element (units are elements).
//
// Limits: numel up to 2^63; any number of spans (several launches beyond
// kMaxSpans per dtype pair); pointers must be aligned to their element size.
#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/TypeCast.h>

#include "offload/buckets.h"

namespace offload {
namespace {

constexpr int kThreads = 256;
constexpr int kUnitsPerThread = 4;  // loads in flight per thread before the stores
constexpr int64_t kTileUnits = kThreads * kUnitsPerThread;
constexpr int kVecBytes = 16;
// 96 spans * 36 bytes + the count: about 3.5 KiB, under the 4 KiB parameter limit.
constexpr int kMaxSpans = 96;

struct SpanTable {
  const void* src[kMaxSpans];
  void* dst[kMaxSpans];
  int64_t numel[kMaxSpans];
  int64_t tile_begin[kMaxSpans + 1];  // prefix sums of tiles per span; [count] is the total
  int32_t head[kMaxSpans];            // elements before the aligned body; -1: element by element
  int32_t count;
};

template <typename T, int N, int A>
struct alignas(A) Vec {
  T v[N];
};

// One unit of the aligned body: V = 16 / sizeof(S) source elements read with one
// 16-byte load, converted, written with one store of V * sizeof(D) bytes.
template <typename S, typename D>
struct VecUnits {
  static constexpr int V = kVecBytes / sizeof(S);
  using In = Vec<S, V, kVecBytes>;
  using Out = Vec<D, V, ((V * sizeof(D)) < kVecBytes ? (V * sizeof(D)) : kVecBytes)>;
  static __device__ __forceinline__ Out convert(const In& in) {
    Out out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = c10::convert<D>(in.v[j]);
    return out;
  }
};

// Raw bytes: plain uint4 loads and stores, nothing else in registers.
template <>
struct VecUnits<uint8_t, uint8_t> {
  using In = uint4;
  using Out = uint4;
  static __device__ __forceinline__ Out convert(const In& in) { return in; }
};

template <typename S, typename D>
__global__ void __launch_bounds__(kThreads) copy_spans_kernel(SpanTable table) {
  constexpr int V = kVecBytes / sizeof(S);
  const int64_t total = table.tile_begin[table.count];
  for (int64_t tile = blockIdx.x; tile < total; tile += gridDim.x) {
    int lo = 0, hi = table.count - 1;  // the last span whose first tile is <= tile
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (table.tile_begin[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    const S* __restrict__ src = static_cast<const S*>(table.src[lo]);
    D* __restrict__ dst = static_cast<D*>(table.dst[lo]);
    const int64_t n = table.numel[lo];
    const int32_t head = table.head[lo];
    const int64_t local = tile - table.tile_begin[lo];
    const int64_t begin = local * kTileUnits;
    if (head < 0) {
      const int64_t end = n < begin + kTileUnits ? n : begin + kTileUnits;
      S values[kUnitsPerThread];
#pragma unroll
      for (int k = 0; k < kUnitsPerThread; ++k) {
        const int64_t i = begin + threadIdx.x + k * kThreads;
        if (i < end) values[k] = src[i];
      }
#pragma unroll
      for (int k = 0; k < kUnitsPerThread; ++k) {
        const int64_t i = begin + threadIdx.x + k * kThreads;
        if (i < end) dst[i] = c10::convert<D>(values[k]);
      }
      continue;
    }
    const int64_t nvec = (n - head) / V;
    const int64_t end = nvec < begin + kTileUnits ? nvec : begin + kTileUnits;
    using Units = VecUnits<S, D>;
    const auto* __restrict__ vsrc = reinterpret_cast<const typename Units::In*>(src + head);
    auto* __restrict__ vdst = reinterpret_cast<typename Units::Out*>(dst + head);
    typename Units::In loaded[kUnitsPerThread];
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      const int64_t i = begin + threadIdx.x + k * kThreads;
      if (i < end) loaded[k] = vsrc[i];
    }
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      const int64_t i = begin + threadIdx.x + k * kThreads;
      if (i < end) vdst[i] = Units::convert(loaded[k]);
    }
    if (local == 0) {  // the unaligned head and the tail shorter than one vector
      for (int64_t i = threadIdx.x; i < head; i += kThreads) dst[i] = c10::convert<D>(src[i]);
      for (int64_t i = head + nvec * V + threadIdx.x; i < n; i += kThreads) dst[i] = c10::convert<D>(src[i]);
    }
  }
}

// Elements to skip so that both pointers are vector aligned, or -1 if no count does.
template <typename S, typename D>
int32_t aligned_head(const void* src, void* dst) {
  constexpr int V = kVecBytes / sizeof(S);
  constexpr uintptr_t kDstAlign = (V * sizeof(D)) < kVecBytes ? (V * sizeof(D)) : kVecBytes;
  const uintptr_t s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  if (s % sizeof(S) != 0 || d % sizeof(D) != 0) return -1;
  const int32_t head = static_cast<int32_t>(((kVecBytes - s % kVecBytes) % kVecBytes) / sizeof(S));
  return (d + head * sizeof(D)) % kDstAlign == 0 ? head : -1;
}

template <typename S, typename D>
void launch_group(const std::vector<CopySpan>& spans, cudaStream_t stream, int max_blocks) {
  constexpr int V = kVecBytes / sizeof(S);
  for (size_t first = 0; first < spans.size(); first += kMaxSpans) {
    SpanTable table;
    table.count = static_cast<int32_t>(std::min<size_t>(kMaxSpans, spans.size() - first));
    int64_t tiles = 0;
    for (int32_t i = 0; i < table.count; ++i) {
      const CopySpan& span = spans[first + i];
      // Raw-byte spans arrive with numel in bytes (see copy_spans_cuda).
      table.src[i] = span.src;
      table.dst[i] = span.dst;
      table.numel[i] = span.numel;
      int32_t head = aligned_head<S, D>(span.src, span.dst);
      if (head >= 0 && head > span.numel) head = -1;
      table.head[i] = head;
      table.tile_begin[i] = tiles;
      const int64_t units = head < 0 ? span.numel : (span.numel - head) / V;
      tiles += std::max<int64_t>(1, (units + kTileUnits - 1) / kTileUnits);
    }
    table.tile_begin[table.count] = tiles;
    const int blocks = static_cast<int>(std::min<int64_t>(tiles, max_blocks));
    copy_spans_kernel<S, D><<<blocks, kThreads, 0, stream>>>(table);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename S>
void launch_cast_to(c10::ScalarType dst, const std::vector<CopySpan>& spans, cudaStream_t stream, int max_blocks) {
  switch (dst) {
    case at::kDouble: return launch_group<S, double>(spans, stream, max_blocks);
    case at::kFloat: return launch_group<S, float>(spans, stream, max_blocks);
    case at::kHalf: return launch_group<S, c10::Half>(spans, stream, max_blocks);
    case at::kBFloat16: return launch_group<S, c10::BFloat16>(spans, stream, max_blocks);
    default: TORCH_CHECK(false, "offload: no cast kernel to ", dst);
  }
}

void launch_cast(c10::ScalarType src, c10::ScalarType dst, const std::vector<CopySpan>& spans, cudaStream_t stream,
                 int max_blocks) {
  switch (src) {
    case at::kDouble: return launch_cast_to<double>(dst, spans, stream, max_blocks);
    case at::kFloat: return launch_cast_to<float>(dst, spans, stream, max_blocks);
    case at::kHalf: return launch_cast_to<c10::Half>(dst, spans, stream, max_blocks);
    case at::kBFloat16: return launch_cast_to<c10::BFloat16>(dst, spans, stream, max_blocks);
    default: TORCH_CHECK(false, "offload: no cast kernel from ", src);
  }
}

// SM count per device, asked once (a driver call per pack would cost more than small packs).
int multiprocessors(c10::DeviceIndex index) {
  static std::array<std::atomic<int>, 64> cache{};
  auto& slot = cache.at(static_cast<size_t>(index));
  int count = slot.load(std::memory_order_relaxed);
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, index));
    slot.store(count, std::memory_order_relaxed);
  }
  return count;
}

}  // namespace

void copy_spans_cuda(const std::vector<CopySpan>& spans, c10::Device device, int64_t max_blocks_arg) {
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // Default: enough resident blocks to keep every SM's load units busy; the rest
  // loop. The blocks are persistent (grid-stride), so a kernel launched beside
  // this one (a collective) finds no SM free until the last block exits; a
  // caller that runs beside a collective passes fewer blocks than SMs instead.
  const int max_blocks = max_blocks_arg > 0 ? static_cast<int>(std::min<int64_t>(max_blocks_arg, 1 << 20))
                                            : multiprocessors(device.index()) * 8;
  std::vector<CopySpan> bytes;
  std::map<std::pair<int, int>, std::vector<CopySpan>> casts;
  for (const CopySpan& span : spans) {
    if (span.src_dtype == span.dst_dtype) {
      const int64_t item = static_cast<int64_t>(c10::elementSize(span.src_dtype));
      bytes.push_back({span.src, span.dst, span.numel * item, at::kByte, at::kByte});
    } else {
      casts[{static_cast<int>(span.src_dtype), static_cast<int>(span.dst_dtype)}].push_back(span);
    }
  }
  if (!bytes.empty()) launch_group<uint8_t, uint8_t>(bytes, stream, max_blocks);
  for (const auto& group : casts) {
    launch_cast(static_cast<c10::ScalarType>(group.first.first), static_cast<c10::ScalarType>(group.first.second),
                group.second, stream, max_blocks);
  }
}

}  // namespace offload
