"""The collectives of a weight sync over a process group: the group, the sender's rank, where
buckets live for the group's backend, and broadcasts whose waits are bounded."""

from __future__ import annotations

import datetime
import pickle
from typing import Optional

import torch
import torch.distributed as dist

from ..core import _device

_DEVICE_BACKENDS = ("nccl", "hccl")

# Note [sync timeouts]
# ~~~~~~~~~~~~~~~~~~~~
# A sync is a fixed sequence of broadcasts that both sides walk in step. When the
# peer raises or dies mid-way, the side still running would wait in the next
# collective until the process group's own timeout (thirty minutes by default,
# and forever for a wait on the host that no watchdog watches). With `timeout_s`
# every wait of a sync is bounded: on gloo (host collectives) each wait is a
# host wait of at most `timeout_s`; on NCCL/HCCL the waits inside the bucket
# pipeline stay device-side (Note [bucket pipeline]) and the host waits the end
# of a sync makes, and the header's, are bounded. A wait that times out or fails
# raises RuntimeError naming the step of the protocol, the peer and the timeout.
# After that, or after the sender raised once its header was out, the two sides
# are at different points of the protocol and the group may still carry part of
# a sync: the object refuses further syncs with an error saying so, and a new
# sender/receiver pair on a new group (`dist.new_group`) syncs afresh (a new
# group has its own connections and its own plan ids, so nothing of the failed
# sync reaches it). `timeout_s=None` keeps the process group's timeout.


def resolve_group(fn: str, group, ranks, backend):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialized; call dist.init_process_group first")
    if group is not None and ranks is not None:
        raise ValueError(f"{fn}: pass either group or ranks, not both")
    if ranks is not None:
        # new_group is collective over the whole world: every rank must build it.
        return dist.new_group(sorted(int(r) for r in ranks), backend=backend)
    return group if group is not None else dist.group.WORLD


def is_member(group) -> bool:
    """False on a rank outside `group` (new_group hands those ranks a sentinel, not a group)."""
    return group is not dist.GroupMember.NON_GROUP_MEMBER


def check_src(fn: str, group, src: int) -> None:
    members = dist.get_process_group_ranks(group)
    if src not in members:
        raise ValueError(f"{fn}: src must be a rank of the group, got src={src} for ranks {members}")


def transport_device(group) -> torch.device:
    """Buckets live where the group's backend reads them: the accelerator for NCCL/HCCL, else the host."""
    backend = str(dist.get_backend(group)).lower()
    if backend in _DEVICE_BACKENDS:
        return _device.current_device()
    return torch.device("cpu")


class Link:
    """One side's collectives of a sync: broadcasts from `src` whose waits are bounded by
    `timeout_s` (Note [sync timeouts]), and the failure that ended the last sync, if any."""

    def __init__(self, fn: str, group, src: int, timeout_s: Optional[float], device: torch.device):
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ValueError(f"{fn}: timeout_s must be a number of seconds > 0 or None (the process group's "
                             f"timeout), got {timeout_s!r}")
        self.fn = fn
        self.group = group
        self.src = src
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.device = device
        self.on_device = device.type != "cpu"  # NCCL/HCCL: a wait on a work is device-side
        self.failure: Optional[str] = None

    def check(self, fn: str) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"{fn}: an earlier sync on this group failed mid-way ({self.failure}); the sender and its "
                "receivers are at different points of it, so this group cannot sync again: destroy it and "
                "construct a new WeightSender and WeightReceiver on a new group (dist.new_group)")

    def fail(self, what: str) -> None:
        if self.failure is None:
            self.failure = what

    def broadcast(self, tensor: torch.Tensor, what: str):
        try:
            return dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)
        except Exception as exc:  # a peer that died is seen here on some backends
            raise self._error(what, exc) from exc

    def wait(self, work, what: str, host: bool = True) -> None:
        """Wait for `work`: bounded by the timeout where the host waits (Note [sync timeouts])."""
        if self.timeout_s is None or (self.on_device and not host):
            work.wait()  # the process group's timeout; device-side on NCCL/HCCL
            return
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise self._error(what, exc) from exc
        if done is False:
            raise self._error(what, None)

    def run(self, tensor: torch.Tensor, what: str) -> None:
        """A broadcast the host waits for (bounded)."""
        self.wait(self.broadcast(tensor, what), what, host=True)

    def send_object(self, obj, what: str) -> None:
        """`obj` pickled, as its length and then its bytes (each a broadcast the host waits for)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        self.run(torch.tensor([data.numel()], dtype=torch.int64, device=self.device), what)
        self.run(data, what)

    def receive_object(self, what: str):
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.run(size, what)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.run(data, what)
        return pickle.loads(data.cpu().numpy().tobytes())

    def _error(self, what: str, exc: Optional[BaseException]) -> RuntimeError:
        bound = (f"within timeout_s={self.timeout_s:g}" if self.timeout_s is not None
                 else "within the process group's timeout")
        cause = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self.fail(f"{what} did not complete {bound}{cause}")
        return RuntimeError(f"{self.fn}: {what} (sender: rank {self.src}) did not complete {bound}; a peer "
                            f"may have failed or died mid-sync{cause}. This group cannot sync again: destroy "
                            "it and sync on a new group")
