// The plan of one device-to-host transfer (CopyEngine::ToHost), shared by the
// synchronous copy (to_host.cpp) and the deferred one (to_host_deferred.cpp).
// Private to csrc/core.
//
// A plan enqueues its transfer group by group: each group is queued as soon as
// its members are prepared, so the copy engine starts after the first group's
// host work instead of after every tensor's. A packed group is packed on the
// pack stream (Note [pack stream]) into one of kSlots staging slots and moved by
// one DMA into one pooled host block; a direct group (one large tensor) moves by
// DMA in chunk_bytes pieces into its own block.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Optional.h>

#include "copy_engine.h"

namespace offload {

class CopyEngine::ToHost {
 public:
  ToHost(TensorSource& tensors, HostPool& pool, const c10::optional<c10::Stream>& stream,
         const CopyOptions& options, Transfer& r, bool on_device);
  ~ToHost();
  ToHost(const ToHost&) = delete;
  ToHost& operator=(const ToHost&) = delete;

  void run(const c10::optional<std::vector<at::Tensor>>& out, const std::shared_ptr<Transfer>& reuse);

  // A refill, in the calling thread: takes the handle's groups and host tensors
  // (shared: see Transfer::outputs_); returns the groups' count.
  size_t adopt_groups(const Transfer& reuse);

  // A deferred copy, in the calling thread: checks the members of group `g`
  // against the handle. False where a member needs a new tensor first (a
  // kernel this thread would have to order); its earlier members stay checked.
  bool check_group(size_t g, const Transfer& reuse, bool deferred);

  // A deferred copy: the event the copy and pack streams wait on (its job owns it).
  void set_snapshot(const c10::Event& snapshot) { snapshot_ = &snapshot; }

  // A deferred copy, in the calling thread: queues groups [from, to) on the copy
  // stream as run() does, checking those from `check_from` on first (the
  // synchronous way: a source that needs a new tensor gets it on the copy stream).
  // The first call makes the copy stream wait on the snapshot and starts the
  // timing; guards are local (the worker may finish this plan).
  void enqueue_here(size_t from, size_t to, const Transfer& reuse, size_t check_from);

  // A deferred copy, on the copy worker: queues the groups from the second on,
  // each once `checked` (the calling thread's count of checked groups, which it
  // raises past 1 only after queueing the first group and reserving the slots)
  // passes it, until `handoff` leaves kChecking; returns that state, with every
  // group below the final count queued. The calling thread queued the first
  // group, so the copy stream already waits on the snapshot, the pack stream
  // where a packed group came first (else enqueue_packed makes it wait).
  // Spins while the caller checks (well under a millisecond a refill): a
  // wake-up per group would cost the caller a notify each.
  int follow_checks(const std::atomic<size_t>& checked, const std::atomic<int>& handoff, int checking);

  size_t queued_groups() const { return queued_groups_; }

  // A deferred copy, in the calling thread: the staging slots its packs will use,
  // so the copy worker allocates nothing (an allocation may fail, or take the GIL
  // when the allocator records Python stacks).
  void reserve_slots();

  // The staging slots, once the packs are queued: recorded on the copy stream,
  // so their memory returns to the pack stream's pool only after the DMAs.
  void release_slots();

  void end_timing();

  void finish_views(bool into_out, const std::shared_ptr<Transfer>& reuse);

 private:
  // A fresh copy: what each source was (Transfer::SourceKeys), for refills.
  void record_source_keys();

  // Makes `waiter` wait for the caller's work up to the call: the snapshot
  // event of a deferred copy, else the caller's stream as it is now.
  void wait_for_caller(const c10::Stream& waiter);

  // Timing starts after the wait for the caller, so it counts the copies only.
  void start_timing();

  // Prepares the members of `group` and checks them against the handle `reuse`.
  // A member copied as it was (SourceKeys::Key::plain) that still is, with the
  // same dtype and sizes, is its own base: checked without reading its host
  // tensor. Any other is prepared as a fresh copy prepares it and compared with
  // its host base. `deferred`: false, before any kernel, where one needs a new
  // tensor (the synchronous path makes it on the copy stream).
  bool check_reused(const Transfer::Group& group, const Transfer& reuse, bool deferred);

  int64_t prepare_member(int64_t i);

  // prepare_member for a source check_source has passed.
  int64_t prepare_checked_member(int64_t i);

  // Members are prepared while the copy stream is current, so a contiguous()
  // copy or a conj/neg resolution made for one ran there: the copy stream reads
  // the result in order (a direct group needs nothing), the pack stream must wait
  // for it before packing it. Called before each pack, once pack_ exists.
  void sync_prepared_work();

  void enqueue(Transfer::Group& group);

  void enqueue_packed(Transfer::Group& group);

  // Staging slot `slot` holds at least `bytes`. A handle's groups (out=<handle>)
  // may have been made with a larger group_bytes than this call's: a slot grows
  // to the group it must hold.
  void ensure_slot(int slot, int64_t bytes, const c10::Stream& pack);

  void finish(const Transfer::Group& group);

  // Caller-owned destinations of any layout: one copy each, an event every chunk_bytes.
  void run_into(const std::vector<at::Tensor>& out);

  TensorSource& tensors_;
  HostPool& pool_;
  const c10::optional<c10::Stream>& stream_;
  const CopyOptions& options_;
  Transfer& r_;
  const bool on_device_;
  const c10::Device device_;
  const size_t n_;
  std::vector<Prepared> prepared_;
  c10::OptionalDeviceGuard device_guard_;
  c10::optional<c10::StreamGuard> stream_guard_;
  c10::optional<c10::Stream> caller_;
  c10::optional<c10::Stream> pack_;
  c10::optional<c10::Event> packed_;  // recorded on pack_ after each group's pack
  at::Tensor slots_[kSlots];
  int32_t slot_events_[kSlots] = {-1, -1, -1};
  int64_t packed_groups_ = 0;
  bool unsynced_prepared_work_ = false;
  const c10::Event* snapshot_ = nullptr;  // a deferred copy's snapshot (its job owns it)
  size_t queued_groups_ = 0;              // a deferred copy: groups queued (by the caller, then the worker)
  std::chrono::steady_clock::time_point host_start_;
};

}  // namespace offload
