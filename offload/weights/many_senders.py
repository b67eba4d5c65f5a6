"""Many senders: every rank of a trainer's mesh sends the weights it owns to the rollout ranks.

`WeightSender(senders=[...])` and `WeightReceiver(senders=[...], slices=...)` run this
protocol (Note [many senders]); the single-sender protocol is sync.py's. Buckets are
planned and packed as there (`plan_buckets`, `copy_spans`), and each sender's
collectives go through a `Link` (timeouts, Note [failed syncs]).
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core import _device
from ..core.checks import is_int
from ..core.copy import CopyHandle, copy_to_host
from ..core.pool import HostPool, default_host_pool
from ..core.timing import PhaseTimer
from . import sources as weight_sources
from .bucket_pack import BucketSpans, bucket_spans, check_received_into, copy_spans, destinations
from .bucket_plan import BucketPlan
from .bucket_planner import DtypePolicy, check_bucket_options, default_bucket_bytes, plan_buckets
from .link import AFTER_FAILURE, Link, check_ranks, collective_max_blocks, transport_device
from .sync_options import BucketBuffers, SenderBuckets

PHASES = ("gather", "pack", "host_copy", "transfer", "unpack")

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


def check_slices(fn: str, slices):
    """None, a callable (name, full_shape) -> (dim, start, stop) or None, or a mapping name -> (dim, start, stop)."""
    if slices is None or callable(slices):
        return slices
    if not hasattr(slices, "items"):
        raise TypeError(f"{fn}: slices must be a mapping name -> (dim, start, stop), a callable (name, full_shape) "
                        f"-> (dim, start, stop) or None, or None, got {type(slices).__name__}")
    for name, spec in slices.items():
        _check_slice(fn, name, spec)
    return dict(slices)


def _check_slice(fn: str, name: str, spec) -> Optional[Tuple[int, int, int]]:
    if spec is None:
        return None
    if not (isinstance(spec, (tuple, list)) and len(spec) == 3 and all(is_int(v) for v in spec)):
        raise TypeError(f"{fn}: the slice of tensor {name!r} must be (dim, start, stop), three ints, or None for "
                        f"the whole tensor, got {spec!r}")
    dim, start, stop = spec
    if dim < 0 or start < 0 or stop < start:
        raise ValueError(f"{fn}: the slice of tensor {name!r} must have dim >= 0 and 0 <= start <= stop, got "
                         f"(dim={dim}, start={start}, stop={stop})")
    return int(dim), int(start), int(stop)


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


# ---------------------------------------------------------------- receiving


@dataclass
class _Copy:
    """One bucket entry's part of a destination: narrow the piece by `src`, the destination by `dst`
    (each a list of (dim, start, length)); `direct` when the whole piece lands contiguously."""

    entry: object  # BucketEntry
    name: str
    src: list
    dst: list
    direct: bool


@dataclass
class _Program:
    """What a receiver does with one sender's plan, given its slices: per bucket, its copies."""

    plan: SenderPlan
    spans: List[BucketSpans]
    copies: List[List[_Copy]]  # per bucket, the entries this receiver keeps
    direct: List[Optional[BucketSpans]]  # per bucket, the spans of the direct copies (None: none)
    contributions: Dict[str, int]  # pieces of this sender that reach each kept tensor


def _narrow(t: torch.Tensor, cuts: list) -> torch.Tensor:
    for dim, start, length in cuts:
        t = t.narrow(dim, start, length)
    return t


def _overlap(piece: Piece, want: Optional[Tuple[int, int, int]]):
    """(src cuts, dst cuts) of the piece's intersection with the wanted slice, or None when they do not meet."""
    shape = piece.shape
    have = {piece.dim: (piece.start, piece.stop)} if piece.dim is not None else {}
    keep = {want[0]: (want[1], want[2])} if want is not None else {}
    src, dst = [], []
    for d in sorted(set(have) | set(keep)):
        h = have.get(d, (0, shape[d]))
        w = keep.get(d, (0, shape[d]))
        lo, hi = max(h[0], w[0]), min(h[1], w[1])
        if hi < lo or (hi == lo and (h[1] > h[0] or w[1] > w[0])):
            return None  # disjoint (a tensor with no rows still meets itself)
        if (lo, hi) != h:
            src.append((d, lo - h[0], hi - lo))
        if (lo, hi) != w:
            dst.append((d, lo - w[0], hi - lo))
    return src, dst


def _contiguous_cut(shape: Tuple[int, ...], cuts: list) -> bool:
    """Whether narrowing a contiguous tensor of `shape` by `cuts` leaves it contiguous."""
    if not cuts:
        return True
    if len(cuts) > 1:
        return False
    d = cuts[0][0]
    outer = 1
    for s in shape[:d]:
        outer *= s
    return outer == 1


class ManyReceiver:
    """One rollout rank's side of a many-sender sync; built by `WeightReceiver(senders=..., slices=...)`."""

    def __init__(self, fn: str, senders: List[int], ranks, backend, slices, reserve_sms: int, timeout_s):
        self.senders = senders
        self.slices = slices
        self.groups, self.members, self.receivers = build_groups(fn, senders, ranks, backend)
        rank = dist.get_rank()
        if rank not in self.receivers:
            what = "a sender" if rank in senders else f"not in the sync group {self.members}"
            raise ValueError(f"{fn}: this rank ({rank}) is {what}, so it cannot receive; construct a "
                             "WeightSender with the same senders here")
        self.device = transport_device(self.groups[0])
        self._max_blocks = collective_max_blocks(fn, self.device, reserve_sms)
        self._links = [Link(fn, g, s, timeout_s, self.device) for g, s in zip(self.groups, senders)]
        self._buffers = [BucketBuffers() for _ in senders]  # per sender: its two bucket buffers
        self._plans: List[Dict[int, SenderPlan]] = [{} for _ in senders]  # by plan id, per sender
        self._programs: Dict[Tuple[int, int], _Program] = {}  # (sender index, plan id) -> program
        self._wanted: Dict[Tuple[str, Tuple[int, ...]], Optional[Tuple[int, int, int]]] = {}
        self.version: Optional[int] = None
        self.timings: dict = {}

    # ------------------------------------------------------------ plans

    def _want(self, fn: str, name: str, shape: Tuple[int, ...]) -> Optional[Tuple[int, int, int]]:
        key = (name, shape)
        if key not in self._wanted:
            if self.slices is None:
                spec = None
            elif callable(self.slices):
                spec = _check_slice(fn, name, self.slices(name, shape))
            else:
                spec = self.slices.get(name)
            if spec is not None and (spec[0] >= len(shape) or spec[2] > shape[spec[0]]):
                raise ValueError(f"{fn}: the slice of tensor {name!r} (dim={spec[0]}, start={spec[1]}, "
                                 f"stop={spec[2]}) is outside its full shape {list(shape)}")
            self._wanted[key] = spec
        return self._wanted[key]

    def out_shape(self, name: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        spec = self._wanted[(name, shape)]
        if spec is None:
            return shape
        dim, start, stop = spec
        return shape[:dim] + (stop - start,) + shape[dim + 1:]

    def _program(self, fn: str, index: int, plan_id: int) -> _Program:
        key = (index, plan_id)
        if key in self._programs:
            return self._programs[key]
        plan = self._plans[index][plan_id]
        pieces = {p.name: p for p in plan.pieces}
        spans = bucket_spans(plan.buckets)
        copies, direct, contributions = [], [], {}
        for p in plan.pieces:
            overlap = _overlap(p, self._want(fn, p.name, p.shape))
            if overlap is not None:
                contributions[p.name] = 1
        for bucket in spans:
            mine = []
            for e in bucket.entries:
                p = pieces[e.name]
                overlap = _overlap(p, self._wanted[(p.name, p.shape)])
                if overlap is None:
                    continue
                src, dst = overlap
                whole = not src and _contiguous_cut(self.out_shape(p.name, p.shape), dst)
                mine.append(_Copy(e, p.name, src, dst, whole))
            copies.append(mine)
            chosen = [c.entry for c in mine if c.direct]
            direct.append(BucketSpans(chosen) if chosen else None)
        program = _Program(plan, spans, copies, direct, contributions)
        self._programs[key] = program
        while len(self._programs) > 8 * len(self.senders):
            self._programs.pop(next(iter(self._programs)))
        return program

    def _headers(self, fn: str) -> Tuple[List[_Program], int]:
        for link in self._links:
            link.check(fn)
        flags = [torch.empty(3, dtype=torch.int64, device=self.device) for _ in self._links]
        works = [link.broadcast(f, "the header") for link, f in zip(self._links, flags)]
        for link, work in zip(self._links, works):
            link.wait(work, "the header", host=True)
        heads = [[int(v) for v in f.tolist()] for f in flags]
        error = None
        sizes: List[Optional[list]] = []
        for index, (link, (version, plan_id, fresh)) in enumerate(zip(self._links, heads)):
            plans = self._plans[index]
            if fresh:
                data = link.receive_object("the bucket plan")
                where = f"offload.WeightReceiver: the plan from rank {self.senders[index]}"
                try:
                    plans[plan_id] = SenderPlan.from_dict(where, data)
                except (KeyError, TypeError, ValueError) as exc:
                    error = error or exc
                    buckets = data.get("buckets") if isinstance(data, dict) else None
                    sizes.append(buckets.get("bucket_sizes") if isinstance(buckets, dict) else None)
                    continue
                while len(plans) > 8:
                    plans.pop(next(iter(plans)))
            elif plan_id not in plans:
                self._fail(f"rank {self.senders[index]} referred to plan {plan_id}, which this receiver never received")
                raise RuntimeError(f"{fn}: rank {self.senders[index]} refers to plan {plan_id}, which this receiver "
                                   f"never received; was it created after the senders' first sync? {AFTER_FAILURE}")
            sizes.append(plans[plan_id].buckets.bucket_sizes)
        versions = {h[0] for h in heads}
        if error is None and len(versions) > 1:
            error = ValueError(f"{fn}: the senders {self.senders} sent versions {[h[0] for h in heads]}; every "
                               "sender sends the same version")
        if error is None:
            try:
                return [self._program(fn, i, h[1]) for i, h in enumerate(heads)], heads[0][0]
            except (TypeError, ValueError) as exc:  # a slice that does not fit a tensor
                error = exc
        # Refused: take every sender's buckets, so none is left waiting, then raise.
        if not all(isinstance(s, list) and all(is_int(n) and n >= 0 for n in s) for s in sizes):
            self._fail("a plan had no readable bucket sizes, so its buckets were not taken")
            raise error
        self._drain(sizes)
        raise error

    def _drain(self, sizes: List[list]) -> None:
        for k in range(max((len(s) for s in sizes), default=0)):
            for index, s in enumerate(sizes):
                if k < len(s):
                    self._links[index].run(self._buffer(index, 0, s[k]), f"bucket {k} of {len(s)}")

    def _fail(self, what: str) -> None:
        for link in self._links:
            link.fail(what)

    def _buffer(self, index: int, slot: int, nbytes: int) -> torch.Tensor:
        return self._buffers[index].get(slot, nbytes, self.device)

    # ------------------------------------------------------------ buckets

    def _buckets(self, programs: List[_Program], timer: PhaseTimer) -> Iterator[Tuple[int, int, torch.Tensor]]:
        """(sender index, bucket k, data), round-robin over senders (Note [many senders]); every sender's
        buckets 0 and 1 are posted now, its bucket k+2 once k has been handed out."""
        counts = [p.plan.buckets.num_buckets for p in programs]
        works: Dict[Tuple[int, int], object] = {}
        datas: Dict[Tuple[int, int], torch.Tensor] = {}

        def post(i, k):
            datas[(i, k % 2)] = self._buffer(i, k % 2, programs[i].plan.buckets.bucket_sizes[k])
            works[(i, k % 2)] = self._links[i].broadcast(datas[(i, k % 2)], f"bucket {k} of {counts[i]}")

        if any(counts):
            timer.mark_span("transfer")
        for k in range(2):
            for i, n in enumerate(counts):
                if k < n:
                    post(i, k)
        last = max(counts, default=0)
        i = k = handed = 0
        try:
            for k in range(last):
                for i, n in enumerate(counts):
                    if k >= n:
                        continue
                    self._links[i].wait(works[(i, k % 2)], f"bucket {k} of {n}", host=k == n - 1)
                    yield i, k, datas[(i, k % 2)]
                    handed += 1
                    if k + 2 < n:
                        post(i, k + 2)
        except BaseException as exc:
            if handed + 1 < sum(counts):  # later buckets are posted, or on their way (Note [failed syncs])
                how = "stopped reading" if isinstance(exc, GeneratorExit) else f"raised {type(exc).__name__}"
                self._fail(f"the receiver {how} at bucket {k} of rank {self.senders[i]}")
            raise
        if any(counts):
            timer.mark_span("transfer")

    def _unpack(self, program: _Program, k: int, data: torch.Tensor, dsts: dict, partial: dict) -> List[str]:
        """Copy bucket k's kept entries into `dsts`; returns the names whose piece from this sender is complete."""
        done = []
        direct = program.direct[k]
        if direct is not None:
            tensors = [_narrow(dsts[c.name], c.dst) for c in program.copies[k] if c.direct]
            copy_spans(data, tensors, direct, pack=False, max_blocks=self._max_blocks)
        for c in program.copies[k]:
            e = c.entry
            last = e.chunk + 1 == e.num_chunks
            if c.direct:
                if last:
                    done.append(c.name)
                continue
            view = data[e.offset:e.offset + e.nbytes].view(e.torch_dtype)
            if e.num_chunks == 1:
                piece = view.view(e.shape)
            else:  # assembled from its chunks, then narrowed
                piece = partial.get(c.name)
                if piece is None:
                    piece = partial[c.name] = torch.empty(e.shape, dtype=e.torch_dtype, device=self.device)
                piece.view(-1)[e.start:e.start + e.numel].copy_(view)
                if not last:
                    continue
                del partial[c.name]
            _narrow(dsts[c.name], c.dst).copy_(_narrow(piece, c.src))
            done.append(c.name)
        return done

    def _expected(self, programs: List[_Program]) -> Dict[str, Tuple[Tuple[int, ...], str, int]]:
        """name -> (shape to receive, bucket dtype, pieces that reach it) over every sender."""
        out: Dict[str, list] = {}
        for program in programs:
            dtypes = {e.name: e.dtype for e in program.plan.buckets.entries}
            for p in program.plan.pieces:
                entry = out.setdefault(p.name, [self.out_shape(p.name, p.shape), dtypes[p.name], 0])
                entry[2] += program.contributions.get(p.name, 0)
        return {n: tuple(v) for n, v in out.items()}

    def _result(self, timer: PhaseTimer, programs: List[_Program], version: int) -> dict:
        plans = [p.plan for p in programs]
        return timer.result(bytes=sum(sum(p.buckets.bucket_sizes) for p in plans),
                            buckets=sum(p.buckets.num_buckets for p in plans), version=version,
                            bytes_per_sender=list(plans[0].bytes_per_sender) if plans else [],
                            model_bytes=plans[0].model_bytes if plans else 0)

    def receive(self) -> Iterator[Tuple[str, torch.Tensor]]:
        fn = "offload.WeightReceiver.receive"
        programs, version = self._headers(fn)
        self.version = version
        timer = PhaseTimer(self.device, PHASES)
        expected = self._expected(programs)
        waiting = {n: v[2] for n, v in expected.items()}
        dsts: Dict[str, torch.Tensor] = {}
        partial: List[dict] = [{} for _ in programs]
        for name in [n for n, count in waiting.items() if count == 0]:  # an empty slice: nothing to wait for
            del waiting[name]
            yield name, torch.empty(expected[name][0], dtype=_dtype(expected[name][1]), device=self.device)
        for i, k, data in self._buckets(programs, timer):
            for c in programs[i].copies[k]:
                if c.name not in dsts:
                    shape, dtype, _ = expected[c.name]
                    dsts[c.name] = torch.empty(shape, dtype=_dtype(dtype), device=self.device)
            with timer.phase("unpack"):
                done = self._unpack(programs[i], k, data, dsts, partial[i])
            for name in done:
                waiting[name] -= 1
                if not waiting[name]:
                    del waiting[name]
                    yield name, dsts.pop(name)
        self.timings = self._result(timer, programs, version)

    def load(self, target, strict: bool) -> dict:
        fn = "offload.WeightReceiver.load"
        dsts = destinations(fn, target)
        programs, version = self._headers(fn)
        self.version = version
        timer = PhaseTimer(self.device, PHASES)
        buckets = self._buckets(programs, timer)  # buckets 0 and 1 are on their way during the checks
        error = None
        try:
            _check_targets(fn, self._expected(programs), dsts, self.device, strict)
        except (TypeError, ValueError) as exc:  # still take the buckets: no sender is left waiting
            error = exc
        partial: List[dict] = [{} for _ in programs]
        with torch.no_grad():
            for i, k, data in buckets:
                if error is None:
                    with timer.phase("unpack"):
                        self._unpack(programs[i], k, data, dsts, partial[i])
        if error is not None:
            raise error
        self.timings = self._result(timer, programs, version)
        return self.timings


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _check_targets(fn: str, expected: dict, dsts: dict, device: torch.device, strict: bool) -> None:
    """Every received tensor has a destination of the shape it is received in (its slice), its bucket dtype,
    contiguous, on `device`; with `strict`, every destination is sent."""
    for name, (shape, dtype, _) in expected.items():
        dst = dsts.get(name)
        if dst is None:
            raise ValueError(f"{fn}: received tensor {name!r} but the target has no tensor of that name")
        check_received_into(fn, name, dst, tuple(shape), dtype, device, "as received (its slice)")
    missing = [n for n in dsts if n not in expected]
    if strict and missing:
        raise ValueError(f"{fn}: the target's tensor {missing[0]!r} was not sent ({len(missing)} missing); "
                         "pass strict=False to allow it")

