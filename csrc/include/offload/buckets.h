// Flat copies with an optional cast between many (source, destination) spans:
// the engine under bucket packing (sources -> bucket) and unpacking (bucket ->
// destinations). A span is `numel` elements, contiguous on both sides.
#pragma once

#include <cstdint>
#include <vector>

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

#ifdef OFFLOAD_WITH_CUDA
void copy_spans_cuda(const std::vector<CopySpan>& spans, c10::Device device, int64_t max_blocks);
#endif

}  // namespace offload
