// The pybind11 module offload._C: build information, then every feature's bindings
// (each feature registers itself, see include/offload/bindings_registry.h).
#include <algorithm>

#include <torch/extension.h>

#include "offload/bindings_registry.h"

#ifndef OFFLOAD_TARGET
#define OFFLOAD_TARGET "cpu"
#endif
#ifndef OFFLOAD_TORCH_VERSION
#define OFFLOAD_TORCH_VERSION "unknown"
#endif
// The build date is this file's compile time: a define passed to every source would change
// all their flags on each build, and ninja would recompile the whole core every time.
#ifndef OFFLOAD_BUILD_DATE
#define OFFLOAD_BUILD_DATE __DATE__ " " __TIME__
#endif

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["target"] = OFFLOAD_TARGET;
  info["torch_version"] = OFFLOAD_TORCH_VERSION;
  info["build_date"] = OFFLOAD_BUILD_DATE;
#ifdef OFFLOAD_CUDA_VERSION
  info["cuda_version"] = OFFLOAD_CUDA_VERSION;
#endif
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  pybind11::list features;
  for (const auto& entry : offload::bindings_registry()) features.append(entry.first);
  info["features"] = features;
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "offload native core: pinned host pool, copy engine, bucket packing, activation engine";
  m.def("build_info", &build_info, "What this core was built for and against");
  auto registry = offload::bindings_registry();
  std::sort(registry.begin(), registry.end());
  for (const auto& entry : registry) entry.second(m);
}
