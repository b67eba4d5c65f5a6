"""The ring of host buffer sets a stager fills: which set a save takes, what each set
holds, and how a set knows whether anyone still reads it."""

from __future__ import annotations

import gc
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core.copy import DEFAULT_SMALL_BYTES
from .object_scan import refcount_sum, storage_addresses, views_over
from .plan import CopyPlan, align, pool_bytes_estimate
from .state_tree import dtensor_type

# After a structure change, small tensors that remain from a broken packed part
# keep their buffers (one copy each from then on) only if there are this few;
# more are packed afresh: one DMA per group beats one per tensor on every later save.
MAX_LOOSE = 16

_use_count = getattr(torch._C, "_storage_Use_Count", None)

# Note [parts of a buffer set]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The first save into a set copies each batch with a fresh `copy_to_host` (no
# `out`), so the copy engine packs small tensors into pooled blocks of up to the
# stager's group size, one DMA each; the set keeps that handle (a "part") and
# later saves pass it back as `out=`, which refills the same blocks with the same
# DMAs and returns the same host tensors. After a structure change a part whose
# tensors all remain is kept; tensors that remain from a broken part keep their
# buffers through `out=<list>` (a loose part, one copy each; a few at most, see
# MAX_LOOSE); the rest get a new fresh part.
#
# Note [who reads a buffer set]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The copy engine writes into its own host tensors (`buffers`), and may keep its
# own references to them, to their storages and to views it makes (the native
# `Transfer` holds its outputs, host bases and packed blocks for as long as the
# handle lives; the fallback holds fewer). Those counts are the backend's
# business and change with it, so none of them is looked at. Every tensor handed
# out in a staged dict is instead a view of `aliases[storage]`: the same bytes as
# the engine's block under a storage object of its own (made through DLPack,
# whose context keeps the pooled block alive), which the copy engine never sees.
# On the save that builds those views (`bind`), into a set found free (so no
# reader exists), and before the staged dict is, `mark_baseline` records (a) the
# Python reference count of every object it hands out, (b) the use count of
# every alias storage and (c) the Python reference count of every alias
# storage's Python object: exactly the stager's own references. Later saves to
# the set find it free only with every sum back at that baseline, so it is not
# taken again. Any later excess is a reader: the staged dict or one of its
# tensors kept (a), a new view taken from one (b), or the storage object of one
# (`tensor.untyped_storage()`, or a TypedStorage over it) kept (c). (c) is a
# count of its own because holding that object adds nothing to the use count:
# torch keeps one Python object per storage (in the StorageImpl's PyObject slot)
# and that object's one reference to the storage is in the baseline of (b)
# however many Python references it has, so only the Python reference count sees
# who holds it. The set holds each alias's storage object, so it stays the one
# torch hands to readers.


class OverLimit(Exception):
    """Fitting a set to a plan would pass limit_bytes by `excess` bytes, with every set
    no one reads already given back: the stager plans with fewer pooled bytes
    (Note [staging past limit_bytes])."""

    def __init__(self, excess: int):
        super().__init__(excess)
        self.excess = excess


class BufferSet:
    """One set of host buffers for a whole state dict; the ring holds `ring_size` of them.

    Where its buffers come from: Note [parts of a buffer set]. How it knows it is
    still read: Note [who reads a buffer set].
    """

    def __init__(self, index: int, block_bytes):
        self.index = index
        self.block_bytes = block_bytes  # the pool's HostPool.block_bytes: what a block of n bytes takes from it
        self.plan: Optional[CopyPlan] = None
        self.ptrs_version = -1  # the plan's ptrs_version at the set's last fill
        self.buffers: Dict[Any, torch.Tensor] = {}  # unit key -> the engine's host tensor for it
        self.parts: Dict[Tuple, Any] = {}  # unit keys (source order) -> the handle of their fresh copy
        # Per batch, the copies one save runs: [mode, source positions (None: all),
        # out, unit keys]; mode "reuse" (out = a part's handle), "loose" (out = a
        # list of kept buffers) or "fresh" (out = None; becomes "reuse" once run).
        self.calls: List[List[list]] = []
        self.blocks: Dict[int, torch.Tensor] = {}  # storage address -> uint8 over the engine's block
        # Addresses in `blocks` of pageable memory, not the pool's (Note [staging past limit_bytes]).
        self.pageable_blocks: frozenset = frozenset()
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
            blocks, pageable = self.blocks, self.pageable_blocks
            held = sum(self.block_bytes(b.numel()) for address, b in blocks.items() if address not in pageable)
            self._held = (blocks, held)  # holds the dict itself: `is` cannot match a new one at its address
        return held

    @property
    def pageable_bytes(self) -> int:
        """Bytes of pageable host memory this set holds (Note [staging past limit_bytes])."""
        return sum(self.blocks[address].numel() for address in self.pageable_blocks)

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
        self.pageable_blocks = frozenset()
        self.alias_storages, self.alias_storage_objects, self.storage_ref_base = [], [], 0
        self.host_leaves, self.handles, self.watch, self.ref_base, self.use_base = [], [], [], 0, 0
        self.marked = False

    def bind(self, plan: CopyPlan) -> None:
        """The staged dict's tensor leaves: views of private aliases of the engine's
        blocks (`_reader_views`), made here and never given to the copy engine."""
        blocks: Dict[int, torch.Tensor] = {}
        aliases: Dict[int, torch.Tensor] = {}
        host_leaves: List[Any] = [None] * len(plan.meta)
        units, buffers = plan.units, self.buffers
        hosts = _reader_views([buffers[unit.key] for unit in units], blocks, aliases, self.blocks,
                              self.aliases)
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
        # Set before `blocks`: held_bytes recomputes when it sees the new dict.
        self.pageable_blocks = frozenset(
            buffers[unit.key].untyped_storage().data_ptr() for unit in units
            if unit.pageable and buffers[unit.key].numel()
        )
        self.blocks, self.aliases = blocks, aliases
        self.alias_storage_objects = [a.untyped_storage() for a in aliases.values()]
        self.alias_storages = [storage._cdata for storage in self.alias_storage_objects]
        self.host_leaves = host_leaves
        self.watch = list({id(o): o for o in watch}.values())
        self.marked = False
        self.plan = plan

    def refills_only(self, plan: CopyPlan) -> bool:
        """Whether every copy of the core's batches refills a handle of this set, bound to
        `plan` and last filled from the addresses the plan holds now (so the core's record of
        them is the plan's)."""
        return self.plan is plan and self.ptrs_version == plan.ptrs_version and all(
            call[0] == "reuse" for batch, calls in zip(plan.batches, self.calls) if batch.asynchronous
            for call in calls
        )


def fit_calls(plan: CopyPlan, old_parts, old_buffers):
    """(calls per batch, parts kept, buffers kept, units to copy fresh) for `plan`, keeping
    what it can of `old_parts` and `old_buffers` (Note [parts of a buffer set])."""
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
        if len(loose) > MAX_LOOSE:
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


class BufferRing:
    """The stager's buffer sets: which one a save takes, and the host memory they hold
    against `limit` (the stager's limit_bytes; 0: none)."""

    def __init__(self, size: int, limit: int, when_busy: str, busy_timeout_s: float, pool_of):
        self.size = size
        self.limit = limit
        self.when_busy = when_busy
        self.busy_timeout_s = busy_timeout_s
        self._pool_of = pool_of  # () -> the HostPool the buffers come from
        self.sets: List[BufferSet] = []
        # (set, copy number) -> a handle the compute stream has not waited on yet; keyed so
        # it never holds a handle the set itself has dropped (see BufferSet.busy_reason).
        self.unwaited: Dict[Tuple[int, int], Any] = {}
        self.measured: Optional[Tuple] = None  # (plan, pool bytes a fresh set for it took), see set_bytes

    def host_bytes(self) -> int:
        """Host memory held by all sets, as the pool counts it (`HostPool.block_bytes` of each block)."""
        return sum(s.held_bytes for s in self.sets)

    def wait_stream(self, stream=None) -> None:
        """Make `stream` wait, on the device, for every copy it has not waited on yet."""
        pending, self.unwaited = self.unwaited, {}
        for handle in pending.values():
            handle.wait_stream(stream)

    def synchronize(self) -> None:
        """Block the host until every set's copies have completed."""
        for buffer_set in self.sets:
            for handle in buffer_set.handles:
                if handle is not None:
                    handle.synchronize()

    def release(self) -> None:
        """Drop every set (their buffers go back to the pool once no staged dict uses them)."""
        for buffer_set in self.sets:
            buffer_set.release()
        self.sets = []
        self.unwaited = {}
        self.measured = None

    def acquire(self, fn, plan: CopyPlan) -> BufferSet:
        """A set a save of `plan` may write: a free one, else a new one (within `size` and
        `limit`), else, all being busy, the first to come free (or RuntimeError, per `when_busy`)."""
        deadline = time.perf_counter() + self.busy_timeout_s
        collected, pause = False, 0.0005
        while True:
            reasons = []
            for buffer_set in self.sets:
                reason = buffer_set.busy_reason()
                if reason is None:
                    return buffer_set
                reasons.append(f"set {buffer_set.index}: {reason}")
            if len(self.sets) < self.size and self._fits_new_set(fn, plan):
                buffer_set = BufferSet(len(self.sets), self._pool_of().block_bytes)
                self.sets.append(buffer_set)
                return buffer_set
            if self.when_busy == "raise":
                raise RuntimeError(
                    f"{fn}: all {len(self.sets)} host buffer sets are busy ({'; '.join(reasons)}); wait for "
                    "the previous save (response.upload_completion.result()), release its staged dict, or "
                    "raise ring_size (and limit_bytes)"
                )
            running = [h for s in self.sets for h in s.handles if h is not None and not h.ready()]
            if running:
                running[0].synchronize()
                continue
            if not collected:  # a staged dict caught in a reference cycle is freed only by the collector
                gc.collect()
                collected = True
                continue
            if time.perf_counter() >= deadline:
                raise RuntimeError(
                    f"{fn}: waited {self.busy_timeout_s:.0f} s for a free host buffer set, all "
                    f"{len(self.sets)} still busy ({'; '.join(reasons)}); release old staged dicts "
                    "or raise ring_size / busy_timeout_s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _fits_new_set(self, fn, plan: CopyPlan) -> bool:
        if not self.limit:
            return True
        held, need = self.host_bytes(), self.set_bytes(plan)
        # The first set always fits: the plan's budget keeps its pooled part within the
        # limit (Note [staging past limit_bytes]), and a save checks the blocks it got.
        return held + need <= self.limit or not self.sets  # else wait for a set in use rather than grow

    def set_bytes(self, plan: CopyPlan) -> int:
        """The pool bytes a new set for `plan` takes: what a set already fitted to it
        holds, or what one took before (give_back_over_limit), else the estimate."""
        for buffer_set in self.sets:
            if buffer_set.plan is plan:
                return buffer_set.held_bytes
        if self.measured is not None and self.measured[0] is plan:
            return self.measured[1]
        return pool_bytes_estimate(plan.units, self._pool_of().block_bytes)

    def give_back_over_limit(self, buffer_set: BufferSet, plan: CopyPlan, new_set: bool) -> bool:
        """The blocks a save just took pass limit_bytes (the pool rounded them up past
        the estimate): the set gives its buffers back once its copies are done, and
        what it took is remembered so the ring does not grow for this plan again.
        True when the ring has other sets to take the save; False when the save must
        take fewer pooled bytes (the stager plans it with a lower budget)."""
        took = buffer_set.held_bytes
        for handle in buffer_set.handles:
            handle.synchronize()
        buffer_set.release()
        self.forget_unwaited(buffer_set.index)
        self.measured = (plan, took)
        if new_set:
            self.sets.pop()  # made for this save: the last one
            return bool(self.sets)
        return False

    def forget_unwaited(self, index: int) -> None:
        """Drop set `index`'s handles from those the compute stream has yet to wait on."""
        for key in [key for key in self.unwaited if key[0] == index]:
            del self.unwaited[key]

    def prepare(self, fn, buffer_set: BufferSet, plan: CopyPlan) -> Tuple[int, int]:
        """Fit the set to a new plan: keep its parts and buffers that still match,
        copy the rest fresh. Returns (units reused, units allocated)."""
        calls, parts, buffers, fresh_units = fit_calls(plan, buffer_set.parts, buffer_set.buffers)
        kept_bytes = sum(align(t.numel() * t.element_size()) for t in buffers.values())
        if fresh_units and kept_bytes * 2 < buffer_set.block_nbytes:
            # Mostly new: start afresh rather than keep old blocks half empty.
            calls, parts, buffers, fresh_units = fit_calls(plan, {}, {})
        if self.limit and fresh_units:
            block_bytes = buffer_set.block_bytes
            new_bytes = pool_bytes_estimate(fresh_units, block_bytes)
            kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in buffers.values() if t.numel()}
            kept_pooled = sum(block_bytes(n) for address, n in kept.items() if address not in buffer_set.pageable_blocks)

            def after() -> int:
                return self.host_bytes() - buffer_set.held_bytes + kept_pooled + new_bytes

            if after() > self.limit:
                # Sets no one reads give their buffers back first (they refill afresh when next taken).
                for other in self.sets:
                    if other is not buffer_set and other.held_bytes and other.busy_reason() is None:
                        other.release()
                        self.forget_unwaited(other.index)
            if after() > self.limit:
                raise OverLimit(after() - self.limit)
        buffer_set.calls, buffer_set.parts, buffer_set.buffers = calls, parts, buffers
        buffer_set.plan = None  # bound by AsyncStager._enqueue, once every fresh copy has returned its buffers
        return len(plan.units) - len(fresh_units), len(fresh_units)
