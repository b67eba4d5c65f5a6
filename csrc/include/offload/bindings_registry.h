// How each native feature adds itself to the Python module offload._C.
//
// A bindings file of csrc/python (host_pool.cpp, copy_engine.cpp, buckets.cpp,
// ...) defines its pybind11 bindings in a function and registers it with
//     OFFLOAD_REGISTER_BINDINGS(name, fn);
// csrc/python/module.cpp runs every registered function when the module is
// imported, in the order of their names, so features never edit a shared file to
// appear. A feature whose signatures name another's class sorts after it
// (a_host_pool before b_copy_engine), so pybind11 knows the class by then.
// Only csrc/python includes this header: it pulls in torch/extension.h (Python.h).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/extension.h>

namespace offload {

using BindingsFn = void (*)(pybind11::module_&);

inline std::vector<std::pair<std::string, BindingsFn>>& bindings_registry() {
  static std::vector<std::pair<std::string, BindingsFn>> registry;
  return registry;
}

struct BindingsRegistrar {
  BindingsRegistrar(const char* name, BindingsFn fn) { bindings_registry().emplace_back(name, fn); }
};

}  // namespace offload

#define OFFLOAD_REGISTER_BINDINGS(name, fn) \
  static ::offload::BindingsRegistrar offload_bindings_registrar_##name(#name, fn)
