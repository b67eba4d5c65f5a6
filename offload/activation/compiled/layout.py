"""Where each saved tensor of a compiled layer's group lies in the group's host block.

One pure function of sizes, strides and dtypes, run twice with the same arguments: by the
ops' fake kernels while the compiler traces (sizes may be symbolic, so only arithmetic that
SymInts support), and by the real kernels at run time. Both must give the same block size,
or the compiled graph's buffer would not match the tensor the op returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

# A span's place in the host block starts on the eager engine's span boundary (the caching
# allocator's block alignment): the host views keep the alignment every dtype needs, and a DMA
# from an aligned address runs at full speed.
from ..groups import SPAN_ALIGN

# Dtypes travel through the ops' schemas as indices into this tuple: a schema has no list of
# dtypes. Its order is part of compiled graphs (cached ones too), so entries are only appended.
DTYPES: Tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
) + tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
          if hasattr(torch, name))


def dtype_code(dtype: torch.dtype) -> int:
    """The index of `dtype` in DTYPES (ValueError for a dtype the ops do not carry)."""
    try:
        return DTYPES.index(dtype)
    except ValueError:
        raise ValueError(f"offload.activation.compiled: saved tensors of dtype {dtype} are not offloaded "
                         f"under torch.compile; supported: {', '.join(str(d) for d in DTYPES)}") from None


@dataclass(frozen=True)
class TensorSpec:
    """What a saved tensor is restored as: its size, stride and dtype (storage offset 0)."""

    size: Tuple
    stride: Tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class GroupLayout:
    """Per tensor: the bytes it reads from its storage (`span_bytes`, from its first element)
    and where they go in the host block (`offsets`); `total` is the block's size."""

    span_bytes: Tuple
    offsets: Tuple
    total: object  # int, or SymInt while tracing


def span_elements(size: Sequence, stride: Sequence):
    """Elements from a non-empty tensor's first element to its last, inclusive."""
    extent = 1
    for n, s in zip(size, stride):
        extent = extent + (n - 1) * s
    return extent


def group_layout(specs: Sequence[TensorSpec]) -> GroupLayout:
    """The host block's layout for `specs`, in order, each span aligned to SPAN_ALIGN."""
    spans, offsets = [], []
    end = 0
    for spec in specs:
        start = (end + SPAN_ALIGN - 1) // SPAN_ALIGN * SPAN_ALIGN
        nbytes = span_elements(spec.size, spec.stride) * spec.dtype.itemsize
        spans.append(nbytes)
        offsets.append(start)
        end = start + nbytes
    return GroupLayout(tuple(spans), tuple(offsets), end)


def specs_of(tensors: Sequence[torch.Tensor]) -> List[TensorSpec]:
    return [TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors]


def flatten_specs(specs: Sequence[TensorSpec]) -> Tuple[list, list, list, list]:
    """(sizes, strides, ranks, dtype codes): the specs as the flat lists the ops' schemas take."""
    sizes, strides, ranks, dtypes = [], [], [], []
    for spec in specs:
        sizes.extend(spec.size)
        strides.extend(spec.stride)
        ranks.append(len(spec.size))
        dtypes.append(dtype_code(spec.dtype))
    return sizes, strides, ranks, dtypes


def unflatten_specs(sizes: Sequence, strides: Sequence, ranks: Sequence[int],
                    dtypes: Sequence[int]) -> List[TensorSpec]:
    """The inverse of `flatten_specs`."""
    specs, at = [], 0
    for rank, code in zip(ranks, dtypes):
        specs.append(TensorSpec(tuple(sizes[at:at + rank]), tuple(strides[at:at + rank]), DTYPES[code]))
        at += rank
    return specs
