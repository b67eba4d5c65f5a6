// Host to device: CopyEngine::to_device and its plan, CopyEngine::ToDevice.
//
// Moves: host tensors to one device, span by span. Small tensors (< small_bytes)
// of one host storage that sit close together (as a packed block's do, gaps of
// at most kMaxSpanGap bytes, 16-byte aligned offsets) form a span: one device
// buffer, one DMA, a view per tensor; others move by themselves, in chunk_bytes
// pieces. Layout: each tensor arrives with its compact dense layout, or, where
// the device-to-host copy made it contiguous, with its original sizes and strides
// (Transfer::restore_specs); into caller-owned tensors (out=) any layout, through
// a staging buffer and one multi-tensor copy. Limits: host sources only; an
// unpinned source would block the host, so require_pinned refuses it.
#include <chrono>
#include <unordered_map>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>

#include "copy_engine.h"
#include "offload/checks.h"
#include "offload/event_cache.h"
#include "offload/multi_tensor_copy.h"
#include "offload/tensor_layout.h"

namespace offload {

// One host-to-device transfer, enqueued span by span. Small tensors of one
// host storage that sit close together (as a packed block's do) form a span:
// one device buffer, one DMA, a view per tensor. The copy stream first waits
// for the caller's stream, so outputs allocated there afterwards are safe to write.
class CopyEngine::ToDevice {
 public:
  ToDevice(TensorSource& tensors, const std::shared_ptr<Transfer>& from,
           const c10::Device& device, HostPool& pool, const c10::optional<c10::Stream>& stream,
           const c10::optional<std::vector<at::Tensor>>& out, const CopyOptions& options, Transfer& r)
      : tensors_(tensors), from_(from), device_(device), pool_(pool), stream_(stream), out_(out),
        options_(options), r_(r), on_device_(!tensors.empty() && !device.is_cpu()), n_(tensors.size()),
        prepared_(n_) {
    r_.outputs_->resize(n_);
    r_.restore_.resize(n_);
    r_.event_of_.assign(n_, -1);
  }

  void run() {
    if (options_.timing) r_.timer_ = std::make_shared<CopyTimer>();
    if (from_ && !on_device_) from_->synchronize();
    if (on_device_) {
      device_guard_.reset_device(device_);
      order_after(*stream_, current_stream(device_));
      if (from_) from_->wait_stream(*stream_);
      if (options_.timing) record_timing(r_.timer_->start, *stream_);  // after the waits: the copies only
    }
    const auto host_start = std::chrono::steady_clock::now();
    enqueue_all();
    if (options_.timing) {
      if (on_device_) {
        // Nothing is queued after the last span's completion event (a timing event in a
        // timed transfer): the timer ends on it.
        if (r_.events_.empty()) {
          record_timing(r_.timer_->end, *stream_);
        } else {
          r_.timer_->end = r_.events_.back();
        }
      } else {
        r_.timer_->stop_host_clock(host_start);
      }
    }
  }

 private:
  void enqueue_all() {
    GroupSizes sizes(options_);
    Span span;
    for (size_t i = 0; i < n_; ++i) {
      check_member(i);
      Prepared& p = prepared_[i];
      p = prepare(tensors_[i], /*allow_contiguous=*/false);
      if (!is_dense(p.base)) {
        if (from_) from_->synchronize();  // a host-side copy must see the finished transfer
        p.base = p.base.contiguous();
      }
      r_.nbytes_ += p.nbytes;
      const int64_t idx = static_cast<int64_t>(i);
      if (p.nbytes == 0) {
        (*r_.outputs_)[i] = out_ ? (*out_)[i]
                                 : finish_output(idx, at::empty_strided(p.base.sizes(), p.base.strides(),
                                                                        p.base.options().device(device_)));
        continue;
      }
      const void* storage = p.base.storage().data();
      const int64_t offset = p.base.storage_offset() * static_cast<int64_t>(p.base.element_size());
      if (p.nbytes >= options_.small_bytes) {
        Span single;
        single.storage = storage;
        single.storage_offset = offset;
        single.bytes = p.nbytes;
        single.members.push_back(idx);
        single.offsets.push_back(0);
        enqueue(single);
        continue;
      }
      const int64_t end = span.storage_offset + span.bytes;
      const bool joins = !span.members.empty() && storage == span.storage && offset >= end &&
                         offset - end <= kMaxSpanGap && offset + p.nbytes - span.storage_offset <= sizes.current() &&
                         (offset - span.storage_offset) % kAlign == 0;
      if (!joins) {
        if (!span.members.empty()) {
          enqueue(span);
          sizes.next();
        }
        span = Span();
        span.storage = storage;
        span.storage_offset = offset;
      }
      span.members.push_back(idx);
      span.offsets.push_back(offset - span.storage_offset);
      span.bytes = std::max(span.bytes, offset + p.nbytes - span.storage_offset);
    }
    if (!span.members.empty()) enqueue(span);
  }

  struct Span {
    const void* storage = nullptr;
    std::vector<int64_t> members;
    std::vector<int64_t> offsets;  // byte offset of each member from the span's start
    int64_t storage_offset = 0;    // byte offset of the span in its host storage
    int64_t bytes = 0;
  };

  void check_member(size_t i) {
    const char* fn = "offload.copy_to_device";
    const at::Tensor& t = tensors_[i];
    if (!out_) check_source(fn, i, t, c10::DeviceType::CPU, tensors_[0]);  // with out=, to_device checked it
    if (on_device_ && options_.require_pinned && !from_ && t.numel() > 0) {
      TORCH_CHECK_VALUE(is_pinned(t), fn, ": tensors[", i, "] is not pinned, so the copy would block the host; "
                        "pass pinned memory (offload.copy_to_host results, offload.HostPool.empty, "
                        "tensor.pin_memory()) or require_pinned=False");
    }
  }

  // Asking the driver whether memory is pinned is a driver call, so ask once per storage.
  bool is_pinned(const at::Tensor& t) {
    const void* key = t.storage().data();
    auto it = pinned_storages_.find(key);
    if (it == pinned_storages_.end()) it = pinned_storages_.emplace(key, pool_.owns(t) || t.is_pinned()).first;
    return it->second;
  }

  at::Tensor finish_output(int64_t i, at::Tensor target) {
    const Prepared& p = prepared_[i];
    if (from_ && from_->restore_.size() == n_ && from_->restore_[i]) {
      const auto& spec = *from_->restore_[i];
      at::Tensor restored = at::empty_strided(spec.first, spec.second, p.base.options().device(device_));
      c10::optional<c10::StreamGuard> on_copy;
      if (on_device_) on_copy.emplace(*stream_);
      restored.copy_(target, /*non_blocking=*/true);
      if (on_device_) restored.record_stream(*stream_);
      return restored;
    }
    return p.expanded ? target.expand(tensors_[i].sizes()) : target;
  }

  void enqueue(Span& span) {
    const at::Tensor& first = prepared_[span.members[0]].base;
    const char* host = static_cast<const char*>(first.storage().data()) + span.storage_offset;
    if (!out_) {
      // Allocated on the caller's (consumer's) stream, which is current here.
      at::Tensor buffer = at::empty({span.bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
      if (on_device_) buffer.record_stream(*stream_);  // written there, even if every view of it dies mid-copy
      {
        c10::optional<c10::StreamGuard> on_copy;
        if (on_device_) on_copy.emplace(*stream_);
        copy_chunked(static_cast<char*>(buffer.data_ptr()), false, host, true, span.bytes, options_.chunk_bytes,
                     device_);
      }
      for (size_t k = 0; k < span.members.size(); ++k) {
        const int64_t i = span.members[k];
        (*r_.outputs_)[i] =
            finish_output(i, view_like(buffer.storage(), span.offsets[k], prepared_[i].base, device_));
      }
    } else {
      c10::optional<c10::StreamGuard> on_copy;
      if (on_device_) on_copy.emplace(*stream_);
      const int64_t i0 = span.members[0];
      const at::Tensor& target0 = (*out_)[i0];
      if (span.members.size() == 1 && is_dense(target0) && same_layout(target0, first)) {
        copy_bytes(target0, first, options_.chunk_bytes, device_);
      } else {
        // Into caller-owned tensors: DMA the span into staging (allocated on the
        // copy stream, which owns it), then one multi-tensor copy scatters it.
        at::Tensor staging = at::empty({span.bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
        copy_bytes_async(staging.data_ptr(), false, host, true, span.bytes, device_);
        std::vector<ByteRange> ranges;
        for (size_t k = 0; k < span.members.size(); ++k) {
          const int64_t i = span.members[k];
          const at::Tensor& target = (*out_)[i];
          at::Tensor view = view_like(staging.storage(), span.offsets[k], prepared_[i].base, device_);
          if (same_layout(target, view) && is_dense(target)) {
            ranges.push_back({view.data_ptr(), target.data_ptr(), tensor_nbytes(view)});
          } else {
            target.copy_(prepared_[i].expanded ? view.expand(tensors_[i].sizes()) : view, /*non_blocking=*/true);
          }
        }
        multi_tensor_copy(ranges, device_);  // staging: allocated and used on the copy stream only
      }
      for (int64_t i : span.members) {
        (*r_.outputs_)[i] = (*out_)[i];
        // Written on the copy stream but owned by the caller's: held until the
        // copies complete, so dropping them (and the handle) early cannot give
        // their memory to the caller's stream while the DMA still writes it.
        if (on_device_) r_.keepalive_.push_back((*out_)[i]);
      }
    }
    if (on_device_) {
      // Pool blocks are held back by the pool's events (here the span's completion event
      // itself); other host memory by a reference.
      const SharedEvent& done = r_.mark_complete(*stream_, span.members);
      if (!pool_.record_stream(first, *stream_, done)) r_.keepalive_.push_back(first);
    }
  }

  TensorSource& tensors_;
  const std::shared_ptr<Transfer>& from_;
  const c10::Device device_;
  HostPool& pool_;
  const c10::optional<c10::Stream>& stream_;
  const c10::optional<std::vector<at::Tensor>>& out_;
  const CopyOptions& options_;
  Transfer& r_;
  const bool on_device_;
  const size_t n_;
  std::vector<Prepared> prepared_;
  std::unordered_map<const void*, bool> pinned_storages_;
  c10::OptionalDeviceGuard device_guard_;
};

std::shared_ptr<Transfer> CopyEngine::to_device(TensorSource& tensors, const std::shared_ptr<Transfer>& from,
                                              const c10::Device& device, HostPool& pool,
                                              const c10::optional<c10::Stream>& stream,
                                              const c10::optional<std::vector<at::Tensor>>& out,
                                              const CopyOptions& options) {
  const char* fn = "offload.copy_to_device";
  const size_t n = tensors.size();
  const bool on_device = n > 0 && !device.is_cpu();
  // Without out= each source is checked as its span is formed (ToDevice::check_member),
  // so the first DMA need not wait for the checks of thousands of tensors behind it.
  if (out) {
    TORCH_CHECK_VALUE(out->size() == n, fn, ": out has ", out->size(), " tensors but tensors has ", n);
    for (size_t i = 0; i < n; ++i) {
      check_source(fn, i, tensors[i], c10::DeviceType::CPU, tensors[0]);
      check_out(fn, i, tensors[i], (*out)[i], device, options.require_pinned, false);
    }
  }
  TORCH_CHECK_VALUE(!on_device || stream.has_value(), fn, ": a copy stream is required for ", device);

  auto result = std::make_shared<Transfer>(device);
  ToDevice job(tensors, from, device, pool, stream, out, options, *result);
  try {
    job.run();
  } catch (...) {
    result->release_keepalive(stream);  // copies already queued keep their host sources
    throw;
  }
  // Nothing is queued after the last span's completion event: the registry's entry shares it.
  result->release_keepalive(stream, /*drain=*/true, result->events_.empty() ? nullptr : result->events_.back());
  return result;
}

}  // namespace offload
