// How a tensor's elements sit in memory, and which bytes a copy must move.
// The same rules as offload/core/layout.py (the pure-PyTorch path).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace offload {

// True when the elements fill a gap-free span once each, in any stride order.
bool is_dense(const at::Tensor& t);

// `t` with every broadcast dimension (stride 0, size > 1) narrowed to one
// element; `expanded` says whether any was. base.expand(t.sizes()) == t.
at::Tensor compact(const at::Tensor& t, bool* expanded);

// A tensor over `storage` with the given dtype, sizes, strides and element offset.
at::Tensor make_view(const at::Storage& storage, at::ScalarType dtype, const at::Device& device,
                     at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset_elements);

// A tensor of `like`'s dtype, sizes and strides whose first element sits at
// `byte_offset` of `storage`; byte_offset must be a multiple of the element size.
at::Tensor view_like(const at::Storage& storage, int64_t byte_offset, const at::Tensor& like,
                     const at::Device& device);

}  // namespace offload
