// The handle of a transfer (include/offload/transfer.h): waits, queries, timing
// and the release of what the engine holds for it. Moves nothing: every method
// reads the events the engine recorded on the copy stream, in order, so the last
// event implies the others.
#include "offload/transfer.h"

#include <utility>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "copy_worker.h"
#include "in_flight.h"
#include "offload/event_cache.h"

namespace offload {

void Transfer::wait_enqueued() const {
  if (!deferred_) return;
  Deferred& d = *deferred_;
  if (!d.ready.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lock(d.mutex);
    d.queued.wait(lock, [&d] { return d.ready.load(std::memory_order_acquire); });
  }
  CopyWorker::instance().collect();
  if (d.error) std::rethrow_exception(d.error);
}

void Transfer::Deferred::publish(std::exception_ptr failure) {
  std::lock_guard<std::mutex> lock(mutex);
  error = failure;
  ready.store(true, std::memory_order_release);
  queued.notify_all();
}

c10::optional<double> CopyTimer::seconds() const {
  if (host_seconds) return host_seconds;
  if (!start || !end || !end->query()) return c10::nullopt;
  return start->elapsed_ms(*end) / 1000.0;
}

namespace {
void check_timed(const char* fn, const std::shared_ptr<CopyTimer>& timer) {
  TORCH_CHECK_VALUE(timer != nullptr, fn, ": this copy was not timed; pass timing=True to offload.copy_to_host or "
                    "offload.copy_to_device");
}
}  // namespace

c10::optional<double> Transfer::copy_seconds() const {
  check_timed("offload.CopyHandle.copy_seconds", timer_);
  if (enqueue_pending()) return c10::nullopt;  // never waits
  wait_enqueued();                             // raises a deferred copy's failure
  return timer_->seconds();
}

std::shared_ptr<CopyTimer> Transfer::timer() const {
  check_timed("offload.CopyHandle.copy_timer", timer_);
  wait_enqueued();  // the events are recorded once the copies are queued
  return timer_;
}

bool Transfer::query(bool drain) const {
  wait_enqueued();
  // The timing end event is recorded after the last completion event: done means
  // both, so copy_seconds() has its answer once a handle is seen done.
  const bool done = (events_.empty() || events_.back()->query()) && (!timer_ || timer_->done());
  if (done && drain) InFlight::instance().drain();
  return done;
}

void Transfer::release_keepalive(const c10::optional<c10::Stream>& stream, bool drain, const SharedEvent& at) {
  if (stream && !keepalive_.empty()) {
    const uint64_t ticket = InFlight::instance().add(*stream, std::move(keepalive_), drain, at);
    if (ticket != 0) inflight_tickets_.push_back(ticket);
  }
  keepalive_.clear();
}

void Transfer::release_sources(const c10::optional<c10::Stream>& stream) {
  const auto waiter = consumer(stream);
  if (!waiter) return;  // a host transfer holds nothing
  wait_stream(*waiter);  // waits for a deferred transfer's copies to be queued
  for (uint64_t ticket : inflight_tickets_) InFlight::instance().release_device_tensors(ticket);
  inflight_tickets_.clear();
}

Transfer::~Transfer() = default;

const SharedEvent& Transfer::mark_complete(const c10::Stream& stream, const std::vector<int64_t>& members) {
  events_.push_back(
      record_event(stream, timer_ ? c10::EventFlag::BACKEND_DEFAULT : c10::EventFlag::PYTORCH_DEFAULT));
  for (int64_t i : members) event_of_[i] = static_cast<int32_t>(events_.size() - 1);
  return events_.back();
}

void Transfer::synchronize(bool drain) const {
  try {
    wait_enqueued();
  } catch (...) {  // a failed deferred transfer: let what it queued finish, then say why
    if (!events_.empty()) events_.back()->synchronize();
    throw;
  }
  if (!events_.empty()) events_.back()->synchronize();
  if (timer_) timer_->synchronize();  // its end is recorded after the last event (see query)
  if (drain) InFlight::instance().drain();
}

c10::optional<c10::Stream> Transfer::consumer(const c10::optional<c10::Stream>& stream) const {
  if (stream || device_.is_cpu()) return stream;
  // The current stream, read here rather than by the caller in Python (a Python
  // stream object per call cost microseconds on every wait).
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

void Transfer::wait_stream(const c10::optional<c10::Stream>& stream) const {
  wait_enqueued();
  // Events are recorded in order on one copy stream: the last implies the rest.
  if (events_.empty()) return;
  if (const auto waiter = consumer(stream)) events_.back()->block(*waiter);
}

void Transfer::wait_stream_for(int64_t index, const c10::optional<c10::Stream>& stream) const {
  TORCH_CHECK_INDEX(index >= 0 && index < static_cast<int64_t>(outputs_->size()), "offload.CopyHandle.wait_tensor: ",
                    "index ", index, " out of range for ", outputs_->size(), " tensors");
  wait_enqueued();
  const int32_t event = event_of_[index];
  if (event < 0) return;
  if (const auto waiter = consumer(stream)) events_[event]->block(*waiter);
}

void release_finished_copies() {
  CopyWorker::instance().collect();
  InFlight::instance().drain();
}

void drain_in_flight() { InFlight::instance().drain(); }

void wait_copy_worker() { CopyWorker::instance().wait_idle(); }

}  // namespace offload
