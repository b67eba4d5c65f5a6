// Device to host, queued by the copy worker: CopyEngine::to_host_deferred and
// its job (Note [deferred copy] in include/offload/transfer.h).
//
// Moves what the synchronous copy moves, into the host buffers of a handle it
// refills (out=<handle>): the same groups, staging slots and DMAs
// (to_host_plan.h). The calling thread checks the sources group by group and
// queues the first group; the worker queues each later group once checked.
// Limits: only refills of a handle whose buffers the engine made; host sources,
// an empty list and sources that need a new tensor first (a gapped slice, a
// conj/neg view) run the synchronous way.
#include <atomic>
#include <exception>
#include <iterator>
#include <thread>
#include <utility>

#include "copy_worker.h"
#include "offload/event_cache.h"
#include "to_host_plan.h"

namespace offload {

// A deferred copy's job: owns what the copy worker needs until the copies are
// queued (transfer.h says who owns what). Members that ToHost refers to are
// declared before it and never move (the job lives on the heap).
//
// Handoff: the calling thread checks the sources group by group and publishes
// its count (`checked`); the worker queues each group below it. The caller
// then sets `handoff`: kComplete (every group checked, every source
// converted: the worker queues the rest, then takes the sources and frees the
// slots), or kTakenBack (a source failed its check or needs a new tensor: the
// worker stops, says so in `stopped`, and leaves the rest to the caller).
struct CopyEngine::DeferredToHost final : DeferredWork {
  static constexpr int kChecking = 0, kComplete = 1, kTakenBack = 2;

  DeferredToHost(std::unique_ptr<TensorSource> tensors, std::shared_ptr<HostPool> pool_,
                 const c10::optional<c10::Stream>& stream_, const CopyOptions& options_, const c10::Device& device)
      : source(std::move(tensors)), pool(std::move(pool_)), stream(stream_),
        options(options_), result(std::make_shared<Transfer>(device)),
        plan(std::make_unique<ToHost>(*source, *pool, stream, options, *result, /*on_device=*/true)) {}

  std::exception_ptr run() noexcept override {
    std::exception_ptr error;
    int how = kChecking;
    try {
      how = plan->follow_checks(checked, handoff, kChecking);
    } catch (...) {
      error = std::current_exception();
      // Nothing more is queued; the plan stays the caller's until it hands off.
      while ((how = handoff.load(std::memory_order_acquire)) == kChecking) std::this_thread::yield();
    }
    if (how == kTakenBack) {
      stopped.store(true, std::memory_order_release);
      return error;  // the caller queues the rest and owns the sources, snapshot and slots
    }
    try {
      plan->end_timing();
      // Moved, not copied: the worker changes no reference count it could
      // take to zero. Copies already queued keep their sources, as in to_host.
      Transfer& r = *result;
      std::vector<at::Tensor> sources = source->take();  // converted by the caller (to_host_deferred)
      r.keepalive_.insert(r.keepalive_.end(), std::make_move_iterator(sources.begin()),
                          std::make_move_iterator(sources.end()));
      r.release_keepalive(stream, /*drain=*/false);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    give_back_event(std::move(*snapshot));
    plan->release_slots();
    return error;
  }

  // In the calling thread, once submitted: stops the worker after the groups
  // queued so far and waits until it has (it is at work on this job: the
  // caller waited for it to be idle before submitting).
  void take_back() {
    handoff.store(kTakenBack, std::memory_order_release);
    while (!stopped.load(std::memory_order_acquire)) std::this_thread::yield();
  }

  std::shared_ptr<Transfer::Deferred> state() const override { return result->deferred_; }

  std::atomic<size_t> checked{1};  // groups the caller has checked (it queues the first)
  std::atomic<int> handoff{kChecking};
  std::atomic<bool> stopped{false};  // the worker let go of the plan (kTakenBack)
  std::unique_ptr<TensorSource> source;  // every tensor converted before the worker takes them
  std::shared_ptr<HostPool> pool;
  c10::optional<c10::Stream> stream;
  CopyOptions options;
  std::shared_ptr<Transfer> result;
  std::unique_ptr<ToHost> plan;
  c10::optional<c10::Event> snapshot;  // recorded on the caller's stream at the call
};

std::shared_ptr<Transfer> CopyEngine::to_host_deferred(std::unique_ptr<TensorSource> owned, HostPool& pool,
                                                     const c10::optional<c10::Stream>& stream,
                                                     const std::shared_ptr<Transfer>& reuse,
                                                     const CopyOptions& options,
                                                     const std::function<void()>& converted) {
  const char* fn = "offload.copy_to_host";
  TORCH_CHECK_VALUE(reuse != nullptr, fn, ": defer=True needs out=<CopyHandle> (an earlier copy_to_host of "
                    "tensors of the same shapes and dtypes, whose host buffers it refills), got none");
  check_same_sources(options, reuse);
  TensorSource& tensors = *owned;
  const size_t n = tensors.size();
  const c10::DeviceType expected = pool.device_type();
  // Every source converted, then the caller told (transfer.h): nothing converts after.
  auto finish_conversion = [&tensors, &converted] {
    tensors.convert_all();
    if (converted) converted();
  };
  // Where there is nothing to defer, the copy runs here (transfer.h says why).
  // As in to_host, tensors[0] is checked against the pool here and every other
  // tensor against tensors[0] once, when check_group checks it against the handle.
  if (n > 0) check_source(fn, 0, tensors[0], expected, tensors[0]);
  if (n == 0 || reuse->groups_.empty() || tensors[0].is_cpu()) {
    finish_conversion();
    return to_host(tensors, pool, stream, c10::nullopt, reuse, options);
  }
  check_reuse_count(*reuse, n);
  const c10::Device device = tensors[0].device();
  TORCH_CHECK_VALUE(stream.has_value(), fn, ": a copy stream is required for ", device);
  auto job = std::make_shared<DeferredToHost>(std::move(owned), pool.shared_from_this(), stream, options, device);
  ToHost& plan = *job->plan;
  // Every check the synchronous path makes, here, so a stale handle raises now.
  // This thread checks the sources group by group and queues the first group
  // itself; the copy worker queues each later group as soon as this thread has
  // checked it (ToHost::follow_checks), so the copies run while the rest are
  // converted and checked, and this thread queues nothing else: the caller's
  // time goes to the checks only.
  const size_t groups = plan.adopt_groups(*reuse);
  if (!plan.check_group(0, *reuse, /*deferred=*/true)) {  // a source needs a kernel first: the synchronous way
    std::unique_ptr<TensorSource> source = std::move(job->source);
    job.reset();
    finish_conversion();
    return to_host(*source, pool, stream, c10::nullopt, reuse, options);
  }
  // Earlier deferred copies into these buffers are queued before this one's.
  // Called from Python, this waits with the GIL held: the worker never takes
  // it, and it is busy only while a previous deferred copy's groups are still
  // being queued.
  CopyWorker::instance().wait_idle();
  // The snapshot point: every group, queued here or by the worker, is copied
  // after the caller's work up to this record (the copy and pack streams wait
  // on it), so work another thread queues on that stream meanwhile is in none.
  job->snapshot.emplace(take_event(device));
  job->snapshot->record(current_stream(device));
  plan.set_snapshot(*job->snapshot);
  auto result = job->result;
  size_t checked = 1;
  bool handed_off = false;
  try {
    if (groups > 1) {
      // Submitted first, so the worker is awake (and spinning) by the time the
      // second group is checked: a thread's wake-up can take longer than the
      // first group's DMA.
      result->deferred_ = std::make_shared<Transfer::Deferred>();
      CopyWorker::instance().submit(job);
      handed_off = true;
    }
    plan.enqueue_here(0, 1, *reuse, /*check_from=*/1);
    if (handed_off) {
      plan.reserve_slots();  // the worker allocates nothing
      // Each group is published once checked, while its tensors are still in
      // the caches (see lazy_conversion's prefetching).
      while (checked < groups && plan.check_group(checked, *reuse, /*deferred=*/true)) {
        job->checked.store(++checked, std::memory_order_release);
      }
    }
    if (checked == groups) {
      tensors.convert_all();  // tensors in no group (empty ones), checked by finish_views
      plan.finish_views(/*into_out=*/false, reuse);
      if (!handed_off) {
        plan.end_timing();
        hold_sources(*result, job->source->converted(), stream);
        return result;
      }
      // From here the job is the worker's: it queues what is left, then takes the sources.
      job->handoff.store(DeferredToHost::kComplete, std::memory_order_release);
      return result;
    }
  } catch (...) {
    if (handed_off) job->take_back();
    hold_sources(*result, job->source->converted(), stream);  // copies already queued keep their tensors
    throw;
  }
  // A source needs a new tensor (a kernel this thread orders on the copy
  // stream): the worker stops where it is and the rest is copied here, as a
  // synchronous copy does.
  try {
    job->take_back();
    finish_conversion();
    plan.enqueue_here(plan.queued_groups(), groups, *reuse, /*check_from=*/checked);
    plan.end_timing();
    plan.finish_views(/*into_out=*/false, reuse);
  } catch (...) {
    hold_sources(*result, job->source->converted(), stream);
    throw;
  }
  hold_sources(*result, job->source->converted(), stream);
  return result;
}

}  // namespace offload
