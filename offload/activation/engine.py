"""Activation offload: the saved tensors of each layer go to pinned host memory while the
next layer computes, and come back one layer ahead in backward.

The data path, top to bottom:
  `enable_activation_offload(model)` / `activation_offload()`   (user API, wrap.py finds layers)
  -> `ActivationEngine`: `saved_tensors_hooks` pack/unpack, grouping, window, prefetch
  -> `copy_spans_to_host` / `copy_to_device` (the copy engine, one batched call per group)
  -> `HostPool` (pinned blocks, reused across steps).

Groups. A group is the span of forward from one layer's start to the next layer's start
(or the end of the model's forward): every tensor autograd saves in that span belongs to
it. Opening groups at layer starts (instead of scoping them to a layer's call) is what
puts the inputs a reentrant checkpoint saves after its layer returns into that layer's
group, and what keeps the hooks outside Hugging Face's and FSDP2's checkpoint wrappers.
Two exceptions without auto mode's plan: a layer that saves less than `min_group_bytes` (a
checkpoint's input at a short sequence) shares its group with the layers after it, and in
mode async the first offloaded layer of a forward is copied in parts while it runs (see
`_first_layer_parts`).

Why one batched copy per group, issued when the group closes, instead of one copy per
tensor at save time: the copy engine then makes one wait on the compute stream, records
one event and packs the small tensors of the layer into one transfer; the pack hook
itself does only bookkeeping (a few attribute reads, a dict lookup, an append). The copy
starts as soon as the layer's kernels are queued and runs on the device-to-host stream
under the next layer's compute.

Hooks. Where the compiled core is loaded, autograd calls its hooks
(csrc/saved_tensor_hooks.cpp): they test each saved tensor in C (`_offload_extent` is the
same test in Python, for the path without the core) and keep what stays without entering
the interpreter; what may be offloaded goes on to `_pack_extent`, and every unpack other
than a kept tensor's to `_unpack`.

Lifetimes and streams (stream ownership):
- A group's device tensors are held (`_Group.held`) from save until its D2H copy is seen
  complete (non-blocking poll at every group boundary, or a host wait when more than
  `resident_groups` groups would be on the device). The copy engine also record_streams
  them on the D2H stream, so dropping them early could never corrupt the copy.
- A group still copying when backward reaches it is served from those held tensors (no
  round trip); so are the last groups of a forward.
- Auto mode's schedule (`_activation_plan.Schedule`) replaces the window and the one-ahead
  prefetch: each group is released at a planned point by the same device-side wait, and
  fetched when backward reaches a planned layer (a hook on that layer's output gradient).
- Each group's spans go to one pooled host block (one pool request per layer, the same
  size every step); it belongs to the group's D2H `CopyHandle` and returns to the pool
  when the group dies (its last saved-tensor handle is freed by autograd).
- In backward, a group's H2D copy allocates its outputs on the consumer (current) stream;
  the consumer waits on that group's copy event once (`CopyHandle.wait_stream`), never on
  the whole device. When the first tensor of group g is unpacked, the copy of the group
  before it is issued (prefetch), so it runs under g's backward compute; the step's first
  unpack (the kept last layer or the head) issues the copy of the first group backward needs
  from the host, so that stream does not idle while backward works through what stayed.

Storages and views. Each storage is offloaded once per group: all saved views of it
share one copied byte span [lo, hi) of the storage (all of it where the first view reads
nearly all: the storage's other views then share that copy from a later group too, the
later parts of a layer copied in parts), and each view is rebuilt with
`as_strided` on the restored span with its exact size, stride and storage offset, so a
transpose, slice, expand or overlapping view is restored exactly (rebuilding with
`.view(shape)` from a deduplicated storage is the bug ms-swift shipped). The same view
saved twice comes back as the same tensor object.

What stays on the device: parameters and buffers (by storage, refreshed per layer for
FSDP's unsharded parameters), leaves that require grad and views of them, autocast's cached
casts of parameters, tensor subclasses (DTensor), tensors below `min_tensor_bytes`.

torch.compile: a compiled layer's activations are saved at run time by AOTAutograd's
autograd function, so they are offloaded like any other (boundaries are opaque to dynamo);
a model compiled whole bypasses the wrappers and is passed through with a warning.

Version counter. With saved-tensor hooks installed autograd no longer checks that a saved
tensor was not modified in place. The engine does it instead: each handle remembers the
tensor's `_version`, and unpack raises autograd's error if it changed. Until the copy is
confirmed complete the tensor itself is held; after that, for a tensor something else can
still reach, an empty alias sharing its version counter (see `_drop_held`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import sys
import time
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..core import _backend, _device
from . import layers as _wrap
from .planner import PROFILE_POINTS, SPLIT_PARTS, TAIL_POINT, _tensor_leaves
from ..core.copy import copy_spans_to_host, copy_to_device
from ..core.pool import HostPool, default_host_pool

MODES = ("async", "sync", "auto")
# Whether engines made from now on use the core's hooks where it is loaded (tests that spy on
# the Python hooks' decisions turn this off; the core's tests are held equal to them).
_NATIVE_HOOKS = True
# Tensors smaller than this stay on the device by default: below ~1 MiB a copy's fixed
# cost (launch, event, bookkeeping) outweighs the memory it frees.
DEFAULT_MIN_TENSOR_BYTES = 1 << 20
# A layer's group smaller than this many times min_tensor_bytes goes on through the next layer
# (min_group_bytes' default): a group costs ~0.3 ms of host time in a launch-bound step (its
# copy out, its copy back, their waits; Llama seq 2048 on the H100), what the bus moves 16 MiB
# in, so a checkpoint's 8 MiB input per layer cost more host time than its copy took.
GROUP_BYTES_PER_TENSOR_BYTE = 32
# The copied span of a storage starts on this boundary, the caching allocator's block
# alignment: a restored view then has the same address modulo 512 as the original, so
# kernels that pick vectorised paths by alignment take the same path (bitwise results).
_SPAN_ALIGN = 512

# A new span that reads at least this share of its storage copies the whole storage.
_WHOLE_STORAGE = 7 / 8

_OPEN, _COPYING, _HOST, _KEPT = "open", "copying", "host", "kept"


def _modified_error(t_desc: str, saved: int, now: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t_desc}] is at version {now}; expected version {saved} instead "
        "(offload.activation: the tensor was modified after autograd saved it)"
    )


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def _not_traced(fn):
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


class _Group:
    """The saved tensors of one forward span (one layer)."""

    __slots__ = (
        "name", "layer", "state", "held", "modified", "watch", "spans", "d2h", "h2d", "device_block", "typed",
        "views", "waited", "n_handles", "n_unpacked", "prev", "nbytes", "los", "nbytes_aligned", "stream",
        "cap", "capped", "split", "part", "continued", "fetch_stream", "offsets", "new_spans", "n_layers",
        "profile", "span_ends", "__weakref__",
    )

    def __init__(self, name, layer, offload: bool, prev):
        self.name = name
        self.layer = layer  # index in the layer list (auto-mode statistics), or None
        self.state = _OPEN if offload else _KEPT
        self.held: Optional[list] = []  # per handle slot: (tensor, version), while device data is valid
        self.modified = None  # slot -> (tensor, saved version, version): modified before the copy was confirmed
        self.watch = None  # per slot, once held is dropped: (tensor sharing its version counter, version) or None
        self.spans: list = []  # per entry: [tensor, lo, hi] (bytes of its storage to copy)
        self.d2h = None  # CopyHandle of the group's spans to host; its one tensor is their pooled host block
        self.h2d = None  # CopyHandle of the spans back to the device (backward)
        self.device_block = None  # the restored uint8 block on the device, laid out as the host block
        self.typed: dict = {}  # dtype -> device_block viewed as that dtype (views are made from it)
        self.views: dict = {}  # (entry, dtype, size, stride, offset) -> restored tensor
        self.waited = set()  # streams that already wait for h2d
        self.n_handles = 0
        self.n_unpacked = 0
        self.prev = prev  # weakref to the previous offloaded group of the same forward
        self.nbytes = 0  # bytes of its storage spans
        self.los: list = []  # per entry: where its copied span starts in the storage (bytes)
        self.nbytes_aligned = 0  # bytes of the group's host (and restored device) block
        self.stream = None  # the stream its tensors were saved on (current when it closed), on an accelerator
        self.cap = None  # bytes of new spans it may offload (auto mode's schedule), None: no limit
        self.capped = 0  # bytes of its layer's new spans so far (counted against the cap)
        self.split = None  # the schedule's part ends of its layer (Schedule.split_at), or None
        self.part = 0  # the index of its layer's part it ends (its release point; see _split)
        self.continued = False  # a later part of a layer copied in parts
        self.new_spans = 0  # new storage spans of its layer so far (with capped: its layer's size)
        self.n_layers = 1  # layers it holds: more when small layers share it (min_group_bytes), 0 for a later part
        self.fetch_stream = None  # the stream its restored device block was allocated on (owns it)
        self.offsets: list = []  # per entry: where its copied span starts in the group's blocks (bytes)
        # Auto mode measuring: its layer's bytes of new spans (ascending) at which the observer
        # marks the time (when the layer saves its bytes), or None.
        self.profile: Optional[list] = None
        # Auto mode measuring: its layer's bytes of new spans after each new span, or None.
        self.span_ends: Optional[list] = None


class _Packed:
    """What autograd holds instead of an offloaded tensor."""

    __slots__ = ("group", "entry", "slot", "dtype", "size", "stride", "offset", "desc")

    def __init__(self, group, entry, slot, dtype, size, stride, offset):
        self.group = group
        self.entry = entry
        self.slot = slot
        self.dtype = dtype
        self.size = size
        self.stride = stride
        self.offset = offset  # bytes from the start of the storage


class ActivationEngine:
    """Packs saved tensors into groups, copies them out and brings them back.

    The engine is driven by `capture()` (the scope where saved tensors are hooked) and
    `boundary()` (a new group starts); `wrap.py` calls these from layer forwards, and the
    `activation_offload()` context manager exposes them to custom loops.
    """

    def __init__(
        self,
        mode: str = "async",
        *,
        min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
        resident_groups: int = 2,
        pool: Optional[HostPool] = None,
        timing: bool = True,
        nvtx: bool = False,
        fn: str = "offload.activation_offload",
        min_group_bytes: Optional[int] = None,
    ):
        if mode not in MODES:
            raise ValueError(f"{fn}: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        if isinstance(min_tensor_bytes, bool) or not isinstance(min_tensor_bytes, int) or min_tensor_bytes < 0:
            raise ValueError(f"{fn}: min_tensor_bytes must be an int >= 0, got {min_tensor_bytes!r}")
        if isinstance(resident_groups, bool) or not isinstance(resident_groups, int) or resident_groups < 1:
            raise ValueError(
                f"{fn}: resident_groups must be an int >= 1 (groups whose activations may be on the "
                f"device at once), got {resident_groups!r}"
            )
        if min_group_bytes is None:
            min_group_bytes = GROUP_BYTES_PER_TENSOR_BYTE * min_tensor_bytes
        elif isinstance(min_group_bytes, bool) or not isinstance(min_group_bytes, int) or min_group_bytes < 0:
            raise ValueError(f"{fn}: min_group_bytes must be an int >= 0 or None (default: "
                             f"{GROUP_BYTES_PER_TENSOR_BYTE} x min_tensor_bytes), got {min_group_bytes!r}")
        if pool is not None and not isinstance(pool, HostPool):
            raise TypeError(f"{fn}: pool must be an offload.HostPool, got {type(pool).__name__}")
        self.mode = mode
        self.min_tensor_bytes = min_tensor_bytes
        self.min_group_bytes = min_group_bytes
        self.resident_groups = resident_groups
        self.pool = pool if pool is not None else default_host_pool()
        self.device = _device.current_device()
        self.on_accel = _device.is_accelerator(self.device)
        self.timing = timing and self.on_accel
        self.nvtx = nvtx
        # The hooks: the core's where it is loaded (the per-tensor tests in C; a tensor that
        # stays never enters the interpreter), else the Python methods. Bound with partial,
        # which the garbage collector traverses (the engine and its hooks form a cycle).
        core = _backend.loaded_core() if _NATIVE_HOOKS else None
        if core is not None:
            pack, unpack = (functools.partial(core.pack_saved_tensor, self),
                            functools.partial(core.unpack_saved_tensor, self))
        else:
            pack, unpack = self._pack, self._unpack
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        # Whether the hooks are on only from an offloaded group's start to the next boundary (set
        # by enable_activation_offload, which marks backward's start on the model's output): a
        # tensor saved outside those spans (kept layers, the head) then costs no Python call to
        # pack or unpack, which in a launch-bound step was the fixed cost of offloading at all
        # (Llama seq 2048 on the H100: 333 tensors hooked, ~2.5 ms a step, for 20 offloaded).
        self.hooks_in_groups_only = False
        self._hooks_on = False  # the outermost capture's hooks are on the default-hooks stack
        self._hooks_base = None  # the stack's top pack hook when the outermost capture began
        self._capturing = 0
        self._group: Optional[_Group] = None
        self._last_offloaded = None  # weakref to the last offloaded group of this forward
        self._storages: Dict[int, tuple] = {}  # storage data_ptr -> (group, entry, StorageWeakRef)
        self._param_ptrs: set = set()
        # Iterables of tensors whose storages join _param_ptrs when a saved tensor first needs the
        # set: walking a model's parameters costs O(parameters) of host time per step, spent only
        # when a tensor big enough to offload is saved.
        self._param_pending: list = []
        self._inflight = collections.deque()  # weakrefs to groups whose D2H copy is not yet confirmed
        self._backward_seen = False
        self._step = 0
        self._counters = self._new_counters()
        # Timings not yet added to the counters: (counters, kind, start, end) for waits timed
        # with events, (counters, kind, timer, None) for copies the copy layer timed (a copy's
        # timer holds none of its buffers: a fetched group's device block is not kept for it).
        self._timing_events: list = []
        # Timing events read and done with, recorded again by later timings: making one cost
        # 6 us of host time, and a step of an 8-layer Llama with checkpointing makes 38.
        self._spare_events: list = []
        # Auto mode's measurements: opened(group), closed(group), unpacked(group), backward_started(); or None.
        self.observer = None
        # Auto mode's plan for the current input shape (_activation_plan.Schedule), or None: then the
        # resident window orders releases and each group prefetches the one before it.
        self.schedule = None
        self._due: list = []  # (release point, weakref to group) of this forward's groups, by the schedule
        # Tensors saved since the last layer ended (head, loss), counted while auto mode measures
        # or its schedule has a point there; None otherwise.
        self._tail: Optional[int] = None
        self._layer_groups: dict = {}  # layer index -> weakrefs to its offloaded groups in this forward
        # layer index -> (bytes, count) of the new storage spans it offloaded in its last forward:
        # async mode copies the first offloaded layer of a forward in parts of those bytes.
        self._layer_sizes: dict = {}

    # ------------------------------------------------------------ statistics

    @staticmethod
    def _new_counters() -> dict:
        return {
            "d2h_bytes": 0, "h2d_bytes": 0, "d2h_seconds": 0.0, "h2d_seconds": 0.0,
            "forward_wait_seconds": 0.0, "backward_wait_seconds": 0.0,
            # A group is a layer's saved tensors, or a part of them (auto mode copies a layer in
            # parts while it runs): layers_offloaded counts each layer once.
            "layers_offloaded": 0, "groups_offloaded": 0, "groups_fetched": 0, "groups_prefetched": 0,
            "tensors_offloaded": 0, "tensors_kept": 0,
        }

    def _resolve_timing(self, block: bool) -> None:
        """Add finished copy/wait timings to the counters of the step they belong to.

        Non-blocking at a step start (the host keeps running ahead of the device);
        `stats()` blocks until the current step's events are done.
        """
        pending = []
        spare = self._spare_events
        for timed in self._timing_events:
            counters, kind, start, end = timed
            if end is None:  # a copy's timer
                if block:
                    start.synchronize()
                seconds = start.seconds()
                if seconds is None:
                    pending.append(timed)
                else:
                    counters[kind] += seconds
            elif block or end.query():
                if block:
                    end.synchronize()
                counters[kind] += start.elapsed_time(end) / 1e3
                if len(spare) < _SPARE_EVENTS:
                    spare += (start, end)  # both passed: free to record again
            else:
                pending.append(timed)
        self._timing_events = pending

    def _timing_event(self):
        spare = self._spare_events
        return spare.pop() if spare else _device.new_event(self.device, timing=True)

    def _timed_start(self, stream):
        if not self.timing:
            return None
        start = self._timing_event()
        start.record(stream)
        return start

    def _timed_end(self, kind, start, stream) -> None:
        if start is not None:
            end = self._timing_event()
            end.record(stream)
            self._timing_events.append((self._counters, kind, start, end))

    def stats(self) -> dict:
        """Counters of the current (or just finished) step; waits for its timing events."""
        self._resolve_timing(block=True)
        c = dict(self._counters)
        c["step"] = self._step
        c["mode"] = self.mode
        c["d2h_gbps"] = c["d2h_bytes"] / c["d2h_seconds"] / 1e9 if c["d2h_seconds"] > 0 else None
        c["h2d_gbps"] = c["h2d_bytes"] / c["h2d_seconds"] / 1e9 if c["h2d_seconds"] > 0 else None
        c["exposed_seconds"] = c["forward_wait_seconds"] + c["backward_wait_seconds"]
        c["peak_device_bytes"] = _device.max_memory_allocated(self.device)
        c["device_bytes"] = _device.memory_allocated(self.device)
        pool = self.pool.stats()
        c["pool"] = {k: pool[k] for k in ("reserved_bytes", "in_use_bytes", "peak_in_use_bytes", "requests",
                                          "cache_hits") if k in pool}
        return c

    # ------------------------------------------------------------ forward side

    def capture(self, params=()):
        """Context: saved tensors in it are hooked; `params` are never offloaded."""
        return _Capture(self, params)

    def _start_step_after_backward(self) -> None:
        if self._backward_seen:  # a new step
            self._resolve_timing(block=False)
            self._step += 1
            self._counters = self._new_counters()
            self._backward_seen = False

    def pass_through_step(self) -> None:
        """A training forward run without hooks (auto mode offloading nothing) is a step of its own.

        Its backward unpacks nothing here, so the step is counted as ended at once: the next
        forward, hooked or not, starts a new one (counters of zero for this one).
        """
        self._start_step_after_backward()
        self._backward_seen = True

    def _enter(self, params) -> None:
        if self._capturing == 0:
            self._start_step_after_backward()
            self._poll()
            self._param_ptrs = set()
            self._param_pending = [params]
            self._last_offloaded = None
            self._due = []
            self._layer_groups = {}
            self._tail = None
            self._hooks_base = _top_pack_hook()
            self._hooks_on = True
        self._capturing += 1
        self._hooks.__enter__()

    def _exit(self) -> None:
        if self._capturing > 1 or self._hooks_on:
            self._hooks.__exit__(None, None, None)
        if self._capturing == 1:
            self._hooks_on = False
        self._capturing -= 1
        if self._capturing == 0:
            self.boundary(None)
            self._storages.clear()
            self._param_ptrs = set()
            self._param_pending = []

    # Opaque to dynamo: inside a compiled layer these run eagerly at a graph break, so the
    # copies, events and pool stay out of the traced graph.
    @_not_traced
    def add_params(self, params) -> None:
        """Storages of `params` stay on the device (FSDP2 unsharded parameters of a layer).

        Read when a saved tensor first needs them (normally inside the layer, while FSDP2's
        unsharded parameters exist): `params` may be a lazy iterable.
        """
        self._param_pending.append(params)

    @_not_traced
    def boundary(self, name=None, offload: bool = True, layer=None) -> None:
        """Close the current group; when `name` is given open a new one (kept if not `offload`).

        A kept group exists only while auto mode measures (its tensors stay on the device and
        are counted); otherwise tensors saved outside an offloaded group pass straight through.
        """
        group = self._group
        schedule = self.schedule
        if (name is not None and offload and layer is not None and group is not None and group.layer is not None
                and group.state == _OPEN and group.capped < self.min_group_bytes and schedule is None
                and self.observer is None and self._capturing):
            # A small layer's group goes on through this layer (fewer, larger copies); auto mode
            # plans and measures layer by layer, so its groups stay one a layer.
            group.n_layers += 1
            self._layer_groups[layer] = [self._last_offloaded]
            return
        self._group = None
        if group is not None:
            self._close(group)
        if schedule is not None and layer is not None:
            self._release_due(layer)  # the point: layer `layer` opens (n: the last layer ended)
        if name is None and layer is not None and (
                self.observer is not None or (schedule is not None and schedule.tail_save is not None)):
            self._tail = 0  # the last layer ended: count the tensors saved after it
        if name is None or not self._capturing:
            self._hooks_follow_groups()
            return
        observer = self.observer
        if offload or observer is not None:
            first = self._last_offloaded is None
            group = _Group(name, layer, offload, self._last_offloaded)
            self._group = group
            if offload:
                self._last_offloaded = weakref.ref(group)
                if layer is not None:
                    self._layer_groups[layer] = [self._last_offloaded]
                    if schedule is not None:
                        if layer < len(schedule.caps):
                            group.cap = schedule.caps[layer]
                            group.split = schedule.split_at.get(layer)
                    elif first and self.mode == "async":
                        group.split = self._first_layer_parts(layer)
            if observer is not None:
                observer.opened(group)
                group.span_ends = []
                size = self._layer_sizes.get(layer)
                if size is not None and size[0] > 0:
                    group.profile = [size[0] * k // PROFILE_POINTS for k in range(1, PROFILE_POINTS)]
        self._hooks_follow_groups()

    def _first_layer_parts(self, layer: int):
        """Async mode: the part ends (bytes of new spans) of the forward's first offloaded layer.

        Its copy would start only when it ends, with the device-to-host stream idle through
        its forward, and in backward it comes back last, the whole layer's copy before its
        backward can start while the stream then idles. In parts (a quarter of the bytes it
        saved in its last forward each), the first copy starts a quarter into the layer, and
        backward starts on the layer's last part while the others are still coming back.
        A layer that saved fewer spans than parts (a checkpoint's input), or whose parts would
        be smaller than `min_group_bytes`, is not split.
        """
        size = self._layer_sizes.get(layer)
        if size is None or size[1] < SPLIT_PARTS or size[0] < SPLIT_PARTS * self.min_group_bytes:
            return None
        return [size[0] * k // SPLIT_PARTS for k in range(1, SPLIT_PARTS)]

    def _hooks_follow_groups(self) -> None:
        """With `hooks_in_groups_only`: hooks on while a group is open or tensors saved after
        the last layer are counted, off otherwise; switched at boundaries of the outermost
        capture only, and only where the stack's top is what the switch expects (ours to pop,
        the top it had before the capture to push back on). A boundary inside another hooks
        scope (a checkpoint wrapping the layer's call) switches nothing: that scope's exit
        pops the top of the stack, which must still be its own."""
        if not self.hooks_in_groups_only or self._capturing != 1:
            return
        want = self._group is not None or self._tail is not None
        if want == self._hooks_on:
            return
        top = _top_pack_hook()
        if want and top is self._hooks_base:
            self._hooks.__enter__()
            self._hooks_on = True
        elif not want and top is self._hooks.pack_hook:
            self._hooks.__exit__(None, None, None)
            self._hooks_on = False

    def _close(self, group: _Group) -> None:
        if group.layer is not None and group.state == _OPEN:
            self._layer_sizes[group.layer] = (group.capped, group.new_spans)  # its last part's: the layer's
        los = []
        for entry in group.spans:
            los.append(entry[1])
            group.nbytes += entry[2] - entry[1]
            entry.append(entry[0]._version)  # a later save may share this copy only at this version
        group.los = los
        if self.observer is not None:
            self.observer.closed(group)
        if group.state == _KEPT:
            group.spans = None
            return
        if not group.spans:
            self._settle(group)
            return
        # One pooled host block per group, spans at aligned offsets: one pool request per
        # layer instead of one per tensor, and the same block size every step (cache hits).
        sizes = [hi - lo for _, lo, hi, _ in group.spans]
        offsets, group.nbytes_aligned = _aligned_layout(sizes)
        group.offsets = offsets
        with _device.nvtx_range(f"offload.d2h {group.name}") if self.nvtx else contextlib.nullcontext():
            # One call for the group's spans, into a block the core acquires from the pool and
            # times itself: the core makes no tensor per span, and no Python event or stream
            # object is made per group (a launch-bound step pays for each on the host).
            group.d2h = copy_spans_to_host([entry[0] for entry in group.spans], los, sizes, group.nbytes_aligned,
                                           offsets, pool=self.pool, timing=self.timing)
        if self.timing:
            self._timing_events.append((self._counters, "d2h_seconds", group.d2h.copy_timer(), None))
        group.state = _COPYING
        c = self._counters
        c["d2h_bytes"] += group.d2h.nbytes
        c["groups_offloaded"] += 1
        c["layers_offloaded"] += group.n_layers
        c["tensors_offloaded"] += len(group.held)
        if self.mode == "sync":
            t0 = time.perf_counter()
            group.d2h.synchronize()
            c["forward_wait_seconds"] += time.perf_counter() - t0
            self._settle(group)
            return
        self._inflight.append(weakref.ref(group))
        self._poll()
        stream = group.stream = _device.current_stream(self.device) if self.on_accel else None
        if self.schedule is not None:
            # Auto mode: the plan says at which point the copy is complete; no window.
            at = self.schedule.release_at.get(group.layer)
            if isinstance(at, list):  # a point per part
                at = at[min(group.part, len(at) - 1)]
            if at is not None:
                self._due.append((at, weakref.ref(group)))
            return
        # The window: the group now opening plus those still copying may not exceed it.
        while len(self._inflight) > self.resident_groups - 1:
            oldest = self._inflight.popleft()()
            if oldest is None or oldest.state != _COPYING:
                continue
            if stream is not None and oldest.stream == stream:
                # A full window makes the compute stream wait on the device, not the host: the
                # host goes on queueing kernels while the copy finishes (a host wait here left
                # the device idle in launch-bound steps). The oldest group's tensors were saved
                # on this stream, so the core lets go of them at once: the allocator reuses
                # their memory only for work queued on this stream after the wait.
                start = self._timed_start(stream)
                oldest.d2h.release_sources(stream)
                self._timed_end("forward_wait_seconds", start, stream)
            else:  # saved on another stream than the one running now: only the host can order it
                t0 = time.perf_counter()
                oldest.d2h.synchronize()
                c["forward_wait_seconds"] += time.perf_counter() - t0
            self._settle(oldest)

    def _poll(self) -> None:
        """Settle, oldest first, the groups whose copies are complete (never blocks).

        The deque holds weak references: a group whose graph was dropped frees itself.
        """
        while self._inflight:
            group = self._inflight[0]()
            if group is not None and group.state == _COPYING and not group.d2h.ready():
                return
            self._inflight.popleft()
            if group is not None and group.state == _COPYING:
                self._settle(group)

    def _release_due(self, point: int) -> None:
        """Let go of the groups whose planned release point has come (auto mode's schedule).

        The compute stream waits on the device for each one's copy, planned to be complete by
        now, and its device tensors go back to the allocator in stream order, as the window
        does; the host is never blocked. A group saved on another stream is left to `_poll`.
        """
        if all(at > point for at, _ in self._due):  # most points release nothing: no stream read
            return
        stream = _device.current_stream(self.device) if self.on_accel else None
        kind = "forward_wait_seconds" if point < self.schedule.n + 1 else "backward_wait_seconds"
        pending = []
        for at, ref in self._due:
            group = ref()
            if group is None or group.state != _COPYING:
                continue
            if at > point:
                pending.append((at, ref))
            elif stream is not None and group.stream == stream:
                start = self._timed_start(stream)
                group.d2h.release_sources(stream)
                self._timed_end(kind, start, stream)
                self._settle(group)
            elif group.d2h.ready():
                self._settle(group)
        self._due = pending

    def _settle(self, group: _Group) -> None:
        """The D2H copy is complete (or will be before any reader): drop the device tensors."""
        _drop_held(group)
        group.spans = None
        group.state = _HOST

    def _pack(self, t: torch.Tensor):
        """The pack hook without the core (the core's `pack_saved_tensor` makes the same tests in C
        and passes what may be offloaded to `_pack_extent`)."""
        # Cheapest tests first: most saved tensors of a step are parameters (a subclass) or
        # below the size threshold, and leave after two attribute reads.
        group = self._group
        if group is None or type(t) is not torch.Tensor:  # parameters, DTensors, other subclasses
            if group is None and self._tail is not None:
                self._saved_after_layers()
            return self._keep(t)
        extent = _offload_extent(t, self.min_tensor_bytes, self.device)
        if extent is None:
            return self._keep(t)
        return self._pack_extent(t, *extent)

    def _pack_extent(self, t: torch.Tensor, ptr: int, first: int, last: int, check_params: bool):
        """Pack `t`, which `_offload_extent` found may be offloaded: it reads bytes [first, last)
        of the storage at `ptr`. `check_params`: it may share a parameter's or input's storage.

        An op's recorded output (its base has a grad_fn) was allocated by that op. Only a tensor
        without one can share a parameter's memory (frozen weights, buffers, DTensor local
        shards, their views; also, conservatively, anything computed without grad, such as int
        or bool outputs) or be a forward's input, and only those read the storages of the
        parameters and inputs (`_param_ptrs`): a walk of every layer's parameters each step,
        which took about a third of the hooks' host time in a profiled step of an 8-layer Llama
        with checkpointing.
        """
        group = self._group
        if check_params:
            if self._param_pending:
                for params in self._param_pending:
                    self._param_ptrs |= _storage_ptrs(params)
                self._param_pending = []
            if ptr in self._param_ptrs:
                return self._keep(t)
        hit = self._storages.get(ptr)
        entry = None
        if hit is not None and not hit[2].expired():
            owner, index, _ = hit
            if owner is group:  # the group still collecting: widen the span to cover this view
                span = group.spans[index]
                if first < span[1] or last > span[2]:
                    span[1] = min(span[1], first - first % _SPAN_ALIGN)
                    span[2] = max(span[2], last)
                entry = index
            elif owner.state == _COPYING:  # its copy is queued: share it if it holds these bytes, unchanged
                span = owner.spans[index]
                if span[1] <= first and last <= span[2] and span[3] == t._version:
                    group, entry = owner, index
        split = False
        if entry is None:
            storage = t.untyped_storage()
            lo = first - first % _SPAN_ALIGN
            size = storage.nbytes()
            if _WHOLE_STORAGE * size <= last - lo:
                # Nearly all of its storage: copy all of it, so that the storage's other views
                # lie in this copy. q, k and v of one fused projection each read all but a
                # sliver of its output, a different sliver each: split into parts after q
                # (a layer copied in parts), k and v copied the whole 201 MB again (the block
                # stack's first layer copied 1209 MB for its 1008, and its copies ended late).
                lo, last = 0, size
            span_bytes = last - lo
            if group.cap is not None and group.capped + span_bytes > group.cap:
                return self._keep(t)  # auto mode offloads this layer in part: its first spans
            group.capped += span_bytes
            group.new_spans += 1
            if group.span_ends is not None:  # auto mode measuring
                group.span_ends.append(group.capped)
                if group.profile and group.capped >= group.profile[0]:
                    self._profiled(group)
            ends = group.split
            split = ends is not None and group.part < len(ends) and group.capped >= ends[group.part]
            entry = len(group.spans)
            group.spans.append([t, lo, last])
            self._storages[ptr] = (group, entry, StorageWeakRef(storage))
        slot = len(group.held)
        group.held.append((t, t._version))
        group.n_handles += 1
        packed = _Packed(group, entry, slot, t.dtype, t.shape, t.stride(), first)  # first: its offset in bytes
        if split:
            self._split(group)
        return packed

    def _profiled(self, group: _Group) -> None:
        """Auto mode measuring: the layer has saved the next share of its bytes (see `_Group.profile`)."""
        profile = group.profile
        while profile and group.capped >= profile[0]:
            profile.pop(0)
        self.observer.saved_bytes(group)

    def _split(self, group: _Group) -> None:
        """Auto mode: copy out what the layer saved so far and go on in a new group of it.

        The copy runs while the layer goes on, and the group is let go at its own point; a
        later view of a storage copied here shares that copy if it lies in it unchanged,
        else the new group copies its bytes again.
        """
        part = _Group(group.name, group.layer, True, self._last_offloaded)
        part.cap, part.capped, part.split, part.continued = group.cap, group.capped, group.split, True
        part.new_spans, part.n_layers = group.new_spans, 0
        # One span may pass several part ends: this group ends the last of them (its copy is
        # planned complete by that part's point, not an earlier one).
        ends = group.split
        index = group.part
        while index < len(ends) and group.capped >= ends[index]:
            index += 1
        group.part, part.part = index - 1, index
        self._group = part
        self._last_offloaded = weakref.ref(part)
        self._layer_groups[group.layer].append(self._last_offloaded)
        self._close(group)

    def _saved_after_layers(self) -> None:
        """A tensor is saved after the last layer: a point auto mode measures, and may release at."""
        self._tail += 1
        if self.observer is not None:
            self.observer.saved_after_layers(self._tail)
        schedule = self.schedule
        if schedule is not None and self._tail == schedule.tail_save:
            self._release_due(schedule.n + TAIL_POINT)

    def _keep(self, t):
        self._counters["tensors_kept"] += 1
        return (t, t._version)

    # ------------------------------------------------------------ backward side

    def _backward_starts(self) -> None:
        """The step's backward starts: at the model output's gradient (`mark_backward_start`),
        or at the step's first unpack, whichever comes first."""
        self._backward_seen = True  # the next capture starts a new step
        self._tail = None
        if self.observer is not None:
            self.observer.backward_started()
        if self.schedule is not None:
            self._backward_start_scheduled()
        elif self.mode != "sync":
            self._prefetch_at_backward_start()

    @_not_traced
    def mark_backward_start(self, output) -> None:
        """Start the step's backward when the gradient of `output` (the model's output) is
        computed: with hooks only in offloaded spans, nothing of the kept last layer or the
        head is unpacked here to mark it, and the first group's copy back would wait for
        backward to reach that group."""
        _when_gradient_of(output, self, _start_backward)  # else marked at the first unpack

    def _unpack(self, packed):
        if not self._backward_seen:  # the step's first unpack: its backward starts
            self._backward_starts()
        if type(packed) is tuple:
            t, version = packed
            if t._version != version:
                raise _modified_error(_describe(t), version, t._version)
            return t
        group = packed.group
        if self.observer is not None and group.n_unpacked == 0:
            self.observer.unpacked(group)
        if group.held is not None:  # still on the device (copy in flight, or kept)
            t, version = group.held[packed.slot]
            if t._version != version:
                raise _modified_error(_describe(t), version, t._version)
            result = t
        else:
            if group.modified and packed.slot in group.modified:
                raise _modified_error(*group.modified[packed.slot])
            watch = group.watch[packed.slot]
            if watch is not None and watch[0]._version != watch[1]:
                desc = f"{str(packed.dtype).replace('torch.', '')} {list(packed.size)}"
                raise _modified_error(desc, watch[1], watch[0]._version)
            result = self._restore(group, packed)
        if group.n_unpacked == 0 and self.mode != "sync":
            self._prefetch(group)
        group.n_unpacked += 1
        if group.n_unpacked >= group.n_handles and group.state != _KEPT:
            self._release(group)
        return result

    def _prefetch(self, group: _Group) -> None:
        if self.schedule is None:  # else fetched at the backward points the schedule chose
            # The group before it, and if that is the last part of a layer copied in parts, its
            # earlier parts too, the last first: fetched one by one at each part's first unpack,
            # a part's copy would start only once backward is in the layer. (At a part's own
            # first unpack they were fetched already: nothing to do.)
            self._fetch_groups(_with_earlier_parts(group.prev))

    def _prefetch_at_backward_start(self) -> None:
        """Fetch the first group backward will need from the host, as backward starts.

        Backward first runs what forward did after the last offloaded group (the kept last
        layer, the head, the loss) and then that group and those before it still copying,
        served from their held device tensors. Prefetching only from a group's first unpack
        left the host-to-device stream idle through all of that (8 ms of a 60 ms Llama step
        on the H100). The fetch stays inside the window, counted in layers: it happens only
        while the layers held on the device and the layers it brings back are at most
        `resident_groups`. Groups of several small layers (`min_group_bytes`) are otherwise
        each one group of the window; counted so, the start of backward (a step's peak, under
        the head's gradients) held every checkpoint input of Llama seq 2048 (two groups of
        3 and 4 layers), as much as checkpointing alone; the group then comes back at the
        held group's first unpack, one group ahead as any other.
        """
        group = self._last_offloaded() if self._last_offloaded is not None else None
        on_device = 0  # layers held on the device (a part of a layer counts as one)
        while group is not None and group.state == _COPYING:  # held on the device
            on_device += max(group.n_layers, 1)
            group = group.prev() if group.prev is not None else None
        if (group is not None and on_device + max(group.n_layers, 1) <= self.resident_groups
                and _on_host_only(group)):
            self._fetch_groups(_with_earlier_parts(weakref.ref(group)))

    def _backward_start_scheduled(self) -> None:
        """Backward starts (auto mode): release what the schedule lets go here, fetch what it fetches."""
        self._release_due(self.schedule.n + 1)
        self._fetch_groups(self._groups_of(self.schedule.fetch_at_start))

    def _groups_of(self, layers) -> list:
        """Weak references to the offloaded groups of `layers` in this forward, each layer's
        last part first: backward needs the tensors a layer saved last first."""
        return [ref for layer in layers for ref in reversed(self._layer_groups.get(layer, ()))]

    def _fetch_groups(self, refs) -> None:
        """Fetch the groups (weak references, or None) that are on the host only."""
        for ref in refs:
            group = ref() if ref is not None else None
            if group is not None and _on_host_only(group):
                self._fetch(group)
                self._counters["groups_prefetched"] += 1

    @_not_traced
    def fetch_when_backward_reaches(self, output, layers) -> None:
        """Fetch the groups of `layers` when backward reaches `output` (a layer's output): a
        hook on its gradient, the first thing computed in that layer's backward. Layers that
        stay on the device save no tensor of the engine's, so nothing else marks that point."""
        refs = self._groups_of(layers)
        if refs:  # else each is fetched at its first unpack
            _when_gradient_of(output, self, lambda engine: engine._fetch_groups(refs))

    def _fetch(self, group: _Group) -> None:
        with _device.nvtx_range(f"offload.h2d {group.name}") if self.nvtx else contextlib.nullcontext():
            # One device block per group (allocated on the consumer stream, its owner) laid out
            # as the host block: one DMA of the whole block (the core would stage a group's
            # adjacent spans and scatter them with a kernel competing with backward for the
            # SMs), and each restored view keeps the original's 512-byte alignment. Copied from
            # the D2H handle, the core makes the copy stream wait for that copy too (a group let
            # go at a release point was seen complete on the device only), and times the copy
            # after both waits.
            block = torch.empty(group.nbytes_aligned, dtype=torch.uint8, device=self.device)
            group.fetch_stream = _device.current_stream(self.device) if self.on_accel else None
            group.h2d = copy_to_device(group.d2h, self.device, out=[block], pool=self.pool, timing=self.timing)
        if self.timing:
            self._timing_events.append((self._counters, "h2d_seconds", group.h2d.copy_timer(), None))
        group.device_block = block
        group.typed = {}
        group.waited = set()
        self._counters["h2d_bytes"] += group.nbytes
        self._counters["groups_fetched"] += 1

    def _restore(self, group: _Group, packed: _Packed) -> torch.Tensor:
        if group.device_block is None:
            self._fetch(group)
        stream = _device.current_stream(self.device) if self.on_accel else None
        if stream not in group.waited:
            if self.mode == "sync" or not self.on_accel:
                t0 = time.perf_counter()
                group.h2d.synchronize()
                self._counters["backward_wait_seconds"] += time.perf_counter() - t0
            else:
                start = self._timed_start(stream)
                if stream == group.fetch_stream:
                    # The block's owner waits for the copy: the core need not hold it until the
                    # host sees the copy done. It held the last group fetched in a step (a
                    # layer's activations) until the next step's first copy.
                    group.h2d.release_sources(stream)
                else:
                    group.h2d.wait_stream(stream)
                self._timed_end("backward_wait_seconds", start, stream)
            group.waited.add(stream)
        key = (packed.entry, packed.dtype, packed.size, packed.stride, packed.offset)
        view = group.views.get(key)
        if view is None:
            # One op per view: as_strided on the block viewed as the dtype (made once per dtype
            # per group), at the view's place in the block, its span's place plus its bytes past
            # the span's start. Whole elements: spans start on _SPAN_ALIGN boundaries, which
            # every itemsize divides. (A slice of the span, a dtype view of it and as_strided
            # were three ops per tensor, each a few us of host time in a launch-bound step.)
            dtype = packed.dtype
            typed = group.typed.get(dtype)
            if typed is None:
                typed = group.typed[dtype] = group.device_block.view(dtype)
            at = group.offsets[packed.entry] + packed.offset - group.los[packed.entry]
            view = typed.as_strided(packed.size, packed.stride, at // dtype.itemsize)
            group.views[key] = view
        return view

    def _release(self, group: _Group) -> None:
        """Every handle of the group was unpacked: drop its device copies (the host copy stays)."""
        if group.state in (_OPEN,):
            return
        if group.d2h is not None:
            # A query that finds the device-to-host copy done also settles it (the copy engine
            # drops the sources it held then, not at the next step's first copy). Never a host
            # wait: one here (a group served from the device while its copy still runs) would
            # hold the host back in backward and open gaps in the compute stream.
            group.d2h.ready()
        if group.held is not None:
            self._settle(group)
        group.device_block = None
        group.typed = {}
        group.h2d = None
        group.views = {}
        group.waited = set()
        group.n_unpacked = 0


def _offload_extent(t: torch.Tensor, min_bytes: int, device: torch.device):
    """Whether the engine may offload `t` (a plain tensor saved in a group), and what it reads.

    None where it stays on the device: below `min_bytes` or empty, on another device, not
    strided, saved while backward runs (a checkpoint's recompute), a leaf that requires grad
    (a parameter's data, a user's input) or a view of one (alive anyway: copying it frees
    nothing), autocast's cached cast of a parameter (alive until the autocast region exits),
    a lazily conjugated or negated complex view. Else (storage data_ptr, first byte, end byte
    it reads, whether its base has no grad_fn: only then can it share a parameter's storage).
    The core's `offload_extent` is this function in C; a test holds the two equal.
    """
    numel = t.numel()
    itemsize = t.element_size()
    if numel * itemsize < min_bytes or numel == 0:
        return None
    if (
        t.device != device
        or t.layout != torch.strided
        or torch._C._current_graph_task_id() != -1  # saved while backward runs (a recompute)
    ):
        return None
    base = t._base
    if base is None:
        if t.requires_grad and t.is_leaf:
            return None
        base = t
    elif base.requires_grad and base.is_leaf:
        return None
    grad_fn = base.grad_fn
    if grad_fn is not None and type(grad_fn).__name__ == "ToCopyBackward0":
        source = grad_fn.next_functions[0][0]
        if source is not None and hasattr(source, "variable"):  # AccumulateGrad: a leaf's cast
            return None
    if t.is_complex() and (t.is_conj() or t.is_neg()):
        return None
    first = t.storage_offset() * itemsize
    last = first + itemsize
    for size, stride in zip(t.shape, t.stride()):
        last += (size - 1) * stride * itemsize
    return t.untyped_storage().data_ptr(), first, last, grad_fn is None


_SPARE_EVENTS = 128  # timing events kept for reuse, at most


def _top_pack_hook():
    """The pack hook on top of autograd's default saved-tensor hooks stack (None if empty)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def _with_earlier_parts(ref) -> list:
    """`ref` (a weak reference to a group, or None) and, if its group is a later part of a
    layer copied in parts, the layer's earlier parts: the order backward needs them in."""
    refs = [ref]
    group = ref() if ref is not None else None
    while group is not None and group.continued:
        refs.append(group.prev)
        group = group.prev() if group.prev is not None else None
    return refs


def _on_host_only(group: _Group) -> bool:
    """Its copy is complete and nothing brought it back to the device yet."""
    return group.state == _HOST and group.device_block is None and group.d2h is not None


def _start_backward(engine: ActivationEngine) -> None:
    if not engine._backward_seen:
        engine._backward_starts()


def _when_gradient_of(output, engine: ActivationEngine, call) -> None:
    """Run call(engine) when backward computes the gradient of the first tensor in `output`
    that needs one (a hook on it; nothing if there is none)."""
    anchor = _first_grad_tensor(output)
    if anchor is None:
        return
    ref = weakref.ref(engine)  # the hook lives as long as the graph: no cycle through it

    def hook(grad):
        this = ref()
        if this is not None:
            call(this)

    anchor.register_hook(hook)


def _first_grad_tensor(value, depth: int = 0):
    """The first tensor in a layer's output (a tensor, or one inside a tuple, list or dict,
    such as a Hugging Face ModelOutput) whose gradient backward computes; None if none."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if depth >= 3:
        return None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_grad_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _loop_refs() -> int:
    """What `sys.getrefcount` adds, in `_drop_held`'s loop, to a tensor held only by its slot
    (`t` and the call's argument: 2 on CPython 3.11-3.13; measured, as interpreters differ)."""
    held = [(object(), 0)]
    for _, (t, _version) in enumerate(held):
        return sys.getrefcount(t) - 1


_LOOP_REFS = _loop_refs()


def _empty_like_storage(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of t's dtype and device (cached): what an alias's data is set to."""
    key = (t.dtype, t.device)
    empty = _EMPTIES.get(key)
    if empty is None:
        empty = _EMPTIES[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    return empty


_EMPTIES: dict = {}


def _drop_held(group: _Group) -> None:
    """The group's device tensors are no longer needed (its host copy is complete).

    An in-place change to a saved tensor after this point must still raise at unpack, as
    autograd's own check would; but the tensor is usually freed before backward (the repro:
    a later layer modifies a tensor the previous layer saved, then drops it). So per slot
    the engine keeps a tensor that shares the saved tensor's version counter and no storage
    (a detached alias whose `.data` is then an empty tensor: setting `.data` keeps the
    alias's version counter and does not bump it, where `set_()` bumped the shared one and
    had to be undone in a context, four times the host time), and the version it was saved at.

    Only for tensors something else may still change: ones the caller still references,
    and views (their base or sibling views may be alive). A tensor referenced only by the
    group dies with it, so nothing can change it. That keeps the alias (a few us) off the
    tensors that were local to the layer; a tensor already changed is recorded at once.
    """
    held = group.held
    if held is None:
        return
    group.held = None
    group.spans = None  # its entries reference the tensors too
    watch = [None] * len(held)
    modified = {}
    alias_slots = []
    slots_of = None  # id(tensor) -> slots holding it, counted only if some tensor needs it
    for slot, (t, version) in enumerate(held):
        now = t._version
        if now != version:
            modified[slot] = (_describe(t), version, now)
        elif t._base is not None:
            alias_slots.append(slot)
        else:
            # References: the tuples of the slots holding it, plus what this loop adds.
            refs = sys.getrefcount(t)
            if refs > _LOOP_REFS + 1:
                if slots_of is None:
                    slots_of = collections.Counter(id(other) for other, _ in held)
                if refs > _LOOP_REFS + slots_of[id(t)]:
                    alias_slots.append(slot)
    for slot in alias_slots:
        t, version = held[slot]
        alias = t.detach()
        alias.data = _empty_like_storage(t)
        watch[slot] = (alias, version)
    group.watch = watch
    group.modified = modified


def _aligned_layout(sizes) -> Tuple[List[int], int]:
    """Where spans of the given sizes start in a block, each on a _SPAN_ALIGN boundary, and the block's bytes."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // _SPAN_ALIGN) * _SPAN_ALIGN
    return offsets, at


def _module_tensors(root: torch.nn.Module):
    """The parameters and buffers of `root` and its submodules (repeats possible), read from
    the modules' own dicts: a third of the cost of parameters() + buffers(), whose walk builds
    a qualified name for every module and member (~0.35 ms a step for an 8-layer Llama)."""
    stack, seen = [root], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for t in module._parameters.values():
            if t is not None:
                yield t
        for t in module._buffers.values():
            if t is not None:
                yield t
        stack.extend(m for m in module._modules.values() if m is not None)


def _input_tensors(args, kwargs):
    """The tensors among a forward's arguments, also inside containers (walked when iterated)."""
    leaves: list = []
    _tensor_leaves([args, kwargs], leaves)
    yield from leaves


def _storage_ptrs(tensors) -> set:
    ptrs = set()
    for p in tensors:
        local = getattr(p, "_local_tensor", None)  # DTensor: its local shard
        t = local if isinstance(local, torch.Tensor) else p
        try:
            ptrs.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # meta or fake tensors have no storage
            pass
    ptrs.discard(0)
    return ptrs


class _Capture:
    """Exception-safe scope of `ActivationEngine.capture`."""

    __slots__ = ("engine", "params")

    def __init__(self, engine, params):
        self.engine = engine
        self.params = params

    def __enter__(self):
        self.engine._enter(self.params)
        return self.engine

    def __exit__(self, *exc):
        self.engine._exit()
        return False


# ---------------------------------------------------------------- user API


def _check_common(fn, mode, min_tensor_bytes, resident_groups, memory_budget_bytes):
    if memory_budget_bytes is not None:
        from ..core.checks import parse_bytes

        if isinstance(memory_budget_bytes, (int, float)) and not isinstance(memory_budget_bytes, bool) \
                and memory_budget_bytes < 0:
            raise ValueError(f"{fn}: memory_budget_bytes must be >= 0 bytes, got {memory_budget_bytes}")
        memory_budget_bytes = parse_bytes(memory_budget_bytes, f"{fn}: memory_budget_bytes")
        if mode != "auto":
            raise ValueError(
                f"{fn}: memory_budget_bytes is used by mode='auto' (which chooses the layers to offload "
                f"to meet it), got mode={mode!r}"
            )
    return memory_budget_bytes


class ActivationOffload:
    """What `enable_activation_offload` returns: `.stats()`, `.disable()`, `.layers`, `.plan`."""

    def __init__(self, model, layers, engine, keep, memory_budget_bytes, verbose):
        # The model and its layers are held weakly: their wrapped forwards hold this handle, so
        # strong references back would make a cycle that keeps a dropped model's memory alive
        # until the cyclic collector runs.
        self._model = weakref.ref(model)
        self.engine = engine
        # Layers and the model's output mark every point the engine needs: hooks only where a
        # group is open (see ActivationEngine.hooks_in_groups_only).
        engine.hooks_in_groups_only = True
        self.layers = [name for name, _ in layers]
        self._modules = [weakref.ref(module) for _, module in layers]
        self._keep = keep  # per layer: kept on the device whatever the mode
        self._offload = [not k for k in keep]  # per layer: offloaded in the current plan
        self._enabled = True
        self._paused = False  # inside paused(): forwards run as without offload
        self._auto = None
        if engine.mode == "auto":
            from .planner import AutoPlanner

            self._auto = AutoPlanner(self, memory_budget_bytes, verbose)
        self._wrapped = []  # weak references to the modules whose forward is wrapped
        self._layer_targets = [weakref.ref(_wrap_target(module)) for _, module in layers]
        self._layers_wrapped = False
        try:
            self._set_layers_wrapped(True)
            _wrap.wrap_forward(model, self._model_forward)
            self._wrapped.append(weakref.ref(model))
        except Exception:
            self.disable()
            raise

    @property
    def model(self):
        """The model (None once it was freed)."""
        return self._model()

    @property
    def plan(self):
        """Auto mode's current plan (dict), or None in the other modes."""
        return None if self._auto is None else self._auto.current_plan()

    def offloaded_layers(self) -> List[str]:
        return [name for name, on in zip(self.layers, self._offload) if on]

    def _model_forward(self, original):
        engine = self.engine

        def forward(*args, **kwargs):
            if _compiling():
                _warn_compiled()
                return original(*args, **kwargs)
            model = self._model()
            if (
                not self._enabled
                or self._paused
                or not torch.is_grad_enabled()
                or torch.is_inference_mode_enabled()
                or not model.training
                or torch._C._current_graph_task_id() != -1
                or (not engine._capturing and _other_hooks_active())
            ):
                return original(*args, **kwargs)
            if self._auto is not None and self._auto.before_forward(args, kwargs):
                # The plan offloads nothing: run exactly as without offload (no hooks, whose
                # per-tensor cost would otherwise be the only overhead left).
                engine.pass_through_step()
                return original(*args, **kwargs)
            # Lazy: walked only if a saved tensor needs it (see ActivationEngine.add_params). The
            # forward's own inputs stay too: the caller holds them through the forward, so a copy
            # would free nothing (the block stack's input batch, 64 MiB of its first layer).
            with engine.capture(itertools.chain(_module_tensors(model), _input_tensors(args, kwargs))):
                out = original(*args, **kwargs)
            if engine.hooks_in_groups_only:
                engine.mark_backward_start(out)
            return out

        return forward

    def _set_layers_wrapped(self, on: bool) -> None:
        """Wrap the layers' forwards (group boundaries), or restore them while auto mode's plan
        for the current shape offloads nothing (then a step runs the layers' own forwards)."""
        if on == self._layers_wrapped or not self._enabled:
            return
        self._layers_wrapped = on
        for index, ref in enumerate(self._layer_targets):
            target = ref()
            if target is None:
                continue
            if on:
                _wrap.wrap_forward(target, functools.partial(self._layer_forward, index))
                self._wrapped.append(ref)
            else:
                _wrap.unwrap_forward(target)
        if not on:
            self._wrapped = [ref for ref in self._wrapped if ref not in self._layer_targets]

    def _layer_forward(self, index, original):
        engine = self.engine
        last = len(self._modules) - 1
        name = self.layers[index]

        def forward(*args, **kwargs):
            # Not skipped while dynamo traces a compiled layer: the boundary below breaks the graph
            # and runs eagerly, and the compiled region's saved tensors reach the hooks at run time.
            if not engine._capturing or torch._C._current_graph_task_id() != -1:
                return original(*args, **kwargs)
            offload = self._offload[index]
            engine.boundary(name, offload=offload, layer=index)
            if offload:
                self._add_layer_params(index)
            out = original(*args, **kwargs)
            schedule = engine.schedule
            if schedule is not None and index in schedule.fetch_at:
                engine.fetch_when_backward_reaches(out, schedule.fetch_at[index])
            if index == last:
                engine.boundary(None, layer=last + 1)  # the point after the last layer (auto mode's schedule)
            return out

        return forward

    @_not_traced
    def _add_layer_params(self, index) -> None:
        module = self._modules[index]()
        if module is not None:
            self.engine.add_params(_module_tensors(module))

    def stats(self) -> dict:
        """Counters of the current or last step (see ActivationEngine.stats), plus the plan."""
        out = self.engine.stats()
        out["layers"] = list(self.layers)
        out["offloaded_layers"] = self.offloaded_layers()
        out["plan"] = self.plan
        return out

    @contextlib.contextmanager
    def paused(self):
        """Training forwards inside run exactly as without offload (no hooks); the handle, its
        statistics and auto mode's plans stay as they were for the steps after it (a probe of
        auto mode's that was running warms up again). For passes that should not be offloaded,
        and to time a step without offload next to one with it.

            with handle.paused():
                model(batch).loss.backward()
        """
        if self._paused:
            raise RuntimeError("offload.ActivationOffload.paused: already paused (not reentrant)")
        if self._auto is not None:
            self._auto.last_start = None  # a probe times from one hooked forward to the next
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    def disable(self) -> None:
        """Restore every wrapped forward; saved tensors already offloaded still come back."""
        self._enabled = False
        for ref in self._wrapped:
            module = ref()
            if module is not None:
                _wrap.unwrap_forward(module)
        self._wrapped = []
        self._layers_wrapped = False

    def __repr__(self) -> str:
        return (f"ActivationOffload(mode={self.engine.mode!r}, {len(self.offloaded_layers())} of "
                f"{len(self.layers)} layers offloaded, enabled={self._enabled})")


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and getattr(compiler, "is_compiling", lambda: False)())


_warned_compiled = []


def _warn_compiled() -> None:
    if not _warned_compiled:
        _warned_compiled.append(True)
        warnings.warn(
            "offload.enable_activation_offload: the model's forward is being traced by torch.compile, so its "
            "activations are not offloaded; compile the layers instead (layer.compile()): what a compiled "
            "layer saves for backward is offloaded",
            stacklevel=3,
        )


def _other_hooks_active() -> bool:
    """Saved-tensor hooks someone else installed (save_on_cpu, a checkpoint around the model)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return top(False) is not None
    except TypeError:  # torch versions whose binding takes no argument
        return top() is not None


def _wrap_target(module):
    return _wrap.forward_target(module)


def enable_activation_offload(
    model: torch.nn.Module,
    mode: str = "async",
    *,
    layers=None,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    min_group_bytes: Optional[int] = None,
    resident_groups: int = 2,
    memory_budget_bytes=None,
    keep_first: int = 0,
    keep_last: int = 1,
    pool: Optional[HostPool] = None,
    timing: bool = True,
    nvtx: bool = False,
    verbose: bool = True,
) -> ActivationOffload:
    """Offload the activations autograd saves in `model`'s layers to pinned host memory.

    Args:
        model: the module whose forward runs a training step (its root is hooked).
        mode: 'async' (copies overlapped with compute, `resident_groups` layers on the device),
            'sync' (each layer's copies waited for; for debugging and comparison) or 'auto'
            (measures the first steps, then offloads what the bus can copy out before backward
            starts, earliest layers first, freed and fetched back at planned points; checked
            against timed steps without offload and backed off while the plan costs over 3%;
            or as few layers as meet `memory_budget_bytes`).
        layers: names (or modules) of the layers to group by; default: FSDP units, else the
            elements of the model's repeated `nn.ModuleList`.
        min_tensor_bytes: saved tensors smaller than this stay on the device.
        min_group_bytes: modes 'async' and 'sync' copy a layer whose offloaded bytes are below
            this together with the layers after it, until the group holds this much (default
            32 x min_tensor_bytes: a group's copies and waits cost host time of their own, more
            than a checkpoint's small input takes on the bus); 0: one group per layer.
        resident_groups: how many groups (layers, or runs of small layers: min_group_bytes)
            may have their activations on the device at once (>= 1).
        memory_budget_bytes: device-memory budget for mode='auto' (int or '20GiB').
        keep_first, keep_last: how many of the first and last layers stay on the device (the
            last layer's activations are needed at once when backward starts).

    Forwards under no_grad, inference_mode or in eval mode pass through untouched.

        handle = offload.enable_activation_offload(model)            # async, every layer but the last
        handle = offload.enable_activation_offload(model, "auto")    # only what hides under compute
        loss = model(batch).loss; loss.backward(); print(handle.stats())
        handle.disable()
    """
    fn = "offload.enable_activation_offload"
    engine = ActivationEngine(mode, min_tensor_bytes=min_tensor_bytes, resident_groups=resident_groups,
                              pool=pool, timing=timing, nvtx=nvtx, fn=fn, min_group_bytes=min_group_bytes)
    memory_budget_bytes = _check_common(fn, mode, min_tensor_bytes, resident_groups, memory_budget_bytes)
    found = _wrap.find_layers(model, layers, fn)
    for what, value in (("keep_first", keep_first), ("keep_last", keep_last)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{fn}: {what} must be an int >= 0, got {value!r}")
    count = len(found)
    keep = [i < keep_first or i >= count - keep_last for i in range(count)]
    if all(keep):
        names = [name for name, _ in found]
        warnings.warn(
            f"{fn}: nothing will be offloaded: keep_first={keep_first} + keep_last={keep_last} keep all "
            f"{count} layer(s) found ({', '.join(names[:4])}{', ...' if count > 4 else ''}) on the device; "
            "lower keep_first/keep_last or name finer layers with layers=[...]",
            stacklevel=2,
        )
    # Compiled layers are supported: AOTAutograd saves a compiled region's activations through
    # an autograd function at run time, where the hooks see them (tested with the CPU path).
    # A compiled *model* is not: its forward, traced whole, bypasses the wrappers (warned then).
    return ActivationOffload(model, found, engine, keep, memory_budget_bytes, verbose)


class activation_offload:  # noqa: N801 - used as a context manager, like torch's save_on_cpu
    """`with offload.activation_offload() as ao:` offloads what autograd saves in the block.

    Groups are explicit: the block starts one group; `ao.boundary()` closes it and starts
    the next (call it between layers or pipeline micro-batches); `ao.boundary(offload=False)`
    starts a span whose tensors stay on the device. Backward may run after the block.
    `params`: tensors never to offload; pass the model's parameters and buffers when some
    are frozen (parameters that require grad, and views of them, are recognised anyway).

        with offload.activation_offload(params=model.parameters()) as ao:
            for block in model.blocks:
                ao.boundary()
                x = block(x)
        loss_fn(x).backward()
    """

    def __init__(self, mode: str = "async", *, min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
                 resident_groups: int = 2, pool: Optional[HostPool] = None, params=(), timing: bool = True,
                 nvtx: bool = False, engine: Optional[ActivationEngine] = None):
        fn = "offload.activation_offload"
        if mode == "auto":
            raise ValueError(f"{fn}: mode='auto' needs layers to measure; use enable_activation_offload(model, "
                             "mode='auto'), or mode='async' or 'sync' here")
        if engine is None:
            engine = ActivationEngine(mode, min_tensor_bytes=min_tensor_bytes, resident_groups=resident_groups,
                                      pool=pool, timing=timing, nvtx=nvtx, fn=fn)
        self.engine = engine
        self._params = params
        self._count = 0
        self._capture = None

    def __enter__(self):
        if self._capture is not None:
            raise RuntimeError("offload.activation_offload: this context is already active; create a new one")
        self._capture = self.engine.capture(self._params)
        self._capture.__enter__()
        self.boundary()
        return self

    def boundary(self, name=None, offload: bool = True) -> None:
        """Close the current group and start the next one."""
        if self._capture is None:
            raise RuntimeError("offload.activation_offload.boundary: call it inside the `with` block")
        self.engine.boundary(f"group{self._count}" if name is None else name, offload=offload)
        self._count += 1

    def __exit__(self, *exc):
        capture, self._capture = self._capture, None
        capture.__exit__(*exc)
        return False

    def stats(self) -> dict:
        return self.engine.stats()
