"""What the pack hook consults: the open group and, per forward, the storages copied so far and
the storages that stay (parameters, buffers, the forward's inputs).

`PackTable` is the Python twin of the core's PackTable (csrc/python/saved_tensor_hooks.cpp),
used without the core (Note [group twins] in groups.py); its `pack_extent` is the core's pack
after the per-tensor test. The notes it follows are engine.py's.
"""

from __future__ import annotations

from typing import Dict

from torch.multiprocessing.reductions import StorageWeakRef

from .groups import COPYING, SPAN_ALIGN, Packed, Span
from .saved_tensors import module_tensors, storage_ptrs

# A new span that reads at least this share of its storage copies the whole storage (Note
# [storages and views] in engine.py; the core compares 7 * size <= 8 * bytes).
WHOLE_STORAGE = 7 / 8


class PackTable:
    """The open group, the storages copied in this forward and those that stay."""

    __slots__ = ("open_group", "params_pending", "params_needed", "_storages", "_param_ptrs")

    def __init__(self):
        self.open_group = None
        self.params_pending = False  # iterables of tensors wait to join the storages that stay
        self.params_needed = False  # a saved tensor of this forward needed them
        self._storages: Dict[int, tuple] = {}  # storage data_ptr -> (group, index of its Span, StorageWeakRef)
        self._param_ptrs: set = set()

    def add_params(self, tensors) -> None:
        """The storages of `tensors` (any iterable) stay (Note [parameter walk] in engine.py)."""
        self._param_ptrs |= storage_ptrs(tensors)

    def add_module_params(self, root) -> None:
        """The storages of `root`'s parameters and buffers and its submodules' stay."""
        self._param_ptrs |= storage_ptrs(module_tensors(root))

    def holds_param(self, ptr: int) -> bool:
        """The storage at `ptr` is among the storages that stay (walked so far)."""
        return ptr in self._param_ptrs

    def __len__(self) -> int:
        """The storages recorded in this forward (each holds its group)."""
        return len(self._storages)

    def clear(self) -> None:
        self._storages.clear()
        self._param_ptrs = set()

    def pack_extent(self, engine, t, ptr: int, first: int, last: int, check_params: bool):
        """Pack `t`, which `offload_extent` found may be offloaded: it reads bytes [first, last)
        of the storage at `ptr`. `check_params`: it may share a parameter's or input's storage.

        An op's recorded output (its base has a grad_fn) was allocated by that op. Only a tensor
        without one can share a parameter's memory (buffers, DTensor local shards, a weight's
        detached alias, their views; a parameter's view stayed in `offload_extent`; also,
        conservatively, anything computed without grad, such as int or bool outputs) or be a
        forward's input, and only those read the storages of the parameters and inputs, which
        costs a walk of every layer's parameters (Note [parameter walk] in engine.py); once per
        storage and forward: a storage this forward saved already was found then to be none.
        """
        group = self.open_group
        hit = self._storages.get(ptr)
        live = hit is not None and not hit[2].expired()  # saved earlier in this forward
        if check_params and not live:
            self.params_needed = True
            if self.params_pending and ptr not in self._param_ptrs:
                engine._walk_params(ptr)
            if ptr in self._param_ptrs:
                return engine._keep(t)
        entry = None
        if live:
            owner, index, _ = hit
            if owner is group:  # the group still collecting: widen the span to cover this view
                span = group.spans[index]
                if first < span.lo or last > span.hi:
                    span.lo = min(span.lo, first - first % SPAN_ALIGN)
                    span.hi = max(span.hi, last)
                entry = index
            elif owner.state == COPYING and owner.spans is not None:
                # Its copy is queued: share it if it holds these bytes, unchanged.
                span = owner.spans[index]
                if span.lo <= first and last <= span.hi and span.version == t._version:
                    group, entry = owner, index
            if entry is None and check_params:  # saved again by a later group (Note [shared constants] in engine.py)
                return engine._keep(t)
        split = False
        if entry is None:
            storage = t.untyped_storage()
            lo = first - first % SPAN_ALIGN
            size = storage.nbytes()
            if WHOLE_STORAGE * size <= last - lo:
                # Nearly all of its storage: copy all of it, so that the storage's other views
                # (q, k and v of one fused projection each read all but a different sliver)
                # lie in this copy, also when the layer is split into parts between them.
                lo, last = 0, size
            span_bytes = last - lo
            auto = group.auto
            if auto is not None:
                if auto.cap is not None and group.capped + span_bytes > auto.cap:
                    return engine._keep(t)  # auto mode offloads this layer in part: its first spans
                if auto.span_ends is not None:  # measuring
                    auto.span_ends.append(group.capped + span_bytes)
            group.capped += span_bytes
            group.new_spans += 1
            if auto is not None and auto.profile and group.capped >= auto.profile[0]:
                engine._profiled(group)
            ends = group.split
            split = ends is not None and group.part < len(ends) and group.capped >= ends[group.part]
            entry = len(group.spans)
            group.spans.append(Span(t, lo, last))
            self._storages[ptr] = (group, entry, StorageWeakRef(storage))
        slot = group.hold(t, t._version)
        packed = Packed(group, entry, slot, t.dtype, t.shape, t.stride(), first)  # first: its offset in bytes
        if split:
            engine._split(group)
        return packed
