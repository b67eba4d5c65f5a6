"""What the compiled graph's offload ops do at run time: copy a group out, let its device
tensors go, bring it back, all on offload's pool and copy streams.

One `GroupTransport` per handle, found by the id the graph carries (`transport_for`). The
ops (ops.py) are thin: they check nothing the graph rewrite (rewrite.py) already fixed and
call these methods.

Note [compiled streams]: the order of a group's copies against compute is the eager
engine's (Note [resident window], Note [backward] in engine.py), expressed in the graph:
- `group_out`, placed after the layer's last node, issues one batched copy of the group's
  spans into one pooled host block on the device-to-host stream, after the work queued on
  the compute stream (the copy layer makes that stream wait). The core holds the sources
  until the copy completes.
- `group_release`, placed `resident_groups - 1` groups later, makes the compute stream wait
  for that copy on the device (no host block) and lets the core drop the sources at once.
  It takes the group's device tensors as arguments, so the compiler keeps them alive until
  there and may reuse their memory only for work queued after the wait.
- `group_prefetch`, placed where backward reaches the group after it, allocates the
  restored tensors on the compute stream (their owner) and issues one batched copy into
  them on the host-to-device stream; `group_in`, placed where the backward of the layer
  that first reads the group starts, makes the compute stream wait for that copy and returns
  the tensors. Where that stream is the one the tensors were allocated on, it also lets the
  core drop its hold on them (`release_sources`): otherwise the core would keep each group's
  restored memory until the host saw its copy done, and the host, which nothing blocks in a
  compiled backward, runs ahead of the copies by many groups, so every group of the step
  would be on the device at once, and some still at the next step.
On the host (a CPU model) every copy is synchronous and the waits are no-ops.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, fields
from typing import Dict, List

import torch

from ...core import _device
from ...core.copy import CopyHandle, copy_spans_to_host, copy_to_device
from .layout import TensorSpec, group_layout, specs_of


@dataclass
class CompiledCounters:
    """A compiled step's counters, named as the eager engine's (`ActivationOffload.stats()`)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    groups_offloaded: int = 0
    groups_fetched: int = 0
    groups_prefetched: int = 0
    layers_offloaded: int = 0
    tensors_offloaded: int = 0


_transports: "weakref.WeakValueDictionary[int, GroupTransport]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_lock = threading.Lock()


def transport_for(runtime: int) -> "GroupTransport":
    """The transport the graph's ops name by `runtime`. A graph outliving its handle (the handle was
    disabled, the compiled code kept) still moves its groups, through a transport of its own."""
    transport = _transports.get(runtime)
    if transport is None:
        with _lock:
            transport = _transports.get(runtime)
            if transport is None:
                transport = _orphans.setdefault(runtime, GroupTransport(None, timing=False))
    return transport


_orphans: Dict[int, "GroupTransport"] = {}


class GroupTransport:
    """Moves a compiled model's groups for one handle (Note [compiled streams])."""

    def __init__(self, pool, timing: bool = False):
        from ...core.pool import default_host_pool

        self.pool = pool if pool is not None else default_host_pool()
        self.device = _device.current_device()
        self.on_accel = _device.is_accelerator(self.device)
        self.timing = timing and self.on_accel
        self.counters = CompiledCounters()
        self.step = 0
        self.steps_served = 0  # compiled forwards that ran offload's ops
        self.backward_seen = False
        self.graph_layers = ([], [])  # (offloaded, recomputed) layer indices of the last compiled forward
        # host block data_ptr -> the copy out of that block, until its release point
        self._out: Dict[int, CopyHandle] = {}
        # prefetch serial -> the copy back, until the group's first use
        self._back: Dict[int, _CopyBack] = {}
        self._serials = itertools.count(1)
        with _lock:
            self.id = next(_ids)
            _transports[self.id] = self

    # ------------------------------------------------------------ steps

    def begin_step(self, offloaded: List[int], recomputed: List[int]) -> None:
        """A compiled forward starts: a new step if the last one's backward began. `offloaded`,
        `recomputed`: the layers its graph offloads and recomputes."""
        self.graph_layers = (offloaded, recomputed)
        if self.backward_seen:
            self.step += 1
            self.counters = CompiledCounters()
            self.backward_seen = False
        self.steps_served += 1

    def counters_dict(self) -> dict:
        return {f.name: getattr(self.counters, f.name) for f in fields(self.counters)}

    # ------------------------------------------------------------ forward

    def group_out(self, saved: List[torch.Tensor], layer: int) -> torch.Tensor:
        """Copy `saved` into one pooled host block (returned); held until `group_release`."""
        layout = group_layout(specs_of(saved))
        starts = [t.storage_offset() * t.element_size() for t in saved]
        streams = _device.copy_streams(self.device) if self.on_accel else (None, None)
        handle = copy_spans_to_host(saved, starts, list(layout.span_bytes), layout.total, list(layout.offsets),
                                    pool=self.pool, stream=streams[0], timing=self.timing)
        block = handle.tensors[0]
        if block.numel() != layout.total:  # the graph's buffer has exactly the layout's size
            block = block[:layout.total]
        self._out[block.data_ptr()] = handle
        c = self.counters
        c.d2h_bytes += sum(layout.span_bytes)
        c.groups_offloaded += 1
        c.layers_offloaded += 1
        c.tensors_offloaded += len(saved)
        return block

    def group_release(self, block: torch.Tensor) -> None:
        """The group's release point: the compute stream waits for its copy out, and the core lets
        go of its device tensors (the graph frees them after this op)."""
        handle = self._out.pop(block.data_ptr(), None)
        if handle is None:
            return
        if self.on_accel:
            handle.release_sources(_device.current_stream(self.device))
        else:
            handle.synchronize()

    # ------------------------------------------------------------ backward

    def group_prefetch(self, block: torch.Tensor, specs: List[TensorSpec], device: torch.device) -> int:
        """Issue the copy back of the group in `block`; returns the serial `group_in` redeems."""
        self.backward_seen = True
        layout = group_layout(specs)
        sources = [block[o:o + n] for o, n in zip(layout.offsets, layout.span_bytes)]
        # Allocated here, on the compute stream: the consumer owns them (Note [compiled streams]).
        out = [torch.empty(n, dtype=torch.uint8, device=device) for n in layout.span_bytes]
        on_accel = _device.is_accelerator(device)
        streams = _device.copy_streams(device) if on_accel else (None, None)
        handle = copy_to_device(sources, device, out=out, pool=self.pool, stream=streams[1],
                                require_pinned=False, timing=self.timing)
        serial = next(self._serials)
        self._back[serial] = _CopyBack(handle, out, _device.current_stream(device) if on_accel else None)
        c = self.counters
        c.h2d_bytes += sum(layout.span_bytes)
        c.groups_prefetched += 1
        return serial

    def group_in(self, serial: int, specs: List[TensorSpec]) -> List[torch.Tensor]:
        """The restored tensors of the group `serial` names, ready on the compute stream."""
        back = self._back.pop(serial, None)
        if back is None:
            raise RuntimeError(f"offload: the compiled backward asked for a group whose copy back was never issued "
                               f"(serial {serial}): {_why_not_issued()}")
        if back.owner is None:
            back.handle.synchronize()
        else:
            stream = _device.current_stream(back.owner.device)
            if stream == back.owner:  # the owner waits: the core's hold on the memory may go now
                back.handle.release_sources(stream)
            else:  # read on another stream: the core holds the memory until the copy is seen done
                back.handle.wait_stream(stream)
        self.counters.groups_fetched += 1
        return [raw.view(spec.dtype).as_strided(spec.size, spec.stride, 0) for raw, spec in zip(back.out, specs)]


def _why_not_issued() -> str:
    """What most likely made a backward graph ask for a group nobody fetched."""
    from torch._dynamo import compiled_autograd

    if getattr(compiled_autograd, "compiled_autograd_enabled", False) \
            or getattr(compiled_autograd, "in_compiled_autograd_region", False):
        return ("compiled autograd (torch._dynamo.config.compiled_autograd) traces the backward graph again, and "
                "offload's ops under a whole-model compile do not support that; turn compiled autograd off, or "
                "offload layers compiled one by one (layer.compile())")
    return ("each group comes back once per forward, so a backward graph run again for the same forward finds "
            "it gone; run one backward per forward, or pause offload (handle.paused()) for such steps")


@dataclass
class _CopyBack:
    """A group's copy back between `group_prefetch` and `group_in`: the copy, the device tensors
    it writes, and the stream they were allocated on (their owner; None on the host)."""

    handle: CopyHandle
    out: List[torch.Tensor]
    owner: object

