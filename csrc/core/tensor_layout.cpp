// Tensor layout helpers for the copy engine (see include/offload/tensor_layout.h):
// which elements a strided tensor reaches, and views made without the dispatcher.
// Moves nothing.
#include "offload/tensor_layout.h"

#include <algorithm>
#include <utility>

#include "offload/checks.h"

namespace offload {

bool is_dense(const at::Tensor& t) {
  if (t.is_contiguous()) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size), size-1 dims carry no layout
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& dim : dims) {
    if (dim.first != expected) return false;
    expected *= dim.second;
  }
  return true;
}

at::Tensor compact(const at::Tensor& t, bool* expanded) {
  *expanded = false;
  at::Tensor base = t;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) {
      base = base.narrow(d, 0, 1);
      *expanded = true;
    }
  }
  return base;
}

at::Tensor make_view(const at::Storage& storage, at::ScalarType dtype, const at::Device& device,
                     at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset_elements) {
  // Built directly rather than through at::empty + set_: the engine makes one
  // view per transferred tensor, and two dispatcher round trips per view would be
  // most of the host time of a batch of thousands of tensors.
  auto key = c10::computeDispatchKey(dtype, at::kStrided, device);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                             caffe2::TypeMeta::fromScalarType(dtype));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset_elements);
  return out;
}

at::Tensor view_like(const at::Storage& storage, int64_t byte_offset, const at::Tensor& like,
                     const at::Device& device) {
  const int64_t itemsize = static_cast<int64_t>(like.element_size());
  TORCH_INTERNAL_ASSERT(byte_offset % itemsize == 0, "offload: misaligned view at byte ", byte_offset);
  return make_view(storage, like.scalar_type(), device, like.sizes(), like.strides(), byte_offset / itemsize);
}

}  // namespace offload
