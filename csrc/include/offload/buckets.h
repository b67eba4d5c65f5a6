// Flat copies with an optional cast between many (source, destination) spans:
// the engine under bucket packing (sources -> bucket) and unpacking (bucket ->
// destinations). A span is `numel` elements, contiguous on both sides.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace offload {

struct CopySpan {
  const void* src;
  void* dst;
  int64_t numel;
  c10::ScalarType src_dtype;
  c10::ScalarType dst_dtype;
};

// True for the dtypes the cast kernels convert between (fp64, fp32, fp16, bf16);
// spans whose two dtypes are equal are copied as raw bytes, whatever the dtype.
bool castable(c10::ScalarType dtype);

// Copies every span; on the CPU with at::parallel_for, on CUDA as one kernel launch
// per (source dtype, destination dtype) pair and per table of spans, on the
// current stream of `device`. `max_blocks` caps the blocks of each CUDA launch (0:
// enough to fill every SM); a weight sync passes fewer than the SM count so the
// pack leaves whole SMs free for the collective running beside it.
void copy_spans(const std::vector<CopySpan>& spans, c10::Device device, int64_t max_blocks = 0);

// Writes elements [starts[i], starts[i] + numels[i]) of sources[i], cast to
// dtypes[i], at byte offsets[i] of `bucket` (a contiguous 1-D uint8 tensor), on
// the current stream of the bucket's device. Checks the plan first: ValueError or
// TypeError naming the argument, the rule and what arrived.
void pack_bucket(const at::Tensor& bucket, const std::vector<at::Tensor>& sources, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& numels, const std::vector<int64_t>& offsets,
                 const std::vector<c10::ScalarType>& dtypes, int64_t max_blocks = 0);

// Reads numels[i] elements of dtype dtypes[i] at byte offsets[i] of `bucket` into
// destinations[i] from element starts[i] on, cast to its dtype; checked as pack_bucket.
void unpack_bucket(const at::Tensor& bucket, const std::vector<at::Tensor>& destinations,
                   const std::vector<int64_t>& starts, const std::vector<int64_t>& numels,
                   const std::vector<int64_t>& offsets, const std::vector<c10::ScalarType>& dtypes,
                   int64_t max_blocks = 0);

#ifdef OFFLOAD_WITH_CUDA
void copy_spans_cuda(const std::vector<CopySpan>& spans, c10::Device device, int64_t max_blocks);
#endif

}  // namespace offload
