"""`offload.AsyncStager`: checkpoint staging that does not block the training loop.

Saving a checkpoint starts by copying the state dict from the device to host
memory ("staging"); until that copy is complete, training must not change the
parameters it reads. `AsyncStager` implements the `AsyncStager` protocol of
`torch.distributed.checkpoint`, so it plugs into `dcp.async_save`:

    stager = offload.AsyncStager()
    stager.protect(optimizer)          # optimizer.step() waits, on the device, for the copy
    for step in ...:
        loss = model(batch).sum(); loss.backward()
        if step % every == 0:
            dcp.async_save(state, checkpoint_id=..., async_stager=stager)
        optimizer.step(); optimizer.zero_grad()

How a save runs:
- `stage(state_dict)` flattens the state dict with code generated for its shape
  (`_state_tree.StateTree`), checks it against the cached copy plan, picks a free
  set of host buffers and enqueues one batched `offload.copy_to_host` per device
  (the device-to-host stream first waits, on the device, for everything already
  queued on the current stream, so the copy holds the values as of the call).
  A set's first save copies fresh, so the copy engine packs small tensors into
  pooled blocks of up to 32 MiB (one DMA each, see _GROUP_BYTES); later saves
  pass that copy's handle back as `out=` and the same blocks are refilled by the
  same DMAs. With
  an unchanged structure no Python code runs per tensor: the copy engine checks
  each tensor against the buffer it refills, and a refusal re-plans. It
  returns a `concurrent.futures.Future` of the host state dict right after
  enqueueing; `dcp.async_save` hands it to its upload thread, which waits for it
  (the wait releases the interpreter lock) and then writes.
- Host buffers come from the pinned pool, allocated on the first save and reused
  by every later save whose tensors have the same path, shape and dtype (whatever
  storages they live in). A changed structure allocates only what changed (see
  `_BufferSet` for how packed parts survive it).
- A ring of buffer sets (default 2): a set is busy while its copy runs or while
  anyone still holds the state dict staged into it or any tensor in it (DCP's
  upload drops it when the write finishes). A save uses a free set, allocates the
  next one, or, when all `ring_size` sets are busy, waits (or raises, with
  `when_busy="raise"`); it never writes into a set someone still reads.
- Tensors that share memory (tied weights) are copied once and stay shared in
  the staged dict; overlapping views of one storage are copied as one byte span.
- DTensors (FSDP2) stage their local shard and come back as DTensors with the
  same mesh and placements, wrapping host memory (DCP writes the local shard).

Stream ownership: the sources belong to the caller's (compute) stream and are
recorded on the copy stream by `copy_to_host`; the host buffers belong to this
stager and are handed out read-only in the staged dict. Nothing here runs a
thread: completion is observed by whoever waits on the future.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections import deque
from concurrent.futures import Future
from operator import attrgetter, itemgetter
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core import _device
from ..core.copy import DEFAULT_SMALL_BYTES, copy_to_host
from ..core.layout import compact
from .object_scan import refcount_sum, storage_addresses, storage_bytes, views_over
from ..core.checks import parse_bytes
from ..core.pool import HostPool, default_host_pool
from .state_tree import Mismatch, StateTree, dtensor_type

try:  # the protocol DCP's async_save expects; absent where torch lacks distributed
    from torch.distributed.checkpoint.staging import AsyncStager as _StagerProtocol
except Exception:  # pragma: no cover - builds without torch.distributed
    _StagerProtocol = object

# Host buffers start on this boundary inside a pooled block: a cache line, and a
# multiple of every dtype's size so typed views of the block are legal.
_ALIGN = 64
# The metrics of this many recent saves are kept.
_METRICS_KEPT = 256
# After a structure change, small tensors that remain from a broken packed part
# keep their buffers (one copy each from then on) only if there are this few;
# more are packed afresh: one DMA per group beats one per tensor on every later save.
_MAX_LOOSE = 16
# Small tensors are packed by the copy engine into groups of this many bytes (one
# pack launch, one DMA and two events each). A set's groups are made once and
# refilled on every save, so the copy engine's default (8 MiB, tuned to start a
# one-off copy's first DMA early) would cost 128 groups' worth of launches and
# events per GiB of small tensors on every save; 32 MiB costs 32, the DMA runs at
# the same speed, and the device holds 3 x 32 MiB of staging buffers while a
# copy runs.
_GROUP_BYTES = 32 << 20
# Saves whose spent copy handles a stager keeps, at most, until a result() lets them go.
_SPENT_KEPT = 4
# A first save of at least this many bytes grows the pool beside its planning
# (_PoolGrowth); below it one ordinary slab suffices and a thread is not worth it.
_GROWTH_MIN_BYTES = 64 << 20

_META = attrgetter("shape", "dtype", "device")
_SHAPE_DTYPE = attrgetter("shape", "dtype")
_is_cpu = attrgetter("is_cpu")
# One call for a list of host-to-host copies (torch >= 2.1): the per-pair copy_
# runs in C++, not as one Python call per tensor.
_foreach_copy = torch._foreach_copy_
_data_ptr = torch.Tensor.data_ptr
_nbytes = attrgetter("nbytes")
_use_count = getattr(torch._C, "_storage_Use_Count", None)
# torch's own check that tensors still have the data pointers recorded for them
# (CUDA graph trees use it for static inputs): one C++ loop for the whole list.
# Builds without it (CPU-only torch) compare a C-level map of data_ptr instead.
_ptrs_at_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _same_data_ptrs(tensors: List[torch.Tensor], ptrs: List[int], indices: List[int]) -> bool:
    """Whether tensors[i].data_ptr() == ptrs[i] for every i in `indices`, in one call
    where torch has one (~4,000 calls of data_ptr from Python otherwise). Raises
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


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _broadcast(t: torch.Tensor, contiguous: bool) -> bool:
    """Whether `t` repeats elements along a dimension (stride 0, size > 1), as expand() makes;
    `contiguous` is t.is_contiguous(), given by callers that read it for many tensors at once."""
    return not contiguous and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _pick(seq, indices) -> list:
    """[seq[i] for i in indices], at C speed for long lists."""
    if not indices:
        return []
    if len(indices) == 1:
        return [seq[indices[0]]]
    return list(itemgetter(*indices)(seq))


def _same(seq):
    return seq


def _picker(indices, length: int, fresh: bool = True):
    """A function doing _pick(seq, indices) for a seq of `length`, made once per plan:
    the identity selection is a plain copy (`fresh`) or `seq` itself (for a caller
    that changes neither list: a copy of 4,000 items costs ~20 us a save), others
    reuse one itemgetter."""
    if list(indices) == list(range(length)):
        return list if fresh else _same
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


def _layout_of(t: torch.Tensor) -> Tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _async_save_takes_futures() -> bool:
    """torch >= 2.9: async_save accepts a Future from stage() (AsyncSaveResponse)."""
    try:
        from torch.distributed.checkpoint import state_dict_saver

        return hasattr(state_dict_saver, "AsyncSaveResponse")
    except Exception:  # pragma: no cover - builds without torch.distributed
        return True


# ---------------------------------------------------------------- the copy plan


class _Unit:
    """One copy: a tensor, tied tensors (copied once, shared) or overlapping views (one byte span)."""

    __slots__ = (
        "kind", "slots", "key", "nbytes", "device", "early", "shape", "dtype", "span_rel", "members", "expanded"
    )

    def __init__(
        self, kind, slots, key, nbytes, device, shape=None, dtype=None, span_rel=0, members=(), expanded=False
    ):
        self.kind = kind  # "tensor" (one or tied slots) or "span"
        self.slots = slots  # tensor slots this unit fills
        self.key = key  # what a buffer must match to be reused
        self.nbytes = nbytes
        self.device = device
        self.early = False
        self.shape = shape
        self.dtype = dtype
        self.span_rel = span_rel  # span: its start relative to slots[0]'s first byte (<= 0)
        self.members = members  # span: per slot (byte offset in span, shape, stride, dtype)
        self.expanded = expanded  # a broadcast (stride-0) tensor: its distinct elements are copied


class _Batch:
    """The units copied by one call: same device, same phase (forward buffers first)."""

    __slots__ = ("device", "early", "asynchronous", "units", "src_slots", "pick_sources", "spans", "keys", "expanded")

    def __init__(self, device, early, asynchronous):
        self.device = device
        self.early = early
        self.asynchronous = asynchronous  # through copy_to_host; else a host copy_ (CPU sources)
        self.units: List[_Unit] = []
        self.src_slots: List[int] = []  # tensor units: the slot whose tensor is the source
        self.pick_sources = list  # _picker(src_slots): the sources from the tensor slots
        self.spans: List[_Unit] = []  # span units, after the tensor units
        self.keys: Tuple = ()  # per source (tensor units, then spans): its unit's key
        self.expanded: List[int] = []  # sources given to the copy narrowed to their distinct elements


class _Plan:
    """How one state dict (shape, tensor layouts, aliasing) is copied."""

    def __init__(self, fn, tree: StateTree, locals_, specs, early_ptrs, early_paths, tensor_paths):
        self.tree = tree
        self.meta = list(map(_META, locals_))
        self.ptrs = list(map(_data_ptr, locals_))
        self.ptr_indices = list(range(len(locals_)))  # for _same_data_ptrs
        # Bumped when `ptrs` move to new storages with the plan kept: a set filled
        # under another version has its own record of the addresses (same_sources).
        self.ptrs_version = 0
        self.specs = specs
        self.units: List[_Unit] = []
        compute = _device.compute_device_type()
        devices = {device for _, _, device in self.meta}
        for device in devices:
            if device.type not in (compute, "cpu"):
                slot = next(i for i, (_, _, d) in enumerate(self.meta) if d == device)
                raise ValueError(
                    f"{fn}: state_dict{''.join(f'[{k!r}]' for k in tensor_paths[slot])} is on {device}; "
                    f"staging copies tensors from {compute} or the host"
                )
        self._group(locals_, tensor_paths)
        for unit in self.units if early_paths or early_ptrs else ():
            unit.early = any(
                tensor_paths[s] in early_paths or (locals_[s].device, self.ptrs[s]) in early_ptrs for s in unit.slots
            )
        batches: Dict[Tuple, _Batch] = {}
        names = {device: str(device) for device in devices}
        for unit in self.units:
            key = (not unit.early, names[unit.device])
            batch = batches.get(key)
            if batch is None:
                asynchronous = unit.device.type == compute
                batch = batches[key] = _Batch(unit.device, unit.early, asynchronous)
            batch.units.append(unit)
        self.batches = [batches[k] for k in sorted(batches)]
        for batch in self.batches:
            if any(u.kind == "span" for u in batch.units):
                batch.units.sort(key=lambda u: u.kind == "span")
            batch.src_slots = [u.slots[0] for u in batch.units if u.kind == "tensor"]
            batch.spans = [u for u in batch.units if u.kind == "span"]
            batch.keys = tuple(u.key for u in batch.units)
            batch.expanded = [i for i, u in enumerate(batch.units) if u.expanded]
            # The sources list is changed in place where spans or expanded sources go in.
            changed = bool(batch.spans or batch.expanded) or not batch.asynchronous
            batch.pick_sources = _picker(batch.src_slots, len(locals_), fresh=changed)
        # Tensors a refill through the core checks the address of itself (copy_to_host's
        # same_sources; see AsyncStager._resolve): the one source of each tensor unit
        # of a batch the core copies, when not empty. The rest are compared here.
        core = {u.slots[0] for b in self.batches if b.asynchronous for u in b.units if u.kind == "tensor" and u.nbytes}
        self.core_slots = sorted(core)
        self.host_slots = [s for s in range(len(locals_)) if s not in core]
        self.span_slots = [s for u in self.units if u.kind == "span" for s in u.slots]
        self.span_strides = [locals_[s].stride() for s in self.span_slots]
        # Tensors whose layout no copy checks on a save with the cached plan (see
        # AsyncStager._resolve): members of spans and of tied units past the first,
        # and empty tensors (nothing to copy). Host copies check their sources as
        # the copy engine does (_copy_on_host).
        watched = set(self.span_slots)
        for unit in self.units:
            if unit.kind == "tensor" and (len(unit.slots) > 1 or not unit.nbytes):
                watched.update(unit.slots)
        self.watched_slots = sorted(watched)
        self.watched_layouts = [_layout_of(locals_[s])[1:] for s in self.watched_slots]
        self.copy_bytes = sum(u.nbytes for u in self.units)
        self.signature = tuple((u.key, u.slots, u.early, u.expanded) for b in self.batches for u in b.units)

    def _group(self, locals_, paths) -> None:
        """Units from tensors: memory that overlaps within one storage is copied once."""
        storages = list(map(_storage_ptr, locals_))
        if len(set(storages)) == len(storages):
            # Every tensor alone in its storage (the usual state dict): nothing can
            # overlap, so skip the extents and sorting and make the units in one pass.
            self._add_tensor_units(range(len(locals_)), locals_, paths)
            return
        by_storage: Dict[Tuple, list] = {}
        for slot, t in enumerate(locals_):
            extent = _extent_bytes(t)
            if extent == 0:
                self._add_tensor_unit([slot], t, paths)
                continue
            start = t.data_ptr()
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((start, start + extent, slot))
        for (_, base), items in by_storage.items():
            if len(items) == 1:  # alone in its storage (most parameters): nothing to group
                self._add_tensor_unit([items[0][2]], locals_[items[0][2]], paths)
                continue
            items.sort()
            cluster, end = [], -1
            for start, stop, slot in items + [(None, None, None)]:
                if slot is not None and start < end:
                    cluster.append(slot)
                    end = max(end, stop)
                    continue
                if cluster:
                    self._add_cluster(cluster, locals_, paths, base)
                cluster, end = [slot], stop

    def _add_tensor_unit(self, slots, t, paths) -> None:
        key = ("tensor", paths[slots[0]], tuple(t.shape), t.dtype)
        nbytes = t.numel() * t.element_size()
        expanded = _broadcast(t, t.is_contiguous())
        self.units.append(_Unit("tensor", slots, key, nbytes, t.device, tuple(t.shape), t.dtype, expanded=expanded))

    def _add_tensor_units(self, slots, locals_, paths) -> None:
        """_add_tensor_unit for each of `slots` (each its own unit), with the
        per-tensor attributes read by C-level maps rather than per-tensor calls."""
        meta = self.meta
        nbytes = list(map(_nbytes, locals_))
        contiguous = list(map(torch.Tensor.is_contiguous, locals_))
        units = self.units
        for slot in slots:
            shape, dtype, device = meta[slot]
            shape = tuple(shape)
            expanded = _broadcast(locals_[slot], contiguous[slot])
            units.append(
                _Unit("tensor", [slot], ("tensor", paths[slot], shape, dtype), nbytes[slot], device, shape, dtype,
                      expanded=expanded)
            )

    def _add_cluster(self, slots, locals_, paths, base) -> None:
        first = locals_[slots[0]]
        layout = _layout_of(first)
        if len(slots) == 1 or all(_layout_of(locals_[s]) == layout for s in slots[1:]):
            self._add_tensor_unit(slots, first, paths)  # tied: one copy, shared
            return
        # Overlapping views: copy the byte span that covers them, from an offset
        # aligned to 16 bytes relative to the storage so every dtype's view is legal.
        start = min(locals_[s].data_ptr() for s in slots)
        stop = max(locals_[s].data_ptr() + _extent_bytes(locals_[s]) for s in slots)
        start -= (start - base) % 16
        members = tuple(
            (locals_[s].data_ptr() - start, tuple(locals_[s].shape), tuple(locals_[s].stride()), locals_[s].dtype)
            for s in slots
        )
        key = ("span", tuple(paths[s] for s in slots), stop - start, members)
        self.units.append(
            _Unit("span", slots, key, stop - start, first.device, span_rel=start - first.data_ptr(), members=members)
        )


# ---------------------------------------------------------------- host buffer sets


class _BufferSet:
    """One set of host buffers for a whole state dict; the ring holds `ring_size` of them.

    Where the buffers come from: the first save into a set copies each batch with
    a fresh `copy_to_host` (no `out`), so the copy engine packs small tensors
    into pooled blocks of up to _GROUP_BYTES, one DMA each; the set keeps that handle
    (a "part") and later saves pass it back as `out=`, which refills the same
    blocks with the same DMAs and returns the same host tensors. After a
    structure change a part whose tensors all remain is kept; tensors that remain
    from a broken part keep their buffers through `out=<list>` (a loose part, one
    copy each; a few at most, see _MAX_LOOSE); the rest get a new fresh part.

    How the set knows it is still read, whatever the copy backend holds: the
    copy engine writes into its own host tensors (`buffers`), and may keep its own
    references to them, to their storages and to views it makes (the native
    `Transfer` holds its outputs, host bases and packed blocks for as long as the
    handle lives; the fallback holds fewer). Those counts are the backend's
    business and change with it, so none of them is looked at. Every tensor
    handed out in a staged dict is instead a view of `aliases[storage]`: the same
    bytes as the engine's block under a storage object of its own (made through
    DLPack, whose context keeps the pooled block alive), which the copy engine
    never sees. On the save that builds those views (`_bind`), into a set found
    free (so no reader exists), and before the staged dict is, `mark_baseline`
    records (a) the Python reference count of every object it hands out, (b)
    the use count of every alias storage and (c) the Python reference count of
    every alias storage's Python object: exactly the stager's own references.
    (Later saves to the set find it free only with every sum back at that
    baseline, so it is not taken again: ~4,000 reference counts a save saved.)
    Any later excess is a reader: the staged dict or one of its tensors kept (a),
    a new view taken from one (b), or the storage object of one
    (`tensor.untyped_storage()`, or a TypedStorage over it) kept (c). (c) is a
    count of its own because holding that object adds nothing to the use count:
    torch keeps one Python object per storage (in the StorageImpl's PyObject
    slot) and that object's one reference to the storage is in the baseline of
    (b) however many Python references it has, so only the Python reference count
    sees who holds it. The set holds each alias's storage object, so it stays the
    one torch hands to readers.
    """

    def __init__(self, index: int, block_bytes):
        self.index = index
        self.block_bytes = block_bytes  # the pool's HostPool.block_bytes: what a block of n bytes takes from it
        self.plan: Optional[_Plan] = None
        self.ptrs_version = -1  # the plan's ptrs_version at the set's last fill
        self.buffers: Dict[Any, torch.Tensor] = {}  # unit key -> the engine's host tensor for it
        self.parts: Dict[Tuple, Any] = {}  # unit keys (source order) -> the handle of their fresh copy
        # Per batch, the copies one save runs: [mode, source positions (None: all),
        # out, unit keys]; mode "reuse" (out = a part's handle), "loose" (out = a
        # list of kept buffers) or "fresh" (out = None; becomes "reuse" once run).
        self.calls: List[List[list]] = []
        self.blocks: Dict[int, torch.Tensor] = {}  # storage address -> uint8 over the engine's block
        self._held: Tuple[Optional[dict], int] = (None, 0)  # (the blocks dict, its held_bytes)
        self.aliases: Dict[int, torch.Tensor] = {}  # storage address -> the same bytes, another storage (readers)
        # The aliases' storage handles, for the use counts (valid: each alias holds its storage).
        self.alias_storages: List[int] = []
        self.alias_storage_objects: List[Any] = []  # their Python objects: extra references mean a reader
        self.host_leaves: List[Any] = []  # per tensor slot: what the staged dict holds (alias views)
        self.handles: List[Any] = []  # the handles of the last save's copies
        self.watch: List[Any] = []  # the objects handed out; extra references to them mean a reader
        self.ref_base = 0  # sum of the watched objects' reference counts with no reader
        self.use_base = 0  # sum of the alias storages' use counts with no reader
        self.storage_ref_base = 0  # sum of the alias storage objects' reference counts with no reader
        self.marked = False  # the three baselines are those of the current watch and aliases

    @property
    def held_bytes(self) -> int:
        """The pool's bytes this set holds: its blocks, at the pool's size classes.

        Asked several times a save (limits, metrics); computed once per `blocks`
        dict, which is replaced, never changed in place, when the blocks change."""
        blocks, held = self._held
        if blocks is not self.blocks:
            blocks = self.blocks
            held = sum(self.block_bytes(b.numel()) for b in blocks.values())
            self._held = (blocks, held)  # holds the dict itself: `is` cannot match a new one at its address
        return held

    @property
    def block_nbytes(self) -> int:
        """The bytes of its blocks as the copies asked for them (what they can hold)."""
        return sum(b.numel() for b in self.blocks.values())

    def busy_reason(self) -> Optional[str]:
        """Why the set cannot be written now, or None."""
        for handle in self.handles:
            if not handle.ready():
                return "its copy is still running"
        # Totals suffice: no count drops below its baseline while the stager holds
        # what it held then, so any excess in the sum is an excess somewhere.
        if refcount_sum(self.watch) > self.ref_base:
            return "the state dict staged into it is still referenced (an upload in progress?)"
        if _use_count is not None and self._alias_uses() > self.use_base:
            return "a view of its host buffers is still referenced"
        if refcount_sum(self.alias_storage_objects) > self.storage_ref_base:
            return "a storage object of its host buffers (tensor.untyped_storage()) is still referenced"
        return None

    def _alias_uses(self) -> int:
        return sum(map(_use_count, self.alias_storages))

    def mark_baseline(self) -> None:
        """Record the references this stager itself holds (call with no staged dict or reader alive)."""
        self.marked = True
        self.ref_base = refcount_sum(self.watch)
        self.storage_ref_base = refcount_sum(self.alias_storage_objects)
        if _use_count is not None:
            self.use_base = self._alias_uses()

    def release(self) -> None:
        self.plan = None
        self.buffers, self.parts, self.calls, self.blocks, self.aliases = {}, {}, [], {}, {}
        self.alias_storages, self.alias_storage_objects, self.storage_ref_base = [], [], 0
        self.host_leaves, self.handles, self.watch, self.ref_base, self.use_base = [], [], [], 0, 0
        self.marked = False


def _private_alias(block: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over `block`'s bytes whose storage no one else holds.

    DLPack gives a new storage whose deleter holds `block`, so the pooled memory
    stays alive (and out of the pool) while any view of the alias does.
    """
    alias = torch.from_dlpack(block)
    if alias.untyped_storage().data_ptr() != block.data_ptr() or (
        alias.untyped_storage()._cdata == block.untyped_storage()._cdata
    ):  # pragma: no cover - a torch whose from_dlpack returns a view of the same storage
        alias = torch.from_numpy(block.numpy())  # the array, held by the new storage, holds the block
    return alias


def _reader_views(engine_sides: List[torch.Tensor], blocks: dict, aliases: dict, old_blocks: dict,
                  old_aliases: dict) -> List[torch.Tensor]:
    """The tensors a staged dict holds for the engine's host tensors: the same bytes,
    layout and dtype, viewed through the private alias of each engine block.

    An alias per block (a few), made here or kept from `old_aliases`; the views in
    one core call (views_over), whose storage they hold like any view.
    """
    addresses = storage_addresses(engine_sides)
    for address, engine_side in dict(zip(addresses, engine_sides)).items():
        if not address:  # no elements: a view of nothing, no alias
            continue
        block, alias = old_blocks.get(address), old_aliases.get(address)
        if alias is None:
            storage = engine_side.untyped_storage()
            block = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            alias = _private_alias(block)
        blocks[address], aliases[address] = block, alias
    return views_over(engine_sides, aliases)


class _HostCopy:
    """A host-to-host copy (CPU tensors of a state dict that lives on an accelerator),
    shaped like the CopyHandle the stager keeps: done when it returns."""

    __slots__ = ("tensors", "meta")

    def __init__(self, tensors: List[torch.Tensor], meta: Optional[list] = None):
        self.tensors = tensors
        self.meta = list(map(_SHAPE_DTYPE, tensors)) if meta is None else meta  # per tensor (shape, dtype)

    def ready(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self) -> List[torch.Tensor]:
        return self.tensors

    def wait_stream(self, stream=None) -> None:
        pass


def _copy_on_host(sources: List[torch.Tensor], *, out=None, pool=None, group_bytes=None) -> _HostCopy:
    """copy_to_host's contract for CPU sources: fresh (one pooled block) or into `out`,
    which must match the sources in shape and dtype (ValueError otherwise, as the
    copy engine refuses a changed tensor), and the sources must still be on the host.

    Per save (`out` given) nothing runs per tensor in Python: the check compares
    C-level maps against the shapes and dtypes kept with `out`, and one
    torch._foreach_copy_ copies every pair (each a plain copy_, so bit for bit).
    """
    fn = "offload.AsyncStager.stage"
    if out is None:
        pool = pool if pool is not None else default_host_pool()
        block = pool.acquire(sum(_align(t.numel() * t.element_size()) for t in sources))
        dsts, offset = [], 0
        for t in sources:
            nbytes = t.numel() * t.element_size()
            dsts.append(block[offset : offset + nbytes].view(t.dtype).view(t.shape))
            offset += _align(nbytes)
        handle = _HostCopy(dsts)
    else:
        handle = out if isinstance(out, _HostCopy) else _HostCopy(out)
        dsts = handle.tensors
        if list(map(_SHAPE_DTYPE, sources)) != handle.meta or not all(map(_is_cpu, sources)):
            for i, (dst, src) in enumerate(zip(dsts, sources)):
                if dst.shape != src.shape or dst.dtype != src.dtype or not src.is_cpu:
                    raise ValueError(f"{fn}: host source {i} changed to {tuple(src.shape)} {src.dtype} on {src.device}")
    if sources:  # _foreach_copy_ refuses empty lists
        _foreach_copy(dsts, sources)
    return handle


def _first_save_bytes(tensors: List[torch.Tensor]) -> Tuple[int, int]:
    """About the host bytes a first save copies, and its largest tensor's bytes: each
    storage once, and never more of it than its tensors cover (a slice of a large
    buffer costs the slice)."""
    total, largest = storage_bytes(tensors)
    # Slack for the copy engine's packing (aligned offsets, block sizes in 2 MiB steps).
    return total + total // 256 + (2 << 20), largest


def _pool_bytes_estimate(units, block_bytes) -> int:
    """About the pool bytes that copying `units` afresh takes, before it runs.

    Units of at least DEFAULT_SMALL_BYTES get a block each from every copy backend,
    counted at the pool's size class; smaller ones are packed into groups or not,
    as the backend does, so their blocks' rounding is not known here and they
    count at their own bytes. A save checks the blocks it got (_over_limit).
    """
    return sum(block_bytes(u.nbytes) if u.nbytes >= DEFAULT_SMALL_BYTES else _align(u.nbytes) for u in units)


class _PoolGrowth:
    """The first save's host memory, grown on a worker thread while that save plans and copies.

    A first save costs its planning (Python), the pool's growth (first touch of
    fresh pages and their registration with the driver: native code that releases
    the interpreter lock) and the copy. Started before planning, the growth runs
    beside it, in large slabs (the pool touches the next while the driver pins
    one). The reservation is announced to the pool before the thread starts, so
    the first save's copies, which start once it has planned, take each slab as
    it is added instead of growing the pool beside it: the copy of the first
    slabs overlaps the growth of the last. A growth that fails (the pool's
    limit, say) ends the reservation: the copies then grow the pool as they go
    and report the limit themselves, with its usual message.
    """

    def __init__(self, pool: HostPool, nbytes: int, largest_block: int):
        self._thread = None
        announced = pool._begin_reserve(nbytes, largest_block)
        if not announced:
            return
        try:
            self._thread = threading.Thread(target=self._grow, args=(pool, announced),
                                            name="offload-stager-growth", daemon=True)
            self._thread.start()
        except BaseException:
            self._thread = None
            pool._cancel_reserve(announced)
            raise

    @staticmethod
    def _grow(pool: HostPool, nbytes: int) -> None:
        try:
            pool._grow_reserved(nbytes)
        except Exception:  # noqa: BLE001 - see the class docstring
            pass

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


class _Stale(Exception):
    """A copy refused a tensor the cached plan did not expect: plan again, checking every tensor."""


# ---------------------------------------------------------------- the future


class StagingFuture(Future):
    """The host state dict of one `stage()` call, complete once its copies are.

    No thread watches the copies: the future completes when someone asks —
    `result()` (which waits; the wait releases the interpreter lock), `done()`,
    `exception()` or `AsyncStager.synchronize_staging()`. DCP's upload thread calls
    `result()` at once, so `AsyncSaveResponse.staging_completion` fires on time.
    The dict itself is made by the first `result()` (on DCP's upload thread, so not
    inside `stage()`), from the leaves as they were at `stage()`. While this future
    (or the dict it returns) is alive, its buffer set is busy.
    """

    def __init__(self, build, scalars, host_leaves, handles, spent=None):
        super().__init__()
        self._spent = spent  # the stager's handles of earlier saves, let go by result() (AsyncStager._spent)
        # What the staged dict is made of, until the first result() makes it
        # (StateTree.build): the non-tensor leaves as of stage() and a list of the
        # host tensors of its own, which keeps the buffer set busy meanwhile.
        self._parts = (build, scalars, host_leaves)
        self._staged = None
        self._pending = [h for h in handles if h is not None]
        self._finish_lock = threading.Lock()
        # Not _finish_lock: set_result runs done-callbacks (DCP's calls result())
        # in the thread that holds that one.
        self._build_lock = threading.Lock()
        self._finish(block=False)

    def _finish(self, block: bool, timeout: Optional[float] = None) -> None:
        if Future.done(self):
            return
        pending = self._pending
        if pending is None:
            return
        try:
            if block and timeout is not None:
                deadline = time.perf_counter() + timeout
                while not all(h.ready() for h in pending):
                    if time.perf_counter() >= deadline:
                        return
                    time.sleep(0.0005)
            elif block:
                for handle in pending:
                    handle.synchronize()
            elif not all(h.ready() for h in pending):
                return
        except BaseException as error:  # a failed copy fails the future, not the waiter's thread
            with self._finish_lock:
                if not Future.done(self):
                    self._pending = None
                    with self._build_lock:  # a dict made while the copies ran is never handed out
                        self._parts = self._staged = None
                    self.set_exception(error)
            return
        with self._finish_lock:
            if not Future.done(self):
                self._pending = None
                self.set_result(None)  # the copies are complete; result() returns the staged dict

    def _staged_dict(self):
        with self._build_lock:
            if self._parts is not None:
                build, scalars, host_leaves = self._parts
                self._staged = build(scalars, host_leaves)
                self._parts = None
            return self._staged

    def done(self) -> bool:
        self._finish(block=False)
        return super().done()

    def result(self, timeout: Optional[float] = None):
        if not Future.done(self):
            self._staged_dict()  # made while the copies run: it reads none of their bytes
        # Earlier saves' handles (their copies are complete) go while this one's copies
        # run, not after the wait, where freeing them would delay the return.
        if self._spent:
            self._spent.clear()
        self._finish(block=True, timeout=timeout)
        super().result(timeout=None if super().done() else 0)  # raises a failed copy's error, or TimeoutError
        return self._staged_dict()

    def exception(self, timeout: Optional[float] = None):
        self._finish(block=True, timeout=timeout)
        return super().exception(timeout=None if super().done() else 0)


# ---------------------------------------------------------------- the stager


class AsyncStager(_StagerProtocol):
    """Stages state dicts into reused pinned host buffers without blocking the caller.

    Args:
        ring_size: host buffer sets kept (>= 1). A save while every set is still
            read (copy running, or its staged dict alive, e.g. an upload in
            progress) waits for one or raises, per `when_busy`.
        pool: where host buffers come from (default `offload.default_host_pool()`).
        limit_bytes: most host memory all sets together may hold (int or '8GiB';
            None: only the pool's limit), counted as the pool counts its blocks
            (rounded up to its size classes, see `host_bytes()`). The ring does
            not grow past it; a single state dict larger than it raises RuntimeError.
        when_busy: "wait" (default) or "raise" when all sets are busy.
        busy_timeout_s: longest wait for a busy set before RuntimeError.
        forward_buffers: tensors that change during the forward pass (BatchNorm
            running statistics, fp8 scaling history): an nn.Module (all its
            buffers) or state-dict paths ("model.bn.running_mean", keys joined by
            dots). They are copied first, and the compute stream waits for that
            small copy on the device, so the next forward cannot change them
            before they are copied. Parameters and optimizer state are guarded by
            `protect(optimizer)` instead.

    `stage()` returns a `StagingFuture` (a `concurrent.futures.Future`) of the
    host state dict; with a torch whose `async_save` cannot take a future
    (< 2.9) it waits for the copy and returns the dict itself.
    """

    # DCP must not block after starting the upload: the future says when staging is done.
    _synchronize_after_execute: bool = False

    def __init__(
        self,
        ring_size: int = 2,
        *,
        pool: Optional[HostPool] = None,
        limit_bytes=None,
        when_busy: str = "wait",
        busy_timeout_s: float = 600.0,
        forward_buffers=None,
    ):
        fn = "offload.AsyncStager"
        if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
            raise ValueError(f"{fn}: ring_size must be an int >= 1, got {ring_size!r}")
        if when_busy not in ("wait", "raise"):
            raise ValueError(f"{fn}: when_busy must be 'wait' or 'raise', got {when_busy!r}")
        if not busy_timeout_s > 0:
            raise ValueError(f"{fn}: busy_timeout_s must be > 0, got {busy_timeout_s!r}")
        if pool is not None and not isinstance(pool, HostPool):
            raise TypeError(f"{fn}: pool must be an offload.HostPool, got {type(pool).__name__}")
        self._pool = pool
        self._limit = 0 if limit_bytes is None else parse_bytes(limit_bytes, f"{fn}: limit_bytes")
        self._ring_size = ring_size
        self._when_busy = when_busy
        self._busy_timeout_s = float(busy_timeout_s)
        self._forward_module, self._forward_paths = _forward_buffers(fn, forward_buffers)
        self._return_future = _async_save_takes_futures()
        self._tree: Optional[StateTree] = None
        self._pickers: Tuple = (None, list, list)  # (tree, _picker of its tensor leaves, of its other leaves)
        self._plan: Optional[_Plan] = None
        self._sets: List[_BufferSet] = []
        # (set, batch) -> the handle the compute stream has not waited on yet; keyed so
        # it never holds a handle the set itself has dropped (see _BufferSet.busy_reason).
        self._unwaited: Dict[Tuple[int, int], Any] = {}
        self._metrics: deque = deque(maxlen=_METRICS_KEPT)
        # Records whose copy time is not read yet: they hold the copies' handles (and so
        # host buffers), so they are read as soon as the copies are done (_read_timings).
        self._untimed: deque = deque()
        # The handles of saves whose copy times were read, let go by a later future's
        # result() (DCP's upload thread, or after the caller's own wait) rather than in
        # stage(): freeing the handle of 4,000 copies took ~0.2 ms of the caller's time
        # on the H100's host. Bounded for callers that never ask for a result.
        self._spent: list = []
        self._saves = 0
        self._closed = False
        self._growth: Optional[_PoolGrowth] = None  # the first save's pool growth, while it plans
        self._measured: Optional[Tuple] = None  # (plan, pool bytes a fresh set for it took), see _set_bytes

    # ------------------------------------------------------------ protocol

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict, **kwargs):
        """Enqueue the copy of `state_dict` to host buffers; return a future of the host copy.

        The copy holds every tensor's value as of this call (the copy stream waits,
        on the device, for the work queued before it). The caller must not change
        the tensors on the host side or on another stream until the copy is done;
        `protect(optimizer)` makes the optimizer's step wait for it on the device.
        """
        fn = "offload.AsyncStager.stage"
        if kwargs:
            raise TypeError(f"{fn}: unexpected keyword arguments {sorted(kwargs)}")
        if self._closed:
            raise RuntimeError(f"{fn}: the stager is closed; make a new offload.AsyncStager")
        with _gc_paused():
            try:
                return self._stage(fn, state_dict)
            finally:
                self._join_growth()  # a save that failed while planning leaves no thread behind

    def _stage(self, fn, state_dict):
        t_enter = time.perf_counter()
        thorough = replanned = False
        while True:
            leaves, plan, locals_, checked = self._resolve(fn, state_dict, thorough)
            replanned |= plan is not self._plan  # a retry (_Stale, _over_limit) keeps what the first try saw
            self._plan = plan
            t_wait = time.perf_counter()
            ring = len(self._sets)
            buffer_set = self._acquire_set(fn, plan)
            waited_ms = (time.perf_counter() - t_wait) * 1e3
            reused, allocated = len(plan.units), 0
            held_before = buffer_set.held_bytes
            if buffer_set.plan is not plan:
                reused, allocated = self._prepare(fn, buffer_set, plan)
                held_before = buffer_set.held_bytes
            # A first save's growth (_PoolGrowth) goes on while it copies: joined once it has.
            # Addresses of the tensors the core copies: compared by the refills of a
            # set bound to this plan (same_sources), else here, before any copy.
            same_sources = not checked and self._refills_only(buffer_set, plan)
            if not checked and not same_sources:
                try:
                    moved = not _same_data_ptrs(locals_, plan.ptrs, plan.core_slots)
                except RuntimeError:  # a tensor without storage: planning names it
                    moved = True
                if moved:
                    thorough = True
                    continue
            try:
                timing, copy_seconds = self._enqueue(plan, buffer_set, locals_, checked, same_sources)
            except _Stale:  # a tensor changed under the cached plan; the set is ours, so just redo it
                thorough = True
                continue
            buffer_set.ptrs_version = plan.ptrs_version
            if self._limit and buffer_set.held_bytes > held_before and self.host_bytes() > self._limit:
                self._over_limit(fn, buffer_set, plan, new_set=len(self._sets) > ring)
                continue  # another set of the ring takes the save (_acquire_set waits or raises)
            break
        allocated_bytes = max(0, buffer_set.held_bytes - held_before)
        if not buffer_set.marked:
            buffer_set.mark_baseline()
        # The future makes the staged dict when first asked for it (DCP's upload
        # thread), not here; until then its own list of the host tensors keeps the
        # set busy, and it keeps the other leaves as they are now.
        scalars = self._pickers[2](leaves)
        future = StagingFuture(plan.tree.build, scalars, list(buffer_set.host_leaves), buffer_set.handles,
                               self._spent)
        self._saves += 1
        self._metrics.append(
            {
                "save": self._saves,
                "set": buffer_set.index,
                "bytes": plan.copy_bytes,
                "tensors": len(plan.meta),
                "copies": len(plan.units),
                "blocked_ms": (time.perf_counter() - t_enter) * 1e3,
                "waited_ms": waited_ms,
                "copy_ms": None if timing else copy_seconds * 1e3,
                "gbps": None,
                "replanned": replanned,
                "buffers_reused": reused,
                "buffers_allocated": allocated,
                "allocated_bytes": allocated_bytes,
                "host_bytes": self.host_bytes(),
                "_timing": timing,
            }
        )
        if timing:
            self._untimed.append(self._metrics[-1])
        self._read_timings()
        if self._return_future:
            return future
        return future.result()

    def _read_timings(self, final: bool = False) -> None:
        """Read the copy times of finished saves, oldest first; `final`: drop the rest."""
        while self._untimed:
            record = self._untimed[0]
            timing = record["_timing"]
            _resolve_timing(record)
            if record["_timing"] is not None and not final:
                break
            record["_timing"] = None
            if timing:
                self._spent.append(timing)
            self._untimed.popleft()
        if final or len(self._spent) > _SPENT_KEPT:
            self._spent.clear()

    def synchronize_staging(self) -> None:
        """Block the host until every enqueued staging copy has completed."""
        for buffer_set in self._sets:
            for handle in buffer_set.handles:
                if handle is not None:
                    handle.synchronize()

    def close(self) -> None:
        """Wait for running copies and drop every buffer set.

        Buffers go back to the pool once the last staged dict that uses them is
        released. The stager cannot stage after this.
        """
        if self._closed:
            return
        self.synchronize_staging()
        self._read_timings(final=True)  # the copies are done: no record keeps a handle
        for buffer_set in self._sets:
            buffer_set.release()
        self._sets = []
        self._unwaited = {}
        self._tree = self._plan = self._measured = None
        self._pickers = (None, list, list)
        self._closed = True

    def __enter__(self) -> "AsyncStager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ keeping the snapshot consistent

    def wait_stream(self, stream=None) -> None:
        """Make `stream` (default: the current one) wait, on the device, for the staging copies.

        Call it before anything that writes the staged tensors on the device (the
        optimizer step); `protect(optimizer)` does it for you. The host is not blocked.
        """
        pending, self._unwaited = self._unwaited, {}
        for handle in pending.values():
            handle.wait_stream(stream)

    def protect(self, optimizer):
        """Make `optimizer.step()` wait (on the device, not the host) for the last staging copy.

        Returns the hook handle; `.remove()` undoes it.
        """
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(
                "offload.AsyncStager.protect: optimizer must be a torch.optim.Optimizer, "
                f"got {type(optimizer).__name__}"
            )
        return optimizer.register_step_pre_hook(lambda *_: self.wait_stream())

    # ------------------------------------------------------------ introspection

    def metrics(self) -> List[dict]:
        """Per save, oldest first: bytes, tensors, blocked_ms (time inside stage),
        waited_ms (of it, waiting for a free buffer set), copy_ms and gbps (None
        until the copy is observed complete), replanned, buffers_reused,
        buffers_allocated, allocated_bytes, host_bytes, set."""
        out = []
        for record in self._metrics:
            _resolve_timing(record)
            out.append({k: v for k, v in record.items() if not k.startswith("_")})
        return out

    def host_bytes(self) -> int:
        """Host memory held by all buffer sets, as the pool counts it (`HostPool.block_bytes`
        of each block: rounded up to the pool's size classes), which `limit_bytes` bounds."""
        return sum(s.held_bytes for s in self._sets)

    @property
    def ring_size(self) -> int:
        return self._ring_size

    # ------------------------------------------------------------ planning

    def _resolve(self, fn, state_dict, thorough: bool = False):
        """(leaves, plan, local tensors, checked): reuse the cached tree and plan where they still fit.

        With the cached plan and not `thorough`, only what no copy checks is
        compared here: the layouts of `_Plan.watched_slots` and the addresses of
        `_Plan.host_slots`. The copies check every other tensor's layout against
        the buffers they refill, and its address (same_sources) where they refill
        a set bound to this plan (else `_stage` compares those addresses); a copy
        that refuses a tensor raises ValueError, and `stage` then plans again with
        `thorough` set. `checked` says every tensor was compared here.
        """
        tree = self._tree
        leaves = None
        if tree is not None:
            try:
                leaves = tree.leaves(state_dict)
            except Mismatch:
                tree = None
        if tree is None:
            tree = StateTree(fn, state_dict)
            leaves = tree.leaves(state_dict)
            self._tree = tree
        if self._pickers[0] is not tree:
            count = len(tree.leaf_types)
            # The tensors: a list no one changes (locals_ is a copy where it differs).
            self._pickers = (tree, _picker(tree.tensor_pos, count, fresh=False), _picker(tree.scalar_pos, count))
        tensors = self._pickers[1](leaves)
        specs = None
        locals_ = tensors
        if tree.dtensor_slots:
            locals_ = list(tensors)
            for slot in tree.dtensor_slots:
                locals_[slot] = tensors[slot]._local_tensor
            specs = [tensors[slot]._spec for slot in tree.dtensor_slots]
        plan = self._plan
        if plan is None and not self._sets:
            self._start_growth(locals_)
        try:
            stale = (
                plan is None
                or plan.tree is not tree
                or specs != plan.specs
                or (plan.watched_slots
                    and [_layout_of(locals_[s])[1:] for s in plan.watched_slots] != plan.watched_layouts)
                or (thorough and list(map(_META, locals_)) != plan.meta)
            )
            if stale:
                moved = False
            elif thorough:
                moved = not _same_data_ptrs(locals_, plan.ptrs, plan.ptr_indices)
            else:
                moved = bool(plan.host_slots) and not _same_data_ptrs(locals_, plan.ptrs, plan.host_slots)
        except RuntimeError:  # a tensor without storage (sparse, say): planning checks every tensor and names it
            stale = True
        if stale:
            return leaves, self._new_plan(fn, tree, locals_, specs), locals_, True
        if moved:
            # New storages (a state dict rebuilt from reallocated tensors): the
            # aliasing may have changed; keep the plan if it did not.
            fresh = self._new_plan(fn, tree, locals_, specs)
            if fresh.signature == plan.signature and fresh.meta == plan.meta:
                plan.ptrs = fresh.ptrs
                plan.ptrs_version += 1
                plan.watched_layouts = fresh.watched_layouts
            else:
                plan = fresh
            return leaves, plan, locals_, True
        return leaves, plan, locals_, thorough

    def _start_growth(self, locals_) -> None:
        """Grow a native pool by about what the first save copies, beside its planning (_PoolGrowth)."""
        pool = self._host_pool()
        if not pool.native:  # torch's pinned cache keeps blocks by size: a reserve would not serve them
            return
        try:
            nbytes, largest = _first_save_bytes(locals_)
        except Exception:  # noqa: BLE001 - a tensor planning refuses (meta, say): planning says why
            return
        if self._limit and nbytes > self._limit:
            return  # planning raises the stager's own limit error
        # Cached free blocks (a closed stager's, say) serve the copies first: grow by the rest.
        nbytes -= pool.stats()["free_bytes"]
        if nbytes >= _GROWTH_MIN_BYTES:
            try:
                # Copies pack small tensors into blocks of up to _GROUP_BYTES; larger ones get their own.
                self._growth = _PoolGrowth(pool, nbytes, max(largest, _GROUP_BYTES))
            except Exception:  # noqa: BLE001 - the pool's limit, say: the copies report it (see _PoolGrowth)
                self._growth = None

    def _host_pool(self) -> HostPool:
        return self._pool if self._pool is not None else default_host_pool()

    def _join_growth(self) -> None:
        growth, self._growth = self._growth, None
        if growth is not None:
            growth.join()

    def _new_plan(self, fn, tree, locals_, specs) -> _Plan:
        # A cached tree compared only the leaves' types: a tensor may have turned
        # meta or sparse since the tree was built. The first save's check says so.
        tree.check_tensors(locals_)
        early_ptrs = set()
        if self._forward_module is not None:
            early_ptrs = {(b.device, b.data_ptr()) for b in self._forward_module.buffers() if b.numel()}
        early_paths = set()
        if self._forward_paths:
            dotted = {".".join(map(str, tree.paths[pos])): tree.paths[pos] for pos in tree.tensor_pos}
            missing = sorted(set(self._forward_paths) - set(dotted))
            if missing:
                known = ", ".join(sorted(dotted)[:5])
                raise ValueError(
                    f"{fn}: forward_buffers names {missing} which are not tensors of the state dict; "
                    f"paths are keys joined by dots, e.g. {known}"
                )
            early_paths = {dotted[p] for p in self._forward_paths}
        tensor_paths = [tree.paths[pos] for pos in tree.tensor_pos]
        return _Plan(fn, tree, locals_, specs, early_ptrs, early_paths, tensor_paths)

    # ------------------------------------------------------------ the ring

    def _acquire_set(self, fn, plan: _Plan) -> _BufferSet:
        deadline = time.perf_counter() + self._busy_timeout_s
        collected, pause = False, 0.0005
        while True:
            reasons = []
            for buffer_set in self._sets:
                reason = buffer_set.busy_reason()
                if reason is None:
                    return buffer_set
                reasons.append(f"set {buffer_set.index}: {reason}")
            if len(self._sets) < self._ring_size and self._fits_new_set(fn, plan):
                buffer_set = _BufferSet(len(self._sets), self._host_pool().block_bytes)
                self._sets.append(buffer_set)
                return buffer_set
            if self._when_busy == "raise":
                raise RuntimeError(
                    f"{fn}: all {len(self._sets)} host buffer sets are busy ({'; '.join(reasons)}); wait for "
                    "the previous save (response.upload_completion.result()), release its staged dict, or "
                    "raise ring_size (and limit_bytes)"
                )
            running = [h for s in self._sets for h in s.handles if h is not None and not h.ready()]
            if running:
                running[0].synchronize()
                continue
            if not collected:  # a staged dict caught in a reference cycle is freed only by the collector
                gc.collect()
                collected = True
                continue
            if time.perf_counter() >= deadline:
                raise RuntimeError(
                    f"{fn}: waited {self._busy_timeout_s:.0f} s for a free host buffer set, all "
                    f"{len(self._sets)} still busy ({'; '.join(reasons)}); release old staged dicts "
                    "or raise ring_size / busy_timeout_s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _fits_new_set(self, fn, plan: _Plan) -> bool:
        if not self._limit:
            return True
        held, need = self.host_bytes(), self._set_bytes(plan)
        if held + need <= self._limit:
            return True
        if not self._sets:
            raise RuntimeError(
                f"{fn}: the state dict needs {need} bytes of host buffers but limit_bytes is "
                f"{self._limit}; raise AsyncStager(limit_bytes=...)"
            )
        return False  # wait for a set in use rather than grow past the limit

    def _set_bytes(self, plan: _Plan) -> int:
        """The pool bytes a new set for `plan` takes: what a set already fitted to it
        holds, or what one took before (_over_limit), else the estimate."""
        for buffer_set in self._sets:
            if buffer_set.plan is plan:
                return buffer_set.held_bytes
        if self._measured is not None and self._measured[0] is plan:
            return self._measured[1]
        return _pool_bytes_estimate(plan.units, self._host_pool().block_bytes)

    def _over_limit(self, fn, buffer_set: _BufferSet, plan: _Plan, new_set: bool) -> None:
        """The blocks a save just took pass limit_bytes (the pool rounded them up past
        the estimate): the set gives its buffers back once its copies are done, and
        what it took is remembered so the ring does not grow for this plan again.
        Returns when the ring has other sets to take the save; raises otherwise."""
        took, total = buffer_set.held_bytes, self.host_bytes()
        for handle in buffer_set.handles:
            handle.synchronize()
        buffer_set.release()
        self._forget_unwaited(buffer_set.index)
        self._measured = (plan, took)
        if new_set:
            self._sets.pop()  # made for this save: the last one
            if self._sets:
                return
        beside = f", beside {total - took} held by the other sets," if total > took else ""
        raise RuntimeError(
            f"{fn}: staging this state dict takes {took} bytes of pooled host buffers ({plan.copy_bytes} bytes "
            f"of tensors, in blocks the pool rounds up to its size classes){beside} but limit_bytes is "
            f"{self._limit}; raise AsyncStager(limit_bytes=...)"
        )

    def _forget_unwaited(self, index: int) -> None:
        """Drop set `index`'s handles from those the compute stream has yet to wait on."""
        for key in [key for key in self._unwaited if key[0] == index]:
            del self._unwaited[key]

    def _prepare(self, fn, buffer_set: _BufferSet, plan: _Plan) -> Tuple[int, int]:
        """Fit the set to a new plan: keep its parts and buffers that still match,
        copy the rest fresh. Returns (units reused, units allocated)."""
        calls, parts, buffers, fresh_units = self._fit(buffer_set, plan, buffer_set.parts, buffer_set.buffers)
        kept_bytes = sum(_align(t.numel() * t.element_size()) for t in buffers.values())
        if fresh_units and kept_bytes * 2 < buffer_set.block_nbytes:
            # Mostly new: start afresh rather than keep old blocks half empty.
            calls, parts, buffers, fresh_units = self._fit(buffer_set, plan, {}, {})
        if self._limit and fresh_units:
            block_bytes = buffer_set.block_bytes
            new_bytes = _pool_bytes_estimate(fresh_units, block_bytes)
            kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffers.values() if t.numel()}
            after = self.host_bytes() - buffer_set.held_bytes + sum(map(block_bytes, kept.values())) + new_bytes
            if after > self._limit:
                raise RuntimeError(
                    f"{fn}: staging needs {new_bytes} more bytes of host buffers ({after} in all) but "
                    f"limit_bytes is {self._limit}; raise AsyncStager(limit_bytes=...) or ring_size=1"
                )
        buffer_set.calls, buffer_set.parts, buffer_set.buffers = calls, parts, buffers
        buffer_set.plan = None  # bound by _enqueue, once every fresh copy has returned its buffers
        return len(plan.units) - len(fresh_units), len(fresh_units)

    @staticmethod
    def _fit(buffer_set, plan: _Plan, old_parts, old_buffers):
        """(calls per batch, parts kept, buffers kept, units to copy fresh) for `plan`."""
        calls, parts, buffers, fresh_units = [], {}, {}, []
        for batch in plan.batches:
            index = {key: i for i, key in enumerate(batch.keys)}
            batch_calls = []
            for keys, handle in old_parts.items():
                if all(key in index for key in keys):
                    parts[keys] = handle
                    batch_calls.append(["reuse", [index[key] for key in keys], handle, keys])
                    for key in keys:
                        buffers[key] = old_buffers[key]
            loose, fresh = [], []
            for i, key in enumerate(batch.keys):
                if key not in buffers:
                    (loose if key in old_buffers else fresh).append(i)
            if len(loose) > _MAX_LOOSE:
                fresh += [i for i in loose if batch.units[i].nbytes < DEFAULT_SMALL_BYTES]
                loose = [i for i in loose if batch.units[i].nbytes >= DEFAULT_SMALL_BYTES]
                fresh.sort()
            if loose:
                keys = tuple(batch.keys[i] for i in loose)
                batch_calls.append(["loose", loose, [old_buffers[key] for key in keys], keys])
                for key in keys:
                    buffers[key] = old_buffers[key]
            if fresh:
                batch_calls.append(["fresh", fresh, None, tuple(batch.keys[i] for i in fresh)])
                fresh_units += [batch.units[i] for i in fresh]
            for call in batch_calls:
                if call[1] == list(range(len(batch.keys))):
                    call[1] = None  # the batch's sources as they are, in order: nothing to pick
            calls.append(batch_calls)
        return calls, parts, buffers, fresh_units

    def _bind(self, buffer_set: _BufferSet, plan: _Plan) -> None:
        """The staged dict's tensor leaves: views of private aliases of the engine's
        blocks (`_reader_views`), made here and never given to the copy engine."""
        blocks: Dict[int, torch.Tensor] = {}
        aliases: Dict[int, torch.Tensor] = {}
        host_leaves: List[Any] = [None] * len(plan.meta)
        units, buffers = plan.units, buffer_set.buffers
        hosts = _reader_views([buffers[unit.key] for unit in units], blocks, aliases, buffer_set.blocks,
                              buffer_set.aliases)
        for unit, host in zip(units, hosts):
            if unit.kind == "tensor":
                if unit.expanded:
                    host = host.expand(unit.shape)
                for slot in unit.slots:
                    host_leaves[slot] = host
                continue
            views: Dict[Tuple, torch.Tensor] = {}
            for slot, (offset, shape, stride, dtype) in zip(unit.slots, unit.members):
                view = views.get((offset, shape, stride, dtype))
                if view is None:
                    extent = (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * dtype.itemsize
                    view = host[offset : offset + extent].view(dtype).as_strided(shape, stride)
                    views[(offset, shape, stride, dtype)] = view
                host_leaves[slot] = view
        watch = [leaf for leaf in host_leaves]
        if plan.specs is not None:
            dtensor = dtensor_type()
            for slot, spec in zip(plan.tree.dtensor_slots, plan.specs):
                # The DTensor constructor (not from_local) keeps the local tensor on the host.
                host_leaves[slot] = dtensor(host_leaves[slot], spec, requires_grad=False)
                watch.append(host_leaves[slot])
        buffer_set.blocks, buffer_set.aliases = blocks, aliases
        buffer_set.alias_storage_objects = [a.untyped_storage() for a in aliases.values()]
        buffer_set.alias_storages = [storage._cdata for storage in buffer_set.alias_storage_objects]
        buffer_set.host_leaves = host_leaves
        buffer_set.watch = list({id(o): o for o in watch}.values())
        buffer_set.marked = False
        buffer_set.plan = plan

    # ------------------------------------------------------------ copying

    @staticmethod
    def _refills_only(buffer_set: _BufferSet, plan: _Plan) -> bool:
        """Whether every copy of the core's batches refills a handle of `buffer_set`, bound to
        `plan` and last filled from the addresses the plan holds now (so the core's record of
        them is the plan's)."""
        return buffer_set.plan is plan and buffer_set.ptrs_version == plan.ptrs_version and all(
            call[0] == "reuse" for batch, calls in zip(plan.batches, buffer_set.calls) if batch.asynchronous
            for call in calls
        )

    def _enqueue(self, plan: _Plan, buffer_set: _BufferSet, locals_, checked: bool, same_sources: bool = False):
        """Enqueue every batch; returns (per-device timed handles, or None on the host; host copy seconds).

        Raises _Stale when a copy refuses a tensor that `_resolve` did not compare
        (`checked` false), having enqueued nothing that could harm the set: copies
        already queued write only this set's buffers, and the retry refills them
        after those copies, on the same stream.
        `same_sources`: refills also refuse a tensor at another address than the
        set's last fill (see `_resolve`).
        """
        timing: Dict[Any, list] = {}
        t0 = time.perf_counter()
        early_handles = []
        handles: List[Any] = []
        rebind = buffer_set.plan is not plan
        buffer_set.handles = handles  # filled as copies are enqueued: the set is busy while any runs
        self._forget_unwaited(buffer_set.index)  # this set's earlier copies: never hold a handle the set dropped
        with torch.no_grad():
            for number, batch in enumerate(plan.batches):
                if not batch.early and early_handles:
                    # The next forward may change these buffers: the compute stream
                    # waits (on the device) for their small copy, not for the rest.
                    for handle in early_handles:
                        handle.wait_stream()
                    early_handles = []
                sources = batch.pick_sources(locals_)
                for unit in batch.spans:
                    first = locals_[unit.slots[0]]
                    storage = first.untyped_storage()
                    offset = first.data_ptr() - storage.data_ptr() + unit.span_rel
                    span = torch.empty(0, dtype=torch.uint8, device=first.device)
                    sources.append(span.set_(storage, offset, (unit.nbytes,), (1,)))
                for i in batch.expanded:  # the host keeps one copy of broadcast elements
                    sources[i] = compact(sources[i])[0]
                device = batch.device
                timed = False
                if batch.asynchronous:
                    copy = copy_to_host
                    if sources and sources[0].device != device:
                        if checked:  # pragma: no cover - a plan made from these tensors has their device
                            raise RuntimeError("offload.AsyncStager: staging plan out of date")
                        raise _Stale()
                    timed = _device.is_accelerator(device)
                else:
                    copy = _copy_on_host
                # Early batches are waited for at once: only the rest is worth deferring.
                defer = timed and not batch.early
                for call in buffer_set.calls[number]:
                    try:
                        handle, fresh = self._run_call(copy, call, sources, buffer_set, checked, timed, defer,
                                                       same_sources and batch.asynchronous)
                    except _Stale:
                        for running in handles:  # the retry may pick this set again
                            running.synchronize()
                        if rebind:
                            buffer_set.plan = None
                        raise
                    rebind |= fresh
                    handles.append(handle)
                    if timed:
                        timing.setdefault(device, []).append(handle)
                    if batch.early:
                        early_handles.append(handle)
                    if _device.is_accelerator(device) and batch.asynchronous:
                        self._unwaited[(buffer_set.index, len(handles))] = handle
            for handle in early_handles:
                handle.wait_stream()
        if rebind:
            self._bind(buffer_set, plan)
        return (timing or None), time.perf_counter() - t0

    def _run_call(self, copy, call, sources, buffer_set: _BufferSet, checked: bool, timed: bool = False,
                  defer: bool = False, same_sources: bool = False):
        """Run one copy of a batch; returns (its handle, whether it made new buffers).

        `timed`: the core times the copies on the copy stream (`copy_seconds`). `defer`:
        a refill of a part's handle (the steady state) is checked here, source by source,
        and queued by the core's worker thread, which never takes the interpreter lock
        (copy_to_host's defer), so the caller is back before the groups are queued.
        `same_sources`: a refill also refuses a source at another address than at the
        set's last fill (copy_to_host's same_sources).
        """
        mode, positions, out, keys = call
        picked = sources if positions is None else _pick(sources, positions)
        extra = {"timing": True} if timed else {}
        if mode != "fresh":
            options = extra
            if mode == "reuse" and (defer or same_sources):  # copy_to_host's only (_copy_on_host takes neither)
                options = dict(extra, defer=defer, same_sources=same_sources)
            try:
                return copy(picked, out=out, pool=self._pool, **options), False
            except ValueError:
                if not checked:
                    raise _Stale() from None
                if mode != "reuse":
                    raise
                # Same shapes and dtypes, other strides: this part is copied afresh.
                del buffer_set.parts[keys]
        handle = copy(picked, out=None, pool=self._pool, group_bytes=_GROUP_BYTES, **extra)
        buffer_set.parts[keys] = handle
        buffer_set.buffers.update(zip(keys, handle.tensors))
        call[0], call[2] = "reuse", handle
        return handle, True


@contextlib.contextmanager
def _gc_paused():
    """Hold off the cycle collector while a save builds thousands of small tuples.

    Every shape and stride tuple counts toward the collector's allocation
    threshold; in a process holding a model, the collections they trigger cost
    several times the save's own work. Nothing built here forms a cycle, so
    reference counting frees it all.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _resolve_timing(record: dict) -> None:
    timing = record.get("_timing")
    if timing:
        # Per device, its copies run one after another on its copy stream: their sum.
        per_device = []
        for handles in timing.values():
            try:
                seconds = [handle.copy_seconds() for handle in handles]
            except Exception:  # noqa: BLE001 - a failed copy: its save's future raises the error
                record["_timing"] = None
                return
            if None in seconds:
                return  # not complete yet (copy_seconds never waits)
            per_device.append(sum(seconds))
        record["copy_ms"] = max(per_device) * 1e3
        record["_timing"] = None
    if record["copy_ms"] is not None and record["gbps"] is None and record["copy_ms"] > 0:
        record["gbps"] = record["bytes"] / (record["copy_ms"] * 1e-3) / 1e9


def _forward_buffers(fn, value):
    """(module or None, tuple of dotted paths) from the forward_buffers argument."""
    if value is None:
        return None, ()
    if isinstance(value, torch.nn.Module):
        return value, ()
    if isinstance(value, str):
        value = [value]
    try:
        paths = tuple(value)
    except TypeError:
        raise TypeError(
            f"{fn}: forward_buffers must be an nn.Module or state-dict paths, got {type(value).__name__}"
        ) from None
    for path in paths:
        if not isinstance(path, str):
            raise TypeError(f"{fn}: forward_buffers paths must be str such as 'model.bn.running_mean', got {path!r}")
    return None, paths


__all__ = ["AsyncStager", "StagingFuture"]
