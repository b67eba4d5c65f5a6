"""The activation engine: saved-tensor hooks that group what autograd saves, copy each group
to pinned host memory while the next layer computes, and bring it back ahead of backward.

The data path, top to bottom: the user API (api.py; layers.py finds and wraps the layers)
-> `ActivationEngine` (the engine's state, its captures, the pack hook, statistics and
events; its forward side, forward.py: groups opened and closed, the resident window or auto
mode's release points; its backward side, backward.py: unpack, fetch back, release) ->
`copy_spans_to_host` / `copy_to_device` (one batched copy per group) -> `HostPool` (pinned
blocks, reused across steps). The notes below give the reasons for all three.
"""

from __future__ import annotations

import collections
import functools
from typing import Optional

import torch

from ..core import _backend, _device
from ..core.copy import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES, CopyHandle, copy_to_device
from ..core.checks import check_bool, check_int
from ..core.pool import HostPool, check_pool, default_host_pool
from .groups import ActivationEvent, Group, group_class
from .backward import BackwardSide
from .forward import ForwardSide
from .pack_table import PackTable
from .saved_tensors import make_not_traced, not_traced, offload_extent, top_pack_hook
from .step_stats import StepTimings, new_counters


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
# Note [parameter walk]: which storages are parameters, buffers or the forward's inputs is read by
# walking the model's tensors each forward (FSDP's parameters change storage between steps),
# O(parameters) of host time. It is read only when a saved tensor may share such a storage (one no
# recorded op made, see pack_table.py's `pack_extent`): a forward without one never walks. A view
# of a parameter, trainable or frozen (a weight's transpose, which a matmul saves), is known
# without it by its base (`offload_extent`): a frozen model under LoRA walks no more than a
# trainable one. A storage this forward saved already (a mask every layer saves) was walked for at
# its first save and is not again. The walk goes in the order given, the forward's inputs before
# the model, and stops where the tensor's storage is found: a model whose only such tensor is its
# input (no buffers or detached weights saved) never walks its parameters. A forward that needed
# it has the next one walk as many of the iterables as its capture begins, before the model's own
# host work. There the host is ahead of the device, or about to wait for it: a Hugging Face model
# reads its attention mask on the host before the first layer, so the host reaches the first layer
# with no lead over the device, and a walk made there, at the first saved tensor that needs it,
# delays the device by its whole time. A layer's own parameters (FSDP's unsharded ones exist only
# inside the layer) are still read there.
#
# Note [shared constants]: a tensor that no recorded op made and that the model builds once per
# forward and passes to every layer (an attention mask materialized for padding, rotary cos and
# sin) is saved by every layer. The first group to save it copies it. A later group shares that
# copy while it is still queued, as any view does, and otherwise keeps the tensor on the device
# instead of copying the same bytes again: keeping it costs its bytes once, until the backward of
# the last layer that saves it (the kept last layer holds it to the step's peak anyway); a copy
# per layer would move (layers - 1) times its bytes each way, and restore a device copy of it per
# layer in backward. An op's output saved by two groups is still copied by each: that is a layer's
# activation, which the later copy frees.
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
    `_release(group)` (`_profiled` and `_split` are the forward side's methods, `unpack` and
    the last four the backward side's, set on the engine when it is made),
    `observer.unpacked(group)`; and read `counters["tensors_kept"]` (incremented for a tensor
    that stays), `backward_seen`, `observer`. The core's cycle of a group (group_cycle.h)
    calls `_copy_streams()`, `_keep_on_device(group, exc)`, `_hooks_follow_groups()` and
    `_fetch_group(group, upto)` (where the cycle is not native: a measured step's fetches),
    reads `schedule`, `_due` and the engine's group bookkeeping, and adds to `counters` (its
    timings go to the core's StepTimings, `_timings`). Every name the core reads or calls is
    listed in csrc/python/engine_interface.h.
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
        # The forward and backward sides (forward.py, backward.py), collaborators; the hooks and the
        # core call their methods through the engine's attributes below (Note [engine interface]).
        self.forward = ForwardSide(self)
        self._split = self.forward.split
        self._profiled = self.forward.profiled
        self._keep_on_device = self.forward.keep_on_device
        self._hooks_follow_groups = self.forward.hooks_follow_groups
        self._saved_after_layers = self.forward.saved_after_layers
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
            self._fetch_native = self._table.fetch_group  # the core's fetch of a group or piece (group_cycle.h)
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
            self.forward.poll()
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
            self.forward.boundary(name, offload, layer)
        if params is not None:
            self._param_pending.append(params)
            self._table.params_pending = True

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
