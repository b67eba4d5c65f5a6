// Device events recycled across transfers (see event_cache.h for why).
#include "offload/event_cache.h"

#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace offload {
namespace {

// Enough for the events of a few hundred transfers in flight; beyond it, events
// are destroyed as before (a driver call each) rather than kept without bound.
constexpr size_t kMaxPending = 1024;
constexpr size_t kMaxReadyPerDevice = 256;
// Queries per take: the oldest given-back events are the likeliest to be done.
constexpr int kQueriesPerTake = 4;

class EventCache {
 public:
  static EventCache& instance() {
    static EventCache* cache = new EventCache();  // never destroyed: events outlive static destructors at exit
    return *cache;
  }

  c10::Event take(const c10::Device& device) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < kQueriesPerTake && !pending_.empty() && pending_.front().query(); ++i) {
      c10::Event done = std::move(pending_.front());
      pending_.pop_front();
      keep_ready_locked(std::move(done));
    }
    auto it = ready_.find(key(device));
    if (it != ready_.end() && !it->second.empty()) {
      c10::Event event = std::move(it->second.back());
      it->second.pop_back();
      return event;
    }
    return c10::Event(device.type());
  }

  void give_back(c10::Event&& event) {
    if (!event.was_marked_for_recording()) return;  // never recorded: no driver event behind it
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(std::move(event));
    if (pending_.size() > kMaxPending) pending_.pop_front();  // destroyed here, as it would have been
  }

 private:
  static std::pair<int, int> key(const c10::Device& device) {
    return {static_cast<int>(device.type()), static_cast<int>(device.index())};
  }

  void keep_ready_locked(c10::Event&& event) {
    auto& ready = ready_[key(event.device())];
    if (ready.size() < kMaxReadyPerDevice) ready.push_back(std::move(event));
  }

  std::mutex mutex_;
  std::deque<c10::Event> pending_;                          // given back, maybe still pending; oldest first
  std::map<std::pair<int, int>, std::vector<c10::Event>> ready_;  // completed, by device
};

}  // namespace

c10::Event take_event(const c10::Device& device) { return EventCache::instance().take(device); }

void give_back_event(c10::Event&& event) { EventCache::instance().give_back(std::move(event)); }

void order_after(const c10::Stream& waiter, const c10::Stream& producer) {
  if (waiter == producer) return;  // one stream is already in order
  c10::Event event = take_event(producer.device());
  event.record(producer);
  event.block(waiter);
  give_back_event(std::move(event));
}

}  // namespace offload
