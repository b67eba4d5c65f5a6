"""`offload.WeightSender`: trainer-to-rollout weight sync in buckets (its receiver: receiver.py).

The sender packs the weights into buckets (cast on the way, `offload.pack_buckets`)
and broadcasts them over a torch.distributed group; each receiver yields
`(name, tensor)` pairs (the convention of `model.load_weights(weights)` in
inference engines) or loads them into a module in place. See docs/weight_sync.md.

Protocol, per sync: a small tensor with the version and the plan's id, the plan
itself (an object broadcast) only when it changed, then one broadcast per bucket.
Timings (`send()` / `load()` return them; `receiver.timings` after `receive()`):
gather_ms, pack_ms, host_copy_ms, transfer_ms, unpack_ms, total_ms, plus bytes,
buckets and version. Phases overlap by design, so they need not sum to the total;
transfer is the span from the first broadcast posted to the last one completed.

`transport="ipc"` (trainer and rollout on the same device) hands the buckets over
through buffers shared once between the two processes instead (ipc.py).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core import _device
from ..core.checks import check_int, check_stream
from ..core.copy import copy_to_host
from ..core.pool import HostPool, check_pool, default_host_pool
from ..core.timing import PhaseTimer, Span
from .bucket_pack import BucketSpans, bucket_spans
from .bucket_plan import BucketPlan
from .bucket_planner import DEFAULT_ALIGNMENT, check_bucket_options, default_bucket_bytes, plan_buckets
from . import sources as weight_sources
from .ipc import DEFAULT_IPC_TIMEOUT_S, IpcSender
from .link import AFTER_FAILURE, Link, check_src, collective_max_blocks, is_member, resolve_group, transport_device
from .colocated_many import ColocatedManySender
from .many_senders import ManySender, check_senders
from .sync_options import (DEFAULT_RESERVE_SMS, DEFAULT_SYNC_BUCKET_BYTES, MODES, PHASES, SenderBuckets, _check_common,
                           _check_many, _check_transport, _check_version)

# Note [bucket pipeline]
# ~~~~~~~~~~~~~~~~~~~~~~
# Two bucket buffers on each side. The sender packs bucket k+1 on the current
# stream while bucket k is on the wire (the collective runs on the process group's
# own stream, which waits for the pack it needs); before packing bucket k+2 into
# the buffer of k, the current stream waits for k's broadcast (`work.wait()` on
# NCCL is a device-side wait). The receiver posts the broadcasts of buckets 0 and
# 1 as soon as the plan is known (before it checks the destinations), and that of
# k+2 once bucket k has been handed out. No device-wide synchronize anywhere;
# `send()` and the end of `receive()` wait (host) only for their own last
# broadcast, to read the timings.
#
# Note [SMs left to the collective]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The pack (and unpack) kernels of bucket k+2 become ready at the instant bucket
# k's broadcast ends, which is when the broadcast of k+1 launches. Launched as
# usual they would hold every SM (their blocks are persistent) and the broadcast
# would wait for the whole pack: pack and wire serialized. So on CUDA they launch
# at most one block per SM on all but `reserve_sms` SMs, leaving whole SMs to the
# collective. One block per SM still packs faster than the link moves the bucket.
#
# Note [host_cache snapshots]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In "host_cache" mode `snapshot(model)` copies the weights to pinned host memory
# (`offload.copy_to_host`, on the copy stream, behind the work already queued) and
# tags them with a version; the trainer goes on while `send(version=v)` (from this
# or another thread) packs from the snapshot on the host and broadcasts it. Call
# `wait_snapshot()` (a device-side wait) before changing the parameters in place,
# e.g. before `optimizer.step()`. The `keep_versions` latest snapshots are kept;
# the oldest one's host buffers are reused for the next. A snapshot queues work
# only on the copy stream; the trainer's stream is never made to wait except by
# `wait_snapshot()`. Sends from a snapshot run on a stream of the sender's own,
# so their uploads and packs never enter the trainer's stream either.

class _Snapshot:
    """One version's host copy of the weights (Note [host_cache snapshots])."""

    def __init__(self, version: int, names: List[str], layout: List[list], handles: List,
                 copy_span: Optional[Span]):
        self.version = version
        self.names = names
        self.layout = layout  # per gather group: shapes and dtypes (see weight_sources.layout_of)
        # CopyHandles of the device-to-host copies, one per gather group, in the
        # order of `names`; empty on ranks other than src.
        self.handles = handles
        # From before the first gather to the end of the last copy; None on ranks other than src.
        self.copy_span = copy_span
        self.readers = 0  # sends in progress from this snapshot (guarded by the sender's lock)

    def tensors(self) -> List[torch.Tensor]:
        return [t for handle in self.handles for t in handle.wait()]

    def wait_stream(self, stream) -> None:
        for handle in self.handles:
            handle.wait_stream(stream)

    def copy_ms(self) -> float:
        return self.copy_span.ms() if self.copy_span is not None else 0.0


class WeightSender:
    """Broadcasts a model's weights in buckets to the receivers of a process group.

    Args:
        group: the process group (sender and receivers); default: the world. Or
            `ranks` to build one (every rank of the world must construct with the
            same ranks, since `new_group` is collective). A rank outside the group
            (an FSDP peer of the trainer that is not in the sync group) constructs
            fine and is gather-only: `send()` and `snapshot()` take part in the
            DTensor gathers, send nothing and return zero timings.
        src: global rank of the sender (an int >= 0, a rank of the group).
        bucket_bytes: most bytes per bucket, an int of at least `alignment`, or None for
            the default (`offload.default_bucket_bytes()` up to 256 MiB; 512 MiB for
            "ipc"); also the most bytes of full tensors a "host_cache" snapshot of
            DTensor sources gathers at once (a larger tensor alone).
        dtype, keep_dtype: the cast policy of `offload.pack_buckets`: None, or one of the
            floating dtypes the buckets cast between (float64, float32, float16, bfloat16),
            with the names matching `keep_dtype` kept as they are (e.g. bf16, with router
            weights kept in fp32).
        mode: "device" (pack straight from the training parameters) or "host_cache"
            (Note [host_cache snapshots]).
        keep_versions: host snapshots kept in "host_cache" mode.
        pool: host pool for snapshots and host buckets.
        reserve_sms: SMs the pack kernels leave to the collective (CUDA; Note [SMs left
            to the collective]); 0 lets a pack take the whole device.
        transport: "nccl" (collectives over the group, whatever its backend: NCCL, HCCL
            or gloo) or "ipc" (receivers in other processes on this device: buckets in
            two buffers shared once, Note [IPC protocol] in ipc.py; mode "device" only).
            The buffers live where the first sync's tensors are (CPU tensors: shared
            memory, Note [IPC stand-in]).
        channel: for "ipc", one end of `multiprocessing.Pipe()` to the receiver instead
            of a process group; with a group, its backend must include gloo.
        timeout_s: longest wait, in seconds, for the other side (Note [sync timeouts]);
            None: the process group's timeout ("nccl"), or DEFAULT_IPC_TIMEOUT_S for
            "ipc" (a dead or failed peer is an error, not a hang).
        senders: global ranks of every trainer rank that sends (Note [many senders] in
            many_senders.py): each sends what it owns (its FSDP shards, and a share of the
            tensors every trainer holds whole), on a group of its own with the receivers,
            the rest of the sync group (`ranks`, or the world). Every rank of the world
            constructs a sender (the trainer ranks) or a receiver with the same senders
            and ranks (`new_group` is collective). Mode "device", or "host_cache" (each
            sender snapshots what it owns); transport "nccl"; `src` and `group` are not used.
    """

    def __init__(
        self,
        group=None,
        *,
        src: int = 0,
        ranks=None,
        backend: Optional[str] = None,
        bucket_bytes: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        keep_dtype=(),
        alignment: int = DEFAULT_ALIGNMENT,
        mode: str = "device",
        keep_versions: int = 2,
        pool: Optional[HostPool] = None,
        reserve_sms: int = DEFAULT_RESERVE_SMS,
        transport: str = "nccl",
        channel=None,
        timeout_s: Optional[float] = None,
        senders=None,
    ):
        fn = "offload.WeightSender"
        # Every argument is checked here, before torch.distributed is asked anything: a bad
        # one is named at the call, not at the first send().
        if mode not in MODES:
            raise ValueError(f"{fn}: mode must be one of {', '.join(MODES)}, got {mode!r}")
        _check_transport(fn, transport, channel)
        ranks = _check_common(fn, group, src, ranks, backend, reserve_sms)
        check_bucket_options(fn, bucket_bytes, dtype, keep_dtype, alignment)
        check_int(fn, "keep_versions", keep_versions, 1)
        check_pool(fn, pool)
        self._ipc = None
        self._many = None
        self._colocated = None
        if senders is not None:
            self._init_many(fn, senders, group, ranks, backend, bucket_bytes, dtype, keep_dtype, alignment, mode,
                            transport, channel, reserve_sms, timeout_s, keep_versions, pool)
        elif transport == "ipc":
            self._init_ipc(fn, group, ranks, channel, src, bucket_bytes, dtype, keep_dtype, alignment, mode,
                           timeout_s)
        else:
            self._init_broadcast(fn, group, ranks, backend, src, bucket_bytes, dtype, keep_dtype, alignment, mode,
                                 keep_versions, pool, reserve_sms, timeout_s)

    def _init_many(self, fn, senders, group, ranks, backend, bucket_bytes, dtype, keep_dtype, alignment, mode,
                   transport, channel, reserve_sms, timeout_s, keep_versions, pool) -> None:
        """Every trainer rank sends what it owns (Note [many senders] in many_senders.py)."""
        senders = check_senders(fn, senders)
        _check_many(fn, group, transport)
        if transport == "ipc":
            self._init_colocated(fn, senders, group, ranks, channel, bucket_bytes, dtype, keep_dtype, alignment, mode,
                                 timeout_s)
            return
        self._many = ManySender(fn, senders, ranks, backend, bucket_bytes, DEFAULT_SYNC_BUCKET_BYTES, dtype,
                                keep_dtype, alignment, reserve_sms, timeout_s, keep_versions, pool)
        self.mode, self.src, self.senders, self.member = mode, None, senders, self._many.member
        self.is_src = self._many.index >= 0
        self.device, self.bucket_bytes = self._many.device, self._many.bucket_bytes
        self._next_version = 0
        self._snapshots: "OrderedDict[int, _Snapshot]" = OrderedDict()
        self._lock = threading.Lock()

    def _init_colocated(self, fn, senders, group, ranks, channel, bucket_bytes, dtype, keep_dtype, alignment, mode,
                        timeout_s) -> None:
        """Every trainer rank hands the weights to the rollout process on its device (Note [colocated
        senders] in colocated_many.py)."""
        if mode != "device":
            raise ValueError(f"{fn}: transport 'ipc' packs from the device (mode 'device'), got mode={mode!r}")
        if ranks is not None:
            raise ValueError(f"{fn}: transport 'ipc' takes a group (or a channel), not ranks")
        self._colocated = ColocatedManySender(fn, senders, group, channel, bucket_bytes, dtype, keep_dtype, alignment,
                                              DEFAULT_IPC_TIMEOUT_S if timeout_s is None else timeout_s)
        self.mode, self.src, self.senders, self.member, self.is_src = mode, None, senders, True, True
        self.device, self.bucket_bytes = self._colocated.device, self._colocated.bucket_bytes
        self._next_version = 0

    def _init_ipc(self, fn, group, ranks, channel, src, bucket_bytes, dtype, keep_dtype, alignment, mode,
                  timeout_s) -> None:
        """Receivers in other processes on this device (Note [IPC protocol] in ipc.py)."""
        if mode != "device":
            raise ValueError(f"{fn}: transport 'ipc' packs from the device (mode 'device'), got mode={mode!r}")
        if ranks is not None:
            raise ValueError(f"{fn}: transport 'ipc' takes a group (or a channel), not ranks")
        self._ipc = IpcSender(fn, group, channel, int(src), bucket_bytes, dtype, keep_dtype, alignment,
                              DEFAULT_IPC_TIMEOUT_S if timeout_s is None else timeout_s)
        self.mode, self.src, self.is_src, self.member = mode, int(src), True, True
        self.device, self.bucket_bytes = self._ipc.device, self._ipc.bucket_bytes
        self._next_version = 0

    def _init_broadcast(self, fn, group, ranks, backend, src, bucket_bytes, dtype, keep_dtype, alignment, mode,
                        keep_versions, pool, reserve_sms, timeout_s) -> None:
        """One sender broadcasts to the group's receivers ("device" or "host_cache" mode)."""
        self.group = resolve_group(fn, group, ranks, backend)
        self.src = int(src)
        self.mode = mode
        self.keep_versions = keep_versions
        self.member = is_member(self.group)
        if self.member:
            check_src(fn, self.group, self.src)
        elif dist.get_rank() == self.src:
            raise ValueError(f"{fn}: src={self.src} (this rank) is not in the group; the sender must be a member")
        # A non-member only gathers: its "transport" device is where the gathers run.
        self.device = transport_device(self.group) if self.member else _device.current_device()
        if bucket_bytes is None:
            bucket_bytes = min(default_bucket_bytes(self.device), DEFAULT_SYNC_BUCKET_BYTES)
            check_bucket_options(fn, bucket_bytes, dtype, keep_dtype, alignment)  # the default against alignment
        self.bucket_bytes = bucket_bytes
        self._max_blocks = collective_max_blocks(fn, self.device, reserve_sms)
        self._link = Link(fn, self.group, self.src, timeout_s, self.device)
        self._backend = dist.get_backend(self.group) if self.member else None
        self.dtype = dtype
        self.keep_dtype = keep_dtype
        self.alignment = alignment
        self._pool = pool
        self.is_src = dist.get_rank() == self.src
        self._buckets = SenderBuckets()
        self._snapshots: "OrderedDict[int, _Snapshot]" = OrderedDict()
        self._next_version = 0
        self._signature = None  # names, shapes, dtypes of the last plan sent on this group
        self._cached_plan: Optional[BucketPlan] = None
        self._cached_spans: List[BucketSpans] = []
        self._plan_id = 0
        self._lock = threading.Lock()  # snapshot() on the trainer thread, send() on another
        self._marker_stream = None  # waits for each snapshot's copy, to time it (accelerators)
        self._send_stream = None  # host_cache sends run here, never on the trainer's stream

    @property
    def pool(self) -> HostPool:
        if self._pool is None:  # only host_cache mode and host-staged sends need one
            self._pool = default_host_pool()
        return self._pool

    # ------------------------------------------------------------ host cache

    def snapshot(self, source, version: Optional[int] = None) -> int:
        """Copy `source`'s weights to pinned host memory, asynchronously; returns the version tag."""
        fn = "offload.WeightSender.snapshot"
        _check_version(fn, version)
        if self._ipc is not None or self._colocated is not None:
            raise ValueError(f"{fn}: transport 'ipc' sends from the device; snapshots need transport 'nccl'")
        items = weight_sources.named_sources(fn, source)  # references: nothing is gathered yet
        if self._many is not None:
            return self._snapshot_many(fn, items, version)
        names = [n for n, _ in items]
        if not self.is_src:  # an FSDP peer: it takes part in the gathers; only src keeps a copy
            return self._snapshot_as_peer(items, names, version)
        groups = weight_sources.gather_groups(items, self.bucket_bytes)
        layout = weight_sources.layout_of(groups)
        device = items[0][1].device if items else _device.current_device()  # a DTensor's: its local shard's
        reuse = [None] * len(groups)
        oldest = None  # the snapshot evicted for this one, put back if this one fails
        with self._lock:
            if version is None:
                version = self._next_version
            duplicate = version in self._snapshots
            if not duplicate:
                self._next_version = max(self._next_version, version + 1)
            if not duplicate and len(self._snapshots) >= self.keep_versions:
                _, oldest = self._snapshots.popitem(last=False)
                if oldest.layout == layout and oldest.readers == 0:  # never overwrite a snapshot being sent
                    for handle in oldest.handles:
                        handle.synchronize()  # its copies are done before new ones overwrite the buffers
                    reuse = oldest.handles
        if duplicate:  # the FSDP peers are in the gathers already: take part, then refuse
            self._gather_only(items, version)
            raise ValueError(f"{fn}: version {version} is already cached; pass a new version")
        copy_span = Span(device)  # on the current stream, which the gathers and copies follow
        handles = self._copy_groups(fn, items, groups, reuse, oldest, version)
        self._stop_at_copies_end(copy_span, handles, device)
        snap = _Snapshot(version, names, layout, handles, copy_span)
        with self._lock:
            self._snapshots[version] = snap
        return version

    def _snapshot_many(self, fn: str, items, version: Optional[int]) -> int:
        """Each sender copies the pieces it owns to host memory (Note [many senders])."""
        if self.mode != "host_cache":
            raise ValueError(f"{fn}: snapshots need mode 'host_cache', this sender has mode {self.mode!r}")
        with self._lock:
            version = self._next_version if version is None else version
            self._next_version = max(self._next_version, version + 1)
            self._many.snapshot(fn, items, version)
        return version

    def _snapshot_as_peer(self, items, names, version: Optional[int]) -> int:
        """`snapshot` on an FSDP peer of src: it takes part in the gathers and keeps no copy."""
        self._gather_only(items, version)  # one tensor at a time, dropped at once
        with self._lock:
            version = self._next_version if version is None else version
            self._next_version = max(self._next_version, version + 1)
            self._snapshots[version] = _Snapshot(version, names, [], [], None)
            while len(self._snapshots) > self.keep_versions:
                self._snapshots.popitem(last=False)
        return version

    def _copy_groups(self, fn, items, groups, reuse, oldest, version) -> list:
        """`snapshot`'s copies: each gather group gathered and copied to host (into `reuse`'s
        buffers where given); on a full pool, `oldest` (the snapshot evicted for this one) is put
        back where its buffers were not written, and the error names what to do."""
        handles = []
        try:
            for k, group in enumerate(groups):
                if k >= 2:
                    # Host wait: group k-2's copy has read its gathered tensors, and the
                    # engine (drained by the wait) has let them go, so their memory is
                    # free before this group's gathers allocate (Note [gathering DTensor sources]).
                    handles[k - 2].synchronize()
                gathered = [weight_sources.gather(t) for _, t in group]
                # The copy stream waits for the current stream (which the gathers
                # joined), and the engine holds `gathered` until the copy completes.
                handles.append(copy_to_host(gathered, out=reuse[k], pool=self.pool))
                del gathered  # ours go now; the engine's when the copy is done
        except torch.OutOfMemoryError as exc:
            # Only host buffers were being filled: the weights are untouched. The copies
            # already queued finish before their buffers go back to the pool.
            for handle in handles:
                handle.synchronize()
            handles = None
            with self._lock:
                if oldest is not None and reuse[0] is None and oldest.version not in self._snapshots:
                    self._snapshots[oldest.version] = oldest  # kept: its buffers were not written
                    self._snapshots.move_to_end(oldest.version, last=False)
            stats = self.pool.stats()
            asked = sum(t.numel() * t.element_size() for _, t in items)
            raise torch.OutOfMemoryError(
                f"{fn}: cannot copy version {version} ({asked} bytes of weights) to pinned host memory: the "
                f"pool holds {stats['in_use_bytes']} bytes in use of its limit of {stats['limit_bytes'] or 'no'} "
                f"bytes, {len(self._snapshots)} snapshot(s) cached (keep_versions={self.keep_versions}) ({exc}). "
                "The weights are unchanged; raise the pool's limit (HostPool(limit_bytes=...), "
                "OFFLOAD_HOST_POOL_LIMIT) or lower keep_versions") from exc
        return handles

    def _stop_at_copies_end(self, copy_span: Span, handles: list, device) -> None:
        """End `copy_span` when `handles`' copies are done, without the current stream waiting."""
        if copy_span.on_accel:
            # A private stream waits for the copies, so the end event marks their
            # completion without the current (training) stream waiting for anything.
            if self._marker_stream is None or self._marker_stream.device != device:
                self._marker_stream = _device.new_stream(device)
            for handle in handles:
                handle.wait_stream(self._marker_stream)
            copy_span.stop(self._marker_stream)
        else:
            copy_span.stop()  # host copies are done when queued

    def wait_snapshot(self, version: Optional[int] = None, stream=None) -> None:
        """Make `stream` (default: current) wait, on the device, until the snapshot's copy has read the weights."""
        fn = "offload.WeightSender.wait_snapshot"
        check_stream(fn, stream)
        if self._many is not None:
            self._many.wait_snapshot(fn, version, stream)
            return
        snap = self._get_snapshot(fn, version)
        snap.wait_stream(stream)

    def snapshot_ms(self, version: Optional[int] = None) -> float:
        """Device time of the snapshot's copy to host (events on the copy stream); waits (host) for the copy."""
        fn = "offload.WeightSender.snapshot_ms"
        if self._many is not None:
            raise ValueError(f"{fn}: a sender of senders= does not time its snapshots' copies; time them with "
                             "wait_snapshot() on a stream of yours")
        snap = self._get_snapshot(fn, version)
        return snap.copy_ms() if snap.handles else 0.0

    @property
    def versions(self) -> List[int]:
        with self._lock:
            return list(self._many.snapshots if self._many is not None else self._snapshots)

    def _get_snapshot(self, fn: str, version: Optional[int], reader: bool = False) -> _Snapshot:
        _check_version(fn, version)
        with self._lock:
            if not self._snapshots:
                raise ValueError(f"{fn}: no snapshot is cached; call snapshot(model) first")
            if version is None:
                version = next(reversed(self._snapshots))
            if version not in self._snapshots:
                raise ValueError(f"{fn}: version {version} is not cached; cached versions: {list(self._snapshots)}")
            snap = self._snapshots[version]
            snap.readers += int(reader)  # in the same lock as the lookup: eviction cannot slip in between
            return snap

    # ------------------------------------------------------------ send

    def send(self, source=None, *, version: Optional[int] = None) -> dict:
        """Broadcast weights to the receivers; returns per-phase timings.

        "device" mode: `source` is a module, state dict or (name, tensor) pairs.
        "host_cache" mode: send the cached snapshot `version` (default: the latest),
        or snapshot `source` first when given.
        """
        fn = "offload.WeightSender.send"
        _check_version(fn, version)
        if self.mode == "host_cache":
            if source is not None:
                version = self.snapshot(source, version)
            if self._many is not None:
                return self._many.send_snapshot(fn, version)
            return self._send_snapshot(fn, self._get_snapshot(fn, version, reader=True))
        if source is None:
            raise ValueError(f"{fn}: mode 'device' needs a source (a module, state dict or (name, tensor) pairs)")
        items = weight_sources.named_sources(fn, source)
        if version is None:
            version = self._next_version
        self._next_version = max(self._next_version, version + 1)
        if self._many is not None:
            return self._many.send(fn, items, version)
        if self._colocated is not None:
            try:
                return self._colocated.send(fn, items, version)
            finally:  # the first sync's tensors fix the device of the IPC buffers
                self.device = self._colocated.device
        if self._ipc is not None:
            try:
                return self._ipc.send(fn, items, version, weight_sources.check_source)
            finally:  # the first sync's tensors fix the device of the IPC buffers
                self.device = self._ipc.device
        if not self.is_src:  # another rank of the FSDP mesh: only take part in the gathers
            return self._gather_only(items, version)
        return self._send_items(fn, items, version, self.device, host_copy_ms=0.0)

    def _plan(self, items) -> Tuple[BucketPlan, int, bool]:
        """The plan for these tensors (cached on their names, shapes and dtypes), its id, and whether it is new."""
        signature = [(n, t.shape, t.dtype) for n, t in items]
        if signature == self._signature:
            return self._cached_plan, self._plan_id, False
        plan = plan_buckets(items, self.bucket_bytes, dtype=self.dtype, keep_dtype=self.keep_dtype,
                            alignment=self.alignment, device=self.device)
        self._signature, self._cached_plan, self._cached_spans = signature, plan, bucket_spans(plan)
        self._plan_id = random.getrandbits(62) + 1  # names this plan for receivers, whichever sender made it
        return plan, self._plan_id, True

    def _gather_only(self, items, version) -> dict:
        timer = PhaseTimer(_device.current_device(), PHASES)
        with timer.phase("gather"):
            for _, t in items:
                if weight_sources.is_dtensor(t):
                    weight_sources.gather(t)
        return timer.result(bytes=0, buckets=0, version=version)

    def _send_snapshot(self, fn: str, snap: _Snapshot) -> dict:
        """Send a snapshot that `_get_snapshot(..., reader=True)` marked as read."""
        try:
            if not self.is_src:
                return PhaseTimer(torch.device("cpu"), PHASES).result(bytes=0, buckets=0, version=snap.version)
            tensors = snap.tensors()  # host wait for the device-to-host copy
            items = list(zip(snap.names, tensors))
            if _device.is_accelerator(self.device) and self._send_stream is None:
                self._send_stream = _device.new_stream(self.device)
            # The uploads, the flag and the broadcasts are queued on the sender's own
            # stream (which also owns the bucket buffers): a send from another thread
            # never puts work in the trainer's stream.
            with _device.stream_context(self._send_stream):
                return self._send_items(fn, items, snap.version, torch.device("cpu"), host_copy_ms=snap.copy_ms())
        finally:
            with self._lock:
                snap.readers -= 1

    def _send_items(self, fn: str, items, version: int, pack_device: torch.device, host_copy_ms: float) -> dict:
        # Every tensor that is not gathered is checked before anything goes on the
        # wire: once the header is out, receivers wait for buckets, and an error here
        # would leave them hanging until the group's timeout. DTensors are checked
        # as they are gathered (gathering them all first would hold the whole model).
        self._link.check(fn)
        for name, t in items:
            if not weight_sources.is_dtensor(t):
                weight_sources.check_source(fn, name, t, pack_device, self._backend)
        timer = PhaseTimer(self.device, PHASES)
        timer.add_host("host_copy", host_copy_ms / 1e3)
        plan, plan_id, fresh = self._plan(items)
        try:
            return self._send_planned(fn, items, version, pack_device, timer, plan, plan_id, fresh)
        except BaseException as exc:
            # The receivers are somewhere inside this sync (Note [sync timeouts]); a
            # KeyboardInterrupt leaves them there as much as an error does. The group is
            # aborted (Note [failed syncs]); an error of the sender's own says so in a note
            # where Python has them (a wait that failed has said so in its message).
            if self._link.failure is None:
                self._link.fail(f"the sender raised {type(exc).__name__} during the sync of version {version}")
                if hasattr(exc, "add_note"):
                    exc.add_note(f"{fn}: the sync of version {version} failed mid-way. {AFTER_FAILURE}")
            raise

    def _send_planned(self, fn: str, items, version: int, pack_device: torch.device, timer: PhaseTimer,
                      plan: BucketPlan, plan_id: int, fresh: bool) -> dict:
        link = self._link
        # A small tensor first: the version, the plan's id and whether the plan
        # follows. The plan (an object broadcast, pickled) is sent only when this
        # sender's names, shapes or dtypes changed, so a steady-state sync costs one
        # tiny collective of metadata; receivers keep the plans they have seen by id.
        flag = torch.tensor([version, plan_id, int(fresh)], dtype=torch.int64, device=self.device)
        link.wait(link.broadcast(flag, "the header"), "the header", host=False)
        if fresh:
            link.send_object(plan.to_dict(), "the bucket plan")
        tensors = dict(items)
        staged = pack_device != self.device  # host snapshot sent over NCCL: pack on the host, then copy up
        works: List = [None, None]
        gathered: Dict[str, torch.Tensor] = {}
        for k, spans in enumerate(self._cached_spans):
            entries = spans.entries
            slot = k % 2
            size = plan.bucket_sizes[k]
            if works[slot] is not None:
                # Device-side on NCCL: the buffer's previous broadcast is done.
                link.wait(works[slot], f"bucket {k - 2} of {plan.num_buckets}", host=False)
            sources = []
            # Timed only when something is gathered: a phase that did not run reports 0.
            gathers = any(weight_sources.is_dtensor(tensors[e.name]) for e in entries)
            with timer.phase("gather") if gathers else contextlib.nullcontext():
                for e in entries:
                    src = gathered.get(e.name)
                    if src is None:
                        src = weight_sources.gather(tensors[e.name])
                        if e.chunk + 1 < e.num_chunks:
                            gathered[e.name] = src  # more chunks follow in later buckets
                    elif e.chunk + 1 == e.num_chunks:
                        del gathered[e.name]
                    sources.append(src)
            for e, s in zip(entries, sources):  # the plan checked names, shapes and dtypes
                if gathers and weight_sources.is_dtensor(tensors[e.name]):  # the others were checked before the header
                    weight_sources.check_source(fn, e.name, s, pack_device, self._backend)
            data = self._buckets.pack(slot, size, self.device, sources, spans, timer,
                                      host_pool=self.pool if staged else None, max_blocks=self._max_blocks)
            if k == 0:
                timer.mark_span("transfer")
            with _device.nvtx_range(f"offload.weight_sync.bucket{k}"):
                works[slot] = link.broadcast(data, f"bucket {k} of {plan.num_buckets}")
        for k in range(max(0, plan.num_buckets - 2), plan.num_buckets):
            link.wait(works[k % 2], f"bucket {k} of {plan.num_buckets}", host=True)
        timer.mark_span("transfer")
        return timer.result(bytes=sum(plan.bucket_sizes), buckets=plan.num_buckets, version=version)
