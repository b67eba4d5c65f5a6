"""The copy plan of a state dict: which tensors are copied as one unit, in which batches.

Built once per shape of state dict and reused by every save while the tensors'
shapes, dtypes, devices and aliasing stay the same.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Dict, List, Tuple

import torch

from ..core import _device
from ..core.copy import DEFAULT_SMALL_BYTES
from .state_tree import StateTree

# Host buffers start on this boundary inside a pooled block: a cache line, and a
# multiple of every dtype's size so typed views of the block are legal.
ALIGN = 64

META = attrgetter("shape", "dtype", "device")
_data_ptr = torch.Tensor.data_ptr
_nbytes = attrgetter("nbytes")
# torch's own check that tensors still have the data pointers recorded for them
# (CUDA graph trees use it for static inputs): one C++ loop for the whole list.
# Builds without it (CPU-only torch) compare a C-level map of data_ptr instead.
_ptrs_at_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def same_data_ptrs(tensors: List[torch.Tensor], ptrs: List[int], indices: List[int]) -> bool:
    """Whether tensors[i].data_ptr() == ptrs[i] for every i in `indices`, in one call
    where torch has one (one data_ptr call from Python per tensor otherwise). Raises
    RuntimeError for a tensor without storage."""
    if len(tensors) != len(ptrs):
        return False
    if len(indices) * 8 < len(tensors):
        # A few (often none): torch's helper would convert every tensor of the list.
        return all(_data_ptr(tensors[i]) == ptrs[i] for i in indices)
    if _ptrs_at_equal is not None:
        return _ptrs_at_equal(tensors, ptrs, indices)
    if len(indices) == len(tensors):
        return list(map(_data_ptr, tensors)) == ptrs
    return [_data_ptr(tensors[i]) for i in indices] == [ptrs[i] for i in indices]


def _storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_broadcast(t: torch.Tensor, contiguous: bool) -> bool:
    """Whether `t` repeats elements along a dimension (stride 0, size > 1), as expand() makes;
    `contiguous` is t.is_contiguous(), given by callers that read it for many tensors at once."""
    return not contiguous and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pick(seq, indices) -> list:
    """[seq[i] for i in indices], at C speed for long lists."""
    if not indices:
        return []
    if len(indices) == 1:
        return [seq[indices[0]]]
    return list(itemgetter(*indices)(seq))


def _identity(seq):
    return seq


def make_picker(indices, length: int, fresh: bool = True):
    """A function doing pick(seq, indices) for a seq of `length`, made once per plan:
    the identity selection is a plain copy (`fresh`) or `seq` itself (for a caller
    that changes neither list, which saves a copy of every leaf per save), others
    reuse one itemgetter."""
    if list(indices) == list(range(length)):
        return list if fresh else _identity
    if len(indices) == 1:
        index = indices[0]
        return lambda seq: [seq[index]]
    if not indices:
        return lambda seq: []
    getter = itemgetter(*indices)
    return lambda seq: list(getter(seq))


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first element to just past its last (strides are never negative)."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def layout_of(t: torch.Tensor) -> Tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class CopyUnit:
    """One copy: a tensor, tied tensors (copied once, shared) or overlapping views (one byte span)."""

    __slots__ = (
        "kind", "slots", "key", "nbytes", "device", "copied_first", "shape", "dtype", "span_start", "members",
        "expanded", "pageable",
    )

    def __init__(
        self, kind, slots, key, nbytes, device, shape=None, dtype=None, span_start=0, members=(), expanded=False
    ):
        self.kind = kind  # "tensor" (one or tied slots) or "span"
        self.slots = slots  # tensor slots this unit fills
        self.key = key  # what a buffer must match to be reused
        self.nbytes = nbytes
        self.device = device
        self.copied_first = False  # a forward buffer (AsyncStager forward_buffers): copied first
        self.shape = shape
        self.dtype = dtype
        self.span_start = span_start  # span: its start relative to slots[0]'s first byte (<= 0)
        self.members = members  # span: per slot (byte offset in span, shape, stride, dtype)
        self.expanded = expanded  # a broadcast (stride-0) tensor: its distinct elements are copied
        self.pageable = False  # staged to pageable host memory: past limit_bytes (Note [staging past limit_bytes])


class CopyBatch:
    """The units copied by one call: same device, same phase (forward buffers first)."""

    __slots__ = (
        "device", "copied_first", "asynchronous", "pageable", "units", "src_slots", "pick_sources", "spans", "keys",
        "expanded",
    )

    def __init__(self, device, copied_first, asynchronous, pageable=False):
        self.device = device
        self.copied_first = copied_first  # forward buffers: copied before the rest, waited for at once
        # Through copy_to_host; else a copy_ on the caller's thread: into pooled blocks
        # (CPU sources), or into pageable memory (`pageable`, Note [staging past limit_bytes]).
        self.asynchronous = asynchronous
        self.pageable = pageable
        self.units: List[CopyUnit] = []
        self.src_slots: List[int] = []  # tensor units: the slot whose tensor is the source
        self.pick_sources = list  # make_picker(src_slots): the sources from the tensor slots
        self.spans: List[CopyUnit] = []  # span units, after the tensor units
        self.keys: Tuple = ()  # per source (tensor units, then spans): its unit's key
        self.expanded: List[int] = []  # sources given to the copy narrowed to their distinct elements


# Note [staging past limit_bytes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A state dict whose host buffers would pass the stager's limit_bytes is still
# staged: the plan gives pooled (pinned) buffers to the units that fit a budget,
# in order, and marks the rest `pageable`. Those go into pageable host memory, in
# batches of their own, copied with copy_ on the caller's thread: each copy waits
# for the work queued before it on the current stream and returns when its bytes
# are on the host, so the save holds the same values and blocks the caller for
# those bytes instead of failing. A pageable unit's key differs from the pinned
# one's, so a buffer set never refills a pooled buffer from a pageable batch or
# the reverse. The budget starts at the limit and counts each unit as
# `pool_bytes_estimate` does; where the pool's rounding makes the blocks a save
# took pass the limit anyway, the stager lowers the budget by the excess and
# plans again (AsyncStager._enqueue_save), so the pooled bytes stay within the limit.


def _check_devices(fn: str, meta, tensor_paths) -> set:
    """The devices of the tensors (`meta`, as META gives it), each the compute device's type or the host's."""
    compute = _device.compute_device_type()
    devices = {device for _, _, device in meta}
    for device in devices:
        if device.type not in (compute, "cpu"):
            slot = next(i for i, (_, _, d) in enumerate(meta) if d == device)
            raise ValueError(
                f"{fn}: state_dict{''.join(f'[{k!r}]' for k in tensor_paths[slot])} is on {device}; "
                f"staging copies tensors from {compute} or the host"
            )
    return devices


class CopyPlan:
    """How one state dict (shape, tensor layouts, aliasing) is copied.

    `pinned_budget`: pool bytes the units may take (None: all of them pooled); the
    rest are staged to pageable memory (Note [staging past limit_bytes]), counted
    with `block_bytes` (the pool's HostPool.block_bytes).
    """

    def __init__(self, fn, tree: StateTree, local_tensors, specs, forward_ptrs, forward_paths, tensor_paths,
                 pinned_budget=None, block_bytes=None):
        self.tree = tree
        self.pinned_budget = pinned_budget
        self.meta = list(map(META, local_tensors))
        self.ptrs = list(map(_data_ptr, local_tensors))
        self.ptr_indices = list(range(len(local_tensors)))  # for same_data_ptrs
        # Bumped when `ptrs` move to new storages with the plan kept: a set filled
        # under another version has its own record of the addresses (same_sources).
        self.ptrs_version = 0
        self.specs = specs
        self.units: List[CopyUnit] = []
        devices = _check_devices(fn, self.meta, tensor_paths)
        self._group(local_tensors, tensor_paths)
        for unit in self.units if forward_paths or forward_ptrs else ():
            unit.copied_first = any(
                tensor_paths[s] in forward_paths or (local_tensors[s].device, self.ptrs[s]) in forward_ptrs
                for s in unit.slots
            )
        if pinned_budget is not None:
            self._spill(pinned_budget, block_bytes)
        self.batches = self._batch(local_tensors, devices)
        self._slots_to_compare(local_tensors)
        self.copy_bytes = sum(u.nbytes for u in self.units)
        self.pageable_bytes = sum(u.nbytes for u in self.units if u.pageable)
        self.pageable_units = sum(u.pageable for u in self.units)
        self.signature = tuple((u.key, u.slots, u.copied_first, u.expanded) for b in self.batches for u in b.units)

    def _batch(self, local_tensors, devices) -> List[CopyBatch]:
        """The units in batches, one per (copied first, pageable, device), each with what its copy
        picks from the state dict's tensors."""
        compute = _device.compute_device_type()
        batches: Dict[Tuple, CopyBatch] = {}
        names = {device: str(device) for device in devices}
        for unit in self.units:
            # Pooled batches first: their copies run on the copy stream while the pageable ones block.
            key = (not unit.copied_first, unit.pageable, names[unit.device])
            batch = batches.get(key)
            if batch is None:
                asynchronous = unit.device.type == compute and not unit.pageable
                batch = batches[key] = CopyBatch(unit.device, unit.copied_first, asynchronous, unit.pageable)
            batch.units.append(unit)
        ordered = [batches[k] for k in sorted(batches)]
        for batch in ordered:
            if any(u.kind == "span" for u in batch.units):
                batch.units.sort(key=lambda u: u.kind == "span")
            batch.src_slots = [u.slots[0] for u in batch.units if u.kind == "tensor"]
            batch.spans = [u for u in batch.units if u.kind == "span"]
            batch.keys = tuple(u.key for u in batch.units)
            batch.expanded = [i for i, u in enumerate(batch.units) if u.expanded]
            # The sources list is changed in place where spans or expanded sources go in.
            changed = bool(batch.spans or batch.expanded) or not batch.asynchronous
            batch.pick_sources = make_picker(batch.src_slots, len(local_tensors), fresh=changed)
        return ordered

    def _slots_to_compare(self, local_tensors) -> None:
        """The tensors whose address or layout a save with this plan compares itself; the copies check the rest."""
        # Tensors a refill through the core checks the address of itself (copy_to_host's
        # same_sources; see AsyncStager._resolve): the one source of each tensor unit
        # of a batch the core copies, when not empty. The rest are compared here.
        core = {u.slots[0] for b in self.batches if b.asynchronous for u in b.units if u.kind == "tensor" and u.nbytes}
        self.core_slots = sorted(core)
        self.host_slots = [s for s in range(len(local_tensors)) if s not in core]
        self.span_slots = [s for u in self.units if u.kind == "span" for s in u.slots]
        self.span_strides = [local_tensors[s].stride() for s in self.span_slots]
        # Tensors whose layout no copy checks on a save with the cached plan (see
        # AsyncStager._resolve): members of spans and of tied units past the first,
        # and empty tensors (nothing to copy). Host copies check their sources as
        # the copy engine does (_copy_on_host).
        watched = set(self.span_slots)
        for unit in self.units:
            if unit.kind == "tensor" and (len(unit.slots) > 1 or not unit.nbytes):
                watched.update(unit.slots)
        self.watched_slots = sorted(watched)
        self.watched_layouts = [layout_of(local_tensors[s])[1:] for s in self.watched_slots]

    def _spill(self, budget: int, block_bytes) -> None:
        """Mark `pageable` the units that do not fit `budget` pool bytes, forward buffers
        (copied first) placed first, the rest in order (Note [staging past limit_bytes])."""
        used = 0
        for unit in sorted(self.units, key=lambda u: not u.copied_first):
            cost = unit_pool_bytes(unit, block_bytes)
            if used + cost <= budget:
                used += cost
                continue
            unit.pageable = True
            unit.key = ("pageable",) + unit.key

    def _group(self, local_tensors, paths) -> None:
        """Units from tensors: memory that overlaps within one storage is copied once."""
        storages = list(map(_storage_address, local_tensors))
        if len(set(storages)) == len(storages):
            # Every tensor alone in its storage (the usual state dict): nothing can
            # overlap, so skip the extents and sorting and make the units in one pass.
            self._add_tensor_units(range(len(local_tensors)), local_tensors, paths)
            return
        by_storage: Dict[Tuple, list] = {}
        for slot, t in enumerate(local_tensors):
            extent = _extent_bytes(t)
            if extent == 0:
                self._add_tensor_unit([slot], t, paths)
                continue
            start = t.data_ptr()
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((start, start + extent, slot))
        for (_, base), items in by_storage.items():
            if len(items) == 1:  # alone in its storage (most parameters): nothing to group
                self._add_tensor_unit([items[0][2]], local_tensors[items[0][2]], paths)
                continue
            items.sort()
            cluster, end = [], -1
            for start, stop, slot in items + [(None, None, None)]:
                if slot is not None and start < end:
                    cluster.append(slot)
                    end = max(end, stop)
                    continue
                if cluster:
                    self._add_cluster(cluster, local_tensors, paths, base)
                cluster, end = [slot], stop

    def _add_tensor_unit(self, slots, t, paths) -> None:
        key = ("tensor", paths[slots[0]], tuple(t.shape), t.dtype)
        nbytes = t.numel() * t.element_size()
        expanded = _is_broadcast(t, t.is_contiguous())
        self.units.append(CopyUnit("tensor", slots, key, nbytes, t.device, tuple(t.shape), t.dtype, expanded=expanded))

    def _add_tensor_units(self, slots, local_tensors, paths) -> None:
        """_add_tensor_unit for each of `slots` (each its own unit), with the
        per-tensor attributes read by C-level maps rather than per-tensor calls."""
        meta = self.meta
        nbytes = list(map(_nbytes, local_tensors))
        contiguous = list(map(torch.Tensor.is_contiguous, local_tensors))
        units = self.units
        for slot in slots:
            shape, dtype, device = meta[slot]
            shape = tuple(shape)
            expanded = _is_broadcast(local_tensors[slot], contiguous[slot])
            units.append(
                CopyUnit("tensor", [slot], ("tensor", paths[slot], shape, dtype), nbytes[slot], device, shape, dtype,
                      expanded=expanded)
            )

    def _add_cluster(self, slots, local_tensors, paths, base) -> None:
        first = local_tensors[slots[0]]
        layout = layout_of(first)
        if len(slots) == 1 or all(layout_of(local_tensors[s]) == layout for s in slots[1:]):
            self._add_tensor_unit(slots, first, paths)  # tied: one copy, shared
            return
        # Overlapping views: copy the byte span that covers them, from an offset
        # aligned to 16 bytes relative to the storage so every dtype's view is legal.
        start = min(local_tensors[s].data_ptr() for s in slots)
        stop = max(local_tensors[s].data_ptr() + _extent_bytes(local_tensors[s]) for s in slots)
        start -= (start - base) % 16
        members = tuple(
            (t.data_ptr() - start, tuple(t.shape), tuple(t.stride()), t.dtype)
            for t in (local_tensors[s] for s in slots)
        )
        key = ("span", tuple(paths[s] for s in slots), stop - start, members)
        self.units.append(
            CopyUnit("span", slots, key, stop - start, first.device, span_start=start - first.data_ptr(),
                     members=members)
        )



def pool_bytes_estimate(units, block_bytes) -> int:
    """About the pool bytes that copying `units` afresh takes, before it runs.

    Units of at least DEFAULT_SMALL_BYTES get a block each from every copy backend,
    counted at the pool's size class; smaller ones are packed into groups or not,
    as the backend does, so their blocks' rounding is not known here and they
    count at their own bytes; pageable units take none. A save checks the blocks it got (see
    `BufferRing.give_back_over_limit`).
    """
    return sum(unit_pool_bytes(u, block_bytes) for u in units if not u.pageable)


def unit_pool_bytes(unit: CopyUnit, block_bytes) -> int:
    """A unit's share of `pool_bytes_estimate` (were it pooled)."""
    return block_bytes(unit.nbytes) if unit.nbytes >= DEFAULT_SMALL_BYTES else align(unit.nbytes)
