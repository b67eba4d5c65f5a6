// Byte spans of device storages into one host block: CopyEngine::spans_to_host,
// the activation engine's copy of a layer's saved tensors.
//
// Moves: span i, bytes [starts[i], starts[i] + sizes[i]) of tensors[i]'s storage,
// to bytes [offsets[i], offsets[i] + sizes[i]) of one uint8 host block, by one DMA
// per span (in chunk_bytes pieces, enqueued as one batch where the runtime has one)
// on the copy stream, after the caller's work so far. Layout: raw storage bytes,
// whatever the tensors' dtypes and strides; no per-span tensor is made. Limits: one
// device per call; the block is a HostPool block (given, or acquired here), so the
// pool holds it back until the copies end.
#include <chrono>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>

#include "copy_engine.h"
#include "offload/checks.h"
#include "offload/event_cache.h"
#include "offload/multi_tensor_copy.h"

namespace offload {

std::shared_ptr<Transfer> CopyEngine::spans_to_host(const std::vector<at::Tensor>& sources,
                                                  const std::vector<int64_t>& starts,
                                                  const std::vector<int64_t>& sizes, const at::Tensor& given_out,
                                                  int64_t out_bytes, const std::vector<int64_t>& offsets,
                                                  HostPool& pool, const c10::optional<c10::Stream>& stream,
                                                  const CopyOptions& options) {
  const char* fn = "offload.copy_spans_to_host";
  const size_t n = sources.size();
  TORCH_CHECK_VALUE(starts.size() == n && sizes.size() == n && offsets.size() == n, fn,
                    ": tensors, starts, sizes and offsets need one entry per span, got ", n, ", ", starts.size(),
                    ", ", sizes.size(), " and ", offsets.size());
  if (given_out.defined()) {
    TORCH_CHECK_VALUE(given_out.is_cpu() && given_out.scalar_type() == at::kByte && given_out.dim() == 1 &&
                          given_out.is_contiguous(),
                      fn, ": out must be a 1-d uint8 host tensor (a HostPool block), got ", describe(given_out));
    TORCH_CHECK_VALUE(pool.owns(given_out), fn, ": out must be a block of the pool the copy records on "
                      "(HostPool.acquire), so it is not reused before the copy completes");
  } else {
    TORCH_CHECK_VALUE(out_bytes >= 0, fn, ": out must be a HostPool block or its size in bytes (>= 0), got ",
                      out_bytes);
  }
  const c10::DeviceType expected = pool.device_type();
  const int64_t out_numel = given_out.defined() ? given_out.numel() : out_bytes;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    check_source(fn, i, sources[i], expected, sources[0]);
    const int64_t storage_bytes = static_cast<int64_t>(sources[i].storage().nbytes());
    TORCH_CHECK_VALUE(starts[i] >= 0 && sizes[i] >= 0 && starts[i] + sizes[i] <= storage_bytes, fn, ": span ", i,
                      " is bytes [", starts[i], ", ", starts[i] + sizes[i], ") of a storage of ", storage_bytes,
                      " bytes");
    TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + sizes[i] <= out_numel, fn, ": span ", i, " goes to bytes [",
                      offsets[i], ", ", offsets[i] + sizes[i], ") of out, which has ", out_numel);
    total += sizes[i];
  }
  const c10::Device device = n ? sources[0].device() : c10::Device(at::kCPU);
  const bool on_device = !device.is_cpu();
  TORCH_CHECK_VALUE(!on_device || stream.has_value(), fn, ": a copy stream is required for ", device);
  const at::Tensor out = given_out.defined() ? given_out : pool.allocate(static_cast<size_t>(out_bytes));
  auto result = std::make_shared<Transfer>(device);
  result->nbytes_ = total;
  if (options.timing) result->timer_ = std::make_shared<CopyTimer>();
  result->outputs_->push_back(out);
  result->host_bases_->push_back(out);
  result->event_of_.assign(1, -1);
  char* dst = static_cast<char*>(out.data_ptr());
  auto copy_all = [&] {
    // One batch for the group (copy_ranges_async): the spans land in disjoint bytes of
    // `out`, and the completion event below follows all of them.
    std::vector<ByteRange> ranges;
    ranges.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const char* src = static_cast<const char*>(sources[i].storage().data()) + starts[i];
      for (int64_t at = 0; at < sizes[i]; at += options.chunk_bytes) {
        ranges.push_back({src + at, dst + offsets[i] + at, std::min(options.chunk_bytes, sizes[i] - at)});
      }
    }
    copy_ranges_async(ranges, /*dst_on_host=*/true, /*src_on_host=*/!on_device, device);
  };
  if (!on_device) {  // host to host: done on return
    const auto start = std::chrono::steady_clock::now();
    copy_all();
    if (options.timing) result->timer_->stop_host_clock(start);
    return result;
  }
  SharedEvent done;
  {
    // The copy stream waits for the caller's work so far (the values the spans
    // hold now); the pool holds `out` back until the copies complete, and the
    // transfer holds the sources (their storages) until then.
    c10::DeviceGuard on_device_guard(device);
    order_after(*stream, current_stream(device));
    c10::StreamGuard on_copy(*stream);
    if (options.timing) record_timing(result->timer_->start, *stream);  // after the wait: the copies only
    copy_all();
    // One event after the copies serves the transfer, the pool's block, the timer's end
    // and the in-flight entry of the sources (RecordedEvent): nothing is queued after it.
    done = result->mark_complete(*stream, {0});
    if (!pool.record_stream(out, *stream, done)) result->keepalive_.push_back(out);
    if (options.timing) result->timer_->end = done;
  }
  hold_sources(*result, sources, stream, done);
  return result;
}

}  // namespace offload
