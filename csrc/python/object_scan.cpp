// Loops over thousands of Python objects that the stager runs on every save,
// in C rather than in the interpreter (offload/staging/object_scan.py has the same
// functions in Python, used without the compiled core).
//
// Why: a steady save of a state dict of thousands of tensors must leave the
// caller within a few milliseconds. Two of its checks walk every leaf: that the
// leaves still have the types the cached plan was made for, and that no staged
// dict still holds a buffer set's tensors (the sum of their reference counts
// against a baseline). As `list(map(type, ...))` and
// `sum(map(sys.getrefcount, ...))` they cost a fair part of that budget; here, a
// few microseconds.
//
// A third sizes a first save before it plans, so that the pool's growth can
// start beside the planning: in Python it makes a storage object per tensor, all
// of it ahead of the growth.
//
// The last two make a first save's reader views: for each of the copy engine's
// host tensors, a tensor of the same dtype and layout over the same bytes under
// another storage (Note [who reads a buffer set] in offload/staging/ring.py says why). In Python
// each costs a storage object, dict lookups and an as_strided, microseconds a
// tensor after the copies are queued.
//
// A fifth reads a wide dict's values in the plan's key order, for the cached
// tree's extraction of the leaves (offload/staging/state_tree.py), on every save.
//
// They run with the interpreter lock held. The first two take lists (pybind11
// refuses anything else with a TypeError), dict_values a dict and a tuple; the
// others any sequence of tensors.
#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/extension.h>

#include "offload/bindings_registry.h"
#include "offload/prefetch.h"
#include "offload/tensor_layout.h"

namespace offload {
namespace {

// Objects ahead of the one read whose header is asked for (prefetch.h): each
// object is a cache miss of its own after a training step.
constexpr Py_ssize_t kAhead = 8;

// The sum of Py_REFCNT over the items of `objects`. Only compared with another
// sum from this same function (a buffer set's baseline), so whatever fixed count
// the list itself adds per item cancels out.
int64_t refcount_sum(const pybind11::list& objects) {
  int64_t total = 0;
  PyObject* list = objects.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch(PyList_GET_ITEM(list, i + kAhead));
    total += static_cast<int64_t>(Py_REFCNT(PyList_GET_ITEM(list, i)));
  }
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
    if (i + kAhead < n) prefetch(PyList_GET_ITEM(objs, i + kAhead));
    if (reinterpret_cast<PyObject*>(Py_TYPE(PyList_GET_ITEM(objs, i))) != PyList_GET_ITEM(typs, i)) return false;
  }
  return true;
}

// [d[k] for k in keys]: the values of a wide dict of the state dict in the
// order the cached plan saw its keys. Its own order is tried first, one pass
// comparing each key with the expected one by identity (the same key objects,
// the usual case), then by equality; where it differs (another insertion order,
// an OrderedDict reordered by move_to_end, whose dict order is not its
// iteration order) each key is looked up. A missing key raises KeyError. In
// Python, `tuple(d) == keys` then `list(d.values())` makes two lists of the dict's size.
pybind11::list dict_values(const pybind11::dict& d, const pybind11::tuple& keys) {
  PyObject* dict = d.ptr();
  PyObject* expected = keys.ptr();
  const Py_ssize_t n = PyTuple_GET_SIZE(expected);
  // The values' addresses first (the dict's own entries, read in order), then a
  // reference to each, its object asked for ahead (each is a cache miss).
  std::vector<PyObject*> values;
  values.reserve(static_cast<size_t>(n));
  bool in_order = PyDict_GET_SIZE(dict) == n;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (in_order && PyDict_Next(dict, &pos, &key, &value)) {
    PyObject* want = PyTuple_GET_ITEM(expected, static_cast<Py_ssize_t>(values.size()));
    // Equality only for exact str keys: no Python __eq__ runs while the dict is walked.
    if (key != want && !(PyUnicode_CheckExact(key) && PyUnicode_CheckExact(want) &&
                         PyUnicode_Compare(key, want) == 0)) {
      in_order = false;
      break;
    }
    values.push_back(value);
  }
  if (in_order) {
    pybind11::list out(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch(values[static_cast<size_t>(i + kAhead)]);
      PyObject* item = values[static_cast<size_t>(i)];
      Py_INCREF(item);
      PyList_SET_ITEM(out.ptr(), i, item);  // steals the reference
    }
    return out;
  }
  pybind11::list looked_up(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* want = PyTuple_GET_ITEM(expected, k);
    PyObject* found = PyDict_GetItemWithError(dict, want);  // borrowed
    if (found == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, want);
      throw pybind11::error_already_set();
    }
    Py_INCREF(found);
    PyList_SET_ITEM(looked_up.ptr(), k, found);
  }
  return looked_up;
}

// (bytes, largest): the bytes of `tensors`' storages that a first save copies,
// each storage once and never more of it than its tensors' bytes add up to (a
// slice of a large buffer costs the slice), and the largest tensor's bytes.
// Empty tensors count nothing. offload/staging/stager.py adds the packing slack.
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

// The address of each tensor's storage; 0 for a tensor with no elements, whose
// view needs no alias.
std::vector<int64_t> storage_addresses(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    out.push_back(t.numel() == 0 ? 0 : reinterpret_cast<int64_t>(t.storage().data()));
  }
  return out;
}

// For each host tensor, the same dtype, sizes, strides and storage offset over
// the storage of `aliases[address of its storage]`, a uint8 tensor whose storage
// starts at the same byte (so the element offset carries over); an empty tensor
// of its layout for a tensor with no bytes.
std::vector<at::Tensor> views_over(const std::vector<at::Tensor>& tensors,
                                   const std::unordered_map<int64_t, at::Tensor>& aliases) {
  const char* fn = "offload.AsyncStager (reader views)";
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.layout() == at::kStrided, fn, ": tensor ", i,
                      " must be a strided host tensor, got ", t.device(), " ", t.layout());
    if (t.numel() == 0) {
      out.push_back(at::empty_strided(t.sizes(), t.strides(), t.options()));
      continue;
    }
    const auto found = aliases.find(reinterpret_cast<int64_t>(t.storage().data()));
    TORCH_CHECK_VALUE(found != aliases.end(), fn, ": no alias for the storage of tensor ", i);
    const c10::Storage& storage = found->second.storage();
    int64_t last = t.storage_offset();  // the last element it reaches
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    TORCH_CHECK_VALUE((last + 1) * static_cast<int64_t>(t.element_size()) <= static_cast<int64_t>(storage.nbytes()),
                      fn, ": tensor ", i, " reaches past its alias (", storage.nbytes(), " bytes)");
    out.push_back(make_view(storage, t.scalar_type(), t.device(), t.sizes(), t.strides(), t.storage_offset()));
  }
  return out;
}

void bind_object_scan(pybind11::module_& m) {
  m.def("_refcount_sum", &refcount_sum, "Sum of the reference counts of a list's items (the stager's busy check)",
        pybind11::arg("objects"));
  m.def("_types_equal", &types_equal, "Whether each item of a list has exactly the type at its position in another",
        pybind11::arg("objects"), pybind11::arg("types"));
  m.def("_dict_values", &dict_values, "The values of a dict in the order of a tuple of its keys (KeyError if one "
        "is missing)", pybind11::arg("d"), pybind11::arg("keys"));
  m.def("_storage_bytes", &storage_bytes,
        "(bytes, largest): the storage bytes a first save of these tensors copies, and the largest tensor's",
        pybind11::arg("tensors"));
  m.def("_storage_addresses", &storage_addresses, "The address of each tensor's storage (0: no elements)",
        pybind11::arg("tensors"));
  m.def("_views_over", &views_over,
        "Each host tensor's layout over the storage of the alias of its storage (a first save's reader views)",
        pybind11::arg("tensors"), pybind11::arg("aliases"));
}

}  // namespace
}  // namespace offload

OFFLOAD_REGISTER_BINDINGS(object_scan, offload::bind_object_scan);
