// A scripted accelerator for the C++ unit tests: a guard implementation for
// PrivateUse1, registered by including this file (once per test program), whose
// events complete only when the test says so (log().complete_all()) and which
// counts every event it creates and destroys and every wait. It lets the CPU
// build test the logic that orders work by events (the event cache, the pool's
// held-back blocks), which a CPU device has no events to exercise.
#pragma once

#include <set>
#include <utility>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace scripted {

struct ScriptedEvent {
  bool done = false;
  c10::StreamId recorded_on = 0;
  c10::EventFlag flag = c10::EventFlag::PYTORCH_DEFAULT;  // what it was created with
};

// What the scripted device did, for the tests to read.
struct Log {
  int created = 0;
  int destroyed = 0;
  int synchronized = 0;  // host waits on events
  int queries = 0;       // queries of events (driver calls)
  std::set<ScriptedEvent*> live;
  std::vector<std::pair<ScriptedEvent*, c10::StreamId>> blocks;  // (event, waiting stream)
  void complete_all() {
    for (ScriptedEvent* e : live) e->done = true;
  }
  // Completes one pending event recorded on a stream of id `stream` (of any device);
  // false if there is none.
  bool complete_one(c10::StreamId stream) {
    for (ScriptedEvent* e : live) {
      if (e->recorded_on == stream && !e->done) {
        e->done = true;
        return true;
      }
    }
    return false;
  }
};
inline Log& log() {
  static Log l;
  return l;
}

struct ScriptedGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    current_ = d.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(type(), current_); }
  void setDevice(c10::Device d) const override { current_ = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_ = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::UNSAFE, d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 4; }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag flag) const override {
    if (*event == nullptr) {
      auto* e = new ScriptedEvent();
      e->flag = flag;
      log().created += 1;
      log().live.insert(e);
      *event = e;
    }
    auto* e = static_cast<ScriptedEvent*>(*event);
    e->done = false;  // pending until the test completes it
    e->recorded_on = stream.id();
  }
  void block(void* event, const c10::Stream& stream) const override {
    log().blocks.emplace_back(static_cast<ScriptedEvent*>(event), stream.id());
  }
  bool queryEvent(void* event) const override {
    log().queries += 1;
    return event == nullptr || static_cast<ScriptedEvent*>(event)->done;
  }
  void synchronizeEvent(void* event) const override {  // the host waits: the event completes
    log().synchronized += 1;
    if (event != nullptr) static_cast<ScriptedEvent*>(event)->done = true;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    if (event == nullptr) return;
    log().destroyed += 1;
    log().live.erase(static_cast<ScriptedEvent*>(event));
    delete static_cast<ScriptedEvent*>(event);
  }
  static thread_local c10::DeviceIndex current_;
};
inline thread_local c10::DeviceIndex ScriptedGuardImpl::current_ = 0;


inline c10::Device device(int index) { return c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index)); }
inline c10::Stream stream(int index, c10::StreamId id) { return c10::Stream(c10::Stream::UNSAFE, device(index), id); }

// The driver event behind a c10::Event (the scripted device's), by recording it once
// more on a stream nobody waits on: record keeps the same driver event.
inline ScriptedEvent* driver_event(c10::Event& event, int index) {
  event.record(stream(index, 99));
  return static_cast<ScriptedEvent*>(const_cast<void*>(event.eventId()));
}

}  // namespace scripted

C10_REGISTER_GUARD_IMPL(PrivateUse1, scripted::ScriptedGuardImpl)
