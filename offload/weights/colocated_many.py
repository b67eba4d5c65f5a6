"""Colocated weight sync from many senders: `WeightSender(senders=[...], transport="ipc")`.

Each trainer rank hands the weights over to the rollout process on its own device through
the IPC transport (ipc.py); the full tensors are assembled across the trainer ranks with one
all-gather per bucket (Note [colocated senders]).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .bucket_pack import bucket_spans, copy_spans
from .bucket_plan import BucketPlan
from .bucket_planner import check_bucket_options
from .ipc import DEFAULT_IPC_BUCKET_BYTES, IpcSender
from .link import Link
from .many_senders import Piece, SendersPlan, local_sources, plan_senders, plan_signature

# Note [colocated senders]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Trainer rank i and rollout process i share device i (colocated). Every rollout process
# takes the whole model, and the trainer ranks hold it sharded (FSDP2, HSDP), so the full
# tensors must meet on every device. Gathering them one tensor at a time (what a single
# IPC sender per device does with DTensors) makes a collective per tensor; here each
# trainer rank owns pieces as a sender of `senders=` does (Note [many senders] in
# many_senders.py) and packs them into its buckets, and bucket k of every sender is
# all-gathered at once over the trainers' group, straight into the IPC buffer its rollout
# process reads: one collective per bucket, each rank packing about 1/N of the model.
# - The gathered bucket k is every sender's bucket k in sender order, each in a slot of
#   the largest one's size (aligned): an all-gather wants equal inputs. Its plan (the
#   "gathered plan") is the senders' plans with each entry moved to its slot and named as
#   a chunk of the full tensor: a piece that is a range of rows of dim 0 (FSDP2's and
#   HSDP's Shard(0), or a whole tensor) is a flat range of the full tensor's elements.
#   Chunks are numbered in element order, so `BucketPlan.validate` holds the pieces to
#   tile each tensor exactly; they arrive in bucket order instead, and the receiver
#   counts them (`bucket_tensors`). A piece cut on another dim is refused by name.
# - The rollout process is an ordinary IPC receiver of that plan: the protocol, the two
#   shared slots, the events and the error paths are ipc.py's (Note [IPC protocol]). The
#   all-gather writes the slot on the trainer's current stream (a device collective's
#   work is waited for there), and the slot's ready event is recorded after it.
# - Streams: the staging buffer a rank packs its own bucket into is read by the all-gather
#   and written again only for the next bucket, after the current stream waited for it.
# - Memory per device: two gathered slots (N x the per-sender bucket) and one staging
#   bucket; the default per-sender bucket is the IPC default over N, so a gathered bucket
#   is about the IPC default.
# - Failures: a trainer that fails or dies ends the all-gather on the others (bounded by
#   `timeout_s`, Note [sync timeouts] in link.py), which abort their receivers (ipc.py).


@dataclasses.dataclass
class _GatheredSync:
    """A sync's plans as every trainer rank computes them alike, for one signature of its tensors."""

    every: SendersPlan  # who sends which piece, and every sender's buckets
    plan: BucketPlan  # the gathered buckets, as the rollout processes receive them
    slots: List[int]  # per gathered bucket: each sender's slot in it (bytes)
    own_spans: list  # this sender's buckets' BucketSpans


def _checked_below(fn, name, t, device, backend) -> None:
    """The bind's check of a source, left to `local_sources`, which checks it with its piece."""


def _flat_start(fn: str, piece: Piece) -> int:
    """The element of the full tensor where `piece` starts, for a piece that is a flat range of it."""
    if not piece.cuts:
        return 0
    (dim, start, _), *more = piece.cuts
    outer = 1
    for size in piece.shape[:dim]:
        outer *= size
    if more or outer != 1:
        raise ValueError(f"{fn}: transport 'ipc' with senders= hands each piece over as a range of its tensor's "
                         f"rows; tensor {piece.name!r} (shape {list(piece.shape)}) is split into {piece.describe()} "
                         "(sharded on another dim than the first); send it with transport 'nccl', or shard it on "
                         "dim 0 only")
    inner = 1
    for size in piece.shape[dim + 1:]:
        inner *= size
    return start * inner


def gathered_plan(fn: str, plans: List[BucketPlan], owned: List[List[Tuple[Piece, int]]],
                  alignment: int) -> Tuple[BucketPlan, List[int]]:
    """The plan of the gathered buckets, and each bucket's slot size per sender (Note [colocated senders])."""
    count = max((p.num_buckets for p in plans), default=0)
    slots = []
    for k in range(count):
        size = max((p.bucket_sizes[k] for p in plans if k < p.num_buckets), default=0)
        slots.append(-(-size // alignment) * alignment)
    entries = []
    for index, (plan, own) in enumerate(zip(plans, owned)):
        pieces = {piece.name: piece for piece, _ in own}
        for e in plan.entries:
            piece = pieces[e.name]
            entries.append(dataclasses.replace(e, shape=tuple(piece.shape), offset=e.offset + index * slots[e.bucket],
                                               start=_flat_start(fn, piece) + e.start))
    chunks: Dict[str, List[int]] = {}
    for at, e in enumerate(entries):
        chunks.setdefault(e.name, []).append(at)
    for name, ats in chunks.items():
        for number, at in enumerate(sorted(ats, key=lambda a: entries[a].start)):
            entries[at] = dataclasses.replace(entries[at], chunk=number, num_chunks=len(ats))
    entries.sort(key=lambda e: (e.bucket, e.offset))
    sizes = [len(plans) * slot for slot in slots]
    plan = BucketPlan(entries, sizes, max(sizes + [alignment]), alignment)
    return plan.validate(f"{fn}: the gathered plan"), slots


class ColocatedManySender:
    """One trainer rank of a colocated many-sender sync (Note [colocated senders]); built by
    `WeightSender(senders=..., transport="ipc")`."""

    def __init__(self, fn: str, senders: List[int], group, channel, bucket_bytes: Optional[int], dtype, keep_dtype,
                 alignment: int, timeout_s: float):
        self.senders = senders
        # Collective over the world: a rollout rank's WeightReceiver(senders=..., transport="ipc") builds it too.
        self.gather_group = dist.new_group(senders)
        rank = dist.get_rank()
        if rank not in senders:
            raise ValueError(f"{fn}: this rank ({rank}) is not in senders {senders}; a rollout process constructs "
                             "WeightReceiver(senders=..., transport='ipc') with the same senders")
        self.index = senders.index(rank)
        if bucket_bytes is None:  # a gathered bucket (N of these) about the IPC default
            bucket_bytes = max(alignment, DEFAULT_IPC_BUCKET_BYTES // len(senders) // alignment * alignment)
        self.policy = check_bucket_options(fn, bucket_bytes, dtype, keep_dtype, alignment)
        self.bucket_bytes, self.dtype, self.keep_dtype, self.alignment = bucket_bytes, dtype, keep_dtype, alignment
        self._ipc = IpcSender(fn, group, channel, rank, bucket_bytes, dtype, keep_dtype, alignment, timeout_s)
        self._link: Optional[Link] = None  # on the device of the first sync's tensors
        self._signature = None
        self._sync: Optional[_GatheredSync] = None  # the plans of the last signature
        self._staging: Optional[torch.Tensor] = None  # this sender's bucket, the all-gather's input

    @property
    def device(self) -> torch.device:
        return self._ipc.device

    def _plan(self, fn: str, items) -> _GatheredSync:
        signature = plan_signature(items)
        if signature != self._signature:
            every = plan_senders(fn, items, self.senders, self.policy, self.bucket_bytes, self.dtype,
                                 self.keep_dtype, self.alignment)
            plan, slots = gathered_plan(fn, every.plans, every.owned, self.alignment)
            self._signature = signature
            self._sync = _GatheredSync(every, plan, slots, bucket_spans(every.plans[self.index]))
        return self._sync

    def send(self, fn: str, items, version: int) -> dict:
        sync = self._plan(fn, items)
        every, plan, slots, own_spans = sync.every, sync.plan, sync.slots, sync.own_spans
        owned = every.owned[self.index]
        # The first sync's tensors fix the device of the IPC buffers; `local_sources` checks each
        # tensor on it (the bind itself checks none: every one is checked once).
        self._ipc.bind(fn, [(piece.name, items[i][1]) for piece, i in owned], _checked_below)
        device = self._ipc.device
        sources = dict(zip((piece.name for piece, _ in owned), local_sources(fn, owned, items, device, "ipc")))
        if self._link is None:
            self._link = Link(fn, self.gather_group, dist.get_rank(), self._ipc.timeout_s, device)
        self._link.check(fn)
        biggest = max(slots, default=0)
        if self._staging is None or self._staging.numel() < biggest:
            # Owned by this process's current stream: packed there, read by the all-gather it waits for.
            self._staging = torch.empty(max(biggest, 1), dtype=torch.uint8, device=device)
        own_plan = every.plans[self.index]
        link = self._link

        def fill(k: int, data: torch.Tensor, spans, timer) -> None:
            mine = self._staging[: slots[k]]
            if k < own_plan.num_buckets:
                with timer.phase("pack"):
                    copy_spans(mine[: own_plan.bucket_sizes[k]], [sources[e.name] for e in own_spans[k].entries],
                               own_spans[k], pack=True)
            with timer.phase("gather"):
                what = f"the gather of bucket {k} of {plan.num_buckets}"
                link.wait(link.all_gather(data, mine, what), what, host=not link.on_device)

        figures = {"bytes_per_sender": [sum(p.bucket_sizes) for p in every.plans], "model_bytes": every.model_bytes}
        result = self._ipc.send_planned(fn, plan, self._ipc.adopt_plan(plan), version, fill, figures)
        result.update(figures, bytes_sent=sum(own_plan.bucket_sizes))
        return result
