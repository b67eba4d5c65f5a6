// Argument checks that name the function, the argument, the rule and what arrived.
#pragma once

#include <cstdio>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace offload {

// The dtype as Python spells it (torch.float32 -> "float32"), so messages match.
inline std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    default: return c10::toString(type);
  }
}

inline std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << "shape " << t.sizes() << " and dtype " << dtype_name(t.scalar_type());
  return out.str();
}

inline std::string human_bytes(size_t bytes) {
  char text[64];
  if (bytes >= (size_t(1) << 30)) {
    std::snprintf(text, sizeof(text), "%.3g GiB", double(bytes) / double(size_t(1) << 30));
  } else if (bytes >= (size_t(1) << 20)) {
    std::snprintf(text, sizeof(text), "%.3g MiB", double(bytes) / double(size_t(1) << 20));
  } else {
    std::snprintf(text, sizeof(text), "%zu bytes", bytes);
  }
  return text;
}

inline int64_t tensor_nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// The bytes of its storage that a strided tensor reaches: up to its last element's end.
inline int64_t storage_bytes_needed(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return (last + 1) * static_cast<int64_t>(t.element_size());
}

// Whether a tensor's storage holds every element it spans. A parameter parked by
// offload.offload_params keeps its sizes over a storage resized to 0 bytes (Note [parked
// reads] in offload/weights/parked.py): read, it would be freed memory.
inline bool has_data(const at::Tensor& t) {
  return !t.has_storage() || t.storage().nbytes() >= static_cast<size_t>(storage_bytes_needed(t));
}

// The error for a tensor without data, naming what the caller calls it (e.g. "tensors[3]").
template <typename... Args>
inline void check_has_data(const at::Tensor& t, const char* fn, const Args&... what) {
  TORCH_CHECK_VALUE(has_data(t), fn, ": ", what..., " has no data: its storage holds ",
              t.has_storage() ? t.storage().nbytes() : 0, " bytes but the tensor reaches ", storage_bytes_needed(t),
              ". A parameter parked by offload.offload_params keeps its shape while its values are on the host; "
              "call offload.reload_params(module) first, or read module.state_dict(), which gives the parked "
              "values from the host");
}

}  // namespace offload
