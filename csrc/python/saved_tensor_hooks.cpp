// The activation engine's saved-tensor hooks: their per-tensor tests in C.
//
// Why: in a launch-bound training step every microsecond the hooks spend on a saved tensor
// is step time. In Python, deciding whether a tensor may be offloaded and which bytes of its
// storage it reads is about fifteen attribute calls (size, device, layout, base, grad_fn,
// storage, strides). Here it is one call, and a tensor that stays on the device
// (parameters, small tensors) never enters the interpreter.
//
// What is decided where (the engine's side is Note [engine interface] in
// offload/activation/engine.py):
// - offload_extent is offload/activation/saved_tensors.py's `offload_extent` in C (the
//   Python path without the core uses that one; a test holds the two equal on a catalogue
//   of tensors).
// - pack_saved_tensor(engine, t) is the pack hook (bound to its engine with
//   functools.partial, which the garbage collector sees through, so an engine and its
//   hooks are freed together). With no group open it hands the tensor to the engine's
//   Python `pack`, which counts what is saved after the last layer; a tensor that stays
//   it keeps here, as the engine does (counted); one that may be offloaded goes to the
//   engine's `pack_extent` with its extent, for the group's bookkeeping.
// - unpack_saved_tensor(engine, packed) returns a kept tensor whose version is unchanged
//   and hands everything else (the step's first unpack, offloaded tensors, a modified
//   tensor's error) to the engine's `unpack`.
// All run with the interpreter lock held, on the thread autograd calls the hooks from.
#include <cstdint>
#include <exception>
#include <string>
#include <typeindex>
#include <unordered_map>

#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "offload/bindings_registry.h"

namespace offload {
namespace {

namespace py = pybind11;

// Whether the last component of `node`'s C++ type name is `name` (Node::name() demangles,
// an allocation per call: the answer is cached per type). The Python path compares the
// node's Python class name, which is that same last component.
bool node_is(const torch::autograd::Node& node, const char* name) {
  static std::unordered_map<std::type_index, std::string> names;
  const std::type_index type(typeid(node));
  auto it = names.find(type);
  if (it == names.end()) {
    std::string full = node.name();
    const auto colon = full.rfind("::");
    it = names.emplace(type, colon == std::string::npos ? full : full.substr(colon + 2)).first;
  }
  return it->second == name;
}

struct Extent {
  int64_t ptr;  // the storage's data pointer
  int64_t first;  // first byte of the storage the tensor reads
  int64_t last;  // one past the last byte it reads
  bool check_params;  // its base has no grad_fn: it may share a parameter's or input's storage
};

// Whether the engine may offload `t`, a plain tensor saved while a group is open; the
// reasons it stays are listed at offload/activation/saved_tensors.py's `offload_extent`.
bool offload_extent_of(const at::Tensor& t, int64_t min_bytes, const c10::Device& device, Extent* out) {
  const int64_t numel = t.numel();
  const int64_t itemsize = t.element_size();
  if (numel * itemsize < min_bytes || numel == 0) return false;
  if (t.device() != device || t.layout() != at::kStrided) return false;
  if (torch::autograd::get_current_graph_task_id() != -1) return false;  // saved in backward: a recompute
  at::Tensor base = t;
  if (t.is_view()) base = t._base();
  if (base.requires_grad() && base.is_leaf()) return false;  // a leaf that requires grad, or its view
  // A shared_ptr up to torch 2.12, an intrusive_ptr from 2.13: both have get() and ->.
  const auto& grad_fn = base.grad_fn();
  if (grad_fn.get() != nullptr && grad_fn->num_outputs() > 0 && node_is(*grad_fn, "ToCopyBackward0")) {
    const auto& source = grad_fn->next_edge(0).function;
    if (source.get() != nullptr && node_is(*source, "AccumulateGrad")) return false;  // autocast's cast of a leaf
  }
  if (t.is_complex() && (t.is_conj() || t.is_neg())) return false;
  int64_t first = t.storage_offset() * itemsize;
  int64_t last = first + itemsize;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d] * itemsize;
  out->ptr = reinterpret_cast<int64_t>(t.storage().data());
  out->first = first;
  out->last = last;
  out->check_params = grad_fn.get() == nullptr;
  return true;
}

// (storage data_ptr, first byte, end byte, check_params), or None where `t` stays.
py::object offload_extent(const at::Tensor& t, int64_t min_bytes, const c10::Device& device) {
  Extent extent{};
  if (!offload_extent_of(t, min_bytes, device, &extent)) return py::none();
  return py::make_tuple(extent.ptr, extent.first, extent.last, extent.check_params);
}

// The engine's attributes the hooks read (its documented interface), as interned strings
// made once (a lookup by a C string makes a new str object each time). `_version` is the
// tensor's own attribute.
struct Names {
  PyObject* group = PyUnicode_InternFromString("open_group");
  PyObject* pack = PyUnicode_InternFromString("pack");
  PyObject* pack_extent = PyUnicode_InternFromString("pack_extent");
  PyObject* unpack = PyUnicode_InternFromString("unpack");
  PyObject* counters = PyUnicode_InternFromString("counters");
  PyObject* tensors_kept = PyUnicode_InternFromString("tensors_kept");
  PyObject* min_tensor_bytes = PyUnicode_InternFromString("min_tensor_bytes");
  PyObject* device = PyUnicode_InternFromString("device");
  PyObject* backward_seen = PyUnicode_InternFromString("backward_seen");
  PyObject* version = PyUnicode_InternFromString("_version");
};

const Names& names() {
  static const Names* interned = new Names();  // never freed: the module lives as long as the interpreter
  return *interned;
}

py::object attr(py::handle obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// What autograd holds for a tensor that stays: (tensor, version at save), as the engine
// keeps one, which is also counted. The version is read as Python reads it (a subclass may
// answer it itself), so the engine's `unpack` compares like with like.
py::object keep(py::handle engine, py::handle tensor) {
  const Names& n = names();
  py::object counters = attr(engine, n.counters);
  PyObject* kept = PyDict_GetItemWithError(counters.ptr(), n.tensors_kept);  // borrowed
  if (kept == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "tensors_kept");
    throw py::error_already_set();
  }
  py::object more = py::reinterpret_steal<py::object>(PyNumber_Add(kept, py::int_(1).ptr()));
  if (!more || PyDict_SetItem(counters.ptr(), n.tensors_kept, more.ptr()) < 0) throw py::error_already_set();
  return py::make_tuple(py::reinterpret_borrow<py::object>(tensor), attr(tensor, n.version));
}

py::object pack_saved_tensor(py::handle engine, py::handle tensor) {
  const Names& n = names();
  if (attr(engine, n.group).is_none() || !THPVariable_Check(tensor.ptr())) {
    return attr(engine, n.pack)(tensor);  // the tail's count, or not a tensor at all: Python decides
  }
  if (!THPVariable_CheckExact(tensor.ptr())) return keep(engine, tensor);  // parameters, DTensors
  const py::object device = attr(engine, n.device);
  if (!THPDevice_Check(device.ptr())) throw py::type_error("offload: the engine's device is not a torch.device");
  Extent extent{};
  const auto min_bytes = attr(engine, n.min_tensor_bytes).cast<int64_t>();
  const at::Tensor& t = THPVariable_Unpack(tensor.ptr());
  if (!offload_extent_of(t, min_bytes, reinterpret_cast<THPDevice*>(device.ptr())->device, &extent)) {
    return keep(engine, tensor);
  }
  return attr(engine, n.pack_extent)(tensor, extent.ptr, extent.first, extent.last, extent.check_params);
}

py::object unpack_saved_tensor(py::handle engine, py::handle packed) {
  const Names& n = names();
  PyObject* obj = packed.ptr();
  if (PyTuple_CheckExact(obj) && PyTuple_GET_SIZE(obj) == 2 && THPVariable_Check(PyTuple_GET_ITEM(obj, 0)) &&
      PyObject_IsTrue(attr(engine, n.backward_seen).ptr()) == 1) {
    py::handle tensor = PyTuple_GET_ITEM(obj, 0);
    const py::object now = attr(tensor, n.version);
    const int same = PyObject_RichCompareBool(now.ptr(), PyTuple_GET_ITEM(obj, 1), Py_EQ);
    if (same < 0) throw py::error_already_set();
    if (same == 1) return py::reinterpret_borrow<py::object>(tensor);
  }
  return attr(engine, n.unpack)(packed);  // the step's first unpack, an offloaded tensor, or an error
}

// The hooks as plain C functions taking (engine, x) by the vectorcall protocol: autograd calls
// them once per saved tensor, and a pybind11 function's argument dispatch cost more than the
// rest of a kept tensor's pack.
template <py::object (*Hook)(py::handle, py::handle)>
PyObject* fast_call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "offload._C hook: expected 2 arguments (engine, tensor or packed), got %zd", nargs);
    return nullptr;
  }
  try {
    return Hook(args[0], args[1]).release().ptr();
  } catch (py::error_already_set& e) {  // raised in Python (the engine's methods): as it was
    e.restore();
  } catch (const py::builtin_exception& e) {  // py::type_error and its kin: their Python type
    e.set_error();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef hook_defs[] = {
    {"pack_saved_tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<pack_saved_tensor>)),
     METH_FASTCALL, "The activation engine's pack hook: pack_saved_tensor(engine, tensor) (bind the engine with "
     "functools.partial)"},
    {"unpack_saved_tensor",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call<unpack_saved_tensor>)), METH_FASTCALL,
     "The activation engine's unpack hook: unpack_saved_tensor(engine, packed) (bind the engine with "
     "functools.partial)"},
};

void bind(py::module_& m) {
  m.def("offload_extent", &offload_extent, py::arg("tensor"), py::arg("min_bytes"), py::arg("device"),
        "Whether the activation engine may offload `tensor` (a plain tensor saved in a group): "
        "None, or (storage data_ptr, first byte, end byte, whether its base has no grad_fn)");
  for (PyMethodDef& def : hook_defs) {
    PyObject* fn = PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace

OFFLOAD_REGISTER_BINDINGS(saved_tensor_hooks, bind);

}  // namespace offload
