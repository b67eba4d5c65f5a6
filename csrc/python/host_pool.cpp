// Python bindings of the pinned host pool (include/offload/host_pool.h): the class
// offload._C.HostPool that offload/core/pool.py wraps. Allocation, reservation and
// trimming let the GIL go: they may wait for the driver or for copies in flight.
#include <string>

#include <torch/extension.h>

#include "offload/bindings_registry.h"
#include "offload/host_memory.h"
#include "offload/host_pool.h"

namespace offload {
namespace {

c10::DeviceType parse_device_type(const std::string& name) {
  if (name == "cpu") return c10::DeviceType::CPU;
  if (name == "cuda") return c10::DeviceType::CUDA;
  if (name == "npu") return c10::DeviceType::PrivateUse1;
  TORCH_CHECK_VALUE(false, "offload.HostPool: device_type must be 'cpu', 'cuda' or 'npu', got '", name, "'");
  return c10::DeviceType::CPU;
}

void bind_host_pool(pybind11::module_& m) {
  namespace py = pybind11;
  // For `python -m offload.info`: asks the driver nothing, so it answers before any device is used.
  m.def("host_pinner_registered", [](const std::string& device_type) {
        return host_memory_pinner_registered(parse_device_type(device_type));
      }, py::arg("device_type"), "Whether this build pins host memory for device_type ('cpu', 'cuda' or 'npu')");
  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool")
      .def(py::init([](const std::string& device_type, size_t limit_bytes, size_t slab_bytes, int touch_threads) {
             return HostPool::create(parse_device_type(device_type), limit_bytes, slab_bytes, touch_threads);
           }),
           py::arg("device_type"), py::arg("limit_bytes"), py::arg("slab_bytes"), py::arg("touch_threads"))
      .def("allocate", &HostPool::allocate, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("record_stream", [](HostPool& p, const at::Tensor& t, const c10::Stream& s) { return p.record_stream(t, s); },
           py::arg("tensor"), py::arg("stream"))
      .def("owns", &HostPool::owns, py::arg("tensor"))
      .def("reserve", &HostPool::reserve, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("begin_reserve", &HostPool::begin_reserve, py::arg("nbytes"), py::arg("largest_block"))
      .def("grow_reserved", &HostPool::grow_reserved, py::arg("bytes"), py::call_guard<py::gil_scoped_release>())
      .def("cancel_reserve", &HostPool::cancel_reserve, py::arg("bytes"))
      .def("trim", &HostPool::trim, py::call_guard<py::gil_scoped_release>())
      .def("pinned", &HostPool::pinned)
      .def("limit", &HostPool::limit)
      .def("set_limit", &HostPool::set_limit, py::arg("limit_bytes"))
      .def_static("size_class", &HostPool::size_class, py::arg("nbytes"))
      .def("stats", [](HostPool& pool) {
        const HostPoolStats s = pool.stats();
        py::dict d;
        d["reserved_bytes"] = s.reserved_bytes;
        d["in_use_bytes"] = s.in_use_bytes;
        d["peak_in_use_bytes"] = s.peak_in_use_bytes;
        d["free_bytes"] = s.free_bytes;
        d["pending_blocks"] = s.pending_blocks;
        d["limit_bytes"] = s.limit_bytes;
        d["requests"] = s.requests;
        d["cache_hits"] = s.cache_hits;
        d["slabs"] = s.slabs;
        d["recycled_slabs"] = s.recycled_slabs;
        d["allocation_seconds"] = s.allocation_seconds;
        d["registration_seconds"] = s.registration_seconds;
        return d;
      });
}

}  // namespace

OFFLOAD_REGISTER_BINDINGS(a_host_pool, bind_host_pool);

}  // namespace offload
