// The copy engine: batched, asynchronous transfers between a device and the host.
// Its parts live in csrc/core (copy_engine.h lists them); its Python bindings in
// csrc/python/copy_engine.cpp.
//
// Stream ownership, in one place:
// - Sources of a device-to-host copy belong to the caller's stream. The copy
//   stream first waits (on the device) for an event recorded there, so it sees
//   every value the caller queued; the transfer then holds the sources until its
//   last event completes (Note [in-flight registry], csrc/core/in_flight.h), so
//   the caching allocator cannot reuse them mid-copy.
// - Device staging buffers are allocated while the copy stream is current and
//   used only on it, so the allocator's stream order protects them.
// - Host blocks come from the HostPool; every copy records its stream on them,
//   so a block whose tensors die early is not reused before the copy completes.
// - Outputs of a host-to-device copy are allocated on the caller's (consumer's)
//   stream; the copy stream waits for an event recorded there first (earlier
//   users of that memory) and record_stream()s them, and the consumer waits for
//   the transfer's events before reading them.
// - A deferred device-to-host copy (copy_to_host_deferred): Note [deferred copy].
//
// Note [deferred copy]
// A deferred device-to-host copy splits the work in two. The calling thread fixes
// the transfer's outputs, groups and host buffers (those of the handle it reuses),
// waits until the worker has queued every earlier deferred copy (so refills land in
// call order), records the snapshot event on the caller's current stream, queues the
// first group itself, allocates the device staging slots (on the pack stream,
// recorded on the copy stream, as a synchronous copy does: the worker allocates
// nothing), then converts and checks every other source, group by group. The copy
// worker (one native thread per process, FIFO, never takes the GIL) queues each
// group as soon as the calling thread has checked it, making the copy and pack
// streams wait on the snapshot event, not on the caller's stream as it is then, so
// the copy holds the values as of the call. Where a source fails its check or needs
// a new tensor, the calling thread stops the worker, waits until it has, and raises
// or copies the rest itself.
//
// Until the worker has queued the copies, the job owns the sources and a reference
// to the transfer (so neither dies under it); then the sources go to the in-flight
// registry, as for a synchronous copy. Every method that reads the events (query,
// synchronize, wait_stream, wait_stream_for, release_sources, copy_seconds) first
// waits, on the host, until the worker has queued them, and raises the worker's
// error, if any, on every call. Finished jobs are destroyed by a later call from a
// calling thread (the next deferred copy, a wait on a deferred handle:
// CopyWorker::collect, with the GIL held where called from Python), never by the
// worker, since dropping the last C++ reference to a tensor that has a Python object
// takes the GIL.
//
// A synchronous copy into buffers (out=) first waits until the worker has queued
// every deferred copy, so refills of one set of buffers land in call order.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

#include "offload/event_cache.h"
#include "offload/host_pool.h"
#include "offload/tensor_source.h"

namespace offload {

// The timing of a timed copy (options.timing): timing-enabled events around the
// copies on the copy stream, or on the host (synchronous copies) the seconds they
// took. Apart from the transfer: it holds none of its tensors, so a caller that
// reads the seconds later (the activation engine, at the next step) need not keep
// the copy's buffers alive until then.
struct CopyTimer {
  CopyTimer() = default;
  CopyTimer(const CopyTimer&) = delete;
  CopyTimer& operator=(const CopyTimer&) = delete;
  SharedEvent start;
  SharedEvent end;  // where it can, the transfer's last completion event itself
  c10::optional<double> host_seconds;
  // Seconds from the start event to the end event, or nullopt while the copies run;
  // never waits.
  c10::optional<double> seconds() const;
  bool done() const { return host_seconds.has_value() || !end || end->query(); }
  // On the host (synchronous copies): the seconds since `start`.
  void stop_host_clock(std::chrono::steady_clock::time_point start) {
    host_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  void synchronize() const {
    if (end) end->synchronize();
  }
};

class Transfer {
 public:
  // Host layout of a device-to-host transfer, kept so a later transfer of
  // tensors with the same shapes can reuse the host buffers (copy_to_host(out=...)).
  struct Group {
    bool packed = false;          // many small tensors in one block, one DMA
    at::Tensor host_block;        // packed: the uint8 block they share
    int64_t bytes = 0;
    std::vector<int64_t> members;  // indices into the outputs
    std::vector<int64_t> offsets;  // packed: byte offset of each member in the block
  };
  using Strides = std::pair<std::vector<int64_t>, std::vector<int64_t>>;

  // What a deferred transfer's readers wait on (see the top of this file). Holds no
  // tensor: the copy worker may drop the last reference to it.
  struct Deferred {
    std::mutex mutex;
    std::condition_variable queued;
    std::atomic<bool> ready{false};
    std::exception_ptr error;  // written before ready; read after it
    // Called by the copy worker once it has queued (or failed to queue) the copies.
    void publish(std::exception_ptr failure);
  };

  // What each source of a device-to-host transfer made afresh (no out) was, so
  // a refill of its buffers (out=<handle>) checks a source against these few
  // values instead of reading the host tensors: thousands of host tensors read
  // on every refill cost more than the checks themselves once the training
  // step between two saves has evicted them from the caches. Shared by every
  // transfer into the same buffers (a refill's handle works as out= too).
  struct SourceKeys {
    struct Key {
      bool plain = false;  // copied as it was: contiguous, no conj/neg bit, not empty
      c10::ScalarType dtype = c10::ScalarType::Undefined;
      int64_t sizes_at = 0;  // its sizes: sizes[sizes_at, sizes_at + ndim)
      int64_t ndim = 0;
    };
    explicit SourceKeys(size_t n) : keys(n), data(n) {}
    std::vector<Key> keys;
    std::vector<int64_t> sizes;
    // Where each source's bytes were when the buffers were last filled
    // (CopyOptions::same_sources); written and read by calling threads only.
    std::vector<std::atomic<uintptr_t>> data;
  };

  explicit Transfer(c10::Device device) : device_(device) {}
  ~Transfer();  // gives its events back to the cache (event_cache.h)
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  const std::vector<at::Tensor>& tensors() const { return *outputs_; }
  int64_t nbytes() const { return nbytes_; }
  c10::Device device() const { return device_; }
  // Original sizes and strides of sources that moved as contiguous copies, per
  // tensor; empty for a device-to-host transfer that made none.
  const std::vector<c10::optional<Strides>>& restore_specs() const { return restore_; }

  // Both end by dropping the tensors the engine held for copies that are complete
  // (this transfer's and others'), unless `drain` is false. A source whose Python
  // object is alive takes the GIL as its reference goes, so a caller that waits
  // without the GIL drains after taking it back (Note [dropping tensors],
  // csrc/core/in_flight.h).
  bool query(bool drain = true) const;
  void synchronize(bool drain = true) const;
  // The consumer `stream` (default: the current stream of the transfer's device;
  // nothing to wait for on the CPU) waits on the device for the whole transfer, or
  // only for the copy that carries output `index`.
  void wait_stream(const c10::optional<c10::Stream>& stream = c10::nullopt) const;
  void wait_stream_for(int64_t index, const c10::optional<c10::Stream>& stream = c10::nullopt) const;
  // The consumer `stream` (default: the current one) waits on the device for the
  // whole transfer, and the engine drops at once, without a host wait, the device
  // tensors it held until the copies complete (a device-to-host transfer's
  // sources). Their memory returns to the caching allocator in that stream's
  // order, which is safe for memory allocated on that stream: the allocator hands
  // a freed block to later allocations on the stream it was allocated on, and
  // those are queued after this wait. The caller promises that. Host tensors stay
  // held until the copies complete.
  void release_sources(const c10::optional<c10::Stream>& stream = c10::nullopt);
  // Seconds the copies took on the copy stream (after the caller's earlier work),
  // or nullopt while they run or are not queued yet; never waits. On the host:
  // the time of the synchronous copies. Raises unless copied with options.timing.
  c10::optional<double> copy_seconds() const;
  // The copy's timing apart from the transfer (see CopyTimer); waits until a
  // deferred transfer's copies are queued. Raises unless copied with options.timing.
  std::shared_ptr<CopyTimer> timer() const;
  // True while a deferred transfer's copies are not queued yet.
  bool enqueue_pending() const {
    return deferred_ != nullptr && !deferred_->ready.load(std::memory_order_acquire);
  }
  // Blocks the host until a deferred transfer's copies are queued (no-op for
  // others); raises the copy worker's error if it failed.
  void wait_enqueued() const;
  bool deferred() const { return deferred_ != nullptr; }

 private:
  friend class CopyEngine;
  // Hands keepalive_ to the in-flight registry, which drops it once the copies
  // queued on `stream` so far have completed. `drain` false: leave finished
  // entries for another thread to drop (the copy worker must not drop tensors).
  // `at`: an event already recorded on `stream` after every copy queued so far
  // (the last completion), which the entry shares instead of recording its own.
  void release_keepalive(const c10::optional<c10::Stream>& stream, bool drain = true, const SharedEvent& at = nullptr);
  // Records the event after which `members` are complete on the copy `stream`; a
  // timed transfer's is a timing event, so that its timer may end on it.
  const SharedEvent& mark_complete(const c10::Stream& stream, const std::vector<int64_t>& members);
  c10::optional<c10::Stream> consumer(const c10::optional<c10::Stream>& stream) const;
  using TensorList = std::vector<at::Tensor>;
  c10::Device device_;
  // A refill (out=<handle>) writes the same host tensors as the handle it refills,
  // so it shares these lists instead of copying them: a copy costs a reference
  // count per tensor, on cache lines a training step has evicted, for thousands
  // of tensors per refill. Never changed once the transfer is returned.
  std::shared_ptr<TensorList> outputs_ = std::make_shared<TensorList>();
  // Device-to-host: what was written (outputs_ may be expanded views of it).
  std::shared_ptr<TensorList> host_bases_ = std::make_shared<TensorList>();
  std::vector<c10::optional<Strides>> restore_;
  std::vector<Group> groups_;
  std::shared_ptr<SourceKeys> source_keys_;  // device-to-host into pooled buffers (not out=<list>)
  std::vector<SharedEvent> events_;  // recorded on the copy stream, in order
  std::vector<int32_t> event_of_;    // per output: the event after which it is complete (-1: no event)
  int64_t nbytes_ = 0;
  // Tensors that must outlive the copies (a device-to-host transfer's sources,
  // non-pooled host sources): handed to the in-flight registry when queued.
  std::vector<at::Tensor> keepalive_;
  std::vector<uint64_t> inflight_tickets_;  // what the in-flight registry holds for this transfer
  std::shared_ptr<Deferred> deferred_;      // set by copy_to_host_deferred only
  std::shared_ptr<CopyTimer> timer_;        // options.timing only
};

struct CopyOptions {
  bool require_pinned = true;
  int64_t small_bytes = int64_t(1) << 20;   // below: packed with others into one DMA
  int64_t chunk_bytes = int64_t(64) << 20;  // large tensors move in pieces of this size
  // Most bytes packed into one group (one pack launch, one DMA, one event); the
  // group also never exceeds chunk_bytes. 8 MiB already runs the DMA close to its
  // peak (benchmarks/RESULTS.md) and starts the first DMA soon after the call; a caller that refills
  // the same groups many times (checkpoint staging) asks for larger groups, so
  // thousands of small tensors cost fewer launches and events per save. The
  // device holds three staging buffers of this size while a copy runs.
  int64_t group_bytes = int64_t(8) << 20;
  // copy_to_host, copy_spans_to_host, copy_to_device: time the copies on the
  // copy stream (Transfer::copy_seconds).
  bool timing = false;
  // copy_to_host(out=<handle>): every source must be where the source it
  // replaces was when the handle's buffers were last filled, else ValueError. A
  // caller whose own bookkeeping depends on those addresses (the stager's plan of
  // which tensors share memory) need not read them itself.
  bool same_sources = false;
};

// Each takes its tensors as a vector or as a TensorSource (converted as the
// engine walks it; see tensor_source.h).
std::shared_ptr<Transfer> copy_to_host(TensorSource& tensors, HostPool& pool,
                                       const c10::optional<c10::Stream>& stream,
                                       const c10::optional<std::vector<at::Tensor>>& out,
                                       const std::shared_ptr<Transfer>& out_transfer, const CopyOptions& options);
std::shared_ptr<Transfer> copy_to_host(const std::vector<at::Tensor>& tensors, HostPool& pool,
                                       const c10::optional<c10::Stream>& stream,
                                       const c10::optional<std::vector<at::Tensor>>& out,
                                       const std::shared_ptr<Transfer>& out_transfer, const CopyOptions& options);

// Copies byte spans of device storages into one host block: span i, bytes
// [starts[i], starts[i] + sizes[i]) of tensors[i]'s storage, lands at out[offsets[i]:].
// `out` is a uint8 block of `pool` (recorded on the copy stream); undefined, the
// call acquires a block of `out_bytes` from `pool` itself (one call less per
// group from Python). One call for a group of spans (the activation engine's
// saved tensors of a layer), no per-span tensors; the handle's one output is the
// block. After the caller's work on its current stream, as copy_to_host.
std::shared_ptr<Transfer> copy_spans_to_host(const std::vector<at::Tensor>& tensors,
                                             const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
                                             const at::Tensor& out, int64_t out_bytes,
                                             const std::vector<int64_t>& offsets, HostPool& pool,
                                             const c10::optional<c10::Stream>& stream, const CopyOptions& options);

// Checks the sources against `out_transfer` (a transfer of tensors of the same
// layout, whose host buffers are refilled) and records the snapshot event here,
// then returns; the copy worker queues the copies (see the top of this file).
// Runs synchronously, as copy_to_host, where there is nothing to defer: host
// sources (no stream order protects the snapshot on the host, so a deferred copy
// would race with the caller's next writes), an empty list, a handle made with an
// out list, or a source that needs a new tensor first (a gapped slice, a
// conj/neg view: a kernel the caller's thread would have to order).
// `tensors` may convert lazily (a TensorSource with a Fill): the first groups are
// queued once their own sources are converted, then the rest are converted and
// checked batch by batch, and `converted` is called once every source is
// (Python lets the GIL go there); nothing is converted after that call.
std::shared_ptr<Transfer> copy_to_host_deferred(std::unique_ptr<TensorSource> tensors, HostPool& pool,
                                                const c10::optional<c10::Stream>& stream,
                                                const std::shared_ptr<Transfer>& out_transfer,
                                                const CopyOptions& options,
                                                const std::function<void()>& converted = {});
std::shared_ptr<Transfer> copy_to_host_deferred(std::vector<at::Tensor> tensors, HostPool& pool,
                                                const c10::optional<c10::Stream>& stream,
                                                const std::shared_ptr<Transfer>& out_transfer,
                                                const CopyOptions& options);

// Drops, in the calling thread, what the copy worker finished and the tensors the
// in-flight registry held for copies that have completed. The Python bindings
// call it with the GIL held before they let it go (Note [dropping tensors]).
void release_finished_copies();
// Only the in-flight registry's part of release_finished_copies().
void drain_in_flight();
// Blocks until the copy worker has queued every deferred copy submitted so far.
void wait_copy_worker();

std::shared_ptr<Transfer> copy_to_device(TensorSource& tensors, const std::shared_ptr<Transfer>& from,
                                         const c10::Device& device, HostPool& pool,
                                         const c10::optional<c10::Stream>& stream,
                                         const c10::optional<std::vector<at::Tensor>>& out,
                                         const CopyOptions& options);
std::shared_ptr<Transfer> copy_to_device(const std::vector<at::Tensor>& tensors,
                                         const std::shared_ptr<Transfer>& from, const c10::Device& device,
                                         HostPool& pool, const c10::optional<c10::Stream>& stream,
                                         const c10::optional<std::vector<at::Tensor>>& out,
                                         const CopyOptions& options);

}  // namespace offload
