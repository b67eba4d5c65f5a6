// Python bindings of bucket packing (include/offload/buckets.h): offload._C.pack_bucket
// and unpack_bucket, which offload/weights/bucket_pack.py calls with its plan.
//
// Bound with pybind11 rather than TORCH_LIBRARY: the ops take parallel lists of
// offsets and dtypes and write into a caller-owned bucket or caller-owned
// parameters in place; they are a transport step outside any autograd or compiled
// graph, and the pybind call avoids boxing four lists through the dispatcher on a
// path where host overhead per bucket matters.
#include <torch/extension.h>

#include "offload/bindings_registry.h"
#include "offload/buckets.h"

namespace offload {
namespace {

void bind_buckets(pybind11::module_& m) {
  namespace py = pybind11;
  // The GIL is released: a host-cache sender packs on its own thread while the trainer runs.
  m.def("pack_bucket", &pack_bucket, "Pack spans of many tensors into one uint8 bucket, casting on the way",
        py::call_guard<py::gil_scoped_release>(), py::arg("bucket"), py::arg("sources"), py::arg("starts"),
        py::arg("numels"), py::arg("offsets"), py::arg("dtypes"), py::arg("max_blocks") = 0);
  m.def("unpack_bucket", &unpack_bucket, "Copy spans of a uint8 bucket into many tensors, casting on the way",
        py::call_guard<py::gil_scoped_release>(), py::arg("bucket"), py::arg("destinations"), py::arg("starts"),
        py::arg("numels"), py::arg("offsets"), py::arg("dtypes"), py::arg("max_blocks") = 0);
}

}  // namespace
}  // namespace offload

OFFLOAD_REGISTER_BINDINGS(buckets, offload::bind_buckets);
