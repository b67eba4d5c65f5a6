// Bucket packing and unpacking: many tensors into one uint8 bucket and back, with a
// cast on the way (fp32 -> bf16 and the like).
//
// Moves: spans of contiguous elements, [start, start + numel) of each tensor, to
// and from byte offsets of one bucket. Layout: Python plans it
// (offload/weights/bucket_planner.py); every tensor is contiguous and on the bucket's
// device, every offset aligned to its dtype. This file checks the plan against the
// tensors, turns it into flat spans and copies them: on the CPU with
// at::parallel_for, on CUDA with the multi-tensor kernel of cuda/bucket_pack.cu
// (one launch per dtype pair and table of spans, on the current stream). Limits:
// casts between float64, float32, float16 and bfloat16 only; other dtypes move as
// bytes into the same dtype; other devices are not built in.
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <ATen/ATen.h>

#include "offload/buckets.h"
#include "offload/checks.h"

namespace offload {

bool castable(c10::ScalarType dtype) {
  return dtype == at::kDouble || dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

namespace {

// Work is cut into pieces of this many source bytes so at::parallel_for balances
// one huge tensor against many small ones; 1 MiB amortises the task overhead.
constexpr int64_t kPieceBytes = 1 << 20;

void copy_spans_cpu(const std::vector<CopySpan>& spans) {
  // Casts go through torch's own CPU copy (vectorized and parallel itself), so a
  // packed value is bit for bit what tensor.to(dtype) gives, NaN payloads included
  // (torch's vectorized and scalar bf16 casts differ there). Same-dtype spans are
  // cut into pieces and memcpy'd in parallel.
  struct Piece {
    size_t span;
    int64_t begin, end;  // bytes
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < spans.size(); ++i) {
    const auto& s = spans[i];
    if (s.src_dtype != s.dst_dtype) {
      auto src = at::from_blob(const_cast<void*>(s.src), {s.numel}, at::TensorOptions().dtype(s.src_dtype));
      auto dst = at::from_blob(s.dst, {s.numel}, at::TensorOptions().dtype(s.dst_dtype));
      dst.copy_(src);
      continue;
    }
    const int64_t nbytes = s.numel * static_cast<int64_t>(c10::elementSize(s.src_dtype));
    for (int64_t b = 0; b < nbytes; b += kPieceBytes) pieces.push_back({i, b, std::min(nbytes, b + kPieceBytes)});
  }
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const Piece& piece = pieces[p];
      const CopySpan& s = spans[piece.span];
      std::memcpy(static_cast<char*>(s.dst) + piece.begin, static_cast<const char*>(s.src) + piece.begin,
                  piece.end - piece.begin);
    }
  });
}

// Checks shared by pack and unpack; `what` names the per-tensor list in errors.
void check_lists(const char* fn, const at::Tensor& bucket, const std::vector<at::Tensor>& tensors,
                 const std::vector<int64_t>& starts, const std::vector<int64_t>& numels,
                 const std::vector<int64_t>& offsets, const std::vector<c10::ScalarType>& dtypes, const char* what) {
  TORCH_CHECK_TYPE(bucket.scalar_type() == at::kByte && bucket.dim() == 1, fn,
                   ": bucket must be a 1-D uint8 tensor, got ", bucket.scalar_type(), " of shape ", bucket.sizes());
  TORCH_CHECK_VALUE(bucket.is_contiguous(), fn, ": bucket must be contiguous");
  const size_t n = tensors.size();
  TORCH_CHECK_VALUE(starts.size() == n && numels.size() == n && offsets.size() == n && dtypes.size() == n, fn,
                    ": ", what, ", starts, numels, offsets and dtypes must have one entry per tensor, got ", n, ", ",
                    starts.size(), ", ", numels.size(), ", ", offsets.size(), ", ", dtypes.size());
  const int64_t size = bucket.numel();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.layout() == at::kStrided && !t.is_meta(), fn, ": ", what, "[", i,
                      "] must be a strided tensor with data");
    TORCH_CHECK_VALUE(t.is_contiguous(), fn, ": ", what, "[", i, "] must be contiguous");
    check_has_data(t, fn, what, "[", i, "]");
    TORCH_CHECK_VALUE(t.device() == bucket.device(), fn, ": ", what, "[", i, "] is on ", t.device(),
                      " but the bucket is on ", bucket.device());
    TORCH_CHECK_VALUE(starts[i] >= 0 && numels[i] >= 0 && starts[i] + numels[i] <= t.numel(), fn, ": elements [",
                      starts[i], ", ", starts[i] + numels[i], ") are out of range for ", what, "[", i, "] with ",
                      t.numel(), " elements");
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtypes[i]));
    TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] % item == 0 && offsets[i] + numels[i] * item <= size, fn,
                      ": bytes [", offsets[i], ", ", offsets[i] + numels[i] * item, ") of ", what, "[", i,
                      "] do not fit a bucket of ", size, " bytes at ", dtypes[i], " alignment");
    TORCH_CHECK_VALUE(t.scalar_type() == dtypes[i] || (castable(t.scalar_type()) && castable(dtypes[i])), fn,
                      ": cannot cast ", what, "[", i, "] between ", t.scalar_type(), " and ", dtypes[i],
                      " (casts exist between float64, float32, float16 and bfloat16)");
  }
}

}  // namespace

void copy_spans(const std::vector<CopySpan>& spans, c10::Device device, int64_t max_blocks) {
  TORCH_CHECK_VALUE(max_blocks >= 0, "offload: max_blocks must be >= 0 (0: fill the device), got ", max_blocks);
  if (spans.empty()) return;
#ifdef OFFLOAD_WITH_CUDA
  if (device.is_cuda()) {
    copy_spans_cuda(spans, device, max_blocks);
    return;
  }
#endif
  TORCH_CHECK(device.is_cpu(), "offload: bucket copies on ", device, " are not built into this core");
  copy_spans_cpu(spans);
}

// Writes elements [starts[i], starts[i] + numels[i]) of sources[i], cast to
// dtypes[i], at byte offsets[i] of the bucket.
void pack_bucket(const at::Tensor& bucket, const std::vector<at::Tensor>& sources, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& numels, const std::vector<int64_t>& offsets,
                 const std::vector<c10::ScalarType>& dtypes, int64_t max_blocks) {
  check_lists("offload.pack_bucket", bucket, sources, starts, numels, offsets, dtypes, "sources");
  std::vector<CopySpan> spans;
  spans.reserve(sources.size());
  char* base = static_cast<char*>(bucket.data_ptr());
  for (size_t i = 0; i < sources.size(); ++i) {
    if (numels[i] == 0) continue;
    const at::Tensor& s = sources[i];
    const char* src = static_cast<const char*>(s.const_data_ptr()) + starts[i] * s.element_size();
    spans.push_back({src, base + offsets[i], numels[i], s.scalar_type(), dtypes[i]});
  }
  c10::OptionalDeviceGuard guard(bucket.device());
  copy_spans(spans, bucket.device(), max_blocks);
}

// Reads numels[i] elements of dtype dtypes[i] at byte offsets[i] of the bucket
// into destinations[i] from element starts[i] on, cast to its dtype.
void unpack_bucket(const at::Tensor& bucket, const std::vector<at::Tensor>& destinations,
                   const std::vector<int64_t>& starts, const std::vector<int64_t>& numels,
                   const std::vector<int64_t>& offsets, const std::vector<c10::ScalarType>& dtypes,
                   int64_t max_blocks) {
  check_lists("offload.unpack_bucket", bucket, destinations, starts, numels, offsets, dtypes, "destinations");
  std::vector<CopySpan> spans;
  spans.reserve(destinations.size());
  const char* base = static_cast<const char*>(bucket.const_data_ptr());
  for (size_t i = 0; i < destinations.size(); ++i) {
    if (numels[i] == 0) continue;
    const at::Tensor& d = destinations[i];
    char* dst = static_cast<char*>(d.data_ptr()) + starts[i] * d.element_size();
    spans.push_back({base + offsets[i], dst, numels[i], dtypes[i], d.scalar_type()});
  }
  c10::OptionalDeviceGuard guard(bucket.device());
  copy_spans(spans, bucket.device(), max_blocks);
}

}  // namespace offload
