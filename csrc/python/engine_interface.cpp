// The calls on the Python engine's objects that the core makes (engine_interface.h).
#include "engine_interface.h"

namespace offload {
namespace activation {

const EngineNames& engine_names() {
  static const EngineNames* interned = new EngineNames();  // never freed: the module lives as long as the interpreter
  return *interned;
}

py::object attr(py::handle obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

py::object call(py::handle obj, PyObject* name, py::handle arg) {
  PyObject* result = PyObject_CallMethodOneArg(obj.ptr(), name, arg.ptr());
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

bool truthy(const py::object& value) {
  const int on = PyObject_IsTrue(value.ptr());
  if (on < 0) throw py::error_already_set();
  return on == 1;
}

py::object deref(const py::object& ref) {
  if (ref.is_none()) return ref;
  PyObject* target = PyWeakref_GetObject(ref.ptr());  // borrowed
  if (target == nullptr) throw py::error_already_set();
  return py::reinterpret_borrow<py::object>(target);
}

void add_to(const py::object& counters, PyObject* key, py::handle amount) {
  PyObject* now = PyDict_GetItemWithError(counters.ptr(), key);  // borrowed
  if (now == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    throw py::error_already_set();
  }
  const py::object more = py::reinterpret_steal<py::object>(PyNumber_Add(now, amount.ptr()));
  if (!more || PyDict_SetItem(counters.ptr(), key, more.ptr()) < 0) throw py::error_already_set();
}

void add_count(py::handle engine, PyObject* key, py::handle amount) {
  add_to(attr(engine, engine_names().counters), key, amount);
}

}  // namespace activation
}  // namespace offload
