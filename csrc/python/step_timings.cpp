// StepTimings: the activation engine's timings not yet counted (step_timings.h).
#include "step_timings.h"

#include <iterator>

#include "engine_interface.h"
#include "offload/bindings_registry.h"
#include "offload/event_cache.h"

namespace offload {
namespace activation {

WaitStart::~WaitStart() { give_back_event(std::move(event)); }

void StepTimings::copy(py::object counters, py::object kind, std::shared_ptr<CopyTimer> timer) {
  TORCH_CHECK_VALUE(timer != nullptr, "offload.StepTimings.copy: timer must be a copy's timer, got None");
  pending_.push_back(Pending{std::move(counters), std::move(kind), std::move(timer), nullptr, nullptr});
}

std::shared_ptr<WaitStart> StepTimings::start(const c10::Stream& stream) {
  auto start = std::make_shared<WaitStart>(take_event(device_, c10::EventFlag::BACKEND_DEFAULT));
  start->event.record(stream);
  return start;
}

void StepTimings::end(py::object counters, py::object kind, std::shared_ptr<WaitStart> start,
                      const c10::Stream& stream) {
  TORCH_CHECK_VALUE(start != nullptr, "offload.StepTimings.end: start must be what start() returned, got None");
  auto end = std::make_shared<WaitStart>(take_event(device_, c10::EventFlag::BACKEND_DEFAULT));
  end->event.record(stream);
  pending_.push_back(Pending{std::move(counters), std::move(kind), nullptr, std::move(start), std::move(end)});
}

void StepTimings::resolve(bool block) {
  // Taken out of the list first: a blocking wait lets the interpreter lock go, and autograd's
  // device thread may time another wait meanwhile (appended to pending_, counted next time).
  std::vector<Pending> timings;
  timings.swap(pending_);
  std::vector<Pending> left;
  for (Pending& timed : timings) {
    if (timed.copy != nullptr) {
      if (block) {
        py::gil_scoped_release no_gil;
        timed.copy->synchronize();
      }
      const c10::optional<double> seconds = timed.copy->seconds();
      if (seconds.has_value()) {
        add_to(timed.counters, timed.kind.ptr(), py::float_(*seconds));
      } else {
        left.push_back(std::move(timed));
      }
      continue;
    }
    if (block) {
      py::gil_scoped_release no_gil;
      timed.end->event.synchronize();
    } else if (!timed.end->event.query()) {
      left.push_back(std::move(timed));
      continue;
    }
    add_to(timed.counters, timed.kind.ptr(), py::float_(timed.start->event.elapsedTime(timed.end->event) / 1e3));
  }
  left.insert(left.end(), std::make_move_iterator(pending_.begin()), std::make_move_iterator(pending_.end()));
  pending_ = std::move(left);
}

namespace {

void bind(py::module_& m) {
  py::class_<WaitStart, std::shared_ptr<WaitStart>>(m, "WaitStart");
  py::class_<StepTimings, std::shared_ptr<StepTimings>>(m, "StepTimings")
      .def(py::init<c10::Device>(), py::arg("device"))
      .def("copy", &StepTimings::copy, py::arg("counters"), py::arg("kind"), py::arg("timer"))
      .def("start", &StepTimings::start, py::arg("stream"))
      .def("end", &StepTimings::end, py::arg("counters"), py::arg("kind"), py::arg("start"), py::arg("stream"))
      .def("resolve", &StepTimings::resolve, py::arg("block"))
      .def_property_readonly("pending", &StepTimings::pending);
}

}  // namespace

OFFLOAD_REGISTER_BINDINGS(step_timings, bind);

}  // namespace activation
}  // namespace offload
