// Loops over thousands of Python objects that the stager runs on every save,
// in C rather than in the interpreter (offload/_object_scan.py has the same
// functions in Python, used without the compiled core).
//
// Why: a steady save of a 4,000-tensor state dict must leave the caller within
// about 2 ms. Two of its checks walk every leaf: that the leaves still have the
// types the cached plan was made for, and that no staged dict still holds a
// buffer set's tensors (the sum of their reference counts against a baseline).
// As `list(map(type, ...))` and `sum(map(sys.getrefcount, ...))` they cost
// 0.1-0.15 ms each at 4,000 objects; here, a few microseconds.
//
// A third sizes a first save before it plans, so that the pool's growth can
// start beside the planning: ~2 us a tensor in Python (a storage object made per
// tensor), 9 ms at 4,000 tensors on the H100's host, all of it ahead of the growth.
//
// They run with the interpreter lock held and take lists (pybind11 refuses
// anything else with a TypeError).
#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>

#include <torch/extension.h>

#include "offload/bindings_registry.h"

namespace offload {
namespace {

// The sum of Py_REFCNT over the items of `objects`. Only compared with another
// sum from this same function (a buffer set's baseline), so whatever fixed count
// the list itself adds per item cancels out.
int64_t refcount_sum(const pybind11::list& objects) {
  int64_t total = 0;
  PyObject* list = objects.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  for (Py_ssize_t i = 0; i < n; ++i) total += static_cast<int64_t>(Py_REFCNT(PyList_GET_ITEM(list, i)));
  return total;
}

// Whether `objects` and `types` have the same length and each object's type is
// exactly the type at its position (no subclass matches: a Parameter where the
// plan saw a Tensor is a change of structure).
bool types_equal(const pybind11::list& objects, const pybind11::list& types) {
  PyObject* objs = objects.ptr();
  PyObject* typs = types.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(objs);
  if (PyList_GET_SIZE(typs) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(PyList_GET_ITEM(objs, i))) != PyList_GET_ITEM(typs, i)) return false;
  }
  return true;
}

// (bytes, largest): the bytes of `tensors`' storages that a first save copies,
// each storage once and never more of it than its tensors' bytes add up to (a
// slice of a large buffer costs the slice), and the largest tensor's bytes.
// Empty tensors count nothing. offload/staging.py adds the packing slack.
std::pair<int64_t, int64_t> storage_bytes(const std::vector<at::Tensor>& tensors) {
  struct Extent {
    int64_t whole;  // the storage's bytes
    int64_t used;   // its tensors' bytes
  };
  std::unordered_map<const void*, Extent> storages;
  storages.reserve(tensors.size());
  int64_t largest = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (nbytes == 0) continue;
    largest = std::max(largest, nbytes);
    const c10::Storage& storage = t.storage();
    auto [it, fresh] = storages.try_emplace(storage.data(), Extent{static_cast<int64_t>(storage.nbytes()), 0});
    it->second.used += nbytes;
  }
  int64_t total = 0;
  for (const auto& entry : storages) total += std::min(entry.second.whole, entry.second.used);
  return {total, largest};
}

void bind_object_scan(pybind11::module_& m) {
  m.def("_refcount_sum", &refcount_sum, "Sum of the reference counts of a list's items (the stager's busy check)",
        pybind11::arg("objects"));
  m.def("_types_equal", &types_equal, "Whether each item of a list has exactly the type at its position in another",
        pybind11::arg("objects"), pybind11::arg("types"));
  m.def("_storage_bytes", &storage_bytes,
        "(bytes, largest): the storage bytes a first save of these tensors copies, and the largest tensor's",
        pybind11::arg("tensors"));
}

}  // namespace
}  // namespace offload

OFFLOAD_REGISTER_BINDINGS(object_scan, offload::bind_object_scan);
