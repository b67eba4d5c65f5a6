// Argument checks that name the function, the argument, the rule and what arrived.
#pragma once

#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace offload {

inline std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << "shape " << t.sizes() << " and dtype " << c10::toString(t.scalar_type());
  return out.str();
}

inline std::string human_bytes(size_t bytes) {
  std::ostringstream out;
  out.precision(3);
  if (bytes >= (size_t(1) << 30)) {
    out << double(bytes) / double(size_t(1) << 30) << " GiB";
  } else if (bytes >= (size_t(1) << 20)) {
    out << double(bytes) / double(size_t(1) << 20) << " MiB";
  } else {
    out << bytes << " bytes";
  }
  return out.str();
}

inline int64_t tensor_nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

}  // namespace offload
