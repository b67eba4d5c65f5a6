// The copy engine's parts and what they share; private to csrc/core.
//
// include/offload/transfer.h is the engine's interface (and says who owns which
// buffer on which stream). Behind it, one class CopyEngine, the friend of
// Transfer, gathers the entry points and the helpers every direction uses; its
// parts live in their own files:
//   copy_engine.cpp        the helpers below and the public entry points of transfer.h
//   to_host.cpp            device -> host (to_host, and the plan ToHost, to_host_plan.h)
//   to_host_deferred.cpp   device -> host queued by the copy worker (to_host_deferred)
//   spans_to_host.cpp      byte spans of storages -> one host block (spans_to_host)
//   to_device.cpp          host -> device (to_device, and its plan ToDevice)
//   transfer.cpp           the handle: waits, queries, timing
//   in_flight.h/.cpp       tensors held until the copies that read them complete
//   copy_worker.h/.cpp     the thread that queues deferred copies
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

#include "offload/host_pool.h"
#include "offload/tensor_source.h"
#include "offload/transfer.h"

namespace offload {

class CopyEngine {
 public:
  // Device to host (to_host.cpp): small tensors (< small_bytes) are packed by one
  // multi-tensor copy into a device staging buffer and moved by one DMA into one
  // pooled host block; large tensors move by DMA in chunk_bytes pieces into their
  // own block.
  static std::shared_ptr<Transfer> to_host(TensorSource& tensors, HostPool& pool,
                                           const c10::optional<c10::Stream>& stream,
                                           const c10::optional<std::vector<at::Tensor>>& out,
                                           const std::shared_ptr<Transfer>& reuse, const CopyOptions& options);
  // Device to host, queued by the copy worker (to_host_deferred.cpp; Note [deferred copy]).
  static std::shared_ptr<Transfer> to_host_deferred(std::unique_ptr<TensorSource> owned, HostPool& pool,
                                                    const c10::optional<c10::Stream>& stream,
                                                    const std::shared_ptr<Transfer>& reuse,
                                                    const CopyOptions& options,
                                                    const std::function<void()>& converted);
  // Byte spans of device storages into one host block (spans_to_host.cpp).
  static std::shared_ptr<Transfer> spans_to_host(const std::vector<at::Tensor>& sources,
                                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
                                                 const at::Tensor& given_out, int64_t out_bytes,
                                                 const std::vector<int64_t>& offsets, HostPool& pool,
                                                 const c10::optional<c10::Stream>& stream,
                                                 const CopyOptions& options);
  // Host to device (to_device.cpp): host tensors that sit close together in one
  // storage (as a packed block's do) move as one DMA into one device buffer,
  // viewed per tensor; others move by themselves. One event per group lets a
  // consumer wait for the tensor it needs rather than the whole batch.
  static std::shared_ptr<Transfer> to_device(TensorSource& tensors, const std::shared_ptr<Transfer>& from,
                                             const c10::Device& device, HostPool& pool,
                                             const c10::optional<c10::Stream>& stream,
                                             const c10::optional<std::vector<at::Tensor>>& out,
                                             const CopyOptions& options);

 private:
  class ToHost;                // to_host_plan.h
  struct DeferredToHost;       // to_host_deferred.cpp
  class ToDevice;              // to_device.cpp

  static constexpr int64_t kAlign = 16;                      // packed offsets: 16-byte vector copies
  static constexpr int64_t kMaxSpanGap = int64_t(64) << 10;  // host gap worth reading to save a DMA
  // Staging buffers a device-to-host transfer packs into: kSlots of them, reused
  // in turn; packing into a slot waits (on the device) for the DMA that last read it.
  static constexpr int kSlots = 3;

  static int64_t align_up(int64_t value) { return (value + kAlign - 1) / kAlign * kAlign; }

  // One staging buffer and one DMA (CopyOptions::group_bytes says why its size).
  static int64_t group_limit(const CopyOptions& options) {
    return std::max(options.small_bytes, std::min(options.chunk_bytes, options.group_bytes));
  }

  // Group sizes for one transfer: 1 MiB first, doubling up to group_limit. The
  // first DMA then starts after the host work of a few tensors rather than of a
  // full group (512 tensors of 16 KiB), and the queue is deep again by the fourth.
  class GroupSizes {
   public:
    explicit GroupSizes(const CopyOptions& options)
        : limit_(group_limit(options)), current_(std::min(limit_, kFirstGroupBytes)) {}
    int64_t current() const { return current_; }
    void next() { current_ = std::min(limit_, current_ * 2); }

   private:
    static constexpr int64_t kFirstGroupBytes = int64_t(1) << 20;
    const int64_t limit_;
    int64_t current_;
  };

  // The per-tensor work both directions share: what is read, and its size.
  struct Prepared {
    at::Tensor base;  // compact (broadcast dims narrowed) and dense
    bool expanded = false;
    bool made_contiguous = false;
    bool resolved = false;  // a conj/neg view resolved into a new tensor
    int64_t nbytes = 0;
  };

  // ------------------------------------------------------ helpers (copy_engine.cpp)
  static c10::Stream current_stream(const c10::Device& device);
  // The side stream a device-to-host transfer packs on (Note [pack stream]).
  static c10::Stream pack_stream(const c10::Device& device);

  // Argument checks that name the function, the argument, the rule and what arrived.
  static void check_source(const char* fn, size_t i, const at::Tensor& t, c10::DeviceType expected,
                           const at::Tensor& first);
  static void check_out(const char* fn, size_t i, const at::Tensor& src, const at::Tensor& dst,
                        const c10::Device& where, bool require_pinned, bool pinning);
  static void check_same_sources(const CopyOptions& options, const std::shared_ptr<Transfer>& reuse);
  static void check_reuse_count(const Transfer& reuse, size_t n);

  // Copies `nbytes` from `src` to `dst` in pieces of at most `chunk_bytes`, on the
  // current stream of `device`.
  static void copy_chunked(char* dst, bool dst_on_host, const char* src, bool src_on_host, int64_t nbytes,
                           int64_t chunk_bytes, const c10::Device& device);
  // Copies the bytes of dense `src` into dense `dst` (identical strides), in chunks,
  // on the current stream of `device`.
  static void copy_bytes(const at::Tensor& dst, const at::Tensor& src, int64_t chunk_bytes,
                         const c10::Device& device);
  static bool same_layout(const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type();
  }

  // What a copy reads for `t`: compact and dense; `allow_contiguous` lets it make
  // a contiguous copy of a gapped tensor (on the current stream).
  static Prepared prepare(const at::Tensor& t, bool allow_contiguous);
  // Whether prepare() would make a new tensor (a kernel) for `t`.
  static bool needs_new_tensor(const at::Tensor& t);

  // A timing event from the cache, recorded on `stream`.
  static void record_timing(SharedEvent& event, const c10::Stream& stream);

  // A device-to-host transfer holds its sources until its copies complete. They
  // are handed over once queued (or on failure, those converted so far), not
  // before, so the first copy does not wait for thousands of reference counts.
  // `at`: the transfer's last completion, when nothing was queued after it, for the
  // registry's entry to share (Transfer::release_keepalive).
  static void hold_sources(Transfer& r, const std::vector<at::Tensor>& sources,
                           const c10::optional<c10::Stream>& stream, const SharedEvent& at = nullptr);
  static void hold_sources(Transfer& r, TensorSource& tensors, bool on_device,
                           const c10::optional<c10::Stream>& stream);
};

}  // namespace offload
