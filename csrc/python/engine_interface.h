// The Python engine's attributes and methods that the core reads and calls (Note [engine
// interface] in offload/activation/engine.py), as interned strings made once (a lookup by a
// C string makes a new str object each time), and the few calls made on them. `_version` is
// a tensor's own attribute; the rest are the engine's, its groups' and its schedule's.
#pragma once

#include <type_traits>

#include <torch/extension.h>

namespace offload {
namespace activation {

namespace py = pybind11;

struct EngineNames {
  PyObject* append = PyUnicode_InternFromString("append");
  PyObject* pack = PyUnicode_InternFromString("pack");
  PyObject* unpack = PyUnicode_InternFromString("unpack");
  PyObject* counters = PyUnicode_InternFromString("counters");
  PyObject* tensors_kept = PyUnicode_InternFromString("tensors_kept");
  PyObject* backward_seen = PyUnicode_InternFromString("backward_seen");
  PyObject* backward_starts = PyUnicode_InternFromString("_backward_starts");
  PyObject* observer = PyUnicode_InternFromString("observer");
  PyObject* unpacked = PyUnicode_InternFromString("unpacked");
  PyObject* make_ready = PyUnicode_InternFromString("_make_ready");
  PyObject* prefetch = PyUnicode_InternFromString("_prefetch");
  PyObject* release = PyUnicode_InternFromString("_release");
  PyObject* walk_params = PyUnicode_InternFromString("_walk_params");
  PyObject* profiled = PyUnicode_InternFromString("_profiled");
  PyObject* split = PyUnicode_InternFromString("_split");
  PyObject* cap = PyUnicode_InternFromString("cap");
  PyObject* span_ends = PyUnicode_InternFromString("span_ends");
  PyObject* profile = PyUnicode_InternFromString("profile");
  PyObject* version = PyUnicode_InternFromString("_version");
  PyObject* copy_streams = PyUnicode_InternFromString("_copy_streams");
  PyObject* fetch_in_python = PyUnicode_InternFromString("_fetch_group");
  PyObject* h2d_bytes = PyUnicode_InternFromString("h2d_bytes");
  PyObject* h2d_seconds = PyUnicode_InternFromString("h2d_seconds");
  PyObject* d2h_seconds = PyUnicode_InternFromString("d2h_seconds");
  PyObject* groups_fetched = PyUnicode_InternFromString("groups_fetched");
  PyObject* groups_prefetched = PyUnicode_InternFromString("groups_prefetched");
  PyObject* backward_wait_seconds = PyUnicode_InternFromString("backward_wait_seconds");
  PyObject* forward_wait_seconds = PyUnicode_InternFromString("forward_wait_seconds");
  PyObject* layer_sizes = PyUnicode_InternFromString("_layer_sizes");
  PyObject* inflight = PyUnicode_InternFromString("_inflight");
  PyObject* popleft = PyUnicode_InternFromString("popleft");
  PyObject* resident_groups = PyUnicode_InternFromString("resident_groups");
  PyObject* keep_on_device = PyUnicode_InternFromString("_keep_on_device");
  PyObject* d2h_bytes = PyUnicode_InternFromString("d2h_bytes");
  PyObject* groups_offloaded = PyUnicode_InternFromString("groups_offloaded");
  PyObject* layers_offloaded = PyUnicode_InternFromString("layers_offloaded");
  PyObject* tensors_offloaded = PyUnicode_InternFromString("tensors_offloaded");
  PyObject* capturing = PyUnicode_InternFromString("capturing");
  PyObject* min_group_bytes = PyUnicode_InternFromString("min_group_bytes");
  PyObject* layer_groups = PyUnicode_InternFromString("_layer_groups");
  PyObject* last_offloaded = PyUnicode_InternFromString("_last_offloaded");
  PyObject* hooks_in_groups_only = PyUnicode_InternFromString("hooks_in_groups_only");
  PyObject* hooks_on = PyUnicode_InternFromString("_hooks_on");
  PyObject* tail = PyUnicode_InternFromString("_tail");
  PyObject* hooks_follow_groups = PyUnicode_InternFromString("_hooks_follow_groups");
  PyObject* schedule = PyUnicode_InternFromString("schedule");
  PyObject* release_at = PyUnicode_InternFromString("release_at");
  PyObject* due = PyUnicode_InternFromString("_due");
  PyObject* layer_count = PyUnicode_InternFromString("n");  // a schedule's layers
  PyObject* tail_save = PyUnicode_InternFromString("tail_save");
  PyObject* caps = PyUnicode_InternFromString("caps");
  PyObject* split_at = PyUnicode_InternFromString("split_at");
};

const EngineNames& engine_names();

// obj.<name>, raising what Python raised.
py::object attr(py::handle obj, PyObject* name);
// obj.<name>(arg).
py::object call(py::handle obj, PyObject* name, py::handle arg);
bool truthy(const py::object& value);
// The object a weak reference (or None) names, or None.
py::object deref(const py::object& ref);
// counters[key] += amount, on a counters dict (an int counter, or a float one for seconds).
void add_to(const py::object& counters, PyObject* key, py::handle amount);
// engine.counters[key] += amount.
void add_count(py::handle engine, PyObject* key, py::handle amount);
template <typename Number, typename = std::enable_if_t<std::is_arithmetic<Number>::value>>
void add_count(py::handle engine, PyObject* key, Number amount) {
  add_count(engine, key, py::cast(amount));
}

}  // namespace activation
}  // namespace offload
