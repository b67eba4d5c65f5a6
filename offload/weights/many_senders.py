"""Many senders: every rank of a trainer's mesh sends the weights it owns to the rollout ranks.

`WeightSender(senders=[...])` and `WeightReceiver(senders=[...], slices=...)` run this
protocol (Note [many senders]); the single-sender protocol is sync.py's. Buckets are
planned and packed as there (`plan_buckets`, `copy_spans`), and each sender's
collectives go through a `Link` (timeouts, Note [failed syncs]). This module holds the
sending side (`ManySender`) and what both sides share (the groups, `Piece`, `SenderPlan`);
the receiving side is many_receiver.py's.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core import _device
from ..core.checks import is_int
from ..core.copy import CopyHandle, copy_to_host
from ..core.pool import HostPool, default_host_pool
from ..core.timing import PhaseTimer
from . import sources as weight_sources
from .bucket_pack import BucketSpans, bucket_spans
from .bucket_plan import BucketPlan
from .bucket_planner import DtypePolicy, check_bucket_options, default_bucket_bytes, plan_buckets
from .link import AFTER_FAILURE, Link, check_ranks, collective_max_blocks, transport_device
from .sync_options import PHASES, SenderBuckets

# Note [many senders]
# ~~~~~~~~~~~~~~~~~~~
# One sender gathering an FSDP model and broadcasting every byte sends N times what
# each trainer rank holds and gathers the model through its own memory. With
# `senders=[...]` every trainer rank sends what it owns instead:
# - Ownership is computed alike on every trainer rank from names, shapes, dtypes and
#   placements, without a message. A DTensor sharded on one dimension of a 1-D mesh
#   (FSDP2's Shard(0)) goes as its shards, each from the rank that holds it (torch's
#   chunk rule: ceil(n / mesh size) rows per rank); nothing is gathered. A tensor every
#   trainer holds whole (plain, or a replicated DTensor) goes whole from one owner:
#   largest first to the owner with the fewest bytes so far (ties: model order, then
#   sender order), so the busiest owner sends at most its share plus one whole tensor.
# - Transport: one process group per sender, {sender} + every receiver, built once at
#   construction (`new_group`, collective over the world). On its own group each sender
#   runs the single-sender protocol: a header (version, plan id, whether the plan is
#   new), its plan when it changed (receivers cache plans by id), then its buckets, two
#   in flight (Note [bucket pipeline]). A plan is the sender's pieces (name, full shape,
#   and the slice `dim, start, stop` of the full tensor each carries) and the buckets of
#   `plan_buckets` over those pieces, so the cast, the alignment and the splitting of a
#   large piece are the single sender's. Broadcast, not point to point: each sender
#   pays for its own bytes once however many receivers there are (replicated rollout
#   engines each get the whole model from one send), the groups run side by side, and
#   each inherits the timeouts and failure handling of the single-sender protocol.
# - Receivers post buckets 0 and 1 of every sender, then walk the buckets round-robin
#   (bucket k of each sender in sender order, then k+1), the same order on every
#   receiver: collectives of several communicators on one device are issued in one
#   order everywhere, which NCCL needs to rule out a cross-communicator deadlock.
# - `slices` says what a receiver keeps (a tensor-parallel shard, or the whole tensor):
#   each piece's intersection with it is copied into place; the rest of the bucket is
#   received and dropped (a broadcast does not skip a member). Where the intersection
#   is the whole piece and lands contiguously (a Shard(0) piece into a whole tensor or
#   a row slice) the bucket's copies are one batched `copy_spans`; other intersections
#   are narrowed views copied one by one.
# - Memory: a sender packs from its own shards into two buckets; a receiver holds two
#   buckets per sender, and in `receive()` the tensors whose pieces have not all
#   arrived. Senders send in model order, so those are a window of a few tensors.
# - A failure on any sender's group ends the receiver's sync and aborts all its groups
#   (Note [failed syncs]); the other senders' waits then fail or time out in turn.
# - `mode="host_cache"`: each sender's `snapshot()` copies the pieces it owns (its shards,
#   its whole tensors: about 1/N of the model, nothing gathered) to pinned host memory,
#   asynchronously, and returns at once; a later `send(version=v)` sends that snapshot,
#   packing on the host into pinned buckets copied up to the device before their broadcast
#   (on the sender's own stream), so training goes on while the weights leave. The wire is
#   the device mode's: receivers cannot tell the two apart. Every sender snapshots and
#   sends the same versions in the same order.


def check_senders(fn: str, senders) -> List[int]:
    """`senders` as a sorted list of distinct global ranks (ints >= 0), checked before torch.distributed is asked."""
    return check_ranks(fn, "senders", senders, "the trainer ranks that send", "each trainer rank once")


def build_groups(fn: str, senders: List[int], ranks: Optional[List[int]], backend) -> Tuple[list, List[int], List[int]]:
    """One group per sender, {sender} + receivers, in sender order (collective over the world);
    returns (groups, members, receivers). `ranks` (None: the world) are the senders and receivers."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialized; call dist.init_process_group first")
    world = dist.get_world_size()
    members = list(range(world)) if ranks is None else list(ranks)
    outside = [r for r in members + senders if r >= world]
    if outside:
        raise ValueError(f"{fn}: ranks and senders must be ranks of the world (0 to {world - 1}), got {outside[0]}")
    strays = [s for s in senders if s not in members]
    if strays:
        raise ValueError(f"{fn}: senders must be ranks of the sync group {members}, got {strays[0]}")
    receivers = [r for r in members if r not in senders]
    if not receivers:
        raise ValueError(f"{fn}: every rank of the sync group {members} is a sender; at least one must receive")
    # new_group is collective over the world: every rank builds every group, in this order.
    groups = [dist.new_group(sorted([s] + receivers), backend=backend) for s in senders]
    return groups, members, receivers


@dataclass(frozen=True)
class Piece:
    """The part of a full tensor one sender carries: [start, stop) along `dim`, or the whole (dim None)."""

    name: str
    shape: Tuple[int, ...]  # of the full tensor
    dim: Optional[int] = None
    start: int = 0
    stop: int = 0

    @property
    def local_shape(self) -> Tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return self.shape[:self.dim] + (self.stop - self.start,) + self.shape[self.dim + 1:]

    def to_list(self) -> list:
        return [self.name, list(self.shape), self.dim, self.start, self.stop]

    @classmethod
    def from_list(cls, fn: str, data) -> "Piece":
        if not (isinstance(data, list) and len(data) == 5 and isinstance(data[0], str)
                and isinstance(data[1], list) and all(is_int(s) and s >= 0 for s in data[1])
                and (data[2] is None or is_int(data[2])) and is_int(data[3]) and is_int(data[4])):
            raise ValueError(f"{fn}: a piece must be [name, shape, dim, start, stop], got {data!r:.120}")
        piece = cls(data[0], tuple(data[1]), data[2], data[3], data[4])
        if piece.dim is not None and not (0 <= piece.dim < len(piece.shape)
                                          and 0 <= piece.start <= piece.stop <= piece.shape[piece.dim]):
            raise ValueError(f"{fn}: piece of tensor {piece.name!r} holds [{piece.start}, {piece.stop}) of dim "
                             f"{piece.dim} of a tensor of shape {list(piece.shape)}")
        return piece


@dataclass
class SenderPlan:
    """What one sender sends in a sync: its pieces (in bucket order) and their buckets."""

    pieces: List[Piece]
    buckets: BucketPlan
    bytes_per_sender: List[int]  # wire bytes of every sender's buckets, in sender order
    model_bytes: int  # bytes of every full tensor in its bucket dtype

    def to_dict(self) -> dict:
        return {"pieces": [p.to_list() for p in self.pieces], "buckets": self.buckets.to_dict(),
                "bytes_per_sender": list(self.bytes_per_sender), "model_bytes": self.model_bytes}

    @classmethod
    def from_dict(cls, fn: str, data) -> "SenderPlan":
        if not isinstance(data, dict) or set(data) != {"pieces", "buckets", "bytes_per_sender", "model_bytes"}:
            raise ValueError(f"{fn}: expected a plan with keys pieces, buckets, bytes_per_sender, model_bytes, got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        buckets = BucketPlan.from_dict(data["buckets"]).validate(fn)
        pieces = [Piece.from_list(fn, p) for p in data["pieces"]] if isinstance(data["pieces"], list) else None
        if pieces is None or len({p.name for p in pieces}) != len(pieces):
            raise ValueError(f"{fn}: the pieces must be a list naming each tensor once")
        by_name = {p.name: p for p in pieces}
        for e in buckets.entries:
            piece = by_name.get(e.name)
            if piece is None or tuple(e.shape) != piece.local_shape:
                raise ValueError(f"{fn}: tensor {e.name!r} has shape {list(e.shape)} in the buckets but its piece is "
                                 f"{piece.local_shape if piece else 'missing'}")
        return cls(pieces, buckets, list(data["bytes_per_sender"]), int(data["model_bytes"]))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * _itemsize(dtype)


def _shards(fn: str, name: str, t, senders: List[int]) -> Optional[List[Tuple[int, Piece]]]:
    """(sender index, piece) per shard of a DTensor sharded on one dim of a 1-D mesh; None for a tensor
    every trainer holds whole (plain, or replicated)."""
    if not weight_sources.is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    if t.device_mesh.ndim != 1 or type(placements[0]) is not Shard:
        raise ValueError(f"{fn}: tensor {name!r} has placements {placements} on a {t.device_mesh.ndim}-D mesh; "
                         "senders= sends DTensors sharded on one dimension of a 1-D mesh (FSDP2's Shard(0)) or "
                         "replicated, and plain tensors")
    shape = tuple(t.shape)
    dim = placements[0].dim % len(shape)
    ranks = t.device_mesh.mesh.flatten().tolist()
    rows = shape[dim]
    chunk = -(-rows // len(ranks))  # torch.chunk's rule, which DTensor and FSDP2 shard by
    out = []
    for i, r in enumerate(ranks):
        if r not in senders:
            raise ValueError(f"{fn}: tensor {name!r} has a shard on rank {r}, which is not in senders {senders}")
        start = min(i * chunk, rows)
        stop = min(start + chunk, rows)
        if stop > start or i == 0:  # a tensor with no rows still goes once, from the first rank
            out.append((senders.index(r), Piece(name, shape, dim, start, stop)))
    return out


def assign(fn: str, items, senders: List[int], policy: DtypePolicy) -> List[List[Tuple[Piece, int]]]:
    """Per sender (in `senders` order), its (piece, index of the item it comes from) pairs in model order
    (Note [many senders]).
    Depends only on names, shapes, dtypes and placements: every trainer rank computes the same."""
    owned: List[List[Tuple[int, Piece]]] = [[] for _ in senders]
    load = [0] * len(senders)
    whole = []
    for i, (name, t) in enumerate(items):
        shards = _shards(fn, name, t, senders)
        dtype = policy.target(name, t.dtype)
        if shards is None:
            whole.append((-_nbytes(t.shape, dtype), i, name, t))
            continue
        for owner, piece in shards:
            owned[owner].append((i, piece))
            load[owner] += _nbytes(piece.local_shape, dtype)
    for minus_bytes, i, name, t in sorted(whole, key=lambda w: (w[0], w[1])):
        owner = min(range(len(senders)), key=lambda k: (load[k], k))
        owned[owner].append((i, Piece(name, tuple(t.shape))))
        load[owner] -= minus_bytes
    return [[(piece, i) for i, piece in sorted(own, key=lambda o: o[0])] for own in owned]


@dataclass
class HostSnapshot:
    """One version of a sender's pieces in pinned host memory (mode "host_cache")."""

    version: int
    plan: "SenderPlan"
    plan_id: int
    handle: Optional[CopyHandle]  # the copy of the pieces, in the plan's order; None off the sync group


class ManySender:
    """One trainer rank's side of a many-sender sync (Note [many senders]); built by `WeightSender(senders=...)`."""

    def __init__(self, fn: str, senders: List[int], ranks, backend, bucket_bytes: Optional[int], default_cap: int,
                 dtype, keep_dtype, alignment: int, reserve_sms: int, timeout_s, keep_versions: int = 2,
                 pool: Optional[HostPool] = None):
        self.senders = senders
        self.groups, self.members, self.receivers = build_groups(fn, senders, ranks, backend)
        rank = dist.get_rank()
        self.member = rank in self.members
        if self.member and rank not in senders:
            raise ValueError(f"{fn}: this rank ({rank}) is not in senders {senders}; construct a WeightReceiver "
                             "with the same senders here")
        self.index = senders.index(rank) if rank in senders else -1
        self.group = self.groups[self.index] if self.member else None
        self.device = transport_device(self.group) if self.member else _device.current_device()
        if bucket_bytes is None:  # as a single sender's default: up to `default_cap`
            bucket_bytes = min(default_bucket_bytes(self.device), default_cap)
            check_bucket_options(fn, bucket_bytes, dtype, keep_dtype, alignment)  # the default against alignment
        self.bucket_bytes = bucket_bytes
        self.policy = check_bucket_options(fn, bucket_bytes, dtype, keep_dtype, alignment)
        self.dtype, self.keep_dtype, self.alignment = dtype, keep_dtype, alignment
        self._max_blocks = collective_max_blocks(fn, self.device, reserve_sms)
        self._link = Link(fn, self.group, rank, timeout_s, self.device) if self.member else None
        self._backend = dist.get_backend(self.group) if self.member else None
        self._buckets = SenderBuckets()
        self._signature = None
        self._plan: Optional[SenderPlan] = None
        self._spans: List[BucketSpans] = []
        self._plan_id = 0
        self._owned: List[Tuple[Piece, int]] = []
        # Plan ids sent on this group lately: a plan goes with its first send (receivers keep
        # their last 8 by id, so these few are known to every receiver).
        self._sent_plans: deque = deque(maxlen=4)
        self.keep_versions = keep_versions
        self._pool = pool
        self.snapshots: "OrderedDict[int, HostSnapshot]" = OrderedDict()
        self._send_stream = None  # host_cache sends run here, never on the trainer's stream

    def _make_plan(self, fn: str, items) -> Tuple[SenderPlan, int, bool]:
        signature = [(n, tuple(t.shape), t.dtype, _layout_key(t)) for n, t in items]
        if signature == self._signature:
            return self._plan, self._plan_id, False
        owned = assign(fn, items, self.senders, self.policy)
        plans = []
        for own in owned:  # every sender's buckets, for the bytes each sends (metadata only)
            meta = [(p.name, torch.empty(p.local_shape, dtype=items[i][1].dtype, device="meta")) for p, i in own]
            plans.append(plan_buckets(meta, self.bucket_bytes, dtype=self.dtype, keep_dtype=self.keep_dtype,
                                      alignment=self.alignment))
        model_bytes = sum(_nbytes(t.shape, self.policy.target(n, t.dtype)) for n, t in items)
        sizes = [sum(p.bucket_sizes) for p in plans]
        self._owned = owned[self.index]  # (piece, item index): the items of later sends have the same order
        plan = SenderPlan([p for p, _ in self._owned], plans[self.index], sizes, model_bytes)
        self._signature, self._plan, self._spans = signature, plan, bucket_spans(plan.buckets)
        self._plan_id = random.getrandbits(62) + 1
        return plan, self._plan_id, True

    def _local_sources(self, fn: str, items) -> List[torch.Tensor]:
        """The tensors this sender sends, one per piece of its plan, checked (before a header
        goes out: receivers wait for buckets once it is)."""
        sources = []
        for piece, i in self._owned:  # checked before the header: receivers wait for buckets once it is out
            t = items[i][1]
            local = t.to_local() if weight_sources.is_dtensor(t) else t
            weight_sources.check_source(fn, piece.name, local, self.device, self._backend)
            if tuple(local.shape) != piece.local_shape:
                raise ValueError(f"{fn}: the local shard of tensor {piece.name!r} has shape {list(local.shape)}, "
                                 f"expected {list(piece.local_shape)} (rows [{piece.start}, {piece.stop}) of dim "
                                 f"{piece.dim}, torch.chunk's rule)")
            sources.append(local)
        return sources

    def send(self, fn: str, items, version: int) -> dict:
        if not self.member:  # a world rank outside the sync group: it only built the groups
            return PhaseTimer(torch.device("cpu"), PHASES).result(bytes=0, buckets=0, version=version, bytes_sent=0)
        self._link.check(fn)
        plan, plan_id, _ = self._make_plan(fn, items)
        sources = self._local_sources(fn, items)
        return self._send_pieces(fn, plan, plan_id, dict(zip((p.name for p in plan.pieces), sources)), version,
                                 PhaseTimer(self.device, PHASES), on_host=False)

    @property
    def pool(self) -> HostPool:
        if self._pool is None:
            self._pool = default_host_pool()
        return self._pool

    def snapshot(self, fn: str, items, version: int) -> None:
        """Copy the pieces this sender owns to pinned host memory, asynchronously (mode "host_cache")."""
        if version in self.snapshots:
            raise ValueError(f"{fn}: version {version} is already cached; pass a new version")
        if not self.member:
            snap = HostSnapshot(version, None, 0, None)
        else:
            plan, plan_id, _ = self._make_plan(fn, items)
            # The copy stream waits for the current stream, and the engine holds the sources
            # until the copy is done: training may change them as soon as this returns.
            snap = HostSnapshot(version, plan, plan_id, copy_to_host(self._local_sources(fn, items), pool=self.pool))
        self.snapshots[version] = snap
        while len(self.snapshots) > self.keep_versions:
            self.snapshots.popitem(last=False)

    def _snapshot(self, fn: str, version: Optional[int]) -> HostSnapshot:
        if not self.snapshots:
            raise ValueError(f"{fn}: no snapshot cached; call snapshot() (or send(source)) first")
        if version is None:
            version = next(reversed(self.snapshots))
        snap = self.snapshots.get(version)
        if snap is None:
            raise ValueError(f"{fn}: version {version} is not cached (cached: {list(self.snapshots)}; "
                             f"keep_versions={self.keep_versions})")
        return snap

    def wait_snapshot(self, fn: str, version: Optional[int], stream) -> None:
        """`stream` (None: the current one) waits, on the device, for the snapshot's copy."""
        snap = self._snapshot(fn, version)
        if snap.handle is not None:
            snap.handle.wait_stream(stream)

    def send_snapshot(self, fn: str, version: Optional[int]) -> dict:
        """Send the snapshot `version` (None: the latest): packed on the host, copied up, broadcast."""
        snap = self._snapshot(fn, version)
        version = snap.version
        if not self.member:
            return PhaseTimer(torch.device("cpu"), PHASES).result(bytes=0, buckets=0, version=version, bytes_sent=0)
        self._link.check(fn)
        timer = PhaseTimer(self.device, PHASES)
        with timer.phase("host_copy"):
            tensors = snap.handle.wait()  # host wait for the device-to-host copy
        on_accel = _device.is_accelerator(self.device)
        if on_accel and self._send_stream is None:
            self._send_stream = _device.new_stream(self.device)
        # The uploads and the broadcasts are queued on the sender's own stream (which owns the
        # device buckets): a send from another thread never puts work in the trainer's stream.
        with _device.stream_context(self._send_stream if on_accel else None):
            return self._send_pieces(fn, snap.plan, snap.plan_id, dict(zip((p.name for p in snap.plan.pieces),
                                                                             tensors)),
                                     version, timer, on_host=on_accel)

    def _send_pieces(self, fn: str, plan: "SenderPlan", plan_id: int, tensors: dict, version: int,
                     timer: PhaseTimer, on_host: bool) -> dict:
        fresh = plan_id not in self._sent_plans
        if fresh:
            self._sent_plans.append(plan_id)
        try:
            self._send_planned(plan, plan_id, fresh, tensors, version, timer, on_host)
        except BaseException as exc:  # the receivers are mid-sync (Note [failed syncs])
            if self._link.failure is None:
                self._link.fail(f"the sender raised {type(exc).__name__} during the sync of version {version}")
                if hasattr(exc, "add_note"):
                    exc.add_note(f"{fn}: the sync of version {version} failed mid-way. {AFTER_FAILURE}")
            raise
        sent = sum(plan.buckets.bucket_sizes)
        return timer.result(bytes=sent, buckets=plan.buckets.num_buckets, version=version, bytes_sent=sent,
                            bytes_per_sender=list(plan.bytes_per_sender), model_bytes=plan.model_bytes)

    def _send_planned(self, plan: SenderPlan, plan_id: int, fresh: bool, tensors: dict, version: int,
                      timer: PhaseTimer, on_host: bool = False) -> None:
        """The header, the plan where it is new, then the buckets, two in flight; `on_host`: the
        sources are host tensors (a snapshot), packed into pinned host buckets and copied up."""
        link = self._link
        flag = torch.tensor([version, plan_id, int(fresh)], dtype=torch.int64, device=self.device)
        link.wait(link.broadcast(flag, "the header"), "the header", host=False)
        if fresh:
            link.send_object(plan.to_dict(), "the bucket plan")
        n = plan.buckets.num_buckets
        works: List = [None, None]
        spans_of = self._spans if plan is self._plan else bucket_spans(plan.buckets)  # a snapshot's older plan
        for k, spans in enumerate(spans_of):  # two buckets in flight (Note [bucket pipeline])
            slot = k % 2
            if works[slot] is not None:
                link.wait(works[slot], f"bucket {k - 2} of {n}", host=False)
            data = self._buckets.pack(slot, plan.buckets.bucket_sizes[k], self.device,
                                      [tensors[e.name] for e in spans.entries], spans, timer,
                                      host_pool=self.pool if on_host else None, max_blocks=self._max_blocks)
            if k == 0:
                timer.mark_span("transfer")
            works[slot] = link.broadcast(data, f"bucket {k} of {n}")
        for k in range(max(0, n - 2), n):
            link.wait(works[k % 2], f"bucket {k} of {n}", host=True)
        timer.mark_span("transfer")



def _layout_key(t) -> tuple:
    if not weight_sources.is_dtensor(t):
        return ()
    return (str(tuple(t.placements)), tuple(t.device_mesh.mesh.flatten().tolist()))
