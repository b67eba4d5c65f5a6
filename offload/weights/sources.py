"""What a weight sync sends: (name, tensor) references from a module, a state dict or pairs,
DTensor sources gathered a bounded group at a time, and the checks a source must pass."""

from __future__ import annotations

from typing import List, Tuple

import torch

from ..core.checks import check_has_data

# Note [gathering DTensor sources]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FSDP2 / DTensor sources are gathered with `full_tensor()` one tensor at a time
# as their bucket is packed, never the whole model at once. Every rank of the FSDP
# mesh calls `send()` (and `snapshot()`) with the same source in the same order;
# ranks other than `src` only take part in the gathers and keep no copy.
# A snapshot of such sources walks the tensors in groups of at most
# `bucket_bytes` of full tensors (a larger tensor alone), gathers one group,
# queues its copy to the host and drops the gathered tensors, which the copy
# engine holds only until that copy completes. Before gathering group k+2 the
# host waits for the copy of group k, so at most two groups of gathered tensors
# exist at once: the copy of one group overlaps the gather of the next, and
# device memory stays bounded even when the gathers outrun the host link. The
# price is that `snapshot()` returns only once the copies of all but the last two
# groups have completed; the gathers are collectives in the trainer's order, so
# they cannot move to another thread. `snapshot_ms()` then spans the gathers too.
# Such a snapshot is several copy handles (one per group, each reusing the host
# buffers of the same group of an evicted version); without DTensors it is one
# batched copy of everything.


def named_sources(fn: str, source) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) references: module state dict, mapping, or pairs. Nothing is gathered here."""
    if isinstance(source, torch.nn.Module):
        items = list(source.state_dict(keep_vars=True).items())
    elif hasattr(source, "items"):
        items = list(source.items())
    else:
        try:
            items = list(source)
        except TypeError:
            raise TypeError(
                f"{fn}: source must be a module, a state dict or (name, tensor) pairs, got {type(source).__name__}"
            ) from None
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"{fn}: source item {i} must be a (name, tensor) pair, got {item!r:.80}")
        # Before any gather or header: a parked tensor (or DTensor shard) has nothing to send.
        t = item[1]
        check_has_data(fn, f"tensor {item[0]!r}", t._local_tensor if is_dtensor(t) else t)
        out.append((item[0], t.detach()))
    return out


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


def gather(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective over its mesh), else `t` itself."""
    return t.full_tensor() if is_dtensor(t) else t


def gather_groups(items, max_bytes: int) -> List[list]:
    """Consecutive groups of (name, tensor) references that `snapshot()` gathers and copies together.

    Without DTensors: one group, one batched copy (nothing is gathered). With
    them: groups of at most `max_bytes` of full tensors, a larger tensor alone, so
    the gathered tensors alive at once stay bounded (Note [gathering DTensor sources]).
    """
    if not any(is_dtensor(t) for _, t in items):
        return [items]
    groups: List[list] = []
    current: list = []
    size = 0
    for item in items:
        nbytes = item[1].numel() * item[1].element_size()  # a DTensor's numel is its full size
        if current and size + nbytes > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def layout_of(groups) -> List[list]:
    """Shapes and dtypes of the full tensors, per group: a snapshot's host buffers fit another of the same layout."""
    return [[(tuple(t.shape), t.dtype) for _, t in group] for group in groups]


def check_source(fn: str, name: str, t: torch.Tensor, device: torch.device, backend) -> None:
    if t.is_meta:
        raise ValueError(f"{fn}: tensor {name!r} is a meta tensor, which has no data to send")
    if t.device != device:
        parked = (" (a module parked by offload.offload_params gives its state dict from the host: call "
                  "offload.reload_params(module) before sending)" if t.device.type == "cpu" else "")
        raise ValueError(f"{fn}: tensor {name!r} is on {t.device} but this group's backend ({backend}) sends from "
                         f"{device}{parked}")
    if t.is_sparse or t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(f"{fn}: tensor {name!r} must be a contiguous strided tensor (layout {t.layout}, shape "
                         f"{list(t.shape)}, stride {list(t.stride()) if t.layout == torch.strided else None}); "
                         "pass t.contiguous()")
