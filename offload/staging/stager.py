"""`offload.AsyncStager`: checkpoint staging that does not block the training loop.

It implements the `AsyncStager` protocol of `torch.distributed.checkpoint`
(`dcp.async_save(..., async_stager=stager)`); see docs/staging.md for use, and
Note [how a save runs] for the design. The copy plan lives in plan.py, the
buffer sets in ring.py, the first save's pool growth (a worker thread) in growth.py.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..core import _device
from ..core.checks import check_int, check_stream, parse_bytes
from ..core.copy import copy_to_host
from ..core.layout import compact
from ..core.pool import HostPool, check_pool, default_host_pool
from ..core.timing import Span
from .future import StagingFuture
from .growth import PoolGrowth, start_growth
from .host_copy import copy_on_host
from .metrics import SaveLog
from .host_copy import copy_to_pageable
from .plan import META, CopyBatch, CopyPlan, layout_of, make_picker, pick, pool_bytes_estimate, same_data_ptrs
from .ring import BufferRing, BufferSet, OverLimit
from .state_tree import Mismatch, StateTree

try:  # the protocol DCP's async_save expects; absent where torch lacks distributed
    from torch.distributed.checkpoint.staging import AsyncStager as _StagerProtocol
except Exception:  # pragma: no cover - builds without torch.distributed
    _StagerProtocol = object

# Small tensors are packed by the copy engine into groups of this many bytes (one
# pack launch, one DMA and two events each). A set's groups are made once and
# refilled on every save, so the copy engine's smaller default (tuned to start a
# one-off copy's first DMA early) would cost more launches and events on every
# save; the DMA runs at the same speed, and the device holds three staging
# buffers of this size while a copy runs.
GROUP_BYTES = 32 << 20

# Note [how a save runs]
# ~~~~~~~~~~~~~~~~~~~~~~
# `stage(state_dict)` flattens the state dict with code generated for its shape
# (`StateTree`), checks it against the cached copy plan (`CopyPlan`), picks a
# free buffer set of the ring and enqueues one batched `copy_to_host` per device.
# The device-to-host stream first waits, on the device, for everything already
# queued on the current stream, so the copy holds the values as of the call. A
# set's first save copies fresh, so the copy engine packs small tensors into
# pooled blocks of up to GROUP_BYTES; later saves pass that copy's handle back as
# `out=` and the same blocks are refilled by the same DMAs (Note [parts of a
# buffer set]). With an unchanged structure no Python code runs per tensor: the
# copy engine checks each tensor against the buffer it refills, and a refusal
# re-plans (`_ReplanNeeded`). `stage` returns a `StagingFuture` right after
# enqueueing; DCP's upload thread waits for it (the wait releases the
# interpreter lock) and then writes.
#
# A set is busy while its copy runs or while anyone still holds the state dict
# staged into it or any tensor in it (Note [who reads a buffer set]). A save uses
# a free set, allocates the next one, or, when all `ring_size` sets are busy,
# waits (or raises, with `when_busy="raise"`); it never writes into a set someone
# still reads. Tensors that share memory (tied weights) are copied once and stay
# shared in the staged dict; overlapping views of one storage are copied as one
# byte span. DTensors (FSDP2) stage their local shard and come back as DTensors
# with the same mesh and placements, wrapping host memory.
#
# Stream ownership: the sources belong to the caller's (compute) stream and are
# recorded on the copy stream by `copy_to_host`; the host buffers belong to the
# stager and are handed out read-only in the staged dict.


class _Enqueued(NamedTuple):
    """A save's copy, enqueued into a buffer set: what `AsyncStager._stage` logs of it."""

    leaves: list
    plan: CopyPlan
    buffer_set: BufferSet
    timing: Optional[Dict[Any, list]]  # per device, the timed copies' handles (None: copy_ms is the copy's time)
    copy_ms: float  # host time of the enqueue (of the whole copy where nothing is timed on a device)
    waited_ms: float  # for a free buffer set
    reused: int  # the set's buffers reused for this plan
    allocated: int  # and allocated for it
    held_before: int  # bytes the set held before this save
    replanned: bool  # the save made a new plan


class _ReplanNeeded(Exception):
    """A copy refused a tensor the cached plan did not expect: plan again, checking every tensor."""


def _async_save_takes_futures() -> bool:
    """torch >= 2.9: async_save accepts a Future from stage() (AsyncSaveResponse)."""
    try:
        from torch.distributed.checkpoint import state_dict_saver

        return hasattr(state_dict_saver, "AsyncSaveResponse")
    except Exception:  # pragma: no cover - builds without torch.distributed
        return True


def _batch_sources(batch: CopyBatch, local_tensors) -> list:
    """What one batch copies, in its units' order: its tensors, then a uint8 view of each byte span
    (overlapping views of one storage, copied as one span)."""
    sources = batch.pick_sources(local_tensors)
    for unit in batch.spans:
        first = local_tensors[unit.slots[0]]
        storage = first.untyped_storage()
        offset = first.data_ptr() - storage.data_ptr() + unit.span_start
        span = torch.empty(0, dtype=torch.uint8, device=first.device)
        sources.append(span.set_(storage, offset, (unit.nbytes,), (1,)))
    for i in batch.expanded:  # the host keeps one copy of broadcast elements
        sources[i] = compact(sources[i])[0]
    return sources


class AsyncStager(_StagerProtocol):
    """Stages state dicts into reused pinned host buffers without blocking the caller.

    Args:
        ring_size: host buffer sets kept (>= 1). A save while every set is still
            read (copy running, or its staged dict alive, e.g. an upload in
            progress) waits for one or raises, per `when_busy`.
        pool: where host buffers come from (default `offload.default_host_pool()`).
        limit_bytes: most pooled (pinned) host memory all sets together may hold
            (int >= 0 or '8GiB'; None or 0: only the pool's limit), counted as the pool
            counts its blocks (rounded up to its size classes, see `host_bytes()`).
            The ring does not grow past it. A state dict whose buffers do not fit
            is still staged: the tensors past the limit go to pageable host memory,
            copied before `stage()` returns (slower, the same values), with one
            warning per stager saying how many bytes and why (`pageable_bytes()`;
            Note [staging past limit_bytes] in plan.py).
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
        check_int(fn, "ring_size", ring_size, 1)
        if when_busy not in ("wait", "raise"):
            raise ValueError(f"{fn}: when_busy must be 'wait' or 'raise', got {when_busy!r}")
        if isinstance(busy_timeout_s, bool) or not isinstance(busy_timeout_s, (int, float)):
            raise TypeError(f"{fn}: busy_timeout_s must be a number of seconds > 0, got "
                            f"{type(busy_timeout_s).__name__}")
        if not busy_timeout_s > 0:
            raise ValueError(f"{fn}: busy_timeout_s must be > 0, got {busy_timeout_s!r}")
        self._pool = check_pool(fn, pool)
        self._limit = 0 if limit_bytes is None else parse_bytes(limit_bytes, f"{fn}: limit_bytes (bytes; None or 0: "
                                                                             "no limit but the pool's)")
        # Pool bytes a plan may give its units (None: no limit); lowered where the pool's
        # rounding passes the limit (Note [staging past limit_bytes]).
        self._budget: Optional[int] = self._limit or None
        self._warned_pageable = False
        self._ring = BufferRing(ring_size, self._limit, when_busy, float(busy_timeout_s), self._host_pool)
        self._forward_module, self._forward_paths = _forward_buffers(fn, forward_buffers)
        self._return_future = _async_save_takes_futures()
        self._tree: Optional[StateTree] = None
        self._leaf_pickers: Tuple = (None, list, list)  # (tree, make_picker of its tensor leaves, of its other leaves)
        self._plan: Optional[CopyPlan] = None
        self._log = SaveLog()
        self._saves = 0
        self._closed = False
        self._growth: Optional[PoolGrowth] = None  # the first save's pool growth, while it plans

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
        entered = Span()
        save = self._enqueue_save(fn, state_dict)
        plan, buffer_set = save.plan, save.buffer_set
        self._warn_pageable_once(fn, plan)
        allocated_bytes = max(0, buffer_set.held_bytes - save.held_before)
        if not buffer_set.marked:
            buffer_set.mark_baseline()
        # The future makes the staged dict when first asked for it (DCP's upload
        # thread), not here; until then its own list of the host tensors keeps the
        # set busy, and it keeps the other leaves as they are now.
        scalars = self._leaf_pickers[2](save.leaves)
        future = StagingFuture(plan.tree.build, scalars, list(buffer_set.host_leaves), buffer_set.handles,
                               self._log.spent)
        self._saves += 1
        self._log.add(
            {
                "save": self._saves, "set": buffer_set.index, "bytes": plan.copy_bytes, "tensors": len(plan.meta),
                "copies": len(plan.units), "blocked_ms": entered.stop().ms(), "waited_ms": save.waited_ms,
                "copy_ms": None if save.timing else save.copy_ms, "gbps": None, "replanned": save.replanned,
                "buffers_reused": save.reused, "buffers_allocated": save.allocated, "allocated_bytes": allocated_bytes,
                "host_bytes": self.host_bytes(), "pageable_bytes": plan.pageable_bytes, "_timing": save.timing,
            }
        )
        self._read_timings()
        if self._return_future:
            return future
        return future.result()

    def _enqueue_save(self, fn, state_dict) -> _Enqueued:
        """Plan (or reuse the cached plan), take a buffer set and enqueue the copy into it; again,
        checking every tensor, when a copy refuses a tensor the cached plan did not expect, and
        with fewer pool bytes when the set's blocks pass limit_bytes (Note [staging past limit_bytes] in
        plan.py)."""
        thorough = replanned = False
        while True:
            leaves, plan, local_tensors, checked = self._resolve(fn, state_dict, thorough)
            replanned |= plan is not self._plan  # a retry (_ReplanNeeded, over the limit) keeps what the first try saw
            self._plan = plan
            waiting = Span()
            sets_before = len(self._ring.sets)
            buffer_set = self._acquire_set(fn, plan)
            waited_ms = waiting.stop().ms()
            reused, allocated = len(plan.units), 0
            held_before = buffer_set.held_bytes
            if buffer_set.plan is not plan:
                try:
                    reused, allocated = self._ring.prepare(fn, buffer_set, plan)
                except OverLimit as over:
                    self._lower_budget(plan, over.excess)
                    continue
                held_before = buffer_set.held_bytes
            # A first save's growth (PoolGrowth) goes on while it copies: joined once it has.
            # Addresses of the tensors the core copies: compared by the refills of a
            # set bound to this plan (same_sources), else here, before any copy.
            same_sources = not checked and buffer_set.refills_only(plan)
            if not checked and not same_sources:
                try:
                    moved = not same_data_ptrs(local_tensors, plan.ptrs, plan.core_slots)
                except RuntimeError:  # a tensor without storage: planning names it
                    moved = True
                if moved:
                    thorough = True
                    continue
            try:
                timing, copy_ms = self._enqueue(plan, buffer_set, local_tensors, checked, same_sources)
            except _ReplanNeeded:  # a tensor changed under the cached plan; the set is ours, so just redo it
                thorough = True
                continue
            buffer_set.ptrs_version = plan.ptrs_version
            if self._limit and buffer_set.held_bytes > held_before and self.host_bytes() > self._limit:
                excess = self.host_bytes() - self._limit
                if not self._ring.give_back_over_limit(buffer_set, plan, new_set=len(self._ring.sets) > sets_before):
                    self._lower_budget(plan, excess)
                continue  # another set takes the save (_acquire_set waits or raises), or a plan with fewer pool bytes
            return _Enqueued(leaves, plan, buffer_set, timing, copy_ms, waited_ms, reused, allocated, held_before,
                             replanned)

    def _warn_pageable_once(self, fn: str, plan) -> None:
        """Once per stager: the plan stages some tensors to pageable memory (over limit_bytes)."""
        if plan.pageable_bytes and not self._warned_pageable:
            self._warned_pageable = True
            warnings.warn(
                f"{fn}: the state dict's {plan.copy_bytes} bytes of tensors do not fit limit_bytes={self._limit} of "
                f"pooled host buffers, so {plan.pageable_bytes} bytes ({plan.pageable_units} tensors) are staged to "
                "pageable host memory, copied before stage() returns (slower, the same values); raise "
                "AsyncStager(limit_bytes=...) to stage them all asynchronously. Warned once per stager.",
                stacklevel=4,
            )

    def _read_timings(self, final: bool = False) -> None:
        self._log.read_timings(final)

    def synchronize_staging(self) -> None:
        """Block the host until every enqueued staging copy has completed."""
        self._ring.synchronize()

    def close(self) -> None:
        """Wait for running copies and drop every buffer set.

        Buffers go back to the pool once the last staged dict that uses them is
        released. The stager cannot stage after this.
        """
        if self._closed:
            return
        self.synchronize_staging()
        self._read_timings(final=True)  # the copies are done: no record keeps a handle
        self._ring.release()
        self._tree = self._plan = None
        self._leaf_pickers = (None, list, list)
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
        check_stream("offload.AsyncStager.wait_stream", stream)
        self._ring.wait_stream(stream)

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
        buffers_allocated, allocated_bytes, host_bytes, pageable_bytes (of the
        save's tensors, staged to pageable memory past limit_bytes), set."""
        return self._log.public()

    def host_bytes(self) -> int:
        """Pooled host memory held by all buffer sets, as the pool counts it (`HostPool.block_bytes`
        of each block: rounded up to the pool's size classes), which `limit_bytes` bounds."""
        return self._ring.host_bytes()

    def pageable_bytes(self) -> int:
        """Pageable host memory held by all buffer sets: what did not fit `limit_bytes`."""
        return sum(s.pageable_bytes for s in self._ring.sets)

    @property
    def ring_size(self) -> int:
        return self._ring.size

    # ------------------------------------------------------------ planning

    def _resolve(self, fn, state_dict, thorough: bool = False):
        """(leaves, plan, local tensors, checked): reuse the cached tree and plan where they still fit.

        With the cached plan and not `thorough`, only what no copy checks is
        compared here: the layouts of `CopyPlan.watched_slots` and the addresses of
        `CopyPlan.host_slots`. The copies check every other tensor's layout against
        the buffers they refill, and its address (same_sources) where they refill
        a set bound to this plan (else `_enqueue_save` compares those addresses); a copy
        that refuses a tensor raises ValueError, and `stage` then plans again with
        `thorough` set. `checked` says every tensor was compared here.
        """
        tree, leaves, local_tensors, specs = self._flatten(fn, state_dict)
        plan = self._plan
        if plan is None and not self._ring.sets:
            self._growth = start_growth(self._host_pool(), local_tensors, self._limit, GROUP_BYTES)
        try:
            stale = (
                plan is None
                or plan.pinned_budget != self._budget
                or plan.tree is not tree
                or specs != plan.specs
                or (plan.watched_slots
                    and [layout_of(local_tensors[s])[1:] for s in plan.watched_slots] != plan.watched_layouts)
                or (thorough and list(map(META, local_tensors)) != plan.meta)
            )
            if stale:
                moved = False
            elif thorough:
                moved = not same_data_ptrs(local_tensors, plan.ptrs, plan.ptr_indices)
            else:
                moved = bool(plan.host_slots) and not same_data_ptrs(local_tensors, plan.ptrs, plan.host_slots)
        except RuntimeError:  # a tensor without storage (sparse, say): planning checks every tensor and names it
            stale = True
        if stale:
            return leaves, self._new_plan(fn, tree, local_tensors, specs), local_tensors, True
        if moved:
            # New storages (a state dict rebuilt from reallocated tensors): the
            # aliasing may have changed; keep the plan if it did not.
            fresh = self._new_plan(fn, tree, local_tensors, specs)
            if fresh.signature == plan.signature and fresh.meta == plan.meta:
                plan.ptrs = fresh.ptrs
                plan.ptrs_version += 1
                plan.watched_layouts = fresh.watched_layouts
            else:
                plan = fresh
            return leaves, plan, local_tensors, True
        return leaves, plan, local_tensors, thorough

    def _flatten(self, fn, state_dict):
        """(tree, leaves, local tensors, the DTensors' specs or None) of `state_dict`, with the cached
        tree where the state dict still has its shape; a DTensor's local tensor is its shard."""
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
        if self._leaf_pickers[0] is not tree:
            count = len(tree.leaf_types)
            # The tensors: a list no one changes (local_tensors is a copy where it differs).
            self._leaf_pickers = (tree, make_picker(tree.tensor_pos, count, fresh=False),
                                  make_picker(tree.scalar_pos, count))
        tensors = self._leaf_pickers[1](leaves)
        specs = None
        local_tensors = tensors
        if tree.dtensor_slots:
            local_tensors = list(tensors)
            for slot in tree.dtensor_slots:
                local_tensors[slot] = tensors[slot]._local_tensor
            specs = [tensors[slot]._spec for slot in tree.dtensor_slots]
        return tree, leaves, local_tensors, specs

    def _host_pool(self) -> HostPool:
        return self._pool if self._pool is not None else default_host_pool()

    def _join_growth(self) -> None:
        growth, self._growth = self._growth, None
        if growth is not None:
            growth.join()

    def _new_plan(self, fn, tree, local_tensors, specs) -> CopyPlan:
        # A cached tree compared only the leaves' types: a tensor may have turned
        # meta or sparse since the tree was built. The first save's check says so.
        tree.check_tensors(local_tensors)
        forward_ptrs = set()
        if self._forward_module is not None:
            forward_ptrs = {(b.device, b.data_ptr()) for b in self._forward_module.buffers() if b.numel()}
        forward_paths = set()
        if self._forward_paths:
            dotted = {".".join(map(str, tree.paths[pos])): tree.paths[pos] for pos in tree.tensor_pos}
            missing = sorted(set(self._forward_paths) - set(dotted))
            if missing:
                known = ", ".join(sorted(dotted)[:5])
                raise ValueError(
                    f"{fn}: forward_buffers names {missing} which are not tensors of the state dict; "
                    f"paths are keys joined by dots, e.g. {known}"
                )
            forward_paths = {dotted[p] for p in self._forward_paths}
        tensor_paths = [tree.paths[pos] for pos in tree.tensor_pos]
        return CopyPlan(fn, tree, local_tensors, specs, forward_ptrs, forward_paths, tensor_paths, self._budget,
                        self._host_pool().block_bytes)

    def _lower_budget(self, plan: CopyPlan, excess: int) -> None:
        """The pooled part of `plan` passes limit_bytes by `excess` bytes: plan later saves
        with that much less (Note [staging past limit_bytes]). Strictly lower each time,
        so a save ends, at worst with every tensor pageable."""
        pooled = pool_bytes_estimate(plan.units, self._host_pool().block_bytes)
        self._budget = max(0, min(self._budget, pooled) - excess)

    # ------------------------------------------------------------ the ring

    def _acquire_set(self, fn, plan: CopyPlan) -> BufferSet:
        return self._ring.acquire(fn, plan)

    # ------------------------------------------------------------ copying

    def _enqueue(self, plan: CopyPlan, buffer_set: BufferSet, local_tensors, checked: bool, same_sources: bool = False):
        """Enqueue every batch; returns (per-device timed handles, or None on the host; host copy ms).

        Raises _ReplanNeeded when a copy refuses a tensor that `_resolve` did not compare
        (`checked` false), having enqueued nothing that could harm the set: copies
        already queued write only this set's buffers, and the retry refills them
        after those copies, on the same stream.
        `same_sources`: refills also refuse a tensor at another address than the
        set's last fill (see `_resolve`).
        """
        timing: Dict[Any, list] = {}
        host_time = Span()
        forward_handles = []
        handles: List[Any] = []
        rebind = buffer_set.plan is not plan
        buffer_set.handles = handles  # filled as copies are enqueued: the set is busy while any runs
        self._ring.forget_unwaited(buffer_set.index)  # this set's earlier copies: never hold a handle the set dropped
        with torch.no_grad():
            for number, batch in enumerate(plan.batches):
                if not batch.copied_first and forward_handles:
                    # The next forward may change these buffers: the compute stream
                    # waits (on the device) for their small copy, not for the rest.
                    for handle in forward_handles:
                        handle.wait_stream()
                    forward_handles = []
                sources = _batch_sources(batch, local_tensors)
                device = batch.device
                timed = False
                if batch.pageable:
                    copy = copy_to_pageable
                elif batch.asynchronous:
                    copy = copy_to_host
                    if sources and sources[0].device != device:
                        if checked:  # pragma: no cover - a plan made from these tensors has their device
                            raise RuntimeError("offload.AsyncStager: staging plan out of date")
                        raise _ReplanNeeded()
                    timed = _device.is_accelerator(device)
                else:
                    copy = copy_on_host
                # Forward buffers are waited for at once: only the rest is worth deferring.
                defer = timed and not batch.copied_first
                for call in buffer_set.calls[number]:
                    try:
                        handle, fresh = self._run_call(copy, call, sources, buffer_set, checked, timed, defer,
                                                       same_sources and batch.asynchronous)
                    except _ReplanNeeded:
                        for running in handles:  # the retry may pick this set again
                            running.synchronize()
                        if rebind:
                            buffer_set.plan = None
                        raise
                    rebind |= fresh
                    handles.append(handle)
                    if timed:
                        timing.setdefault(device, []).append(handle)
                    if batch.copied_first:
                        forward_handles.append(handle)
                    if _device.is_accelerator(device) and batch.asynchronous:
                        self._ring.unwaited[(buffer_set.index, len(handles))] = handle
            for handle in forward_handles:
                handle.wait_stream()
        if rebind:
            buffer_set.bind(plan)
        return (timing or None), host_time.stop().ms()

    def _run_call(self, copy, call, sources, buffer_set: BufferSet, checked: bool, timed: bool = False,
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
        picked = sources if positions is None else pick(sources, positions)
        extra = {"timing": True} if timed else {}
        if mode != "fresh":
            options = extra
            if mode == "reuse" and (defer or same_sources):  # copy_to_host's only (copy_on_host takes neither)
                options = dict(extra, defer=defer, same_sources=same_sources)
            try:
                return copy(picked, out=out, pool=self._pool, **options), False
            except ValueError:
                if not checked:
                    raise _ReplanNeeded() from None
                if mode != "reuse":
                    raise
                # Same shapes and dtypes, other strides: this part is copied afresh.
                del buffer_set.parts[keys]
        handle = copy(picked, out=None, pool=self._pool, group_bytes=GROUP_BYTES, **extra)
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
