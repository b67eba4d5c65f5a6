"""Many senders, the receiving side: one rollout rank takes every sender's buckets and keeps its slices.

`WeightReceiver(senders=[...], slices=...)` builds a `ManyReceiver` (Note [many senders]
in many_senders.py, which also holds what sender and receiver share: the groups, the
pieces and the plans). Per sender plan, a receiver works out once what it keeps of each
bucket (a `_Program`), then walks the buckets of all senders round-robin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.checks import is_int
from ..core.timing import PhaseTimer
from .bucket_pack import BucketSpans, bucket_spans, check_received_into, copy_spans, destinations
from .link import AFTER_FAILURE, Link, collective_max_blocks, transport_device
from .many_senders import Piece, SenderPlan, build_groups
from .slices import Slices
from .sync_options import PHASES, BucketBuffers


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
    have = {dim: (start, stop) for dim, start, stop in piece.cuts}
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
        self.slices = Slices(slices)
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
        self.version: Optional[int] = None
        self.timings: dict = {}

    # ------------------------------------------------------------ plans

    def out_shape(self, name: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        return self.slices.out_shape("offload.WeightReceiver", name, shape)

    def _program(self, fn: str, index: int, plan_id: int) -> _Program:
        key = (index, plan_id)
        if key in self._programs:
            return self._programs[key]
        plan = self._plans[index][plan_id]
        pieces = {p.name: p for p in plan.pieces}
        spans = bucket_spans(plan.buckets)
        copies, direct, contributions = [], [], {}
        for p in plan.pieces:
            overlap = _overlap(p, self.slices.want(fn, p.name, p.shape))
            if overlap is not None:
                contributions[p.name] = 1
        for bucket in spans:
            mine = []
            for e in bucket.entries:
                p = pieces[e.name]
                overlap = _overlap(p, self.slices.want(fn, p.name, p.shape))
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

