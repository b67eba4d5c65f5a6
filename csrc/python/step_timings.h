// The activation engine's device timings not yet counted: offload/activation/step_stats.py's
// StepTimings in native code, so the core's group cycle (group_cycle.h) times its copies and
// waits without an interpreter call. The Python class serves the pure-PyTorch path; the
// engine takes this one wherever the core is loaded, and its Python methods call the same
// object, so both paths of a step add to the same pending list.
//
// A copy is timed by the copy engine (its CopyTimer); a wait of the compute stream by a pair
// of timing events recorded on that stream around it. Each is added to the counters of the
// step it belongs to (the dict given with it) once the device has passed it, so a step's
// start never blocks the host on the last step's timings.
#pragma once

#include <memory>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/extension.h>

#include "offload/transfer.h"

namespace offload {
namespace activation {

// Where a timed wait began: a timing event recorded on the waiting stream.
struct WaitStart {
  explicit WaitStart(c10::Event e) : event(std::move(e)) {}
  ~WaitStart();  // gives the event back to the cache (event_cache.h)
  WaitStart(const WaitStart&) = delete;
  WaitStart& operator=(const WaitStart&) = delete;
  c10::Event event;
};

class StepTimings {
 public:
  explicit StepTimings(c10::Device device) : device_(device) {}

  // Add a copy's time (its copy engine timer) to `counters[kind]` once it is known.
  void copy(py::object counters, py::object kind, std::shared_ptr<CopyTimer> timer);
  // An event recorded on `stream` where a timed wait starts.
  std::shared_ptr<WaitStart> start(const c10::Stream& stream);
  // The timed wait that began at `start` ends here on `stream`; its time goes to `counters[kind]`.
  void end(py::object counters, py::object kind, std::shared_ptr<WaitStart> start, const c10::Stream& stream);
  // Add finished timings to their counters; with `block`, wait for all of them.
  void resolve(bool block);
  size_t pending() const { return pending_.size(); }

 private:
  struct Pending {
    py::object counters;  // the step's counters dict
    py::object kind;      // its key
    std::shared_ptr<CopyTimer> copy;  // a copy's timer, or
    std::shared_ptr<WaitStart> start;  // a wait's events
    std::shared_ptr<WaitStart> end;
  };

  c10::Device device_;
  std::vector<Pending> pending_;
};

}  // namespace activation
}  // namespace offload
