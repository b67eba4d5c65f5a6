"""Many senders: every rank of a trainer's mesh sends the weights it owns to the rollout ranks.

`WeightSender(senders=[...])` and `WeightReceiver(senders=[...], slices=...)` run this
protocol (Note [many senders]); the single-sender protocol is sync.py's. Buckets are
planned and packed as there (`plan_buckets`, `copy_spans`), and each sender's
collectives go through a `Link` (timeouts, Note [failed syncs]). This module holds the
sending side (`ManySender`) and what both sides share (the groups, `Piece`, `SenderPlan`);
the receiving side is many_receiver.py's.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core import _device
from ..core.checks import is_int
from ..core.copy import CopyHandle, copy_to_host
from ..core.pool import HostPool, default_host_pool
from ..core.timing import PhaseTimer
from . import sources as weight_sources
from .bucket_pack import BucketSpans, bucket_spans
from .bucket_plan import BucketPlan, dtype_itemsize
from .bucket_planner import DtypePolicy, check_bucket_options, default_bucket_bytes, plan_buckets
from .link import AFTER_FAILURE, Link, check_ranks, collective_max_blocks, transport_device
from .sync_options import PHASES, SenderBuckets

# Note [many senders]
# ~~~~~~~~~~~~~~~~~~~
# One sender gathering an FSDP model and broadcasting every byte sends N times what
# each trainer rank holds and gathers the model through its own memory. With
# `senders=[...]` every trainer rank sends what it owns instead:
# - Ownership is computed alike on every trainer rank from names, shapes, dtypes and
#   placements, without a message. A sharded DTensor goes as its local boxes (Note
#   [shard boxes]), each from a rank that holds it; nothing is gathered. A box one rank
#   holds goes from it; a box several ranks hold (HSDP's replicas, a tensor every
#   trainer holds whole: plain, or a replicated DTensor) goes from one of them: largest
#   first to the holder with the fewest bytes so far (ties: model order, then sender
#   order), so the busiest owner sends at most its share plus one such box.
# - Transport: one process group per sender, {sender} + every receiver, built once at
#   construction (`new_group`, collective over the world). On its own group each sender
#   runs the single-sender protocol: a header (version, plan id, whether the plan is
#   new), its plan when it changed (receivers cache plans by id), then its buckets, two
#   in flight (Note [bucket pipeline]). A plan is the sender's pieces (name, full shape,
#   and the box `[dim, start, stop], ...` of the full tensor each carries) and the buckets of
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

# Note [shard boxes]
# ~~~~~~~~~~~~~~~~~~
# A DTensor's local tensor on the rank at mesh coordinate c is a box of the full tensor:
# DTensor applies its placements in mesh-dim order, and a Shard(d) on mesh dim i cuts
# what the earlier placements left of tensor dim d into mesh.size(i) pieces by
# torch.chunk's rule (ceil(n / size) each, the last ones shorter or empty) and keeps
# piece c[i]; Replicate() keeps all of it. So FSDP2 (Shard(0) on a 1-D mesh), HSDP
# (Replicate(), Shard(0)), and FSDP2 beside tensor parallelism on another dim
# ((Shard(0), Shard(1))) all give boxes, computed here for every coordinate from the
# mesh's shape and ranks alone, and checked against each sender's own local tensor
# before it sends. `_StridedShard` (FSDP2 over a tensor-parallel shard of the same dim)
# interleaves rows instead and is refused by name, as is Partial (not yet a weight).


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
    """The part of a full tensor one sender carries: a box, [start, stop) along each dim of `cuts`
    (sorted by dim), the whole tensor along the others; no cuts: the whole tensor."""

    name: str
    shape: Tuple[int, ...]  # of the full tensor
    cuts: Tuple[Tuple[int, int, int], ...] = ()  # (dim, start, stop)

    @property
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.shape)
        for dim, start, stop in self.cuts:
            shape[dim] = stop - start
        return tuple(shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def describe(self) -> str:
        if not self.cuts:
            return "the whole tensor"
        return ", ".join(f"[{start}, {stop}) of dim {dim}" for dim, start, stop in self.cuts)

    def to_list(self) -> list:
        return [self.name, list(self.shape), [list(c) for c in self.cuts]]

    @classmethod
    def from_list(cls, fn: str, data) -> "Piece":
        if not (isinstance(data, list) and len(data) == 3 and isinstance(data[0], str)
                and isinstance(data[1], list) and all(is_int(s) and s >= 0 for s in data[1])
                and isinstance(data[2], list)
                and all(isinstance(c, list) and len(c) == 3 and all(is_int(v) for v in c) for c in data[2])):
            raise ValueError(f"{fn}: a piece must be [name, shape, [[dim, start, stop], ...]], got {data!r:.120}")
        piece = cls(data[0], tuple(data[1]), tuple(tuple(c) for c in data[2]))
        dims = [dim for dim, _, _ in piece.cuts]
        if dims != sorted(set(dims)) or not all(0 <= dim < len(piece.shape) and 0 <= start <= stop <= piece.shape[dim]
                                                for dim, start, stop in piece.cuts):
            raise ValueError(f"{fn}: piece of tensor {piece.name!r} holds {piece.describe()} of a tensor of shape "
                             f"{list(piece.shape)}")
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


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype_itemsize(dtype)


def _boxes(fn: str, name: str, t, senders: List[int]) -> Optional[List[Tuple[List[int], Piece]]]:
    """(the indices in `senders` of the ranks that hold it, piece) per distinct local box of a DTensor
    (Note [shard boxes]); None for a tensor every trainer holds whole (plain, or replicated)."""
    if not weight_sources.is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    for p in placements:
        if type(p) is not Shard and not isinstance(p, Replicate):
            raise ValueError(f"{fn}: tensor {name!r} has placements {placements}; senders= sends DTensors whose "
                             "placements are Shard(dim) or Replicate() on each mesh dimension (FSDP2, HSDP, FSDP2 "
                             "with tensor parallelism on another dim), and plain tensors; "
                             f"{type(p).__name__} is not one of them")
    shape = tuple(t.shape)
    mesh = t.device_mesh.mesh
    boxes: Dict[Tuple[Tuple[int, int, int], ...], List[int]] = {}
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        rank = int(mesh[coordinate])
        if rank not in senders:
            raise ValueError(f"{fn}: tensor {name!r} has a shard on rank {rank}, which is not in senders {senders}")
        box = _box_of(shape, placements, tuple(mesh.shape), coordinate)
        boxes.setdefault(box, []).append(senders.index(rank))
    pieces = [(holders, Piece(name, shape, box)) for box, holders in boxes.items()]
    kept = [(holders, piece) for holders, piece in pieces if piece.numel > 0]
    return kept or pieces[:1]  # a tensor with no elements still goes once, from its first holder


def _box_of(shape, placements, mesh_shape, coordinate) -> Tuple[Tuple[int, int, int], ...]:
    """The box of the full tensor the rank at `coordinate` holds: each mesh dim's Shard(d), in mesh-dim
    order, cuts what the earlier ones left of dim d into torch.chunk's pieces (ceil(n / size) each)."""
    from torch.distributed.tensor import Shard

    ranges = {}
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard):  # Replicate: every coordinate along it holds the same box
            continue
        dim = placement.dim % len(shape)
        start, stop = ranges.get(dim, (0, shape[dim]))
        length = stop - start
        chunk = -(-length // mesh_shape[mesh_dim])
        lo = min(coordinate[mesh_dim] * chunk, length)
        ranges[dim] = (start + lo, start + min(lo + chunk, length))
    return tuple((dim, lo, hi) for dim, (lo, hi) in sorted(ranges.items()) if (lo, hi) != (0, shape[dim]))


def assign(fn: str, items, senders: List[int], policy: DtypePolicy) -> List[List[Tuple[Piece, int]]]:
    """Per sender (in `senders` order), its (piece, index of the item it comes from) pairs in model order
    (Note [many senders]).
    Depends only on names, shapes, dtypes and placements: every trainer rank computes the same."""
    owned: List[List[Tuple[int, Piece]]] = [[] for _ in senders]
    load = [0] * len(senders)
    shared = []  # (-bytes, item index, holders, piece): pieces several ranks hold, placed by load
    everyone = list(range(len(senders)))
    for i, (name, t) in enumerate(items):
        boxes = _boxes(fn, name, t, senders)
        dtype = policy.target(name, t.dtype)
        if boxes is None:
            boxes = [(everyone, Piece(name, tuple(t.shape)))]
        for holders, piece in boxes:
            nbytes = _nbytes(piece.local_shape, dtype)
            if len(holders) == 1:
                owned[holders[0]].append((i, piece))
                load[holders[0]] += nbytes
            else:
                shared.append((-nbytes, i, holders, piece))
    for minus_bytes, i, holders, piece in sorted(shared, key=lambda w: (w[0], w[1], w[3].cuts)):
        owner = min(holders, key=lambda k: (load[k], k))
        owned[owner].append((i, piece))
        load[owner] -= minus_bytes
    return [[(piece, i) for i, piece in sorted(own, key=lambda o: o[0])] for own in owned]


@dataclass
class SendersPlan:
    """Every sender's share of a sync, as each trainer rank computes it alike (Note [many senders])."""

    owned: List[List[Tuple[Piece, int]]]  # per sender: (piece, index of its item) in model order
    plans: List[BucketPlan]  # per sender: the buckets of its pieces
    model_bytes: int  # bytes of every full tensor in its bucket dtype


def plan_senders(fn: str, items, senders: List[int], policy: DtypePolicy, bucket_bytes: int, dtype, keep_dtype,
                 alignment: int) -> SendersPlan:
    """Who sends which piece of `items` ((name, tensor) pairs), and every sender's buckets (metadata only)."""
    owned = assign(fn, items, senders, policy)
    plans = []
    for own in owned:
        meta = [(p.name, torch.empty(p.local_shape, dtype=items[i][1].dtype, device="meta")) for p, i in own]
        plans.append(plan_buckets(meta, bucket_bytes, dtype=dtype, keep_dtype=keep_dtype, alignment=alignment))
    model_bytes = sum(_nbytes(t.shape, policy.target(n, t.dtype)) for n, t in items)
    return SendersPlan(owned, plans, model_bytes)


def local_sources(fn: str, owned: List[Tuple[Piece, int]], items, device: torch.device, backend) -> List[torch.Tensor]:
    """The local tensor of each of this sender's pieces (a DTensor's shard), checked against its piece."""
    sources = []
    for piece, i in owned:
        t = items[i][1]
        local = t.to_local() if weight_sources.is_dtensor(t) else t
        weight_sources.check_source(fn, piece.name, local, device, backend)
        if tuple(local.shape) != piece.local_shape:
            raise ValueError(f"{fn}: the local shard of tensor {piece.name!r} has shape {list(local.shape)}, "
                             f"expected {list(piece.local_shape)} ({piece.describe()}, torch.chunk's rule)")
        sources.append(local)
    return sources


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
        signature = plan_signature(items)
        if signature == self._signature:
            return self._plan, self._plan_id, False
        every = plan_senders(fn, items, self.senders, self.policy, self.bucket_bytes, self.dtype, self.keep_dtype,
                             self.alignment)
        sizes = [sum(p.bucket_sizes) for p in every.plans]
        self._owned = every.owned[self.index]  # (piece, item index): the items of later sends have the same order
        plan = SenderPlan([p for p, _ in self._owned], every.plans[self.index], sizes, every.model_bytes)
        self._signature, self._plan, self._spans = signature, plan, bucket_spans(plan.buckets)
        self._plan_id = random.getrandbits(62) + 1
        return plan, self._plan_id, True

    def _local_sources(self, fn: str, items) -> List[torch.Tensor]:
        """The tensors this sender sends, one per piece of its plan, checked (before a header
        goes out: receivers wait for buckets once it is)."""
        return local_sources(fn, self._owned, items, self.device, self._backend)

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



def plan_signature(items) -> list:
    """What a many-sender plan depends on, per (name, tensor): its shape, dtype, and a DTensor's
    placements and mesh ranks. A sender plans again only when this changes."""
    return [(n, tuple(t.shape), t.dtype, _layout_key(t)) for n, t in items]


def _layout_key(t) -> tuple:
    if not weight_sources.is_dtensor(t):
        return ()
    return (str(tuple(t.placements)), tuple(t.device_mesh.mesh.flatten().tolist()))
