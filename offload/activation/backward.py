"""The backward side of the activation engine: unpack, fetch back, restore views, release.

`BackwardSide` is a base class of `ActivationEngine` (engine.py), split out by concern: the
two share the engine's state, and engine.py's notes (Note [backward], Note [storages and
views]) give the reasons for what is done here.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch

from ..core import _device
from ..core.copy import copy_to_device
from .groups import COPYING, KEPT, OPEN, Group, Packed, on_host_only, with_earlier_parts
from .saved_tensors import describe, modified_error, not_traced, when_gradient_of


# Note [after FSDP2's hook]: FSDP2 hooks the gradient of each unit's output too, and there
# unshards the unit for its backward: it copies the all-gathered parameters out on the compute
# stream, with a small host-to-device copy of their sizes among them. Host-to-device copies
# run in the order they reach the device's copy engine, whatever stream queued them, so a copy
# back queued before that small copy holds the compute stream up until the whole copy back is
# done. FSDP2 registers its hook after the layer's forward returns, later than the engine can,
# so the engine's fetch runs as a pre-hook of the gradient's node, after every tensor hook: the
# small copy goes first. (A copy back that outlasts the layer's backward still delays the next
# layer's small copy by what is left of it.)


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
        if group.n_unpacked == 0 and self.mode != "sync":
            self._prefetch(group)
        group.n_unpacked += 1
        if group.n_unpacked >= group.n_handles and group.state != KEPT:
            self._release(group)
        return result

    def _prefetch(self, group: Group) -> None:
        if self.schedule is None:  # else fetched at the backward points the schedule chose
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
            if group is not None and on_host_only(group):
                self._fetch(group)
                self.counters["groups_prefetched"] += 1

    @not_traced
    def fetch_when_backward_reaches(self, output, layers) -> None:
        """Fetch the groups of `layers` when backward reaches `output` (a layer's output): a
        hook on its gradient, the first thing computed in that layer's backward. Layers that
        stay on the device save no tensor of the engine's, so nothing else marks that point.
        The hook runs after the others on that gradient (Note [after FSDP2's hook])."""
        refs = self._groups_of(layers)
        if refs:  # else each is fetched at its first unpack
            when_gradient_of(output, self, lambda engine: engine._fetch_groups(refs), after_tensor_hooks=True)

    def _fetch(self, group: Group) -> None:
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
            self._timings.copy(self.counters, "h2d_seconds", group.h2d.copy_timer())
        group.device_block = block
        group.typed_blocks = {}
        group.waited = set()
        self.counters["h2d_bytes"] += group.nbytes
        self.counters["groups_fetched"] += 1

    def _restore(self, group: Group, packed: Packed) -> torch.Tensor:
        if group.device_block is None:
            self._fetch(group)
        stream = _device.current_stream(self.device) if self.on_accel else None
        if stream not in group.waited:
            if self.mode == "sync" or not self.on_accel:
                t0 = time.perf_counter()
                group.h2d.synchronize()
                self.counters["backward_wait_seconds"] += time.perf_counter() - t0
            else:
                start = self._timed_start(stream)
                if stream == group.fetch_stream:
                    # The block's owner waits for the copy: the core need not hold it until the
                    # host sees the copy done (else it would hold the last group fetched in a
                    # step until the next step's first copy).
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

    def _release(self, group: Group) -> None:
        """Every handle of the group was unpacked: drop its device copies (the host copy stays)."""
        if group.state in (OPEN,):
            return
        if group.d2h is not None:
            # A query that finds the device-to-host copy done also completes it (the copy engine
            # drops the sources it held then, not at the next step's first copy). Never a host
            # wait: one here (a group served from the device while its copy still runs) would
            # hold the host back in backward and open gaps in the compute stream.
            group.d2h.ready()
        if group.held is not None:
            self._mark_copied(group)
        group.device_block = None
        group.typed_blocks = {}
        group.h2d = None
        group.views = {}
        group.waited = set()
        group.n_unpacked = 0

def _start_backward(engine) -> None:
    if not engine.backward_seen:
        engine._backward_starts()
