"""Copies a stager runs on the caller's thread, with `copy_to_host`'s contract (fresh
into one block, or refilling `out`): the CPU tensors of a state dict staged from an
accelerator (into a pooled block), and the tensors past limit_bytes (into pageable
memory, Note [staging past limit_bytes])."""

from __future__ import annotations

from operator import attrgetter
from typing import List, Optional

import torch

from ..core.pool import default_host_pool
from .plan import align

_SHAPE_DTYPE = attrgetter("shape", "dtype")
_is_cpu = attrgetter("is_cpu")


class HostCopy:
    """A host-to-host copy (CPU tensors of a state dict that lives on an accelerator),
    shaped like the CopyHandle the stager keeps: done when it returns."""

    __slots__ = ("tensors", "meta", "device")

    def __init__(self, tensors: List[torch.Tensor], meta: Optional[list] = None, device=None):
        self.tensors = tensors
        self.meta = list(map(_SHAPE_DTYPE, tensors)) if meta is None else meta  # per tensor (shape, dtype)
        self.device = device  # where the sources of a pageable copy are (None: the host)

    def ready(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self) -> List[torch.Tensor]:
        return self.tensors

    def wait_stream(self, stream=None) -> None:
        pass


def copy_on_host(sources: List[torch.Tensor], *, out=None, pool=None, group_bytes=None) -> HostCopy:
    """copy_to_host's contract for CPU sources: fresh (one pooled block) or into `out`,
    which must match the sources in shape and dtype (ValueError otherwise, as the
    copy engine refuses a changed tensor), and the sources must still be on the host.

    Per save (`out` given) nothing runs per tensor in Python: the check compares
    C-level maps against the shapes and dtypes kept with `out`, and one
    torch._foreach_copy_ copies every pair (each a plain copy_, so bit for bit).
    """
    fn = "offload.AsyncStager.stage"
    if out is None:
        pool = pool if pool is not None else default_host_pool()
        block = pool.acquire(sum(align(t.numel() * t.element_size()) for t in sources))
        dsts, offset = [], 0
        for t in sources:
            nbytes = t.numel() * t.element_size()
            dsts.append(block[offset : offset + nbytes].view(t.dtype).view(t.shape))
            offset += align(nbytes)
        handle = HostCopy(dsts)
    else:
        handle = out if isinstance(out, HostCopy) else HostCopy(out)
        dsts = handle.tensors
        if list(map(_SHAPE_DTYPE, sources)) != handle.meta or not all(map(_is_cpu, sources)):
            for i, (dst, src) in enumerate(zip(dsts, sources)):
                if dst.shape != src.shape or dst.dtype != src.dtype or not src.is_cpu:
                    raise ValueError(f"{fn}: host source {i} changed to {tuple(src.shape)} {src.dtype} on {src.device}")
    if sources:  # _foreach_copy_ refuses empty lists
        # One call for the list: the per-pair copy_ runs in C++, not one Python call per tensor.
        torch._foreach_copy_(dsts, sources)
    return handle


def copy_to_pageable(sources: List[torch.Tensor], *, out=None, pool=None, group_bytes=None) -> HostCopy:
    """copy_on_host's contract for the units past limit_bytes (Note [staging past limit_bytes]):
    into one pageable host block (fresh) or into `out`, from sources on one device.

    Each copy is a copy_ on the current stream into pageable memory, which returns
    once its bytes are on the host: the handle is done when this returns. `pool`
    and `group_bytes` are taken for the caller's sake and not used.
    """
    fn = "offload.AsyncStager.stage"
    device = sources[0].device if sources else None
    if out is None:
        block = torch.empty(sum(align(t.numel() * t.element_size()) for t in sources), dtype=torch.uint8)
        dsts, offset = [], 0
        for t in sources:
            nbytes = t.numel() * t.element_size()
            dsts.append(block[offset : offset + nbytes].view(t.dtype).view(t.shape))
            offset += align(nbytes)
        handle = HostCopy(dsts, device=device)
    else:
        handle = out if isinstance(out, HostCopy) else HostCopy(out, device=device)
        dsts = handle.tensors
        if list(map(_SHAPE_DTYPE, sources)) != handle.meta or any(t.device != handle.device for t in sources):
            for i, (dst, src) in enumerate(zip(dsts, sources)):
                if dst.shape != src.shape or dst.dtype != src.dtype or src.device != handle.device:
                    raise ValueError(f"{fn}: source {i} changed to {tuple(src.shape)} {src.dtype} on {src.device}")
    if device is not None and device.type == "cpu":
        torch._foreach_copy_(dsts, sources)
    else:
        for dst, src in zip(dsts, sources):
            dst.copy_(src)
    return handle
