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

}  // namespace offload
