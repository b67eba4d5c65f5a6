"""`offload.WeightReceiver`: the receiving side of a weight sync (sync.py's module docstring gives the
protocol; see docs/weight_sync.md)."""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.checks import check_bool, is_int
from ..core.timing import PhaseTimer
from .bucket_pack import (
    BucketSpans,
    bucket_spans,
    bucket_tensors,
    check_destinations,
    check_not_parked,
    copy_spans,
    destinations,
)
from .bucket_plan import BucketPlan
from .ipc import DEFAULT_IPC_TIMEOUT_S, IpcReceiver
from .link import AFTER_FAILURE, Link, check_src, collective_max_blocks, is_member, resolve_group, transport_device
from .many_receiver import ManyReceiver
from .many_senders import check_senders
from .slices import Slices, check_slices
from .sync_options import DEFAULT_RESERVE_SMS, PHASES, BucketBuffers, _check_common, _check_many, _check_transport

class WeightReceiver:
    """Receives what a `WeightSender` broadcasts.

    Args:
        group / ranks / src: as for `WeightSender` (the same group, the sender's rank).
        reserve_sms: SMs the unpack kernels of `load()` leave to the collective (CUDA).
        transport, channel: as for `WeightSender` (the same transport).
        timeout_s: longest wait, in seconds, for the sender, the first (the header of
            the next sync) included (Note [sync timeouts]); None: the process group's
            timeout ("nccl"), or DEFAULT_IPC_TIMEOUT_S for "ipc".
        senders: the trainer ranks that send, as given to their `WeightSender(senders=...)`
            (Note [many senders]); with `ranks` (None: the world) the same on every rank.
        slices: with `senders`, what this receiver keeps of each tensor: a mapping name ->
            (dim, start, stop), or a callable (name, full_shape) -> (dim, start, stop) or
            None for the whole tensor (names a mapping leaves out come whole). Tensors are
            received, loaded or yielded in the shape of their slice.
    """

    def __init__(self, group=None, *, src: int = 0, ranks=None, backend: Optional[str] = None,
                 reserve_sms: int = DEFAULT_RESERVE_SMS, transport: str = "nccl", channel=None,
                 timeout_s: Optional[float] = None, senders=None, slices=None):
        fn = "offload.WeightReceiver"
        _check_transport(fn, transport, channel)
        ranks = _check_common(fn, group, src, ranks, backend, reserve_sms)
        slices = check_slices(fn, slices)
        self._ipc = None
        self._many = None
        self.version: Optional[int] = None
        self.timings: dict = {}
        if senders is not None and transport == "ipc":
            # Colocated (Note [colocated senders] in colocated_many.py): the trainer on this device sends the
            # gathered buckets as one IPC sender does; the trainers' gather group is collective over the world.
            senders = check_senders(fn, senders)
            if ranks is not None:
                raise ValueError(f"{fn}: with senders= and transport 'ipc' the rollout process takes the weights from "
                                 "the trainer on its device, over their group (or channel), not ranks")
            dist.new_group(senders)
            self._ipc = IpcReceiver(fn, group, channel, int(src),
                                    DEFAULT_IPC_TIMEOUT_S if timeout_s is None else timeout_s,
                                    None if slices is None else Slices(slices))
            self.src, self.senders = int(src), senders
            return
        if senders is not None:
            senders = check_senders(fn, senders)
            _check_many(fn, group, transport)
            self._many = ManyReceiver(fn, senders, ranks, backend, slices, reserve_sms, timeout_s)
            self.src, self.senders, self.device = None, senders, self._many.device
            return
        if slices is not None:
            raise ValueError(f"{fn}: slices= takes parts of tensors that several senders= send; a single sender's "
                             "receiver takes whole tensors")
        if transport == "ipc":
            if ranks is not None:
                raise ValueError(f"{fn}: transport 'ipc' takes a group (or a channel), not ranks")
            self._ipc = IpcReceiver(fn, group, channel, int(src),
                                    DEFAULT_IPC_TIMEOUT_S if timeout_s is None else timeout_s)
            self.src = int(src)
            return
        self.group = resolve_group(fn, group, ranks, backend)
        self.src = int(src)
        if not is_member(self.group):
            raise ValueError(f"{fn}: this rank ({dist.get_rank()}) is not in the group, so it cannot receive; "
                             "construct receivers only on the group's ranks")
        check_src(fn, self.group, self.src)
        self.device = transport_device(self.group)
        self._max_blocks = collective_max_blocks(fn, self.device, reserve_sms)
        self._link = Link(fn, self.group, self.src, timeout_s, self.device)
        self._buffers = BucketBuffers()
        self.version: Optional[int] = None
        self.timings: dict = {}
        # Plans seen, by id, with their per-bucket spans; a sender resends only a changed plan.
        self._plans: Dict[int, Tuple[BucketPlan, List[BucketSpans]]] = {}

    def _header(self, fn: str) -> Tuple[BucketPlan, List[BucketSpans], int]:
        self._link.check(fn)
        flag = torch.empty(3, dtype=torch.int64, device=self.device)
        self._link.run(flag, "the header")
        version, plan_id, fresh = (int(v) for v in flag.tolist())
        if fresh:
            box = [self._link.receive_object("the bucket plan")]
            if not isinstance(box[0], dict) or "entries" not in box[0]:
                raise RuntimeError(f"offload.WeightReceiver: expected a bucket plan from rank {self.src}, "
                                   f"got {type(box[0]).__name__}")
            fn = f"offload.WeightReceiver: the plan from rank {self.src}"
            try:
                plan = BucketPlan.from_dict(box[0]).validate(fn)
            except (KeyError, TypeError, ValueError) as exc:
                # The sender broadcasts its buckets whatever we think of its plan:
                # take them (where their sizes are readable) so it is not left hanging.
                if not self._drain(box[0].get("bucket_sizes")):
                    self._link.fail(f"the plan from rank {self.src} had no readable bucket sizes, so its "
                                    "buckets were not taken")
                if isinstance(exc, ValueError) and str(exc).startswith(fn):
                    raise
                raise ValueError(f"{fn} cannot be read: {type(exc).__name__}: {exc}") from exc
            self._plans[plan_id] = (plan, bucket_spans(plan))
            while len(self._plans) > 8:  # a few senders may share a group; keep their recent plans
                self._plans.pop(next(iter(self._plans)))
        elif plan_id not in self._plans:
            # Its buckets follow, and nothing here can take them (Note [failed syncs]).
            self._link.fail(f"rank {self.src} referred to plan {plan_id}, which this receiver never received")
            raise RuntimeError(f"offload.WeightReceiver: rank {self.src} refers to plan {plan_id}, which this "
                               "receiver never received; was it created after the sender's first sync? "
                               f"{AFTER_FAILURE}")
        self.version = version
        plan, spans = self._plans[plan_id]
        return plan, spans, version

    def _drain(self, sizes) -> bool:
        """Receive and drop buckets of `sizes` bytes (a sync this receiver refuses); False if the sizes
        are not readable (nothing received)."""
        if not isinstance(sizes, list) or not all(is_int(n) and n >= 0 for n in sizes):
            return False
        for k, n in enumerate(sizes):
            self._link.run(self._buffers.get(0, n, self.device), f"bucket {k} of {len(sizes)}")
        return True

    def _buckets(self, plan: BucketPlan, spans: List[BucketSpans],
                 timer: PhaseTimer) -> Iterator[Tuple[torch.Tensor, BucketSpans]]:
        """Posts the broadcasts of buckets 0 and 1 now, then iterates (bucket, spans); k+2 is posted after k."""
        works: List = [None, None]
        datas: List = [None, None]
        n = plan.num_buckets

        link = self._link

        def post(k):
            slot = k % 2
            datas[slot] = self._buffers.get(slot, plan.bucket_sizes[k], self.device)
            works[slot] = link.broadcast(datas[slot], f"bucket {k} of {n}")

        if n:
            timer.mark_span("transfer")
        for k in range(min(2, n)):
            post(k)

        def handout():
            k = 0
            try:
                for k in range(n):
                    # The last bucket's wait is on the host where a timeout bounds it (Note
                    # [sync timeouts]); the others stay device-side on NCCL/HCCL.
                    link.wait(works[k % 2], f"bucket {k} of {n}", host=k == n - 1)
                    yield datas[k % 2], spans[k]
                    if k + 2 < n:
                        # The consumer asked for more after bucket k: it is done with k's
                        # buffer. On NCCL the broadcast also waits for the consumer's
                        # copies already queued on the current stream.
                        post(k + 2)
            except BaseException as exc:
                if k + 1 < n:  # later buckets are posted, or on their way (Note [failed syncs])
                    how = "stopped reading" if isinstance(exc, GeneratorExit) else f"raised {type(exc).__name__}"
                    link.fail(f"the receiver {how} at bucket {k} of {n}")
                raise
            timer.mark_span("transfer")

        return handout()

    def receive(self, copy: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        """Yield (name, tensor) pairs as they arrive, for `model.load_weights(receiver.receive())`.

        Tensors are views into a bucket buffer, valid until the next bucket is
        requested (one further bucket after this one's last tensor), unless
        `copy=True`; tensors split across buckets are assembled into new tensors.
        Timings are in `self.timings` once the generator is exhausted.
        """
        check_bool("offload.WeightReceiver.receive", "copy", copy)  # at the call, not at the first next()
        return self._receive(copy)

    def _receive(self, copy: bool) -> Iterator[Tuple[str, torch.Tensor]]:
        if self._many is not None:  # fresh tensors, whatever `copy` says
            yield from self._many.receive()
            self.version, self.timings = self._many.version, self._many.timings
            return
        if self._ipc is not None:
            yield from self._ipc.receive(copy)
            self.version, self.timings = self._ipc.version, self._ipc.timings
            return
        plan, spans, version = self._header("offload.WeightReceiver.receive")
        timer = PhaseTimer(self.device, PHASES)
        partial: Dict[str, list] = {}  # bucket_tensors: name -> [tensor, chunks to come]
        for data, bucket in self._buckets(plan, spans, timer):
            yield from bucket_tensors(data, bucket, partial, timer, self.device, copy)
        self.timings = timer.result(bytes=sum(plan.bucket_sizes), buckets=plan.num_buckets, version=version)

    def load(self, target, strict: bool = True) -> dict:
        """Receive into `target` (a module's state dict tensors, or a mapping name -> tensor) in place.

        Every received tensor must exist in `target` with the same shape and dtype
        (the sender's cast dtype); with `strict`, every target tensor must be sent.
        On a mismatch the buckets are still received (the other ranks are not left
        hanging in the collective) and then ValueError names the tensor.
        Returns the timings.
        """
        check_bool("offload.WeightReceiver.load", "strict", strict)
        if self._many is not None:
            try:
                return self._many.load(target, strict)
            finally:
                self.version, self.timings = self._many.version, self._many.timings
        if self._ipc is not None:
            try:
                return self._ipc.load(target, strict)
            finally:
                self.version, self.timings = self._ipc.version, self._ipc.timings
        fn = "offload.WeightReceiver.load"
        dsts = destinations(fn, target)
        plan, spans, version = self._header(fn)
        timer = PhaseTimer(self.device, PHASES)
        # The first two buckets are on their way while the destinations are checked.
        buckets = self._buckets(plan, spans, timer)
        error = None
        try:
            check_not_parked(fn, target)
            check_destinations(fn, plan, dsts, self.device, strict)
        except (ValueError, TypeError) as exc:  # still drain the buckets: the sender is not left hanging
            error = exc
        with torch.no_grad():
            for data, bucket in buckets:
                if error is None:  # destinations checked above, once per sync
                    with timer.phase("unpack"):
                        copy_spans(data, [dsts[e.name] for e in bucket.entries], bucket, pack=False,
                                   max_blocks=self._max_blocks)
        if error is not None:
            raise error
        self.timings = timer.result(bytes=sum(plan.bucket_sizes), buckets=plan.num_buckets, version=version)
        return self.timings
