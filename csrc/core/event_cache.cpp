// Device events recycled across transfers (see event_cache.h for why).
//
// Holds: given-back events that may not be recorded again yet, oldest first, until a
// query finds them complete; events ready to be recorded again by (device type,
// device index, flag), handed out newest first. Limits: kMaxPending of the first
// and kMaxReadyPerDevice of the second per key; beyond them events are destroyed,
// as they would be without the cache.
//
// Note [event reuse]
// ~~~~~~~~~~~~~~~~~~
// On CUDA a given-back event is ready at once, pending or not. Recording an event
// again replaces what it captured: a stream already made to wait on it (its
// cudaStreamWaitEvent) still waits for the work captured then, and only later
// queries and synchronizations see the new record; a given-back event has no owner
// left to make either. So no query is needed before its next record, and a group
// of the activation engine takes about a dozen events a step (copies, their
// timers, the waits), each of which would otherwise cost a driver query in a
// launch-bound step. Other backends keep the wait for completion: their runtimes
// (ACL on Ascend) do not promise these semantics for an event re-recorded while
// waiters are outstanding, so an event is handed out again only once a query finds
// it complete.
#include "offload/event_cache.h"

#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace offload {
namespace {

// Enough for the events of a few hundred transfers in flight; beyond it, events
// are destroyed as before (a driver call each) rather than kept without bound.
constexpr size_t kMaxPending = 1024;
constexpr size_t kMaxReadyPerDevice = 256;
// Given-back events are queried only when no completed one of the kind asked for
// is at hand, oldest first (the likeliest to be done), until one is not, and at
// most this many: a query is a driver call, and querying on every take would cost
// one per take that found the newest given-back event still pending, a dozen per
// offloaded layer.
constexpr int kQueriesPerRefill = 64;

class EventCache {
 public:
  static EventCache& instance() {
    static EventCache* cache = new EventCache();  // never destroyed: events outlive static destructors at exit
    return *cache;
  }

  c10::Event take(const c10::Device& device, c10::EventFlag flag) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& ready = ready_[key(device, flag)];
    if (ready.empty()) {
      for (int i = 0; i < kQueriesPerRefill && !pending_.empty() && pending_.front().query(); ++i) {
        c10::Event done = std::move(pending_.front());
        pending_.pop_front();
        keep_ready_locked(std::move(done));
      }
    }
    if (!ready.empty()) {
      c10::Event event = std::move(ready.back());
      ready.pop_back();
      return event;
    }
    return c10::Event(device.type(), flag);
  }

  void give_back(c10::Event&& event) {
    if (!event.was_marked_for_recording()) return;  // never recorded: no driver event behind it
    std::lock_guard<std::mutex> lock(mutex_);
    if (event.device_type() == c10::DeviceType::CUDA) {  // Note [event reuse]
      keep_ready_locked(std::move(event));
      return;
    }
    pending_.push_back(std::move(event));
    if (pending_.size() > kMaxPending) pending_.pop_front();  // destroyed here, as it would have been
  }

 private:
  using Key = std::tuple<int, int, int>;  // device type, device index, event flag
  static Key key(const c10::Device& device, c10::EventFlag flag) {
    return Key{static_cast<int>(device.type()), static_cast<int>(device.index()), static_cast<int>(flag)};
  }

  void keep_ready_locked(c10::Event&& event) {
    auto& ready = ready_[key(event.device(), event.flag())];
    if (ready.size() < kMaxReadyPerDevice) ready.push_back(std::move(event));
  }

  std::mutex mutex_;
  std::deque<c10::Event> pending_;                          // given back, maybe still pending; oldest first
  std::map<Key, std::vector<c10::Event>> ready_;  // completed, by device and flag
};

}  // namespace

c10::Event take_event(const c10::Device& device, c10::EventFlag flag) {
  return EventCache::instance().take(device, flag);
}

void give_back_event(c10::Event&& event) { EventCache::instance().give_back(std::move(event)); }

RecordedEvent::RecordedEvent(const c10::Stream& stream, c10::EventFlag flag)
    : event_(take_event(stream.device(), flag)) {
  event_.record(stream);
}

RecordedEvent::~RecordedEvent() { give_back_event(std::move(event_)); }

bool RecordedEvent::query() const {
  if (complete_.load(std::memory_order_acquire)) return true;
  if (!event_.query()) return false;
  complete_.store(true, std::memory_order_release);
  return true;
}

void RecordedEvent::synchronize() const {
  if (complete_.load(std::memory_order_acquire)) return;
  event_.synchronize();
  complete_.store(true, std::memory_order_release);
}

void RecordedEvent::block(const c10::Stream& waiter) const {
  // A complete point needs no wait on the device: the stream's later work comes after it anyway.
  if (complete_.load(std::memory_order_acquire)) return;
  event_.block(waiter);
}

void RecordedEvent::record_again(const c10::Stream& stream) {
  complete_.store(false, std::memory_order_release);
  event_.record(stream);
}

SharedEvent record_event(const c10::Stream& stream, c10::EventFlag flag) {
  return std::make_shared<RecordedEvent>(stream, flag);
}

void order_after(const c10::Stream& waiter, const c10::Stream& producer) {
  if (waiter == producer) return;  // one stream is already in order
  c10::Event event = take_event(producer.device());
  event.record(producer);
  event.block(waiter);
  give_back_event(std::move(event));
}

}  // namespace offload
