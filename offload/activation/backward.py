"""The backward side of the activation engine: unpack, fetch back, restore views, release.

`BackwardSide` is a base class of `ActivationEngine` (engine.py), split out by concern: the
two share the engine's state, and engine.py's notes (Note [backward], Note [storages and
views]) give the reasons for what is done here.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Optional

import torch

from ..core import _device
from .groups import (COPYING, FETCHED, KEPT, OPEN, RESTORED, SPAN_ALIGN, Group, Packed, on_host_only,
                     with_earlier_parts)
from .saved_tensors import describe, modified_error, not_traced, when_gradient_of


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
    """Unpack hook and the fetches of the activation engine (see `ActivationEngine`)."""

    def _backward_starts(self) -> None:
        """The step's backward starts: at the model output's gradient (`mark_backward_start`),
        or at the step's first unpack, whichever comes first."""
        self.backward_seen = True  # the next capture starts a new step
        self._tail = None
        if self.observer is not None:
            self.observer.backward_started()
        if self.schedule is not None:
            self._backward_start_scheduled()
        elif self.mode != "sync":
            self._prefetch_at_backward_start()

    @not_traced
    def mark_backward_start(self, output) -> None:
        """Start the step's backward when the gradient of `output` (the model's output) is
        computed: with hooks only in offloaded spans, nothing of the kept last layer or the
        head is unpacked here to mark it, and the first group's copy back would wait for
        backward to reach that group."""
        when_gradient_of(output, self, _start_backward)  # else marked at the first unpack

    def unpack(self, packed):
        """The unpack hook without the core, and the core's for what it does not serve (the step's
        first unpack of a kept tensor, a kept tensor modified in place): the core's
        `unpack_saved_tensor` serves offloaded tensors the same way in C."""
        if not self.backward_seen:  # the step's first unpack: its backward starts
            self._backward_starts()
        if type(packed) is tuple:
            t, version = packed
            if t._version != version:
                raise modified_error(describe(t), version, t._version)
            return t
        group = packed.group
        if self.observer is not None and group.n_unpacked == 0:
            self.observer.unpacked(group)
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
            result = self._restore(group, packed)
        if group.n_unpacked == 0:
            self._prefetch(group)
        group.n_unpacked += 1
        if group.n_unpacked >= group.n_handles and group.state != KEPT:
            self._release(group)
        return result

    def _prefetch(self, group: Group) -> None:
        """Backward reached `group` (its first unpack): fetch the one before it."""
        if self.mode != "sync" and self.schedule is None:  # else fetched at the points the schedule chose
            # The group before it, and if that is the last part of a layer copied in parts, its
            # earlier parts too, the last first: fetched one by one at each part's first unpack,
            # a part's copy would start only once backward is in the layer. (At a part's own
            # first unpack they were fetched already: nothing to do.)
            self._fetch_groups(with_earlier_parts(group.prev))

    def _prefetch_at_backward_start(self) -> None:
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
        group = self._last_offloaded() if self._last_offloaded is not None else None
        on_device = 0  # layers held on the device (a part of a layer counts as one)
        while group is not None and group.state == COPYING:  # held on the device
            on_device += max(group.n_layers, 1)
            group = group.prev() if group.prev is not None else None
        if (group is not None and on_device + max(group.n_layers, 1) <= self.resident_groups
                and on_host_only(group)):
            self._fetch_groups(with_earlier_parts(weakref.ref(group)))

    def _backward_start_scheduled(self) -> None:
        """Backward starts (auto mode): release what the schedule lets go here, fetch what it fetches."""
        schedule = self.schedule
        self._release_due(schedule.n + 1)
        for refs, share in self._layer_fetches(schedule.fetch_at_start, schedule.shares_at(schedule.n + 1)):
            self._fetch_groups(refs, share)

    def _groups_of(self, layers) -> list:
        """Weak references to the offloaded groups of `layers` in this forward, each layer's
        last part first: backward needs the tensors a layer saved last first."""
        return [ref for layer in layers for ref in reversed(self._layer_groups.get(layer, ()))]

    def _layer_fetches(self, layers, shares: dict) -> list:
        """Per layer of `layers` with offloaded groups: (their weak references, the share of
        their bytes to fetch, or None for all)."""
        return [(refs, shares.get(layer)) for layer in layers for refs in [self._groups_of([layer])] if refs]

    def _fetch_groups(self, refs, share: Optional[float] = None) -> None:
        """Fetch the groups (weak references, or None) that are on the host; with `share`, the
        groups of one layer up to that share of their bytes, in the order given (a piece,
        Note [fetch in pieces] in auto/schedule.py)."""
        groups = [g for g in (ref() if ref is not None else None for ref in refs) if g is not None]
        wanted = None if share is None else share * sum(g.nbytes_aligned for g in groups)
        for group in groups:
            upto = None if wanted is None or wanted >= group.nbytes_aligned else int(wanted)
            if wanted is not None:
                wanted = max(0.0, wanted - group.nbytes_aligned)
            if on_host_only(group) and upto != 0:
                self._fetch(group, upto)
                if group.fetched == group.nbytes_aligned:
                    self.counters["groups_prefetched"] += 1

    @not_traced
    def fetch_when_backward_reaches(self, output, layers, shares=None) -> None:
        """Fetch the groups of `layers` when backward reaches `output` (a layer's output): a
        hook on its gradient, the first thing computed in that layer's backward. Layers that
        stay on the device save no tensor of the engine's, so nothing else marks that point.
        `shares`: layer -> the share of its bytes to fetch there, for layers fetched in pieces.
        The hook runs after the others on that gradient (Note [after FSDP2's hook])."""
        fetches = self._layer_fetches(layers, shares or {})
        if fetches:  # else each is fetched at its first unpack

            def fetch(engine):
                for refs, share in fetches:
                    engine._fetch_groups(refs, share)

            when_gradient_of(output, self, fetch, after_tensor_hooks=True)

    def _fetch(self, group: Group, upto: Optional[int] = None) -> None:
        """Copy the group's host block back, or its bytes up to `upto` (a piece, Note [fetch in
        pieces] in auto/schedule.py; None: all that is left)."""
        end = group.nbytes_aligned if upto is None else min(group.nbytes_aligned, -(-upto // SPAN_ALIGN) * SPAN_ALIGN)
        if end <= group.fetched:
            return
        with _device.nvtx_range(f"offload.h2d {group.name}") if self.nvtx else contextlib.nullcontext():
            if group.device_block is None:
                # One device block per group (allocated on the consumer stream, its owner) laid
                # out as the host block: DMAs of the block (the core would stage a group's
                # adjacent spans and scatter them with a kernel competing with backward for the
                # SMs), and each restored view keeps the original's 512-byte alignment.
                group.device_block = torch.empty(group.nbytes_aligned, dtype=torch.uint8, device=self.device)
                group.fetch_stream = _device.current_stream(self.device) if self.on_accel else None
            if group.fetched == 0 and end == group.nbytes_aligned:
                # Copied from the D2H handle, the core makes the copy stream wait for that copy
                # too (a group let go at a release point was seen complete on the device only),
                # and times the copy after both waits.
                source, out = group.d2h, [group.device_block]
            else:
                if group.fetched == 0:  # the first piece: the copy stream waits for the copy out
                    if self.on_accel:
                        group.d2h.wait_stream(self._copy_streams()[1])
                    else:
                        group.d2h.synchronize()
                source = [group.d2h.tensors[0][group.fetched:end]]
                out = [group.device_block[group.fetched:end]]
            # Pieces queue on one copy stream in order: the last one done means all are.
            group.h2d.append(self._copy_back(source, out))
        if self.timing:
            self._timings.copy(self.counters, "h2d_seconds", group.h2d[-1].copy_timer())
        start = group.fetched
        share = min(end, group.nbytes) - min(start, group.nbytes)  # of the group's bytes (not its padding)
        group.fetched = end
        self.counters["h2d_bytes"] += share
        if end == group.nbytes_aligned:
            self.counters["groups_fetched"] += 1
        if self._listeners:
            self._emit(FETCHED, group, end - start, start)

    def _make_ready(self, group: Group) -> None:
        """Fetch what no planned point fetched of `group`, and make its reader on the current stream
        (the host, without one) wait for the copy back, once per stream and backward."""
        if group.fetched < group.nbytes_aligned:
            self._fetch(group)
        stream = _device.current_stream(self.device) if self.on_accel else None
        if not group.ready_on(stream):
            begun = self.observer.wait_begins() if self.observer is not None else None
            if self.mode == "sync" or not self.on_accel:
                t0 = time.perf_counter()
                group.h2d[-1].synchronize()
                self.counters["backward_wait_seconds"] += time.perf_counter() - t0
            else:
                start = self._timed_start(stream)
                for h2d in group.h2d:
                    if stream == group.fetch_stream:
                        # The block's owner waits for the copy: the core need not hold it until
                        # the host sees the copy done (else it would hold the last group fetched
                        # in a step until the next step's first copy).
                        h2d.release_sources(stream)
                    else:
                        h2d.wait_stream(stream)
                self._timed_end("backward_wait_seconds", start, stream)
            if begun is not None:
                self.observer.wait_ended(group.layer, begun, backward=True)
            if group.mark_ready(stream):  # the group's first read in this backward
                if group.checksums is not None:
                    group.checksums.check(group, group.device_block)  # Note [verify]
                if self._listeners:
                    self._emit(RESTORED, group, group.nbytes)

    def _restore(self, group: Group, packed: Packed) -> torch.Tensor:
        """The Python path's view of `packed` in its group's restored block (the core's
        ActivationGroup.restored_view)."""
        self._make_ready(group)
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

    def _let_sources_go(self, group: Group) -> None:
        """The copy engine's references to a copying group's sources go now, the copy stream
        protecting their memory until it has passed the copy (Note [served groups' sources])."""
        if not self.on_accel or not group.has_spans:
            return
        stream = self._copy_streams()[0]  # the one the group's copy out ran on
        group.let_sources_go(stream)
        group.d2h.release_sources(stream)

    def _release(self, group: Group) -> None:
        """Every handle of the group was unpacked: drop its device copies (the host copy stays)."""
        if group.state in (OPEN,):
            return
        if group.holds_device_tensors and group.d2h is not None and not group.d2h.ready():
            # Served from the device, its copy not seen done (a query that finds it done also lets
            # the copy engine drop the sources). Never a wait for the copy: a host wait would hold
            # the host back in backward and one on the compute stream would stall it.
            self._let_sources_go(group)
        if group.holds_device_tensors:
            self._mark_copied(group)
        group.reset_restore()
        group.h2d = []

def _start_backward(engine) -> None:
    if not engine.backward_seen:
        engine._backward_starts()
