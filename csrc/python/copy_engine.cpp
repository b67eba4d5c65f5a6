// Python bindings of the copy engine (include/offload/transfer.h): the classes
// offload._C.Transfer and CopyTimer and the functions copy_to_host,
// copy_spans_to_host, copy_to_device and wait_copy_worker that
// offload/core/copy.py wraps, with the CPython fast path that converts a list of
// tensors as the engine reaches it.
//
// The GIL: every call that may wait (for the driver, the copy worker or the
// copies) lets it go, and first drops, with it held, what finished copies left
// (Note [dropping tensors] in csrc/core/in_flight.h).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "offload/bindings_registry.h"
#include "offload/host_pool.h"
#include "offload/multi_tensor_copy.h"
#include "offload/prefetch.h"
#include "offload/tensor_source.h"
#include "offload/transfer.h"

namespace offload {
namespace {

namespace py = pybind11;

// The lines of a tensor the conversion and the copy engine's checks read: its
// reference count, sizes, strides, dtype and device (TensorImpl spans ~4 lines).
inline void prefetch_tensor(const c10::TensorImpl* impl) {
  const char* p = reinterpret_cast<const char*>(impl);
  for (size_t line = 0; line < sizeof(c10::TensorImpl); line += 64) prefetch(p + line);
}

// Items ahead of the one converted, by stage: its Python object, then its
// TensorImpl (read through the object), then its StorageImpl (read through the
// TensorImpl, for the data pointer). After a training step these are cache
// misses, one chain of three per tensor: asked for early, the misses of several
// tensors overlap instead of queueing, and the checks right behind the
// conversion (to_host_deferred) find the lines still in the caches.
constexpr size_t kObjectAhead = 12, kTensorAhead = 8, kStorageAhead = 4;

void prefetch_ahead(PyObject* items, size_t i, size_t size) {
  if (i + kObjectAhead < size) prefetch(PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i + kObjectAhead)));
  if (i + kTensorAhead < size) {
    PyObject* item = PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i + kTensorAhead));
    if (THPVariable_CheckExact(item)) prefetch_tensor(THPVariable_Unpack(item).unsafeGetTensorImpl());
  }
  if (i + kStorageAhead < size) {
    PyObject* item = PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i + kStorageAhead));
    if (THPVariable_CheckExact(item)) {
      const c10::TensorImpl* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
      prefetch(impl->unsafe_storage().unsafeGetStorageImpl());  // null without storage: harmless
    }
  }
}

// Converts list items to tensors on demand, taking the GIL for each batch. The
// list outlives the call (the binding's argument holds it), so it is borrowed.
TensorSource::Fill lazy_conversion(const py::list& list) {
  PyObject* items = list.ptr();
  return [items](std::vector<at::Tensor>& into, size_t upto) {
    py::gil_scoped_acquire gil;
    const auto size = static_cast<size_t>(PyList_GET_SIZE(items));
    TORCH_CHECK_VALUE(size >= upto, "offload: the list of tensors changed size during the copy");
    for (size_t i = into.size(); i < upto; ++i) {
      prefetch_ahead(items, i, size);
      PyObject* item = PyList_GET_ITEM(items, static_cast<Py_ssize_t>(i));
      if (!THPVariable_Check(item)) {
        throw py::type_error("offload: tensors[" + std::to_string(i) + "] must be a torch.Tensor, got " +
                             Py_TYPE(item)->tp_name);
      }
      into.push_back(THPVariable_Unpack(item));
    }
  };
}

// Drops what the copy worker finished and the in-flight registry no longer
// needs, here, with the GIL held: a dropped tensor that has a Python object takes
// the GIL, which costs little when held and, released, may wait for another
// thread's switch interval, per tensor. Bindings call it before they let the GIL
// go, so the engine's own drains (without it) find little left.
void collect_with_gil() { release_finished_copies(); }

// A deferred transfer not queued yet is waited for without the GIL (the worker
// never needs it, but other Python threads should run meanwhile).
void settle_deferred(const Transfer& t) {
  if (t.enqueue_pending()) {
    py::gil_scoped_release no_gil;
    t.wait_enqueued();
  }
  if (t.deferred()) collect_with_gil();
}

void bind_copy_engine(py::module_& m) {
  py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer")
      .def("tensors", &Transfer::tensors)
      // One tensor, or the count, without converting the whole list (thousands of tensors).
      .def("size", [](const Transfer& t) { return t.tensors().size(); })
      .def("tensor",
           [](const Transfer& t, int64_t i) {
             const auto n = static_cast<int64_t>(t.tensors().size());
             TORCH_CHECK_INDEX(i >= 0 && i < n, "offload.CopyHandle: index ", i, " out of range for ", n, " tensors");
             return t.tensors()[i];
           })
      .def("nbytes", &Transfer::nbytes)
      .def("device", &Transfer::device)
      .def("restore_specs", &Transfer::restore_specs)
      // Each waits without the GIL and drains the registry with it (Transfer::query says why).
      .def("query",
           [](const Transfer& t) {
             if (t.enqueue_pending()) return false;  // never waits: not even queued yet
             settle_deferred(t);
             bool done = false;
             {
               py::gil_scoped_release no_gil;
               done = t.query(/*drain=*/false);
             }
             if (done) drain_in_flight();
             return done;
           })
      .def("synchronize",
           [](const Transfer& t) {
             settle_deferred(t);
             {
               py::gil_scoped_release no_gil;
               t.synchronize(/*drain=*/false);
             }
             drain_in_flight();
           })
      // stream None: the current stream of the transfer's device.
      .def("wait_stream",
           [](const Transfer& t, c10::optional<c10::Stream> s) {
             settle_deferred(t);
             t.wait_stream(s);
           })
      .def("wait_stream_for",
           [](const Transfer& t, int64_t i, c10::optional<c10::Stream> s) {
             settle_deferred(t);
             t.wait_stream_for(i, s);
           })
      .def("release_sources",
           [](Transfer& t, c10::optional<c10::Stream> s) {
             settle_deferred(t);
             t.release_sources(s);
           })
      .def("copy_seconds", &Transfer::copy_seconds)  // never waits
      .def("timer", [](const Transfer& t) {
        settle_deferred(t);
        return t.timer();
      });
  py::class_<CopyTimer, std::shared_ptr<CopyTimer>>(m, "CopyTimer")
      .def("seconds", &CopyTimer::seconds)  // never waits
      .def("synchronize", &CopyTimer::synchronize, py::call_guard<py::gil_scoped_release>());
  auto make_options = [](bool require_pinned, int64_t small_bytes, int64_t chunk_bytes) {
    CopyOptions o;
    o.require_pinned = require_pinned;
    o.small_bytes = small_bytes;
    o.chunk_bytes = chunk_bytes;
    return o;
  };
  // `tensors` is a Python list, converted as the engine reaches it (with the GIL
  // taken for each batch); copy_to_device also takes None for "the tensors of `from`".
  m.def("copy_to_host",
        [make_options](const py::list& tensors, HostPool& pool, c10::optional<c10::Stream> stream,
                       c10::optional<std::vector<at::Tensor>> out, std::shared_ptr<Transfer> reuse,
                       bool require_pinned, int64_t small_bytes, int64_t chunk_bytes, int64_t group_bytes,
                       bool defer, bool timing, bool same_sources) {
          CopyOptions options = make_options(require_pinned, small_bytes, chunk_bytes);
          options.group_bytes = group_bytes;
          options.timing = timing;
          options.same_sources = same_sources;
          if (defer) {
            TORCH_CHECK_VALUE(!out.has_value(), "offload.copy_to_host: defer=True takes out=<CopyHandle>, "
                              "not a list of tensors");
            collect_with_gil();  // what earlier copies left, before the GIL is let go
            // Converted with the GIL held until every tensor is (the worker never
            // takes it): the first groups are queued after converting their own
            // tensors only, and each later batch is checked as it is converted.
            // Let go once, not per batch: taken back per batch, it could wait a
            // switch interval each time for another Python thread.
            auto source = std::make_unique<TensorSource>(tensors.size(), lazy_conversion(tensors));
            c10::optional<py::gil_scoped_release> no_gil;
            return copy_to_host_deferred(std::move(source), pool, stream, reuse, options,
                                         [&no_gil] { no_gil.emplace(); });
          }
          collect_with_gil();  // what earlier copies left, before the GIL is let go
          TensorSource source(tensors.size(), lazy_conversion(tensors));
          py::gil_scoped_release no_gil;
          return copy_to_host(source, pool, stream, out, reuse, options);
        });
  // Registered with atexit by the first deferred copy: copies still being queued
  // are queued before the interpreter (and then the driver) goes away.
  m.def("wait_copy_worker", [] {
    py::gil_scoped_release no_gil;
    wait_copy_worker();
  });
  // Drops what the in-flight registry holds for copies already complete (Note
  // [in-flight registry]): otherwise the sources of a process's last copies stay
  // until its next copy or query.
  m.def("release_finished_copies", [] { collect_with_gil(); });
  // Whether a group's spans go out in one batched copy call (where the runtime has one)
  // or one call each: the host section compares the two.
  m.def("_set_batched_copies", &set_batched_copies, py::arg("enabled"));
  m.def("_batched_copies", &batched_copies);
  // out None: the core acquires a block of out_bytes from the pool.
  m.def("copy_spans_to_host",
        [make_options](const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& starts,
                       const std::vector<int64_t>& sizes, c10::optional<at::Tensor> out, int64_t out_bytes,
                       const std::vector<int64_t>& offsets, HostPool& pool, c10::optional<c10::Stream> stream,
                       int64_t chunk_bytes, bool timing) {
          collect_with_gil();
          py::gil_scoped_release no_gil;
          auto options = make_options(true, 0, chunk_bytes);
          options.timing = timing;
          return copy_spans_to_host(tensors, starts, sizes, out.value_or(at::Tensor()), out_bytes, offsets, pool,
                                    stream, options);
        });
  m.def("copy_to_device",
        [make_options](const py::object& tensors, std::shared_ptr<Transfer> from, c10::Device device,
                       HostPool& pool, c10::optional<c10::Stream> stream, c10::optional<std::vector<at::Tensor>> out,
                       bool require_pinned, int64_t small_bytes, int64_t chunk_bytes, bool timing) {
          TORCH_CHECK_VALUE(!tensors.is_none() || from, "offload.copy_to_device: tensors is None and no transfer given");
          c10::optional<TensorSource> given;
          if (!tensors.is_none()) {
            const auto list = tensors.cast<py::list>();
            given.emplace(list.size(), lazy_conversion(list));
          }
          collect_with_gil();
          py::gil_scoped_release no_gil;
          auto options = make_options(require_pinned, small_bytes, chunk_bytes);
          options.timing = timing;
          if (given) return copy_to_device(*given, from, device, pool, stream, out, options);
          return copy_to_device(from->tensors(), from, device, pool, stream, out, options);
        });
}

}  // namespace

OFFLOAD_REGISTER_BINDINGS(b_copy_engine, bind_copy_engine);

}  // namespace offload
