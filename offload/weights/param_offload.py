"""`offload.offload_params(module)` / `offload.reload_params(module)`: park a model in pinned host memory.

Moves a module's parameters (and gradients and optimizer state) to a persistent
pinned host mirror and back, for plain modules, FSDP (flat parameters) and FSDP2
(DTensor parameters) alike: see Note [storages, not tensors] and
Note [the host mirror]. Both calls return timings: the copy's device time
(`copy_ms`), the host time of the call (`total_ms`), bytes and GB/s; they wait
for their copy to finish (an event, not a device-wide synchronize), so the
numbers are final.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import List, Optional

import torch

from ..core import _device
from ..core.checks import check_bool, check_int
from ..core.copy import copy_to_device, copy_to_host
from ..core.pool import HostPool, check_pool, default_host_pool
from ..core.timing import Span
from .parked import ParkedGuard

_STATE_ATTR = "_offload_param_mirror"
# Storages start at multiples of this in the mirror: DMA engines run best from
# aligned host addresses, and 512 covers every dtype and vector width.
_MIRROR_ALIGNMENT = 512

# Note [storages, not tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The unit moved is the storage under each tensor, not the tensor. Every
# parameter, FSDP flat parameter and DTensor local shard is a view into some
# storage; each distinct storage's bytes (padding included) are copied into the
# mirror and then `untyped_storage().resize_(0)` frees the device memory while
# every tensor, view, Parameter and DTensor keeps its identity, sizes, strides
# and offsets. Reload resizes the storages back (allocating on the current
# stream) and copies the bytes in, so the model is bitwise what it was and
# optimizers, hooks and FSDP's own references still point at the same tensors.
# Tied weights and views share a storage and move once.
#
# Note [the host mirror]
# ~~~~~~~~~~~~~~~~~~~~~~
# The tensors to move are collected again at every offload: with
# `zero_grad(set_to_none=True)` each step makes new gradient tensors, and
# optimizers such as AdamW create their state at their first step, so a list
# taken once would leave the new ones on the device. The mirror is one host block
# (each storage at an aligned offset), taken from the host pool at the first
# offload and kept on the module: the layout is a function of the storages'
# sizes, so while they stay the same every offload reuses it as it is; when they
# change the layout is planned again, in the same block if it fits, else in a new
# block of exactly the bytes needed. Between a reload and the next offload the
# mirror holds no reference to the device storages, so gradients the user drops
# are freed. Offloading frees the device blocks at once; the caching allocator
# reuses them only after the copy that reads them (they are recorded on the copy
# stream). Reloading leaves the current stream waiting (on the device) for the
# copy, so the next forward is ordered after it without a host block.


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None and type(t).__name__ == "DTensor" else t


def _tensors(module: torch.nn.Module, grads: bool, optimizer) -> List[torch.Tensor]:
    out = []
    for p in module.parameters():
        out.append(_local(p))
        if grads and p.grad is not None:
            out.append(_local(p.grad))
    for b in module.buffers():
        out.append(_local(b))
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    out.append(_local(value))
    return out


class _Mirror:
    """The storages of one module and where their bytes live on the host (Note [the host mirror])."""

    def __init__(self, pool: HostPool):
        self.pool = pool
        self.host: Optional[torch.Tensor] = None  # one pinned uint8 block, kept across offloads
        self.storages: list = []  # UntypedStorage objects, resized to 0 while offloaded; [] once reloaded
        self.sizes: List[int] = []
        self.offsets: List[int] = []
        self.device = None
        self.offloaded = False
        self.guard: Optional[ParkedGuard] = None  # while offloaded (Note [parked reads])

    def plan(self, fn: str, storages, sizes: List[int], device) -> None:
        """Lay `storages` out in the host block, keeping the block (and the layout) where it still fits."""
        if sizes != self.sizes:
            offsets, total = [], 0
            for n in sizes:
                offsets.append(total)
                total += (n + _MIRROR_ALIGNMENT - 1) // _MIRROR_ALIGNMENT * _MIRROR_ALIGNMENT
            if self.host is None or self.host.numel() < total:
                # The old block (if any) goes back to the pool when this reference drops:
                # nothing reads it now, the last reload's copy was waited for. Planned again
                # from scratch if the new one cannot be had (no stale layout is kept).
                self.host, self.sizes, self.offsets = None, [], []
                try:
                    self.host = self.pool.acquire(total)
                except RuntimeError as exc:
                    # Nothing has moved yet: the module's tensors are where they were.
                    stats = self.pool.stats()
                    raise torch.OutOfMemoryError(
                        f"{fn}: cannot get {total} bytes of pinned host memory for the mirror of {len(sizes)} "
                        f"storages; the pool holds {stats['in_use_bytes']} bytes in use of its limit of "
                        f"{stats['limit_bytes'] or 'no'} bytes ({exc}). The parameters stay where they are; raise "
                        "the pool's limit (OFFLOAD_HOST_POOL_LIMIT, HostPool(limit_bytes=...)) or free host memory"
                    ) from exc
            self.sizes, self.offsets = sizes, offsets
        self.storages, self.device = storages, device

    def host_views(self) -> List[torch.Tensor]:
        return [self.host[o : o + n] for o, n in zip(self.offsets, self.sizes)]

    def device_views(self) -> List[torch.Tensor]:
        return [torch.empty(0, dtype=torch.uint8, device=self.device).set_(s, 0, (n,), (1,))
                for s, n in zip(self.storages, self.sizes)]


def _collect(fn: str, module: torch.nn.Module, grads: bool, optimizer):
    """The distinct storages under the module's tensors now, their sizes and their device."""
    seen = set()
    storages, sizes, device = [], [], None
    for t in _tensors(module, grads, optimizer):
        if t.is_meta or not _device.is_accelerator(t.device) and _device.accelerator_type() is not None:
            continue  # host tensors (an optimizer's step counter) stay where they are
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        if device is not None and t.device != device:
            raise ValueError(f"{fn}: the module's tensors are on {device} and {t.device}; offload one device at a time")
        device = t.device
        seen.add(storage.data_ptr())
        storages.append(storage)
        sizes.append(storage.nbytes())
    return storages, sizes, device or _device.current_device()


def _check_module(fn: str, module) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{fn}: module must be a torch.nn.Module, got {type(module).__name__}")


def _finish(copy_span: Span, handle, call_span: Span, nbytes: int, count: int) -> dict:
    """Wait for `handle`'s copy (on a private stream where it runs on a device), end the
    spans, build the timings."""
    if copy_span.on_accel:
        marker = _device.new_stream(copy_span.device)
        handle.wait_stream(marker)
        copy_span.stop(marker)
    else:
        handle.synchronize()
        copy_span.stop()
    copy_ms = copy_span.ms()
    total_ms = call_span.stop().ms()
    return {"copy_ms": copy_ms, "total_ms": total_ms, "bytes": nbytes, "storages": count,
            "gbps": nbytes / (copy_ms * 1e-3) / 1e9 if copy_ms > 0 else 0.0}


def offload_params(
    module: torch.nn.Module,
    *,
    grads: bool = False,
    optimizer: Optional[torch.optim.Optimizer] = None,
    pool: Optional[HostPool] = None,
    chunk_bytes: int = 64 << 20,
) -> dict:
    """Move `module`'s parameters and buffers (and `grads`, and `optimizer`'s state) to pinned host memory.

    The device memory is freed; the module must not run until `reload_params(module)`
    (running it raises). Meanwhile `module.state_dict()` gives the parked values from the
    host mirror (Note [parked reads]).
    The tensors are collected at every call (new gradients, optimizer state made
    since the last call move too); the host mirror is reused while it fits.
    """
    fn = "offload.offload_params"
    _check_module(fn, module)
    check_bool(fn, "grads", grads)
    if optimizer is not None and not isinstance(getattr(optimizer, "state", None), Mapping):
        raise TypeError(f"{fn}: optimizer must be a torch.optim.Optimizer (or an object whose .state maps "
                        f"parameters to their state) or None, got {type(optimizer).__name__}")
    check_pool(fn, pool)
    check_int(fn, "chunk_bytes", chunk_bytes, 1, "bytes per copy chunk")
    mirror: Optional[_Mirror] = getattr(module, _STATE_ATTR, None)
    if mirror is not None and mirror.offloaded:
        raise RuntimeError(f"{fn}: the parameters of this {type(module).__name__} are already offloaded; "
                           "call offload.reload_params(module) first")
    if mirror is None:
        mirror = _Mirror(pool if pool is not None else default_host_pool())
        object.__setattr__(module, _STATE_ATTR, mirror)
    mirror.plan(fn, *_collect(fn, module, grads, optimizer))
    call_span = Span()
    copy_span = Span(mirror.device)
    views = mirror.device_views()
    handle = copy_to_host(views, out=mirror.host_views(), pool=mirror.pool, chunk_bytes=chunk_bytes)
    if _device.is_accelerator(mirror.device):
        # The copy stream reads these storages; freed below, their blocks would go back
        # to the stream that allocated them at once (the copy engine keeps references
        # to its sources, which resize_(0) does not wait for). Recorded on the copy
        # stream, the allocator hands them out again only after the copy.
        d2h = _device.copy_streams(mirror.device)[0]
        for view in views:
            _device.record_stream(view, d2h)
    for storage in mirror.storages:
        storage.resize_(0)
    mirror.offloaded = True
    stats = _finish(copy_span, handle, call_span, sum(mirror.sizes), len(mirror.storages))
    # After the copy: the state dict it serves reads the mirror from here on.
    mirror.guard = ParkedGuard(module, mirror.storages, mirror.host, mirror.offsets, mirror.sizes)
    return stats


def reload_params(module: torch.nn.Module, *, chunk_bytes: int = 64 << 20) -> dict:
    """Bring back what `offload_params` moved, bitwise; the current stream waits for the copy on the device."""
    fn = "offload.reload_params"
    _check_module(fn, module)
    check_int(fn, "chunk_bytes", chunk_bytes, 1, "bytes per copy chunk")
    mirror: Optional[_Mirror] = getattr(module, _STATE_ATTR, None)
    if mirror is None or not mirror.offloaded:
        raise RuntimeError(f"{fn}: the parameters of this {type(module).__name__} are not offloaded; "
                           "call offload.offload_params(module) first")
    call_span = Span()
    mirror.guard.remove()
    mirror.guard = None
    with _device.stream_context(_device.current_stream(mirror.device)):
        for storage, n in zip(mirror.storages, mirror.sizes):
            storage.resize_(n)  # allocated on the current stream, its consumer
    copy_span = Span(mirror.device)
    # The mirror's pool vouches for its block (pinned, or the host memory of an accelerator without pinning).
    handle = copy_to_device(mirror.host_views(), mirror.device, out=mirror.device_views(), pool=mirror.pool,
                            chunk_bytes=chunk_bytes)
    handle.wait_stream()
    mirror.offloaded = False
    storages, mirror.storages = mirror.storages, []  # a gradient the user drops from now on is freed
    return _finish(copy_span, handle, call_span, sum(mirror.sizes), len(storages))


def params_offloaded(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameters are in the host mirror (offloaded and not yet reloaded)."""
    _check_module("offload.params_offloaded", module)
    mirror = getattr(module, _STATE_ATTR, None)
    return bool(mirror is not None and mirror.offloaded)
