"""Colocated weight sync: `WeightSender(..., transport="ipc")` / `WeightReceiver(..., transport="ipc")`.

Trainer and rollout processes on the same device cannot use NCCL between them,
and one IPC handle per tensor costs an open per tensor (and, done naively, a
device synchronize per tensor). Here the sender packs buckets (the same plan and
dtype policy as the NCCL path, `offload.plan_buckets`) into two device buffers it
allocates once and shares once, through torch's own tensor sharing; each bucket
is signalled with an interprocess event, and the receiver unpacks into its
parameters or hands out views. See Note [IPC protocol], Note [IPC control messages] and
Note [IPC stand-in].
Timings have the fields of the NCCL path (sync.py); `host_copy_ms` is 0 and
`transfer_ms` spans the first bucket signalled to the last one released.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import pickle
import random
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.multiprocessing import reductions

from ..core import _device
from ..core.checks import check_int
from ..core.timing import PhaseTimer
from .bucket_pack import (BucketSpans, bucket_spans, bucket_tensors, check_destinations, check_not_parked, copy_spans,
                          destinations)
from .bucket_plan import BucketPlan
from .bucket_planner import plan_buckets
from .slices import Slices

PHASES = ("gather", "pack", "host_copy", "transfer", "unpack")
DEFAULT_IPC_TIMEOUT_S = 120.0
# Buckets default to this: there is no link to fill, so a bucket only needs to be
# large enough that the per-bucket signal (a host message each way) is noise
# beside its copies.
DEFAULT_IPC_BUCKET_BYTES = 512 << 20

# Message kinds on the control channel.
_HEADER, _READY, _HELLO, _CONSUMED, _ABORT = 1, 2, 3, 4, 5
_KIND_NAMES = {_HEADER: "header", _READY: "bucket ready", _HELLO: "hello", _CONSUMED: "bucket released",
               _ABORT: "abort"}

# Note [IPC protocol]
# ~~~~~~~~~~~~~~~~~~~
# Two bucket buffers live on the sender's device; the sender owns them and packs
# into them on its current stream. They are shared with the receivers once (a
# torch reduction of the whole buffer, re-sent only when a larger plan grows
# them), with two interprocess "ready" events; each receiver answers once with
# its two "released" events. Per sync the sender sends a header (version, plan
# id, the plan only when it changed, the buffers only when they changed), then
# for each bucket k: it waits (host) for the message that bucket k-2 of the same
# slot was released, makes its stream wait (device) on that receiver's released
# event, packs, records the slot's ready event and sends "ready k". The receiver,
# on "ready k", makes its stream wait (device) on the ready event, unpacks (or
# hands out views until the consumer asks for bucket k+2... as the NCCL path
# does), records its released event and sends "released k". An event is always
# recorded before the message that names it is sent, so a wait on it never sees
# an older record. Nothing synchronizes the device; `send()` returns once every
# bucket was released (host), the start of the next sync waits (device) on the
# released events before packing into a slot again.
#
# Either side that fails after the header sends an abort with its error; a side
# waiting for a message gives up after `timeout_s` with an error that names what
# it waited for, so a dead peer is an error, never a hang. A receiver whose
# destinations do not match still releases every bucket (unread), like the NCCL
# path drains them, so the sender completes and the receiver raises.
#
# Note [IPC control messages]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Over a process group (gloo), a point-to-point message is a rendezvous: its bytes
# move only once the receiving side has posted its receive, so a receive posted
# when the message is already waiting costs one more round trip between the two
# processes' gloo threads. Each bucket's "ready" and "released" messages are on
# the pipeline's critical path, so a side that knows another message of this sync
# is coming (the next bucket's) posts its receive for it as soon as it has the
# current one. Only messages of the running sync are posted ahead: after a sync
# that completed, no receive is left pending on the group. Headers go on one tag
# and payloads on another, so a receive posted ahead for a header never meets a
# payload.
#
# Note [IPC stand-in]
# ~~~~~~~~~~~~~~~~~~~
# The buffers live where the sender's tensors are: the first sync's tensors fix
# the sender's device, whatever accelerator the host has. For CPU tensors (CI, or
# a host without device IPC) the buffers are host tensors in shared memory
# (torch's file-name sharing, which works between any two processes of the host),
# there are no events, and the messages themselves order the work: a pack or an
# unpack on the CPU is complete when it returns. The protocol, the pipelining over
# two slots, the buffer reuse and the error paths are the same code as on a device.


def _now() -> float:
    return time.monotonic()


class _PipeChannel:
    """Messages over a `multiprocessing` connection: (kind, a, b, c, obj)."""

    def __init__(self, conn, fn: str):
        for method in ("send", "recv", "poll"):
            if not callable(getattr(conn, method, None)):
                raise TypeError(f"{fn}: channel must be a multiprocessing Connection (one end of "
                                f"multiprocessing.Pipe()), got {type(conn).__name__}")
        self.conn = conn
        self.peers = [0]

    def send(self, peer, kind, a=0, b=0, c=0, obj=None) -> None:
        try:
            self.conn.send((kind, a, b, c, obj))
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise RuntimeError(f"the peer closed the control channel ({type(exc).__name__}: {exc})") from exc

    def post_next(self, peer) -> None:
        pass  # a pipe buffers what is sent: nothing to post ahead

    def recv(self, peer, deadline: float):
        try:
            if not self.conn.poll(max(0.0, deadline - _now())):
                return None
            return self.conn.recv()
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise RuntimeError(f"the peer closed the control channel ({type(exc).__name__}: {exc})") from exc

    def flush(self, deadline: float) -> None:
        pass


class _GroupChannel:
    """Messages as point-to-point sends of small host tensors over a process group (gloo).

    Headers travel on one tag, payloads on another; see Note [IPC control messages]."""

    _HEAD_TAG, _PAYLOAD_TAG = 0, 1

    def __init__(self, group, peers: List[int]):
        self.group = group
        self.peers = peers
        self._sends: List = []  # (work, tensors) of sends not yet known complete
        self._posted: Dict[int, Tuple] = {}  # peer -> (work, head) of a header receive posted ahead

    def send(self, peer, kind, a=0, b=0, c=0, obj=None) -> None:
        payload = None if obj is None else torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        head = torch.tensor([kind, a, b, c, 0 if payload is None else payload.numel()], dtype=torch.int64)
        works = [dist.isend(head, dst=peer, group=self.group, tag=self._HEAD_TAG)]
        if payload is not None:
            works.append(dist.isend(payload, dst=peer, group=self.group, tag=self._PAYLOAD_TAG))
        # Kept (with their tensors) until flush(): gloo completes a send only inside wait().
        self._sends.append((works, head, payload))

    def _wait(self, work, deadline: float) -> bool:
        """False if `work` did not complete by `deadline`. Gloo completes a point-to-point work
        only inside `wait()`, so the deadline is passed to it (and the group is unusable after)."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(0.001, deadline - _now())))
        except RuntimeError as exc:
            if "Timed out" in str(exc) or "timeout" in str(exc).lower():
                return False
            raise RuntimeError(f"the control channel failed ({exc})") from exc
        return True

    def _post(self, peer):
        head = torch.empty(5, dtype=torch.int64)
        return dist.irecv(head, src=peer, group=self.group, tag=self._HEAD_TAG), head

    def post_next(self, peer) -> None:
        """Post the receive of `peer`'s next header now: the caller knows it is coming."""
        if peer not in self._posted:
            self._posted[peer] = self._post(peer)

    def recv(self, peer, deadline: float):
        posted = self._posted.pop(peer, None)
        work, head = posted if posted is not None else self._post(peer)
        if not self._wait(work, deadline):
            return None
        kind, a, b, c, size = (int(v) for v in head.tolist())
        obj = None
        if size:
            payload = torch.empty(size, dtype=torch.uint8)
            if not self._wait(dist.irecv(payload, src=peer, group=self.group, tag=self._PAYLOAD_TAG), deadline):
                return None
            obj = pickle.loads(payload.numpy().tobytes())
        return kind, a, b, c, obj

    def flush(self, deadline: float) -> None:
        for works, _, _ in self._sends:
            for w in works:
                if not self._wait(w, deadline):
                    raise RuntimeError("a control message was not taken by the peer in time")
        self._sends = []


def make_channel(fn: str, group, channel, src: int, is_sender: bool):
    """The control channel: a pipe end (`channel`), or the process group (host backend, e.g. gloo)."""
    if channel is not None:
        if group is not None:
            raise ValueError(f"{fn}: pass either group or channel for transport 'ipc', not both")
        return _PipeChannel(channel, fn)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: transport 'ipc' needs a control channel: a process group (torch.distributed "
                           "initialized) or channel=<one end of multiprocessing.Pipe()>")
    group = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group)).lower()
    if "gloo" not in backend:
        raise ValueError(f"{fn}: transport 'ipc' sends its control messages as host tensors, so the group's "
                         f"backend must include gloo, got {backend!r}; pass dist.new_group(ranks, backend='gloo')")
    ranks = dist.get_process_group_ranks(group)
    if src not in ranks:
        raise ValueError(f"{fn}: src must be a rank of the group, got src={src} for ranks {ranks}")
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"{fn}: this rank ({me}) is not in the group")
    if is_sender and me != src:
        raise ValueError(f"{fn}: with transport 'ipc' the sender is rank src={src}, but this is rank {me}")
    if not is_sender and me == src:
        raise ValueError(f"{fn}: rank {me} is src, the sender; a receiver is another rank of the group")
    return _GroupChannel(group, [r for r in ranks if r != src] if is_sender else [src])


def _share(buf: torch.Tensor):
    """A picklable handle to the whole buffer (Note [IPC stand-in] for the host)."""
    if _device.is_accelerator(buf.device):
        return reductions.reduce_tensor(buf)
    storage = buf.untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild takes this reference over
    return ("cpu", manager, handle, size)


def _open(handle) -> torch.Tensor:
    if isinstance(handle, tuple) and handle and handle[0] == "cpu":
        _, manager, name, size = handle
        storage = reductions.rebuild_storage_filename(torch.UntypedStorage, manager, name, size)
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    rebuild, args = handle
    return rebuild(*args)


def _expect(fn: str, channel, peer, deadline: float, timeout_s: float, kind: int, what: str):
    msg = channel.recv(peer, deadline)
    if msg is None:
        raise RuntimeError(f"{fn}: no {what} from {_peer_name(channel, peer)} within {timeout_s:g} s (timeout_s); "
                           "the other side died, failed or stopped syncing")
    if msg[0] == _ABORT:
        raise RuntimeError(f"{fn}: {_peer_name(channel, peer)} failed during the sync: {msg[4]}")
    if msg[0] != kind:
        raise RuntimeError(f"{fn}: expected {what} from {_peer_name(channel, peer)}, got a "
                           f"{_KIND_NAMES.get(msg[0], msg[0])} message")
    return msg


def _check_broken(fn: str, broken: Optional[str]) -> None:
    if broken is not None:
        raise RuntimeError(f"{fn}: an earlier sync on this channel failed ({broken}); its messages may still be "
                           "in flight, so make a new sender and receiver (and control channel) to sync again")


def _peer_name(channel, peer) -> str:
    return "the peer" if isinstance(channel, _PipeChannel) else f"rank {peer}"


class IpcSender:
    """The sending side of transport 'ipc' (Note [IPC protocol]); `WeightSender` delegates to it."""

    def __init__(self, fn: str, group, channel, src: int, bucket_bytes, dtype, keep_dtype, alignment: int,
                 timeout_s: float):
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"{fn}: timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self.channel = make_channel(fn, group, channel, src, is_sender=True)
        # Until the first sync fixes it from the tensors (Note [IPC stand-in]).
        self.device = _device.current_device()
        self._bound = False
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_IPC_BUCKET_BYTES
        check_int(fn, "bucket_bytes", bucket_bytes, 1)
        self.bucket_bytes = bucket_bytes
        self.dtype, self.keep_dtype, self.alignment = dtype, keep_dtype, alignment
        self.timeout_s = float(timeout_s)
        self._buffers: List[Optional[torch.Tensor]] = [None, None]
        self._ready: List = [None, None]  # interprocess events of the device, made when it is bound
        self._released: Dict[int, list] = {}  # peer -> its two released events (None on the CPU)
        self._pending = [False, False]  # slot was released (host) but not yet waited for (device)
        self._shared = False  # buffers sent to the receivers since they last changed
        self._signature = None
        self._plan: Optional[BucketPlan] = None
        self._spans: List[BucketSpans] = []
        self._plan_id = 0
        # Set when a sync failed part way: messages of it may still be on the channel, so
        # this sender and its receivers cannot sync again (make new ones).
        self.broken: Optional[str] = None

    def _plan_for(self, items) -> Tuple[BucketPlan, bool]:
        signature = [(n, t.shape, t.dtype) for n, t in items]
        if signature == self._signature:
            return self._plan, False
        plan = plan_buckets(items, self.bucket_bytes, dtype=self.dtype, keep_dtype=self.keep_dtype,
                            alignment=self.alignment, device=self.device)
        self._signature, self._plan, self._spans = signature, plan, bucket_spans(plan)
        self._plan_id = random.getrandbits(62) + 1
        return plan, True

    def _wait_released(self, slot: int, stream) -> None:
        """The device waits until every receiver's last unpack from `slot` is done."""
        if self._pending[slot]:
            for events in self._released.values():
                if events[slot] is not None:
                    stream.wait_event(events[slot])
            self._pending[slot] = False

    def _grow(self, size: int, stream) -> None:
        if self._buffers[0] is not None and self._buffers[0].numel() >= size:
            return
        for slot in range(2):  # the old buffers may still be read by an unpack queued in a receiver
            self._wait_released(slot, stream)
        # Owned by this process; written only on the current stream, read by the receivers
        # behind the ready events. On the host: shared memory (Note [IPC stand-in]).
        self._buffers = [torch.empty(max(size, 1), dtype=torch.uint8, device=self.device) for _ in range(2)]
        if not _device.is_accelerator(self.device):
            for buf in self._buffers:
                buf.share_memory_()
        self._shared = False

    def bind(self, fn: str, items, check_source) -> None:
        """Checks the sources; the first sync's fix the device of the buffers (Note [IPC stand-in])."""
        device = self.device
        if not self._bound:
            first = next(((n, t) for n, t in items if not t.is_meta), None)
            if first is not None:
                device = first[1].device  # a DTensor's: its local shard's
        for name, t in items:
            if t.is_meta or t.device == device:
                continue
            if self._bound:
                raise ValueError(f"{fn}: tensor {name!r} is on {t.device} but this sender's shared buffers are on "
                                 f"{device} (where its first sync's tensors were); make another sender to send from "
                                 f"{t.device}")
            raise ValueError(f"{fn}: tensor {name!r} is on {t.device} but {first[0]!r} is on {device}; transport "
                             "'ipc' sends every tensor of a sync from one device")
        for name, t in items:
            if type(t).__name__ != "DTensor":
                check_source(fn, name, t, device, "ipc")
        if not self._bound:
            self.device, self._bound = device, True
            self._ready = [_device.new_ipc_event(device) for _ in range(2)]

    def adopt_plan(self, plan: BucketPlan) -> bool:
        """Send by `plan`, made elsewhere (Note [colocated senders] in colocated_many.py); whether it
        is new to the receivers (a plan object seen last time is not)."""
        if plan is self._plan:
            return False
        self._signature, self._plan, self._spans = None, plan, bucket_spans(plan)
        self._plan_id = random.getrandbits(62) + 1
        return True

    def send(self, fn: str, items, version: int, check_source) -> dict:
        _check_broken(fn, self.broken)
        self.bind(fn, items, check_source)
        plan, fresh = self._plan_for(items)
        tensors = dict(items)
        gathered: Dict[str, torch.Tensor] = {}

        def fill(k: int, data: torch.Tensor, spans: BucketSpans, timer: PhaseTimer) -> None:
            sources = self._bucket_sources(fn, spans, tensors, gathered, timer, check_source)
            with timer.phase("pack"):
                copy_spans(data, sources, spans, pack=True)

        return self.send_planned(fn, plan, fresh, version, fill)

    def send_planned(self, fn: str, plan: BucketPlan, fresh: bool, version: int, fill,
                     figures: Optional[dict] = None) -> dict:
        """One sync by the current plan: `fill(k, data, spans, timer)` writes bucket k into `data`, a
        slot of the shared buffers, on the current stream (Note [IPC protocol]). `figures` (plain
        data) go to the receivers with the header, into their timings."""
        _check_broken(fn, self.broken)
        timer = PhaseTimer(self.device, PHASES)
        stream = _device.current_stream(self.device)
        self._grow(max(plan.bucket_sizes, default=0), stream)
        share = not self._shared
        payload = {}
        if fresh:
            payload["plan"] = plan.to_dict()
        if share:
            payload["buffers"] = [_share(b) for b in self._buffers]
            payload["events"] = [_device.ipc_event_handle(e) for e in self._ready]
        if figures:
            payload["figures"] = figures
        channel = self.channel
        for peer in channel.peers:
            channel.send(peer, _HEADER, version, self._plan_id, int(fresh), payload or None)
        try:
            if share:
                self._receive_hellos(fn)
            if plan.num_buckets:  # Note [IPC control messages]
                for peer in channel.peers:
                    channel.post_next(peer)
            outstanding: List[int] = []  # buckets signalled, not yet released (host)
            for k, spans in enumerate(self._spans):
                slot = k % 2
                if k >= 2:
                    self._released_message(fn, k - 2)
                    outstanding.remove(k - 2)
                self._wait_released(slot, stream)
                fill(k, self._buffers[slot][: plan.bucket_sizes[k]], spans, timer)
                if self._ready[slot] is not None:
                    self._ready[slot].record(stream)
                if k == 0:
                    timer.mark_span("transfer")
                for peer in channel.peers:
                    channel.send(peer, _READY, k)
                outstanding.append(k)
            for k in outstanding:
                self._released_message(fn, k)
        except BaseException as exc:
            self._abort(exc)
            raise
        timer.mark_span("transfer")
        channel.flush(_now() + self.timeout_s)
        return timer.result(bytes=sum(plan.bucket_sizes), buckets=plan.num_buckets, version=version)

    def _receive_hellos(self, fn: str) -> None:
        """Each receiver's answer to the shared buffers: the events it records as it releases them."""
        channel = self.channel
        for peer in channel.peers:
            hello = _expect(fn, channel, peer, _now() + self.timeout_s, self.timeout_s, _HELLO,
                            "answer to the buffers")
            self._released[peer] = [_device.open_ipc_event(self.device, h) for h in hello[4]]
        self._shared = True

    def _bucket_sources(self, fn: str, spans, tensors: dict, gathered: dict, timer, check_source) -> list:
        """The source tensor of each entry of a bucket: DTensors gathered whole (timed as "gather"),
        kept in `gathered` while later buckets still take chunks of them, and checked once gathered."""
        sources = []
        dtensors = any(type(tensors[e.name]).__name__ == "DTensor" for e in spans.entries)
        with timer.phase("gather") if dtensors else contextlib.nullcontext():
            for e in spans.entries:
                src_t = gathered.get(e.name)
                if src_t is None:
                    t = tensors[e.name]
                    src_t = t.full_tensor() if type(t).__name__ == "DTensor" else t
                    if e.chunk + 1 < e.num_chunks:
                        gathered[e.name] = src_t
                elif e.chunk + 1 == e.num_chunks:
                    del gathered[e.name]
                sources.append(src_t)
        if dtensors:
            for e, s in zip(spans.entries, sources):
                check_source(fn, e.name, s, self.device, "ipc")
        return sources

    def _released_message(self, fn: str, k: int) -> None:
        for peer in self.channel.peers:
            msg = _expect(fn, self.channel, peer, _now() + self.timeout_s, self.timeout_s, _CONSUMED,
                          f"release of bucket {k}")
            if msg[1] != k:
                raise RuntimeError(f"{fn}: {_peer_name(self.channel, peer)} released bucket {msg[1]}, expected {k}")
            if k + 1 < self._plan.num_buckets:  # Note [IPC control messages]
                self.channel.post_next(peer)
        self._pending[k % 2] = True

    def _abort(self, exc: BaseException) -> None:
        """Tell the receivers this sync failed (best effort: the channel itself may be what failed)."""
        self.broken = f"{type(exc).__name__}: {exc}"
        for peer in self.channel.peers:
            try:
                self.channel.send(peer, _ABORT, obj=f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - the original error is the one to raise
                pass


class IpcReceiver:
    """The receiving side of transport 'ipc' (Note [IPC protocol]); `WeightReceiver` delegates to it."""

    def __init__(self, fn: str, group, channel, src: int, timeout_s: float, slices: Optional[Slices] = None):
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"{fn}: timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self.channel = make_channel(fn, group, channel, src, is_sender=False)
        # What this receiver keeps of each tensor (a colocated many-sender sync's tensor-parallel
        # rank, Note [colocated senders]); None: every tensor whole.
        self.slices = slices
        self.peer = self.channel.peers[0]
        self.timeout_s = float(timeout_s)
        self.device: Optional[torch.device] = None  # the sender's, known from its buffers
        self._buffers: List[Optional[torch.Tensor]] = [None, None]
        self._ready: List = [None, None]
        self._released: List = [None, None]
        self._plans: Dict[int, Tuple[BucketPlan, List[BucketSpans]]] = {}
        self._figures: dict = {}  # the sender's figures of the running sync, for the timings
        self.version: Optional[int] = None
        self.timings: dict = {}
        self.broken: Optional[str] = None  # as IpcSender.broken

    def _expect(self, fn, kind, what):
        return _expect(fn, self.channel, self.peer, _now() + self.timeout_s, self.timeout_s, kind, what)

    def _header(self, fn: str):
        _, version, plan_id, fresh, payload = self._expect(fn, _HEADER, "sync header")
        payload = payload or {}
        self._figures = dict(payload.get("figures") or {})
        if fresh:
            plan = BucketPlan.from_dict(payload["plan"]).validate(f"{fn}: the sender's plan")
            self._plans[plan_id] = (plan, bucket_spans(plan))
            while len(self._plans) > 8:
                self._plans.pop(next(iter(self._plans)))
        elif plan_id not in self._plans:
            raise RuntimeError(f"{fn}: the sender refers to plan {plan_id}, which this receiver never received; "
                               "was it created after the sender's first sync?")
        if "buffers" in payload:
            self._buffers = [None, None]  # the old mapping goes before the new one opens
            self._buffers = [_open(h) for h in payload["buffers"]]
            self.device = self._buffers[0].device
            self._ready = [_device.open_ipc_event(self.device, h) for h in payload["events"]]
            if self._released[0] is None:
                self._released = [_device.new_ipc_event(self.device) for _ in range(2)]
            self.channel.send(self.peer, _HELLO, obj=[_device.ipc_event_handle(e) for e in self._released])
        if self._buffers[0] is None:
            raise RuntimeError(f"{fn}: the sender sent no buffers; was this receiver created after the sender's "
                               "first sync?")
        self.version = version
        plan, spans = self._plans[plan_id]
        if plan.num_buckets:  # Note [IPC control messages]
            self.channel.post_next(self.peer)
        return plan, spans, version

    def _buckets(self, fn: str, plan: BucketPlan, spans, timer) -> Iterator[Tuple[torch.Tensor, BucketSpans]]:
        """Yields (bucket, spans) once the sender signalled it; releases it when the next one is asked for."""
        stream = _device.current_stream(self.device)
        for k in range(plan.num_buckets):
            slot = k % 2
            msg = self._expect(fn, _READY, f"bucket {k}")
            if msg[1] != k:
                raise RuntimeError(f"{fn}: the sender signalled bucket {msg[1]}, expected {k}")
            if k + 1 < plan.num_buckets:  # Note [IPC control messages]
                self.channel.post_next(self.peer)
            if k == 0:
                timer.mark_span("transfer")
            if self._ready[slot] is not None:
                stream.wait_event(self._ready[slot])
            yield self._buffers[slot][: plan.bucket_sizes[k]], spans[k]
            # The consumer asked for more: it is done with bucket k (its copies are queued on `stream`).
            if self._released[slot] is not None:
                self._released[slot].record(stream)
            self.channel.send(self.peer, _CONSUMED, k)
        timer.mark_span("transfer")

    def _split_buckets(self, fn: str, plan: BucketPlan) -> list:
        """Per bucket of `plan`: (the spans of the tensors kept whole, or None; those of the sliced ones)."""
        split = []
        for spans in bucket_spans(plan):
            sliced = [self.slices.want(fn, e.name, tuple(e.shape)) is not None for e in spans.entries]
            whole = [e for e, cut in zip(spans.entries, sliced) if not cut]
            split.append((BucketSpans(whole) if whole else None,
                          BucketSpans([e for e, cut in zip(spans.entries, sliced) if cut])))
        return split

    def _unpack_into(self, fn: str, data: torch.Tensor, bucket: BucketSpans, split, dsts: dict, partial: dict,
                     timer) -> None:
        """A bucket into the destinations: whole tensors copied in place, sliced ones (`split`, the
        bucket's from `_split_buckets`) assembled whole across buckets in `partial` and their slice
        copied once complete."""
        if split is None:
            copy_spans(data, [dsts[e.name] for e in bucket.entries], bucket, pack=False)
            return
        whole, sliced = split
        if whole is not None:
            copy_spans(data, [dsts[e.name] for e in whole.entries], whole, pack=False)
        for name, t in bucket_tensors(data, sliced, partial, timer, self.device):
            dim, start, stop = self.slices.want(fn, name, tuple(t.shape))
            dsts[name].copy_(t.narrow(dim, start, stop - start))

    def _failed(self, exc: BaseException) -> None:
        self.broken = f"{type(exc).__name__}: {exc}"
        try:
            self.channel.send(self.peer, _ABORT, obj=f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - the original error is the one to raise
            pass

    def _begin(self, fn: str):
        """A sync's start: refuse a broken receiver, read the header; a failure tells the sender."""
        _check_broken(fn, self.broken)
        try:
            return self._header(fn)
        except BaseException as exc:
            self._failed(exc)
            raise

    def _finish(self, timer, plan, version) -> dict:
        """A sync's end: the channel's last messages out, the timings kept."""
        self.channel.flush(_now() + self.timeout_s)
        self.timings = timer.result(bytes=sum(plan.bucket_sizes), buckets=plan.num_buckets, version=version,
                                    **self._figures)
        return self.timings

    def receive(self, copy: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        fn = "offload.WeightReceiver.receive"
        plan, spans, version = self._begin(fn)
        timer = PhaseTimer(self.device, PHASES)
        partial: Dict[str, list] = {}  # bucket_tensors: name -> [tensor, chunks to come]
        try:
            for data, bucket in self._buckets(fn, plan, spans, timer):
                for name, t in bucket_tensors(data, bucket, partial, timer, self.device, copy):
                    want = None if self.slices is None else self.slices.want(fn, name, tuple(t.shape))
                    yield name, (t if want is None else t.narrow(want[0], want[1], want[2] - want[1]).clone())
        except GeneratorExit:
            self._failed(RuntimeError("the receiver stopped reading before the last bucket"))
            raise
        except BaseException as exc:
            self._failed(exc)
            raise
        self._finish(timer, plan, version)

    def load(self, target, strict: bool = True) -> dict:
        fn = "offload.WeightReceiver.load"
        dsts = destinations(fn, target)
        plan, spans, version = self._begin(fn)
        timer = PhaseTimer(self.device, PHASES)
        error = None
        try:
            check_not_parked(fn, target)
            kept = None if self.slices is None else functools.partial(self.slices.out_shape, fn)
            check_destinations(fn, plan, dsts, self.device, strict, kept)
        except (ValueError, TypeError) as exc:  # still release every bucket: the sender completes
            error = exc
        split = [None] * plan.num_buckets if self.slices is None else self._split_buckets(fn, plan)
        partial: Dict[str, list] = {}  # bucket_tensors: name -> [tensor, chunks to come]
        try:
            with torch.no_grad():
                for k, (data, bucket) in enumerate(self._buckets(fn, plan, spans, timer)):
                    if error is None:
                        with timer.phase("unpack"):
                            self._unpack_into(fn, data, bucket, split[k], dsts, partial, timer)
        except BaseException as exc:
            self._failed(exc)
            raise
        if error is not None:
            self.channel.flush(_now() + self.timeout_s)
            raise error
        return self._finish(timer, plan, version)


