// Device events, recycled across transfers.
//
// A transfer uses two events (the copy stream's wait for the caller, and its
// completion, which the pool's block and the in-flight registry share: RecordedEvent
// below); created and destroyed per transfer, each is a driver call, a visible part
// of what a small copy costs beyond a bare copy_ (benchmarks/RESULTS.md). Events
// are taken from here and given back when their owner is done with them (Note
// [event reuse] in event_cache.cpp says when a given-back event may be handed out
// again).
#pragma once

#include <atomic>
#include <memory>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace offload {

// An event for `device` made with `flag`: a completed one from the cache, or a new
// one (created by the backend at its first record). Thread-safe. Timing events
// (BACKEND_DEFAULT) are cached apart from the others: a copy timed once per layer
// per step would otherwise make two and destroy two, each a driver call, in a
// launch-bound step.
c10::Event take_event(const c10::Device& device, c10::EventFlag flag = c10::EventFlag::PYTORCH_DEFAULT);

// Returns an event its owner no longer uses (it may still be pending). Calls the
// driver only to destroy an event the cache has no room for, as the event's own
// destructor would.
void give_back_event(c10::Event&& event);

// One record of an event on a stream, held by every owner that waits for that point of
// the stream. A copy's completion is such a point for the transfer (its waits and
// queries), the pool block it wrote (reused once the copy is done), the in-flight entry
// of its sources (dropped then) and the copy's timer (its end): one record serves all of
// them where each would otherwise record its own, a driver call each in a launch-bound
// step. Once a query finds it complete, later queries of any owner ask no driver.
// Recorded again only by a sole owner (record_again); its event goes back to the cache
// with its last owner.
class RecordedEvent {
 public:
  RecordedEvent(const c10::Stream& stream, c10::EventFlag flag);
  ~RecordedEvent();
  RecordedEvent(const RecordedEvent&) = delete;
  RecordedEvent& operator=(const RecordedEvent&) = delete;
  bool query() const;
  void synchronize() const;
  // Makes `waiter` wait on the device for the recorded point.
  void block(const c10::Stream& waiter) const;
  // Moves the recorded point to `stream`'s work so far. Only for an owner that holds the
  // sole reference (the pool's event of a stream, re-recorded as later work on that stream
  // uses the block): nobody else waits on the point it had.
  void record_again(const c10::Stream& stream);
  // Milliseconds from this event to `end`; both made with timing (BACKEND_DEFAULT).
  double elapsed_ms(const RecordedEvent& end) const { return event_.elapsedTime(end.event_); }

 private:
  c10::Event event_;
  mutable std::atomic<bool> complete_{false};
};
using SharedEvent = std::shared_ptr<RecordedEvent>;

// An event from the cache, recorded on `stream` now.
SharedEvent record_event(const c10::Stream& stream, c10::EventFlag flag = c10::EventFlag::PYTORCH_DEFAULT);

// Makes `waiter` wait, on the device, for the work queued on `producer` so far.
void order_after(const c10::Stream& waiter, const c10::Stream& producer);

}  // namespace offload
