"""The forward side of the activation engine: groups opened and closed at layer boundaries, their
copies out, the resident window and auto mode's release points.

`ForwardSide` is a collaborator of `ActivationEngine` (engine.py), given the engine it serves,
as backward.py's `BackwardSide` is; engine.py's notes (Note [groups], Note [one copy per group],
Note [resident window], Note [layer parts], Note [pool full], Note [hooks in groups only]) give
the reasons for what is done here. With the core, a plain configuration's cycle runs in its
twin instead (csrc/python/group_cycle.h): each method says where it hands over.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref

import torch

from ..core import _device
from ..core.copy import DEFAULT_CHUNK_BYTES, CopyHandle
from .groups import CLOSED, COPYING, HOST, KEPT, OPEN, RELEASED, AutoState, Group
from .saved_tensors import top_pack_hook
from .verify import GroupChecksums

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


class ForwardSide:
    """The activation engine's forward cycle in Python: boundaries, closes, the window, releases.

    A collaborator of `ActivationEngine` (engine.py), which makes it and holds it as `forward`;
    it reads and sets the engine's state through `self.engine` (the open group, the forward's
    group bookkeeping, the counters, the schedule and observer of auto mode), because the
    core's twin reads the same state there (Note [engine interface]). The engine hands the
    hooks and the core the methods they call (`split`, `profiled`, `keep_on_device`,
    `hooks_follow_groups`, `saved_after_layers`) as its own attributes.
    """

    def __init__(self, engine):
        self.engine = engine  # a cycle the collector sees (engine.forward holds this)
        self._warned_pool_full = False  # Note [pool full]: one warning per engine

    def boundary(self, name, offload: bool, layer) -> None:
        """The engine's `boundary` in Python: without the core, and where the core's cycle does not run."""
        engine = self.engine
        group = engine.open_group
        schedule = engine.schedule
        if (name is not None and offload and layer is not None and group is not None and group.layer is not None
                and group.state == OPEN and group.capped < engine.min_group_bytes and schedule is None
                and engine.observer is None and engine.capturing):
            # A small layer's group goes on through this layer (fewer, larger copies); auto mode
            # plans and measures layer by layer, so its groups stay one a layer.
            group.n_layers += 1
            engine._layer_groups[layer] = [engine._last_offloaded]
            return
        engine.open_group = None
        if group is not None:
            self.close(group)
        if schedule is not None and layer is not None:
            self.release_due(layer)  # the point: layer `layer` opens (n: the last layer ended)
        if name is None and layer is not None and (
                engine.observer is not None or (schedule is not None and schedule.tail_save is not None)):
            engine._tail = 0  # the last layer ended: count the tensors saved after it
        if name is not None and engine.capturing and (offload or engine.observer is not None):
            # Set last: the core's table reads the group's auto state and parts here.
            engine.open_group = self._open(name, offload, layer)
        self.hooks_follow_groups()

    def _open(self, name, offload: bool, layer) -> Group:
        """The group `boundary` opens: offloaded, or kept and measured while auto mode measures."""
        engine = self.engine
        schedule = engine.schedule
        first = engine._last_offloaded is None
        group = engine._group_class(name, layer, offload, engine._last_offloaded)
        if offload:
            engine._last_offloaded = weakref.ref(group)
            if layer is not None:
                engine._layer_groups[layer] = [engine._last_offloaded]
                if schedule is not None:
                    if layer < len(schedule.caps):
                        group.auto = AutoState()
                        group.auto.cap = schedule.caps[layer]
                        group.split = schedule.split_at.get(layer)
                elif first and engine.mode == "async":
                    group.split = self.first_layer_parts(layer)
        if engine.observer is not None:
            engine.observer.opened(group)
            group.auto = AutoState()
            group.auto.span_ends = []
            size = engine._layer_sizes.get(layer)
            if size is not None and size[0] > 0:
                group.auto.profile = [size[0] * k // PROFILE_POINTS for k in range(1, PROFILE_POINTS)]
        return group

    def first_layer_parts(self, layer: int):
        """Async mode: the part ends (bytes of new spans) of the forward's first offloaded layer.

        Its copy would start only when it ends, with the device-to-host stream idle through
        its forward, and in backward it comes back last, the whole layer's copy before its
        backward can start while the stream then idles. In parts (a quarter of the bytes it
        saved in its last forward each), the first copy starts a quarter into the layer, and
        backward starts on the layer's last part while the others are still coming back.
        A layer that saved fewer spans than parts (a checkpoint's input), or whose parts would
        be smaller than `min_group_bytes`, is not split.
        """
        size = self.engine._layer_sizes.get(layer)
        if size is None or size[1] < SPLIT_PARTS or size[0] < SPLIT_PARTS * self.engine.min_group_bytes:
            return None
        return [size[0] * k // SPLIT_PARTS for k in range(1, SPLIT_PARTS)]

    def hooks_follow_groups(self) -> None:
        """With `hooks_in_groups_only`: hooks on while a group is open or tensors saved after
        the last layer are counted, off otherwise; switched at boundaries of the outermost
        capture only, and only where the stack's top is what the switch expects (ours to pop,
        the top it had before the capture to push back on). A boundary inside another hooks
        scope (a checkpoint wrapping the layer's call) switches nothing: that scope's exit
        pops the top of the stack, which must still be its own."""
        engine = self.engine
        if not engine.hooks_in_groups_only or engine.capturing != 1:
            return
        want = engine.open_group is not None or engine._tail is not None
        if want == engine._hooks_on:
            return
        top = top_pack_hook()
        if want and top is engine._hooks_base:
            engine._hooks.__enter__()
            engine._hooks_on = True
        elif not want and top is engine._hooks.pack_hook:
            engine._hooks.__exit__(None, None, None)
            engine._hooks_on = False

    def close(self, group: Group) -> None:
        """Seal `group` and issue its copy out (Note [one copy per group]); then the window, or
        auto mode's release point, says when its device tensors go."""
        engine = self.engine
        if engine._native_cycle:  # the core's twin of this method (csrc/python/group_cycle.h)
            engine._table.close_group(group)
            return
        if group.layer is not None and group.state == OPEN:
            engine._layer_sizes[group.layer] = (group.capped, group.new_spans)  # its last part's: the layer's
        spans = group.seal()  # each span's start, version (a later save shares the copy only at it), bytes
        if engine.observer is not None:
            engine.observer.closed(group)
        if group.state == KEPT:
            group.drop_spans()
            return
        if not spans:
            self.mark_copied(group)
            return
        if not self._copy_out(group):
            return
        if engine.mode == "sync":
            t0 = time.perf_counter()
            group.d2h.synchronize()
            engine.counters["forward_wait_seconds"] += time.perf_counter() - t0
            self.mark_copied(group)
            return
        engine._inflight.append(weakref.ref(group))
        if engine.observer is None:
            # Not while auto mode measures: the budget model reads that step's memory where the
            # window lets groups go (Note [memory beside the activations] in auto/budget.py), and
            # what the host sees done depends on how far it runs ahead of the device.
            self.poll()
        stream = group.stream = _device.current_stream(engine.device) if engine.on_accel else None
        if engine.schedule is not None:
            # Auto mode: the plan says at which point the copy is complete; no window.
            at = engine.schedule.release_at.get(group.layer)
            if isinstance(at, list):  # a point per part
                at = at[min(group.part, len(at) - 1)]
            if at is not None:
                engine._due.append((at, weakref.ref(group)))
            return
        self.keep_window(group.layer, stream)

    def _copy_out(self, group: Group) -> bool:
        """Issue `group`'s copy out and count it; False where the pool could not take it (the
        group stays on the device, Note [pool full])."""
        engine = self.engine
        if engine.verify:  # summed on this stream, which the copy out waits for (Note [verify])
            group.checksums = GroupChecksums(group)
        with _device.nvtx_range(f"offload.d2h {group.name}") if engine.nvtx else contextlib.nullcontext():
            # One call for the group's spans, into one pooled host block at aligned offsets (one
            # pool request per layer, the same size every step) that the core acquires and times
            # itself: no tensor per span, and no Python event or stream object per group (a
            # launch-bound step pays for each on the host).
            try:
                group.d2h = CopyHandle(group.copy_out(engine._copy_pool, engine._copy_streams()[0],
                                                      DEFAULT_CHUNK_BYTES, engine.timing))
            except torch.OutOfMemoryError as exc:
                self.keep_on_device(group, exc)
                return False
        if engine.timing:
            engine._timings.copy(engine.counters, "d2h_seconds", group.d2h.copy_timer())
        group.state = COPYING
        c = engine.counters
        c["d2h_bytes"] += group.d2h.nbytes
        c["groups_offloaded"] += 1
        c["layers_offloaded"] += group.n_layers
        c["tensors_offloaded"] += group.n_handles
        if engine._listeners:
            engine._emit(CLOSED, group, group.nbytes)
        return True

    def keep_window(self, layer, stream) -> None:
        """The window (Note [resident window]): the group now opening plus those still copying
        may not exceed it; `layer` (the group just closed) and `stream` (its stream) as `close`
        has them."""
        engine = self.engine
        inflight = engine._inflight
        while len(inflight) > engine.resident_groups - 1:
            oldest = inflight.popleft()()
            if oldest is None or oldest.state != COPYING:
                continue
            begun = engine.observer.wait_begins() if engine.observer is not None else None
            if oldest.saved_on(stream):
                # A full window makes the compute stream wait on the device, not the host: the
                # host goes on queueing kernels while the copy finishes (a host wait here would
                # leave the device idle in launch-bound steps). The oldest group's tensors were saved
                # on this stream, so the core lets go of them at once: the allocator reuses
                # their memory only for work queued on this stream after the wait.
                start = engine._timed_start(stream)
                oldest.d2h.release_sources(stream)
                engine._timed_end("forward_wait_seconds", start, stream)
            else:  # saved on another stream than the one running now: only the host can order it
                t0 = time.perf_counter()
                oldest.d2h.synchronize()
                engine.counters["forward_wait_seconds"] += time.perf_counter() - t0
            if begun is not None:
                engine.observer.wait_ended(layer, begun, backward=False)
            self.mark_copied(oldest)

    def keep_on_device(self, group: Group, exc: BaseException) -> None:
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

    def poll(self) -> None:
        """Mark copied, oldest first, the groups whose copies are complete (never blocks).

        The deque holds weak references: a group whose graph was dropped frees itself.
        """
        inflight = self.engine._inflight
        while inflight:
            group = inflight[0]()
            if group is not None and group.state == COPYING and not group.d2h.ready():
                return
            inflight.popleft()
            if group is not None and group.state == COPYING:
                self.mark_copied(group)

    def release_due(self, point: int) -> None:
        """Let go of the groups whose planned release point has come (Note [planned release points]).

        The compute stream waits on the device for each one's copy, planned to be complete by
        now, and its device tensors go back to the allocator in stream order, as the window
        does; the host is never blocked. A group saved on another stream is left to `poll`.
        """
        engine = self.engine
        if engine._native_cycle:  # the core's twin of this method (csrc/python/group_cycle.h)
            engine._table.release_due(point)
            return
        if all(at > point for at, _ in engine._due):  # most points release nothing: no stream read
            return
        stream = _device.current_stream(engine.device) if engine.on_accel else None
        kind = "forward_wait_seconds" if point < engine.schedule.n + 1 else "backward_wait_seconds"
        pending = []
        for at, ref in engine._due:
            group = ref()
            if group is None or group.state != COPYING:
                continue
            if at > point:
                pending.append((at, ref))
            elif group.saved_on(stream):
                start = engine._timed_start(stream)
                group.d2h.release_sources(stream)
                engine._timed_end(kind, start, stream)
                self.mark_copied(group)
            elif group.d2h.ready():
                self.mark_copied(group)
        engine._due = pending

    def mark_copied(self, group: Group) -> None:
        """The D2H copy is complete (or will be before any reader): drop the device tensors."""
        group.drop_held()
        group.drop_spans()
        group.state = HOST
        if self.engine._listeners and group.d2h is not None:
            self.engine._emit(RELEASED, group, group.nbytes)

    def profiled(self, group: Group) -> None:
        """Auto mode measuring: the layer has saved the next share of its bytes (see `AutoState.profile`)."""
        profile = group.auto.profile
        while profile and group.capped >= profile[0]:
            profile.pop(0)
        self.engine.observer.saved_bytes(group)

    def split(self, group: Group) -> None:
        """Copy out what the layer saved so far and go on in a new group of it (Note [layer parts]).

        The copy runs while the layer goes on, and the group is let go at its own point; a
        later view of a storage copied here shares that copy if it lies in it unchanged,
        else the new group copies its bytes again.
        """
        engine = self.engine
        part = engine._group_class(group.name, group.layer, True, engine._last_offloaded)
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
        engine.open_group = part
        engine._last_offloaded = weakref.ref(part)
        engine._layer_groups[group.layer].append(engine._last_offloaded)
        self.close(group)

    def saved_after_layers(self) -> None:
        """A tensor is saved after the last layer: a point auto mode measures, and may release at."""
        engine = self.engine
        engine._tail += 1
        if engine.observer is not None:
            engine.observer.saved_after_layers(engine._tail)
        schedule = engine.schedule
        if schedule is not None and engine._tail == schedule.tail_save:
            self.release_due(schedule.n + TAIL_POINT)
