"""The backward side of the activation engine: unpack, fetch back, restore views, release.

`BackwardSide` is a collaborator of `ActivationEngine` (engine.py), given the engine it serves;
engine.py's notes (Note [backward], Note [storages and views]) give the reasons for what is
done here.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from typing import Optional

import torch

from ..core import _device
from .groups import (COPYING, FETCHED, KEPT, OPEN, RESTORED, SPAN_ALIGN, Group, Packed, on_host_only,
                     with_earlier_parts)
from .saved_tensors import describe, first_grad_tensor, modified_error, not_traced, when_gradient_of


# Note [after FSDP2's hook]: FSDP2 hooks the gradient of each unit's output too, and there
# unshards the unit for its backward: it copies the all-gathered parameters out on the compute
# stream, with a small host-to-device copy of their sizes among them. Host-to-device copies
# run in the order they reach the device's copy engine, whatever stream queued them, so a copy
# back queued before that small copy holds the compute stream up until the whole copy back is
# done. FSDP2 registers its hook after the layer's forward returns, later than the engine can,
# so the engine's fetch runs as a pre-hook of the gradient's node, after every tensor hook: the
# small copy goes first; and no layer start queues more copies back than the bus moves in that
# layer's backward (Note [fetch in pieces] in auto/schedule.py), so none is left to delay the next
# layer's small copy.


class BackwardSide:
    """The activation engine's backward: its unpack hook, the fetches back and the releases.

    A collaborator of `ActivationEngine` (engine.py), which makes it and holds it as `backward`;
    it reads the engine's state through `self.engine` (the step's counters, the schedule and
    observer of auto mode, the forward's groups, the window, the events) and calls back the
    engine's copy primitives (`_copy_back`, `_fetch_native`) and the forward side's release
    (`forward.mark_copied`, `forward.release_due`, forward.py). The engine hands the hooks its
    methods (Note [engine interface]).
    """

    def __init__(self, engine):
        self.engine = engine  # a cycle the collector sees (engine.backward holds this)
        self._ref = weakref.ref(self)  # what the hooks on gradients hold (no cycle through the graph)

    def starts(self) -> None:
        """The step's backward starts: at the model output's gradient (`mark_backward_start`),
        or at the step's first unpack, whichever comes first."""
        engine = self.engine
        engine.backward_seen = True  # the next capture starts a new step
        engine._tail = None
        if engine.observer is not None:
            engine.observer.backward_started()
        if engine.schedule is not None:
            self.start_scheduled()
        elif engine.mode != "sync":
            self.prefetch_at_start()

    @not_traced
    def mark_backward_start(self, output) -> None:
        """Start the step's backward when the gradient of `output` (the model's output) is
        computed: with hooks only in offloaded spans, nothing of the kept last layer or the
        head is unpacked here to mark it, and the first group's copy back would wait for
        backward to reach that group."""
        self.on_gradient(output, _start_backward)  # else marked at the first unpack

    def on_gradient(self, output, call, native_call=None) -> None:
        """call(self) when backward computes the gradient of the first tensor in `output` that needs
        one: with the core, by a pre-hook of its node in C++ (no Python hook handle per step),
        which calls `native_call()` instead where given (a callable of the core's: no
        interpreter frame at all)."""
        engine = self.engine
        if engine._native:
            anchor = first_grad_tensor(output)
            if anchor is None or engine._table.call_on_gradient(
                    anchor, native_call if native_call is not None else functools.partial(_call_with, self._ref, call)):
                return
            output = anchor  # a leaf: hooked in Python below
        when_gradient_of(output, self, call)

    def unpack(self, packed):
        """The unpack hook without the core, and the core's for what it does not serve (the step's
        first unpack of a kept tensor, a kept tensor modified in place): the core's
        `unpack_saved_tensor` serves offloaded tensors the same way in C."""
        engine = self.engine
        if not engine.backward_seen:  # the step's first unpack: its backward starts
            self.starts()
        if type(packed) is tuple:
            t, version = packed
            if t._version != version:
                raise modified_error(describe(t), version, t._version)
            return t
        group = packed.group
        if engine.observer is not None and group.n_unpacked == 0:
            engine.observer.unpacked(group)
        if group.held is not None:  # still on the device (copy in flight, or kept)
            t, version = group.held[packed.slot]
            if t._version != version:
                raise modified_error(describe(t), version, t._version)
            result = t
        else:
            if group.modified and packed.slot in group.modified:
                raise modified_error(*group.modified[packed.slot])
            watch = group.watch[packed.slot]
            if watch is not None and watch[0]._version != watch[1]:
                desc = f"{str(packed.dtype).replace('torch.', '')} {list(packed.size)}"
                raise modified_error(desc, watch[1], watch[0]._version)
            result = self.restore(group, packed)
        if group.n_unpacked == 0:
            self.prefetch(group)
        group.n_unpacked += 1
        if group.n_unpacked >= group.n_handles and group.state != KEPT:
            self.release(group)
        return result

    def prefetch(self, group: Group) -> None:
        """Backward reached `group` (its first unpack): fetch the one before it."""
        engine = self.engine
        if engine.mode != "sync" and engine.schedule is None:  # else fetched at the points the schedule chose
            # The group before it, and if that is the last part of a layer copied in parts, its
            # earlier parts too, the last first: fetched one by one at each part's first unpack,
            # a part's copy would start only once backward is in the layer. (At a part's own
            # first unpack they were fetched already: nothing to do.)
            self.fetch_groups(with_earlier_parts(group.prev))

    def prefetch_at_start(self) -> None:
        """Fetch the first group backward will need from the host, as backward starts.

        Backward first runs what forward did after the last offloaded group (the kept last
        layer, the head, the loss) and then that group and those before it still copying,
        served from their held device tensors; prefetching only from a group's first unpack
        would leave the host-to-device stream idle through all of that. The fetch stays inside
        the window, counted in layers: it happens only while the layers held on the device and
        the layers it brings back are at most `resident_groups`. (Counted in groups, a group of
        several small layers, `min_group_bytes`, would count as one, and the start of backward,
        a step's peak, could hold every checkpoint input.) Otherwise the group comes back at
        the held group's first unpack, one group ahead as any other.
        """
        engine = self.engine
        group = engine._last_offloaded() if engine._last_offloaded is not None else None
        on_device = 0  # layers held on the device (a part of a layer counts as one)
        while group is not None and group.state == COPYING:  # held on the device
            on_device += max(group.n_layers, 1)
            group = group.prev() if group.prev is not None else None
        if (group is not None and on_device + max(group.n_layers, 1) <= engine.resident_groups
                and on_host_only(group)):
            self.fetch_groups(with_earlier_parts(weakref.ref(group)))

    def start_scheduled(self) -> None:
        """Backward starts (auto mode): release what the schedule lets go here, fetch what it fetches."""
        engine = self.engine
        schedule = engine.schedule
        engine.forward.release_due(schedule.n + 1)
        for refs, share in self.layer_fetches(schedule.fetch_at_start, schedule.shares_at(schedule.n + 1)):
            self.fetch_groups(refs, share)

    def groups_of(self, layers) -> list:
        """Weak references to the offloaded groups of `layers` in this forward, each layer's
        last part first: backward needs the tensors a layer saved last first."""
        engine = self.engine
        return [ref for layer in layers for ref in reversed(engine._layer_groups.get(layer, ()))]

    def layer_fetches(self, layers, shares: dict) -> list:
        """Per layer of `layers` with offloaded groups: (their weak references, the share of
        their bytes to fetch, or None for all)."""
        return [(refs, shares.get(layer)) for layer in layers for refs in [self.groups_of([layer])] if refs]

    def fetch_groups(self, refs, share: Optional[float] = None) -> None:
        """Fetch the groups (weak references, or None) that are on the host; with `share`, the
        groups of one layer up to that share of their bytes, in the order given (a piece,
        Note [fetch in pieces] in auto/schedule.py)."""
        engine = self.engine
        if engine._native:  # the core's twin of this method (csrc/python/group_cycle.h)
            engine._table.fetch_layers([(refs, share)])
            return
        groups = [g for g in (ref() if ref is not None else None for ref in refs) if g is not None]
        wanted = None if share is None else share * sum(g.nbytes_aligned for g in groups)
        for group in groups:
            upto = None if wanted is None or wanted >= group.nbytes_aligned else int(wanted)
            if wanted is not None:
                wanted = max(0.0, wanted - group.nbytes_aligned)
            if on_host_only(group) and upto != 0:
                self.fetch(group, upto)
                if group.fetched == group.nbytes_aligned:
                    engine.counters["groups_prefetched"] += 1

    @not_traced
    def fetch_when_backward_reaches(self, output, layers, shares=None) -> None:
        """Fetch the groups of `layers` when backward reaches `output` (a layer's output): a
        hook on its gradient, the first thing computed in that layer's backward. Layers that
        stay on the device save no tensor of the engine's, so nothing else marks that point.
        `shares`: layer -> the share of its bytes to fetch there, for layers fetched in pieces.
        The hook runs after the others on that gradient (Note [after FSDP2's hook])."""
        fetches = self.layer_fetches(layers, shares or {})
        if not fetches:  # each is fetched at its first unpack
            return

        def fetch(side):
            for refs, share in fetches:
                side.fetch_groups(refs, share)

        # With the core, its hook calls the core's fetch (fetch_groups' twin) directly.
        table = self.engine._table
        self.on_gradient(output, fetch, functools.partial(table.fetch_layers, fetches) if self.engine._native else None)

    def fetch(self, group: Group, upto: Optional[int] = None) -> None:
        """Copy the group's host block back, or its bytes up to `upto` (a piece, Note [fetch in
        pieces] in auto/schedule.py; None: all that is left)."""
        engine = self.engine
        if engine.native_cycle:
            engine._fetch_native(group, upto)  # the core's twin of this method (csrc/python/group_cycle.h)
            return
        end = group.nbytes_aligned if upto is None else min(group.nbytes_aligned, -(-upto // SPAN_ALIGN) * SPAN_ALIGN)
        if end <= group.fetched:
            return
        with _device.nvtx_range(f"offload.h2d {group.name}") if engine.nvtx else contextlib.nullcontext():
            if group.device_block is None:
                # One device block per group (allocated on the consumer stream, its owner) laid
                # out as the host block: DMAs of the block (the core would stage a group's
                # adjacent spans and scatter them with a kernel competing with backward for the
                # SMs), and each restored view keeps the original's 512-byte alignment.
                group.device_block = torch.empty(group.nbytes_aligned, dtype=torch.uint8, device=engine.device)
                group.fetch_stream = _device.current_stream(engine.device) if engine.on_accel else None
            if group.fetched == 0 and end == group.nbytes_aligned:
                # Copied from the D2H handle, the core makes the copy stream wait for that copy
                # too (a group let go at a release point was seen complete on the device only),
                # and times the copy after both waits.
                source, out = group.d2h, [group.device_block]
            else:
                if group.fetched == 0:  # the first piece: the copy stream waits for the copy out
                    if engine.on_accel:
                        group.d2h.wait_stream(engine._copy_streams()[1])
                    else:
                        group.d2h.synchronize()
                source = [group.d2h.tensors[0][group.fetched:end]]
                out = [group.device_block[group.fetched:end]]
            # Pieces queue on one copy stream in order: the last one done means all are.
            back = engine._copy_back(source, out)
            group.add_h2d(back)
        if engine.timing:
            engine._timings.copy(engine.counters, "h2d_seconds", back.copy_timer())
        start = group.fetched
        share = min(end, group.nbytes) - min(start, group.nbytes)  # of the group's bytes (not its padding)
        group.fetched = end
        engine.counters["h2d_bytes"] += share
        if end == group.nbytes_aligned:
            engine.counters["groups_fetched"] += 1
        if engine._listeners:
            engine._emit(FETCHED, group, end - start, start)

    def make_ready(self, group: Group) -> None:
        """Fetch what no planned point fetched of `group`, and make its reader on the current stream
        (the host, without one) wait for the copy back, once per stream and backward."""
        engine = self.engine
        if group.fetched < group.nbytes_aligned:
            self.fetch(group)
        stream = _device.current_stream(engine.device) if engine.on_accel else None
        if not group.ready_on(stream):
            begun = engine.observer.wait_begins() if engine.observer is not None else None
            if engine.mode == "sync" or not engine.on_accel:
                t0 = time.perf_counter()
                group.h2d_handles()[-1].synchronize()
                engine.counters["backward_wait_seconds"] += time.perf_counter() - t0
            else:
                start = engine._timed_start(stream)
                for h2d in group.h2d_handles():
                    if group.owns_block(stream):
                        # The block's owner waits for the copy: the core need not hold it until
                        # the host sees the copy done (else it would hold the last group fetched
                        # in a step until the next step's first copy).
                        h2d.release_sources(stream)
                    else:
                        h2d.wait_stream(stream)
                engine._timed_end("backward_wait_seconds", start, stream)
            if begun is not None:
                engine.observer.wait_ended(group.layer, begun, backward=True)
            if group.mark_ready(stream):  # the group's first read in this backward
                if group.checksums is not None:
                    group.checksums.check(group, group.device_block)  # Note [verify]
                if engine._listeners:
                    engine._emit(RESTORED, group, group.nbytes)

    def restore(self, group: Group, packed: Packed) -> torch.Tensor:
        """The Python path's view of `packed` in its group's restored block (the core's
        ActivationGroup.restored_view)."""
        self.make_ready(group)
        key = (packed.entry, packed.dtype, packed.size, packed.stride, packed.offset)
        view = group.views.get(key)
        if view is None:
            # One op per view: as_strided on the block viewed as the dtype (made once per dtype
            # per group), at the view's place in the block, its span's place plus its bytes past
            # the span's start. Whole elements: spans start on SPAN_ALIGN boundaries, which
            # every itemsize divides. (A slice of the span, a dtype view of it and as_strided
            # would be three ops per tensor, each host time in a launch-bound step.)
            dtype = packed.dtype
            typed = group.typed_blocks.get(dtype)
            if typed is None:
                typed = group.typed_blocks[dtype] = group.device_block.view(dtype)
            at = group.offsets[packed.entry] + packed.offset - group.span_starts[packed.entry]
            view = typed.as_strided(packed.size, packed.stride, at // dtype.itemsize)
            group.views[key] = view
        return view

    def let_sources_go(self, group: Group) -> None:
        """The copy engine's references to a copying group's sources go now, the copy stream
        protecting their memory until it has passed the copy (Note [served groups' sources])."""
        engine = self.engine
        if not engine.on_accel or not group.has_spans:
            return
        stream = engine._copy_streams()[0]  # the one the group's copy out ran on
        group.let_sources_go(stream)
        group.d2h.release_sources(stream)

    def release(self, group: Group) -> None:
        """Every handle of the group was unpacked: drop its device copies (the host copy stays)."""
        engine = self.engine
        if group.state in (OPEN,):
            return
        if group.holds_device_tensors and group.d2h is not None and not group.d2h.ready():
            # Served from the device, its copy not seen done (a query that finds it done also lets
            # the copy engine drop the sources). Never a wait for the copy: a host wait would hold
            # the host back in backward and one on the compute stream would stall it.
            self.let_sources_go(group)
        if group.holds_device_tensors:
            engine.forward.mark_copied(group)
        group.reset_restore()

def _start_backward(side) -> None:
    if not side.engine.backward_seen:
        side.starts()


def _call_with(ref, call) -> None:
    """call(side) for the backward side `ref` names, if it is still alive (a hook on a gradient)."""
    side = ref()
    if side is not None:
        call(side)
