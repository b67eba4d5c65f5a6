"""How a tensor's memory is laid out, and how to move only the bytes that matter.

Shared by the pure-PyTorch copy path and the activation engine; the native core
implements the same rules in csrc/core/tensor_layout.cpp.
"""

from __future__ import annotations

from typing import Tuple

import torch


def is_dense(t: torch.Tensor) -> bool:
    """True when the elements fill a gap-free span once each (any order of strides)."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def compact(t: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """Narrow broadcast dimensions (stride 0) to one element: (base, was_expanded).

    `base.expand(t.shape)` is `t` again, with the same strides.
    """
    if not any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride())):
        return t, False
    index = tuple(slice(0, 1) if (st == 0 and sz > 1) else slice(None) for sz, st in zip(t.shape, t.stride()))
    return t[index], True


def dense_view(block: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View the first bytes of uint8 `block` with `like`'s dtype, sizes and (dense) strides."""
    nbytes = like.numel() * like.element_size()
    flat = block[:nbytes].view(like.dtype)
    return flat.as_strided(like.shape, like.stride(), 0)
