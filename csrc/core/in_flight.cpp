// The in-flight registry (in_flight.h): entries of held tensors, each released
// once the event recorded after their copies completes.
#include "in_flight.h"

#include <iterator>
#include <utility>

#include "offload/event_cache.h"

namespace offload {

InFlight& InFlight::instance() {
  static InFlight* registry = new InFlight();  // never destroyed: it may hold CUDA tensors at exit
  return *registry;
}

uint64_t InFlight::add(const c10::Stream& stream, std::vector<at::Tensor>&& tensors, bool drain,
                       const SharedEvent& at) {
  std::deque<Entry> done;  // destroyed after the lock is released (see drain_locked)
  std::lock_guard<std::mutex> lock(mutex_);
  if (drain) drain_locked(done);
  if (tensors.empty()) return 0;
  entries_.push_back(Entry{at != nullptr ? at : record_event(stream), std::move(tensors), ++last_ticket_});
  return last_ticket_;
}

void InFlight::drain() {
  std::deque<Entry> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    drain_locked(done);
  }
}  // `done` is destroyed here, outside the lock (see drain_locked)

void InFlight::release_device_tensors(uint64_t ticket) {
  std::vector<at::Tensor> dropped;  // destroyed after the lock is released (see drain_locked)
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->ticket != ticket) continue;
    std::vector<at::Tensor> kept;
    for (auto& t : it->tensors) (t.is_cpu() ? kept : dropped).push_back(std::move(t));
    it->tensors = std::move(kept);
    if (it->tensors.empty()) entries_.erase(it);
    return;
  }
}

void InFlight::drain_locked(std::deque<Entry>& done) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->event->query()) {
      done.push_back(std::move(*it));
      it = entries_.erase(it);
    } else {
      it = std::next(it);
    }
  }
}

}  // namespace offload
