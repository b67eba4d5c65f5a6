"""The activation engine: saved-tensor hooks that group what autograd saves, copy each group
to pinned host memory while the next layer computes, and bring it back ahead of backward.

The data path, top to bottom: the user API (api.py; layers.py finds and wraps the layers)
-> `ActivationEngine` (pack/unpack hooks, groups, the resident window or auto mode's
schedule, prefetch) -> `copy_spans_to_host` / `copy_to_device` (one batched copy per group)
-> `HostPool` (pinned blocks, reused across steps). The notes below give the reasons.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
import warnings
import weakref
from typing import Optional

import torch

from ..core import _backend, _device
from ..core.copy import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES, CopyHandle, copy_to_device
from ..core.checks import check_bool, check_int
from ..core.pool import HostPool, check_pool, default_host_pool
from .groups import CLOSED, COPYING, HOST, KEPT, OPEN, RELEASED, ActivationEvent, AutoState, Group, group_class
from .backward import BackwardSide
from .pack_table import PackTable
from .verify import GroupChecksums
from .saved_tensors import make_not_traced, not_traced, offload_extent, top_pack_hook
from .step_stats import StepTimings, new_counters

# A layer whose copy would start on an idle device-to-host stream is copied in this many
# parts, each as soon as the layer has saved its share of the bytes: waiting for the layer
# to end would leave the bus idle through the first offloaded layer's forward.
SPLIT_PARTS = 4
# Auto mode's measured steps mark when each layer has saved every PROFILE_POINTS-th share of
# its bytes (of new spans): a layer's bytes do not come evenly over its time, so auto mode's
# schedule (auto/schedule.py) places a part's close by these marks. A multiple of SPLIT_PARTS:
# the quarters' ends are then marks of their own.
PROFILE_POINTS = 8
# Where the point of the last tensor saved before the step's peak, after the last layer (n),
# sits among a `Schedule`'s points (auto/schedule.py): between the last layer's end (n) and
# backward's start (n + 1).
TAIL_POINT = 0.5

# Note [groups]: a group is the span of forward from one layer's start to the next layer's
# start (or the end of the model's forward). Opening groups at layer starts (instead of
# scoping them to a layer's call) puts the inputs a reentrant checkpoint saves after its
# layer returns into that layer's group, and keeps the hooks outside Hugging Face's and
# FSDP2's checkpoint wrappers. Two exceptions without auto mode's plan: a layer that saves
# less than `min_group_bytes` (a checkpoint's input at a short sequence) shares its group
# with the layers after it, and in mode async the first offloaded layer of a forward is
# copied in parts while it runs (Note [layer parts]).
#
# Note [one copy per group]: a group is copied in one batched call when it closes, not one
# copy per tensor at save time: the copy engine then makes one wait on the compute stream,
# records one event and packs the small tensors of the layer into one transfer, into one
# pooled host block (one pool request per layer, the same size every step). The pack hook
# does only bookkeeping (a few attribute reads, a dict lookup, an append). The copy starts
# as soon as the layer's kernels are queued and runs under the next layer's compute.
#
# Note [resident window]: a group's device tensors are held (`Group.held`) from save until
# its copy is seen complete (a non-blocking poll at every group boundary, but in auto mode's
# measuring steps), or until more than `resident_groups` groups would be on the device:
# then the compute stream waits on the device for the oldest group's copy and its tensors go
# back to the allocator in stream order, while the host goes on queueing kernels. The copy
# engine also record_streams them on the device-to-host stream, so dropping them early could
# never corrupt the copy. A group still copying when backward reaches it is served from those
# held tensors (no round trip); so are the last groups of a forward. Auto mode's schedule
# replaces the window and the one-ahead prefetch (Note [planned release points] in auto/schedule.py).
#
# Note [served groups' sources]: the copy engine holds a device-to-host copy's sources until a
# query or a later copy finds it done (Note [in-flight registry] in csrc/core/in_flight.h). A
# group served from the device in backward is let go while the host, ahead of the device, may
# not see its copy done yet, and nothing may ask before the next step's first copy: its memory
# would stay allocated through the rest of backward and into that step, where auto mode reads
# what each stretch of a step holds. So when backward lets go of such a group, its sources are
# record_stream'd on the copy stream and the core drops its references: the allocator counts the
# memory free at once and reuses it only once the copy stream has passed the copy, with no wait
# on the compute stream.
#
# Note [backward]: a group's copy back allocates its device block on the consumer (current)
# stream, its owner; the consumer waits on that group's copy event once, never on the whole
# device. When the first tensor of group g is unpacked, the copy of the group before it is
# issued (prefetch), so it runs under g's backward; the step's first unpack (or the model
# output's gradient) issues the copy of the first group backward needs from the host, so
# that stream does not idle while backward works through what stayed on the device.
#
# Note [storages and views]: each storage is offloaded once per group: all saved views of it
# share one copied byte span [lo, hi) of the storage (all of it where the first view reads
# nearly all, pack_table.py's `WHOLE_STORAGE`: the storage's other views then share that copy, also from a
# later part of the layer), and each view is rebuilt with `as_strided` on the restored span
# with its exact size, stride and storage offset, so a transpose, slice, expand or
# overlapping view is restored exactly (rebuilding with `.view(shape)` from a deduplicated
# storage would not be). The same view saved twice comes back as the same tensor object.
#
# Note [what stays]: parameters and buffers (by storage, refreshed per layer for FSDP's
# unsharded parameters), the forward's inputs, leaves that require grad and views of them,
# autocast's cached casts of parameters, tensor subclasses (DTensor), tensors below
# `min_tensor_bytes` (`offload_extent` lists the reasons).
#
# Note [layer parts]: a layer whose copy would start only when it ends, on an idle
# device-to-host stream, is copied in parts as it saves its bytes: the group closes at each
# part end (bytes of new spans), its copy starts, and the layer goes on in a new group. A
# later view of a storage copied in an earlier part shares that copy if it lies in it
# unchanged. Backward needs a layer's last part first; its parts are fetched together.
#
# Note [parameter walk]: which storages are parameters, buffers or the forward's inputs is read
# by walking the model's tensors each forward (FSDP's parameters change storage between steps),
# O(parameters) of host time. It is read only when a saved tensor may share such a storage (one
# no recorded op made, see pack_table.py's `pack_extent`): a forward without one never walks.
# The walk goes in the order given, the forward's inputs before the model, and stops where the
# tensor's storage is found: a model whose only such tensor is its input (no frozen weights,
# no buffers saved) never walks its parameters. A forward that needed it has the next one walk
# as many of the iterables as its capture begins, before the model's own host work. There the host
# is ahead of the device, or about to wait for it: a Hugging Face model reads its attention mask
# on the host before the first layer, so the host reaches the first layer with no lead over the
# device, and a walk made there, at the first saved tensor that needs it, delays the device by
# its whole time. A layer's own parameters (FSDP's unsharded ones exist only inside the layer)
# are still read there.
#
# Note [pool full]: a group whose host block the pool cannot give (its `limit_bytes` reached)
# stays on the device as a kept group: its tensors are served as they are in backward, the
# step completes with exactly the gradients it would have had, and device memory holds what
# did not fit. Nothing was queued for it (the block is acquired before any copy), so nothing
# is half-copied. One warning per engine says how much stayed and why; later groups still
# try the pool, which frees blocks as backward releases them.
#
# Note [hooks in groups only]: with `hooks_in_groups_only` (set by enable_activation_offload,
# which marks backward's start on the model's output) the hooks are on only from an
# offloaded group's start to the next boundary: a tensor saved outside those spans (kept
# layers, the head) then costs no Python call to pack or unpack.

MODES = ("async", "sync", "auto")
# Tensors smaller than this stay on the device by default: below ~1 MiB a copy's fixed
# cost (launch, event, bookkeeping) outweighs the memory it frees.
DEFAULT_MIN_TENSOR_BYTES = 1 << 20
# A layer's group smaller than this many times min_tensor_bytes goes on through the next layer
# (min_group_bytes' default): a group costs host time of its own (its copy out, its copy back,
# their waits), more than a small group's bytes take on the bus.
GROUP_BYTES_PER_TENSOR_BYTE = 32


def check_options(fn: str, mode, min_tensor_bytes, resident_groups, min_group_bytes, pool, timing, nvtx,
                  verify=False) -> None:
    """The engine's options, checked for `fn` (the public function that was given them)."""
    allowed = ", ".join(map(repr, MODES))
    if not isinstance(mode, str):
        raise TypeError(f"{fn}: mode must be one of {allowed}, got {type(mode).__name__} {mode!r}")
    if mode not in MODES:
        raise ValueError(f"{fn}: mode must be one of {allowed}, got {mode!r}")
    check_int(fn, "min_tensor_bytes", min_tensor_bytes, 0)
    check_int(fn, "resident_groups", resident_groups, 1, "groups whose activations may be on the device at once")
    if min_group_bytes is not None:
        check_int(fn, "min_group_bytes", min_group_bytes, 0,
                  f"or None: {GROUP_BYTES_PER_TENSOR_BYTE} x min_tensor_bytes")
    check_pool(fn, pool)
    check_bool(fn, "timing", timing)
    check_bool(fn, "nvtx", nvtx)
    check_bool(fn, "verify", verify)


class ActivationEngine:
    """Packs saved tensors into groups, copies them out and brings them back.

    Note [engine interface]: what other modules use; nothing else of the engine's is read
    or set from outside.
    Driving it (api.py's handle and `activation_offload`):
      `capture(params)` the scope where saved tensors are hooked;
      `boundary(name, offload, layer)` a new group starts; `add_params(tensors)` storages
      that stay; `backward.mark_backward_start(output)`;
      `backward.fetch_when_backward_reaches(output, layers)`;
      `pass_through_step()`; `hooks_in_groups_only` (set by the handle); `stats()`;
      `capturing` (read: > 0 inside a capture); `schedule` (read: the plan in use, or None);
      `add_listener(callback)` / `remove_listener(callback)` (Note [events]);
      `native_cycle` (read: the core runs each group's cycle, csrc/python/group_cycle.h).
    Auto mode (auto/planner.py; the observer calls in auto/measure.py):
      `use_plan(schedule, observer)` sets the plan and the observer for the next forwards;
      `backward_seen` (read: the step's backward has started); `counters` (read: the
      current step's counters, a dict replaced at each new step); `resolve_timing(block)`
      adds finished timings to the counters; `device`, `on_accel`, `resident_groups`.
      The observer is called with the group (its `layer`, `nbytes`, `capped`, `auto`):
      `opened`, `closed`, `saved_bytes`, `unpacked`, and `backward_started()`,
      `saved_after_layers(m)`.
    The saved-tensor hooks (the Python ones, `pack`/`unpack` over pack_table.py's `PackTable`,
    or the core's over its PackTable, csrc/python/saved_tensor_hooks.cpp) call, per tensor
    where Python decides and otherwise per group: `pack(t)` (no group open), `unpack(packed)`
    (what the core does not serve), `_keep(t)`, `_walk_params(ptr)`, `_profiled(group)`,
    `_split(group)`, `_backward_starts()`, `_make_ready(group)`, `_prefetch(group)`,
    `_release(group)` (`unpack` and these four are the backward side's methods, set on the
    engine when it is made), `observer.unpacked(group)`; and read `counters["tensors_kept"]`
    (incremented for a tensor that stays), `backward_seen`, `observer`. The core's cycle of a
    group (group_cycle.h) calls `_copy_streams()` and `_fetch_group(group, upto)` (a piece, or
    the rest of a group a plan fetched in pieces), reads `schedule`, `_due` and the engine's
    group bookkeeping, and adds to `counters` (its timings go to the core's StepTimings,
    `_timings`). Every name the core reads or calls is listed in csrc/python/engine_interface.h.
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
        verify: bool = False,
    ):
        # The engine's whole state is set here, each attribute with what it holds: one place to
        # read it (the longest method of the runtime, and only declarations).
        check_options(fn, mode, min_tensor_bytes, resident_groups, min_group_bytes, pool, timing, nvtx, verify)
        make_not_traced()  # before any forward of this engine can be traced (Note [not traced, lazily])
        if min_group_bytes is None:
            min_group_bytes = GROUP_BYTES_PER_TENSOR_BYTE * min_tensor_bytes
        self.mode = mode
        self.min_tensor_bytes = min_tensor_bytes
        self.min_group_bytes = min_group_bytes
        self.resident_groups = resident_groups
        self.pool = pool if pool is not None else default_host_pool()
        self.device = _device.current_device()
        self.on_accel = _device.is_accelerator(self.device)
        self.timing = timing and self.on_accel
        self.nvtx = nvtx
        self.verify = verify  # Note [verify] in verify.py
        # The hooks and the groups: the core's where it is loaded and the pool is its own (a saved
        # tensor costs no interpreter call, Note [group twins] in groups.py), else the Python
        # methods and groups (OFFLOAD_FORCE_FALLBACK=1, or `_backend.force_fallback()` around the
        # engine's making, chooses them). The core's table holds the engine weakly; the Python
        # hooks are bound methods (the engine and its hooks form a cycle the collector sees).
        # The backward side (backward.py), a collaborator; the hooks call its methods through the
        # engine's attributes below (Note [engine interface]).
        self.backward = BackwardSide(self)
        self.unpack = self.backward.unpack
        self._backward_starts = self.backward.starts
        self._make_ready = self.backward.make_ready
        self._prefetch = self.backward.prefetch
        self._release = self.backward.release
        self._fetch_group = self.backward.fetch
        core = self._core = _backend.loaded_core()
        self._streams = None  # the device's copy streams, read at the first copy (`_copy_streams`)
        self._native = core is not None and self.pool.native
        self._group_class = group_class(self._native)
        if self._native:
            self._table = core.PackTable(self, min_tensor_bytes, self.device, self.on_accel)
            self._copy_pool = self.pool.native_pool
            pack, unpack = (functools.partial(core.pack_saved_tensor, self._table),
                            functools.partial(core.unpack_saved_tensor, self._table))
            self._fetch_native = self._table.fetch_group  # the core's fetch of a whole group (group_cycle.h)
            # Copy and wait timings not yet counted, in the core so its cycle adds to them directly
            # (csrc/python/step_timings.h); the Python path calls the same object.
            self._timings = core.StepTimings(self.device)
            self._table.configure_backward(self._copy_pool, CopyHandle, DEFAULT_SMALL_BYTES, DEFAULT_CHUNK_BYTES,
                                           self._timings if self.timing else None, mode == "async")
        else:
            self._table = PackTable()
            self._copy_pool = self.pool
            self._timings = StepTimings(self.device)  # copy and wait timings not yet counted
            pack, unpack = self.pack, self.unpack
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self.hooks_in_groups_only = False  # Note [hooks in groups only]
        self._hooks_on = False  # the outermost capture's hooks are on the default-hooks stack
        self._hooks_base = None  # the stack's top pack hook when the outermost capture began
        self.capturing = 0
        self._last_offloaded = None  # weakref to the last offloaded group of this forward
        # Iterables of tensors whose storages join the table's storages that stay when a saved
        # tensor first needs them (Note [parameter walk]).
        self._param_pending: list = []
        self._walked = 0  # pending iterables walked in this forward (the next one walks as many as it begins)
        self._inflight = collections.deque()  # weakrefs to groups whose D2H copy is not yet confirmed
        self.backward_seen = False
        self._step = 0
        self.counters = new_counters()
        # Auto mode's observer and schedule (set by `use_plan`; Note [engine interface]).
        self.observer = None
        self.schedule = None
        self._due: list = []  # (release point, weakref to group) of this forward's groups, by the schedule
        # Tensors saved since the last layer ended (head, loss), counted while auto mode measures
        # or its schedule has a point there; None otherwise.
        self._tail: Optional[int] = None
        self._layer_groups: dict = {}  # layer index -> weakrefs to its offloaded groups in this forward
        # layer index -> (bytes, count) of the new storage spans it offloaded in its last forward:
        # async mode copies the first offloaded layer of a forward in parts of those bytes.
        self._layer_sizes: dict = {}
        self._warned_pool_full = False  # Note [pool full]
        self._listeners: tuple = ()  # callbacks given ActivationEvents (Note [events])
        self._choose_native_cycle()

    @property
    def open_group(self) -> Optional[Group]:
        """The group saved tensors join now (None outside an offloaded or measured span)."""
        return self._table.open_group

    @open_group.setter
    def open_group(self, group) -> None:
        self._table.open_group = group  # the core's table reads the group's auto state and parts here

    def use_plan(self, schedule, observer=None) -> None:
        """Run the next forwards by auto mode's `schedule` (a `schedule.Schedule`; None: the
        resident window and one-ahead prefetch), reporting to `observer` (None: not measuring)."""
        self.schedule = schedule
        self.observer = observer
        self._choose_native_cycle()

    def _choose_native_cycle(self) -> None:
        """Whether the core runs each group's cycle itself (csrc/python/group_cycle.h): with the
        core, and nothing that only the Python methods serve (auto mode's observer, listeners,
        verify, nvtx ranges, mode sync). Chosen again wherever one of those changes."""
        plain = (self._native and self.observer is None and not self._listeners and not self.verify
                 and not self.nvtx and self.mode != "sync")
        self._native_cycle = plain
        if self._native:
            self._table.native_cycle = plain

    @property
    def native_cycle(self) -> bool:
        """Whether the core runs each group's cycle (csrc/python/group_cycle.h) in the next steps."""
        return self._native_cycle

    # ------------------------------------------------------------ events

    # Note [events]: listeners see what the runtime does to each group (groups.py's
    # `ActivationEvent`: closed, released, fetched, restored), for users who trace or check a
    # step and for the tests, which observe the engine through them. Each place that reports
    # tests one attribute (`_listeners`, an empty tuple when nobody listens) once per group
    # event, never per saved tensor; the record is made only when someone listens. Listeners
    # run synchronously, inside forward or backward (autograd's thread in backward): what
    # they raise propagates there.

    def add_listener(self, callback, fn: str = "offload.ActivationOffload.add_listener") -> None:
        """Call `callback(event)` with an `ActivationEvent` for each group event from now on."""
        if not callable(callback):
            raise TypeError(f"{fn}: callback must be callable, got {type(callback).__name__}")
        self._listeners = self._listeners + (callback,)
        self._choose_native_cycle()

    def remove_listener(self, callback, fn: str = "offload.ActivationOffload.remove_listener") -> None:
        """Stop calling `callback` (added by `add_listener`; once per time it was added)."""
        listeners = list(self._listeners)
        if callback not in listeners:
            raise ValueError(f"{fn}: callback is not a listener of this engine (add it with add_listener)")
        listeners.remove(callback)
        self._listeners = tuple(listeners)
        self._choose_native_cycle()

    def _emit(self, kind: str, group: Group, nbytes: int, offset: int = 0) -> None:
        """Give the listeners the event `kind` of `group` (called only where `_listeners` is not empty)."""
        event = ActivationEvent(kind, group.name, group.layer, group.serial, nbytes, offset, group.nbytes_aligned,
                                group.part, group.n_layers, self._step)
        for listener in self._listeners:
            listener(event)

    # ------------------------------------------------------------ statistics

    def resolve_timing(self, block: bool) -> None:
        """Add finished copy/wait timings to the counters of the step they belong to.

        Non-blocking at a step start (the host keeps running ahead of the device);
        `stats()` blocks until the current step's events are done.
        """
        self._timings.resolve(block)

    def _timed_start(self, stream):
        return self._timings.start(stream) if self.timing else None

    def _timed_end(self, kind, start, stream) -> None:
        if start is not None:
            self._timings.end(self.counters, kind, start, stream)

    def stats(self) -> dict:
        """Counters of the current (or just finished) step; waits for its timing events."""
        self.resolve_timing(block=True)
        c = dict(self.counters)
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

    def capture(self, *params):
        """Context: saved tensors in it are hooked; the tensors of `params` (modules, whose
        parameters and buffers count, or iterables of tensors) are never offloaded."""
        return _Capture(self, params)

    def _start_step_after_backward(self) -> None:
        if self.backward_seen:  # a new step
            self.resolve_timing(block=False)
            self._step += 1
            self.counters = new_counters()
            self.backward_seen = False

    def pass_through_step(self) -> None:
        """A training forward run without hooks (auto mode offloading nothing) is a step of its own.

        Its backward unpacks nothing here, so the step is counted as ended at once: the next
        forward, hooked or not, starts a new one (counters of zero for this one).
        """
        self._start_step_after_backward()
        self.backward_seen = True

    def _enter(self, params) -> None:
        if self.capturing == 0:
            self._start_step_after_backward()
            self._poll()
            self._table.clear()
            self._param_pending = list(params)
            self._table.params_pending = bool(self._param_pending)
            walked, self._walked = self._walked, 0
            if self._table.params_needed:  # the last forward needed the walk: make it here (Note [parameter walk])
                self._walk_params(count=walked)
            self._table.params_needed = False
            self._last_offloaded = None
            self._due = []
            self._layer_groups = {}
            self._tail = None
            self._hooks_base = top_pack_hook()
            self._hooks_on = True
        self.capturing += 1
        self._hooks.__enter__()

    def _exit(self) -> None:
        if self.capturing > 1 or self._hooks_on:
            self._hooks.__exit__(None, None, None)
        if self.capturing == 1:
            self._hooks_on = False
        self.capturing -= 1
        if self.capturing == 0:
            self.boundary(None)
            self._table.clear()
            self._param_pending = []
            self._table.params_pending = False

    # Opaque to dynamo: inside a compiled layer these run eagerly at a graph break, so the
    # copies, events and pool stay out of the traced graph.
    @not_traced
    def add_params(self, params) -> None:
        """Storages of `params` stay on the device (FSDP2 unsharded parameters of a layer).

        Read when a saved tensor first needs them (normally inside the layer, while FSDP2's
        unsharded parameters exist): `params` is a module (its parameters and buffers and its
        submodules') or an iterable of tensors, which may be lazy.
        """
        self._param_pending.append(params)
        self._table.params_pending = True

    @not_traced
    def boundary(self, name=None, offload: bool = True, layer=None, params=None) -> None:
        """Close the current group; when `name` is given open a new one (kept if not `offload`).

        A kept group exists only while auto mode measures (its tensors stay on the device and
        are counted); otherwise tensors saved outside an offloaded group pass straight through.
        `params`: as `add_params(params)` after the boundary (the layer's own parameters), in
        the same call: a layer's Python calls are host time of every step.
        """
        if self._native_cycle:  # the core's twin of this method (csrc/python/group_cycle.h)
            self._table.boundary(name, offload, layer)
        else:
            self._boundary(name, offload, layer)
        if params is not None:
            self._param_pending.append(params)
            self._table.params_pending = True

    def _boundary(self, name, offload: bool, layer) -> None:
        """`boundary` in Python: without the core, and where the core's cycle does not run."""
        group = self.open_group
        schedule = self.schedule
        if (name is not None and offload and layer is not None and group is not None and group.layer is not None
                and group.state == OPEN and group.capped < self.min_group_bytes and schedule is None
                and self.observer is None and self.capturing):
            # A small layer's group goes on through this layer (fewer, larger copies); auto mode
            # plans and measures layer by layer, so its groups stay one a layer.
            group.n_layers += 1
            self._layer_groups[layer] = [self._last_offloaded]
            return
        self.open_group = None
        if group is not None:
            self._close(group)
        if schedule is not None and layer is not None:
            self._release_due(layer)  # the point: layer `layer` opens (n: the last layer ended)
        if name is None and layer is not None and (
                self.observer is not None or (schedule is not None and schedule.tail_save is not None)):
            self._tail = 0  # the last layer ended: count the tensors saved after it
        if name is None or not self.capturing:
            self._hooks_follow_groups()
            return
        observer = self.observer
        if offload or observer is not None:
            first = self._last_offloaded is None
            group = self._group_class(name, layer, offload, self._last_offloaded)
            if offload:
                self._last_offloaded = weakref.ref(group)
                if layer is not None:
                    self._layer_groups[layer] = [self._last_offloaded]
                    if schedule is not None:
                        if layer < len(schedule.caps):
                            group.auto = AutoState()
                            group.auto.cap = schedule.caps[layer]
                            group.split = schedule.split_at.get(layer)
                    elif first and self.mode == "async":
                        group.split = self._first_layer_parts(layer)
            if observer is not None:
                observer.opened(group)
                group.auto = AutoState()
                group.auto.span_ends = []
                size = self._layer_sizes.get(layer)
                if size is not None and size[0] > 0:
                    group.auto.profile = [size[0] * k // PROFILE_POINTS for k in range(1, PROFILE_POINTS)]
            self.open_group = group  # last: the core's table reads its auto state and parts here
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
        if not self.hooks_in_groups_only or self.capturing != 1:
            return
        want = self.open_group is not None or self._tail is not None
        if want == self._hooks_on:
            return
        top = top_pack_hook()
        if want and top is self._hooks_base:
            self._hooks.__enter__()
            self._hooks_on = True
        elif not want and top is self._hooks.pack_hook:
            self._hooks.__exit__(None, None, None)
            self._hooks_on = False

    def _close(self, group: Group) -> None:
        if self._native_cycle:  # the core's twin of this method (csrc/python/group_cycle.h)
            self._table.close_group(group)
            return
        if group.layer is not None and group.state == OPEN:
            self._layer_sizes[group.layer] = (group.capped, group.new_spans)  # its last part's: the layer's
        spans = group.seal()  # each span's start, version (a later save shares the copy only at it), bytes
        if self.observer is not None:
            self.observer.closed(group)
        if group.state == KEPT:
            group.drop_spans()
            return
        if not spans:
            self._mark_copied(group)
            return
        if self.verify:  # summed on this stream, which the copy out waits for (Note [verify])
            group.checksums = GroupChecksums(group)
        with _device.nvtx_range(f"offload.d2h {group.name}") if self.nvtx else contextlib.nullcontext():
            # One call for the group's spans, into one pooled host block at aligned offsets (one
            # pool request per layer, the same size every step) that the core acquires and times
            # itself: no tensor per span, and no Python event or stream object per group (a
            # launch-bound step pays for each on the host).
            try:
                group.d2h = CopyHandle(group.copy_out(self._copy_pool, self._copy_streams()[0], DEFAULT_CHUNK_BYTES,
                                                      self.timing))
            except torch.OutOfMemoryError as exc:
                self._keep_on_device(group, exc)
                return
        if self.timing:
            self._timings.copy(self.counters, "d2h_seconds", group.d2h.copy_timer())
        group.state = COPYING
        c = self.counters
        c["d2h_bytes"] += group.d2h.nbytes
        c["groups_offloaded"] += 1
        c["layers_offloaded"] += group.n_layers
        c["tensors_offloaded"] += group.n_handles
        if self._listeners:
            self._emit(CLOSED, group, group.nbytes)
        if self.mode == "sync":
            t0 = time.perf_counter()
            group.d2h.synchronize()
            c["forward_wait_seconds"] += time.perf_counter() - t0
            self._mark_copied(group)
            return
        self._inflight.append(weakref.ref(group))
        if self.observer is None:
            # Not while auto mode measures: the budget model reads that step's memory where the
            # window lets groups go (Note [memory beside the activations] in auto/budget.py), and
            # what the host sees done depends on how far it runs ahead of the device.
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
        self._keep_window(group.layer, stream)

    def _keep_window(self, layer, stream) -> None:
        """The window (Note [resident window]): the group now opening plus those still copying
        may not exceed it; `layer` (the group just closed) and `stream` (its stream) as `_close`
        has them."""
        c = self.counters
        while len(self._inflight) > self.resident_groups - 1:
            oldest = self._inflight.popleft()()
            if oldest is None or oldest.state != COPYING:
                continue
            begun = self.observer.wait_begins() if self.observer is not None else None
            if oldest.saved_on(stream):
                # A full window makes the compute stream wait on the device, not the host: the
                # host goes on queueing kernels while the copy finishes (a host wait here would
                # leave the device idle in launch-bound steps). The oldest group's tensors were saved
                # on this stream, so the core lets go of them at once: the allocator reuses
                # their memory only for work queued on this stream after the wait.
                start = self._timed_start(stream)
                oldest.d2h.release_sources(stream)
                self._timed_end("forward_wait_seconds", start, stream)
            else:  # saved on another stream than the one running now: only the host can order it
                t0 = time.perf_counter()
                oldest.d2h.synchronize()
                c["forward_wait_seconds"] += time.perf_counter() - t0
            if begun is not None:
                self.observer.wait_ended(layer, begun, backward=False)
            self._mark_copied(oldest)

    def _copy_streams(self) -> tuple:
        """(device-to-host, host-to-device) copy streams of the engine's device, (None, None) on the host."""
        if self._streams is None:
            self._streams = _device.copy_streams(self.device) if self.on_accel else (None, None)
        return self._streams

    def _copy_back(self, source, out: list) -> CopyHandle:
        """One copy back to the device into `out` (a group's restored block, or a piece of it) from
        `source` (its copy out's handle, or a piece of its host block). On the native path through
        the core directly: the engine's own arguments need none of `copy_to_device`'s checks, host
        time a launch-bound step pays per group."""
        if not self._native:
            return copy_to_device(source, self.device, out=out, pool=self.pool, timing=self.timing)
        handle = source._impl if isinstance(source, CopyHandle) else None
        return CopyHandle(self._core.copy_to_device(None if handle is not None else source, handle, self.device,
                                                    self._copy_pool, self._copy_streams()[1], out, True,
                                                    DEFAULT_SMALL_BYTES, DEFAULT_CHUNK_BYTES, self.timing))

    def _keep_on_device(self, group: Group, exc: BaseException) -> None:
        """The pool is at its limit: `group` stays on the device (Note [pool full])."""
        group.state = KEPT
        group.drop_spans()
        if not self._warned_pool_full:
            self._warned_pool_full = True
            warnings.warn(
                f"offload: the host pool cannot take the {group.nbytes_aligned} bytes saved by {group.name!r} "
                f"({exc}); those activations stay on the device, and so does any later group that does not "
                "fit. Raise the pool's limit_bytes (or OFFLOAD_HOST_POOL_LIMIT) to offload them",
                stacklevel=2)

    def _poll(self) -> None:
        """Mark copied, oldest first, the groups whose copies are complete (never blocks).

        The deque holds weak references: a group whose graph was dropped frees itself.
        """
        while self._inflight:
            group = self._inflight[0]()
            if group is not None and group.state == COPYING and not group.d2h.ready():
                return
            self._inflight.popleft()
            if group is not None and group.state == COPYING:
                self._mark_copied(group)

    def _release_due(self, point: int) -> None:
        """Let go of the groups whose planned release point has come (Note [planned release points]).

        The compute stream waits on the device for each one's copy, planned to be complete by
        now, and its device tensors go back to the allocator in stream order, as the window
        does; the host is never blocked. A group saved on another stream is left to `_poll`.
        """
        if self._native_cycle:  # the core's twin of this method (csrc/python/group_cycle.h)
            self._table.release_due(point)
            return
        if all(at > point for at, _ in self._due):  # most points release nothing: no stream read
            return
        stream = _device.current_stream(self.device) if self.on_accel else None
        kind = "forward_wait_seconds" if point < self.schedule.n + 1 else "backward_wait_seconds"
        pending = []
        for at, ref in self._due:
            group = ref()
            if group is None or group.state != COPYING:
                continue
            if at > point:
                pending.append((at, ref))
            elif group.saved_on(stream):
                start = self._timed_start(stream)
                group.d2h.release_sources(stream)
                self._timed_end(kind, start, stream)
                self._mark_copied(group)
            elif group.d2h.ready():
                self._mark_copied(group)
        self._due = pending

    def _mark_copied(self, group: Group) -> None:
        """The D2H copy is complete (or will be before any reader): drop the device tensors."""
        group.drop_held()
        group.drop_spans()
        group.state = HOST
        if self._listeners and group.d2h is not None:
            self._emit(RELEASED, group, group.nbytes)

    def pack(self, t: torch.Tensor):
        """The pack hook without the core, and the core's where no group is open (the core's
        `pack_saved_tensor` makes the same tests in C)."""
        # Cheapest tests first: most saved tensors of a step are parameters (a subclass) or
        # below the size threshold, and leave after two attribute reads.
        group = self.open_group
        if group is None or type(t) is not torch.Tensor:  # parameters, DTensors, other subclasses
            if group is None and self._tail is not None:
                self._saved_after_layers()
            return self._keep(t)
        extent = offload_extent(t, self.min_tensor_bytes, self.device)
        if extent is None:
            return self._keep(t)
        return self._table.pack_extent(self, t, *extent)

    def _walk_params(self, ptr: Optional[int] = None, count: Optional[int] = None) -> None:
        """Add the storages of the pending iterables of tensors to the table's storages that stay,
        in the order given, until the storage at `ptr` is among them, or `count` of them are
        walked (both None: all of them; Note [parameter walk])."""
        pending = self._param_pending
        walked = 0
        while pending and (count is None or walked < count):
            params = pending.pop(0)
            walked += 1
            if isinstance(params, torch.nn.Module):
                self._table.add_module_params(params)
            else:
                self._table.add_params(params)
            if ptr is not None and self._table.holds_param(ptr):
                break
        self._walked += walked
        self._table.params_pending = bool(pending)

    def _profiled(self, group: Group) -> None:
        """Auto mode measuring: the layer has saved the next share of its bytes (see `AutoState.profile`)."""
        profile = group.auto.profile
        while profile and group.capped >= profile[0]:
            profile.pop(0)
        self.observer.saved_bytes(group)

    def _split(self, group: Group) -> None:
        """Copy out what the layer saved so far and go on in a new group of it (Note [layer parts]).

        The copy runs while the layer goes on, and the group is let go at its own point; a
        later view of a storage copied here shares that copy if it lies in it unchanged,
        else the new group copies its bytes again.
        """
        part = self._group_class(group.name, group.layer, True, self._last_offloaded)
        part.capped, part.split, part.continued = group.capped, group.split, True
        if group.auto is not None:
            part.auto = AutoState()
            part.auto.cap = group.auto.cap
        part.new_spans, part.n_layers = group.new_spans, 0
        # One span may pass several part ends: this group ends the last of them (its copy is
        # planned complete by that part's point, not an earlier one).
        ends = group.split
        index = group.part
        while index < len(ends) and group.capped >= ends[index]:
            index += 1
        group.part, part.part = index - 1, index
        self.open_group = part
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
        self.counters["tensors_kept"] += 1
        return (t, t._version)

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
