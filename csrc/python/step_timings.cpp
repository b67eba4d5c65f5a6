// StepTimings: the activation engine's timings not yet counted (step_timings.h).
#include "step_timings.h"

#include <iterator>

#include "offload/bindings_registry.h"
#include "offload/event_cache.h"

namespace offload {
namespace activation {

namespace {

// counters[kind] += seconds, on the step's own dict.
void add_seconds(const py::object& counters, const py::object& kind, double seconds) {
  PyObject* now = PyDict_GetItemWithError(counters.ptr(), kind.ptr());  // borrowed
  if (now == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, kind.ptr());
    throw py::error_already_set();
  }
  const py::object more = py::reinterpret_steal<py::object>(PyNumber_Add(now, py::float_(seconds).ptr()));
  if (!more || PyDict_SetItem(counters.ptr(), kind.ptr(), more.ptr()) < 0) throw py::error_already_set();
}

}  // namespace

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
        add_seconds(timed.counters, timed.kind, *seconds);
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
    add_seconds(timed.counters, timed.kind, timed.start->event.elapsedTime(timed.end->event) / 1e3);
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
