"""The collectives of a weight sync over a process group: the group, the sender's rank, where
buckets live for the group's backend, and broadcasts whose waits are bounded."""

from __future__ import annotations

import datetime
import pickle
from typing import List, Optional

import torch
import torch.distributed as dist

from ..core import _device
from ..core.checks import check_int, is_int

_DEVICE_BACKENDS = ("nccl", "hccl")
# What a user does after a sync failed (Note [failed syncs]); the end of every such error.
AFTER_FAILURE = ("The group is aborted and unusable, for syncs and any other collective: the process may call "
                 "dist.destroy_process_group() and exit, or sync on a new group (dist.new_group, with a new "
                 "WeightSender and WeightReceiver; after a peer died, in a new world)")

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
# sync reaches it). `timeout_s=None` keeps the process group's timeout. What a
# failed sync leaves on the group: Note [failed syncs].
#
# Note [failed syncs]
# ~~~~~~~~~~~~~~~~~~~
# A sync that fails mid-way leaves collectives posted on the group that will never
# be matched: the buckets a receiver posted ahead, a broadcast whose peer posted
# another root or nothing. Such a collective holds the process: gloo runs it on a
# worker thread of the group that waits in it for the group's own timeout, and the
# group's destructor (`destroy_process_group()`, or the interpreter's exit) joins
# that thread; on NCCL/HCCL it stays queued on the device and the group's shutdown
# waits for it. So a failed sync ends what it left posted, and the group with it:
# - Host collectives (gloo) cannot be cancelled, and gloo's `abort()` does nothing,
#   so with `timeout_s` every broadcast of a sync carries `timeout_s` as its own
#   timeout (`BroadcastOptions.timeout`): the collective itself ends by then, its
#   thread is free, and a timed-out gloo context closes its connections, so what
#   else was posted on the group fails at once on both sides.
# - Device collectives get no per-collective timeout (NCCL's watchdog would end the
#   process at it); the failure aborts the group (`ProcessGroup.abort()`: NCCL/HCCL
#   abort their communicators, which ends the kernels still queued), and a later
#   `destroy_process_group()` skips the aborted communicators.
# Either way the group is unusable afterwards: the process may destroy it and exit,
# or sync on a new group. The abort is best effort; it never hides the sync's error.
# With `timeout_s=None` on gloo what was left posted ends at the group's timeout.


def collective_max_blocks(fn: str, device: torch.device, reserve_sms) -> int:
    """`max_blocks` for the pack/unpack kernels that run beside a collective (0: no cap;
    Note [SMs left to the collective] in sync.py)."""
    check_int(fn, "reserve_sms", reserve_sms, 0)
    sms = _device.multiprocessor_count(device) if device.type == "cuda" else 0
    if not sms or not reserve_sms:
        return 0
    return max(1, sms - reserve_sms)  # one persistent block per SM on the others


def check_group_args(fn: str, group, ranks, backend) -> Optional[List[int]]:
    """The arguments that choose a sync's group, checked before torch.distributed is asked
    (TypeError / ValueError naming `fn` and the argument); returns `ranks` as a sorted list."""
    non_member = dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives a rank outside the group
    process_group = getattr(dist, "ProcessGroup", None)
    if group is not None and group is not non_member \
            and not (process_group is not None and isinstance(group, process_group)):
        raise TypeError(f"{fn}: group must be a torch.distributed process group (dist.new_group(...), "
                        f"dist.group.WORLD) or None for the world, got {type(group).__name__} {group!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"{fn}: backend must be a torch.distributed backend name such as 'nccl' or 'gloo', or "
                        f"None, got {type(backend).__name__} {backend!r}")
    if ranks is None:
        return None
    return check_ranks(fn, "ranks", ranks, "ints >= 0, or None",
                       "each rank of the group once (the sender's and the receivers')")


def check_ranks(fn: str, name: str, ranks, what: str, once: str) -> List[int]:
    """`ranks` (argument `name`: global ranks, `what` they are) as a sorted list of distinct ints >= 0;
    `once` says what each must name once."""
    if isinstance(ranks, (str, bytes, dict)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{fn}: {name} must be a list of global ranks ({what}), got {type(ranks).__name__} {ranks!r}")
    ranks = list(ranks)
    for r in ranks:
        if not is_int(r):
            raise TypeError(f"{fn}: {name} must hold global ranks (ints >= 0), got {type(r).__name__} {r!r}")
        if r < 0:
            raise ValueError(f"{fn}: {name} must hold global ranks (ints >= 0), got {r}")
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"{fn}: {name} must name {once}, got {ranks}")
    return sorted(ranks)


def resolve_group(fn: str, group, ranks, backend):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialized; call dist.init_process_group first")
    if group is not None and ranks is not None:
        raise ValueError(f"{fn}: pass either group or ranks, not both")
    if ranks is not None:
        world = dist.get_world_size()
        outside = [r for r in ranks if r >= world]
        if outside:
            raise ValueError(f"{fn}: ranks must be ranks of the world (0 to {world - 1}), got {outside[0]}")
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
                f"{fn}: an earlier sync on this group failed mid-way ({self.failure}), so this group cannot "
                f"sync again. {AFTER_FAILURE}")

    def fail(self, what: str) -> None:
        """Record the failure that ended a sync and abort the group (Note [failed syncs])."""
        if self.failure is None:
            self.failure = what
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 - best effort: the sync's own error is the one raised
                pass

    def broadcast(self, tensor: torch.Tensor, what: str):
        try:
            if self.timeout_s is None or self.on_device:
                return dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)
            # A host collective that ends by itself within the timeout (Note [failed syncs]).
            opts = dist.BroadcastOptions()
            opts.rootRank = dist.get_group_rank(self.group, self.src)
            opts.rootTensor = 0
            opts.timeout = datetime.timedelta(seconds=self.timeout_s)
            return self.group.broadcast([tensor], opts)
        except Exception as exc:  # a peer that died is seen here on some backends
            raise self._error(what, exc) from exc

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, what: str):
        """Every member's `mine` into `out`, in group-rank order (each `mine.numel()` bytes long):
        its waits bounded as a broadcast's (Note [sync timeouts])."""
        try:
            if self.timeout_s is None or self.on_device:
                return dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True)
            # A host collective that ends by itself within the timeout (Note [failed syncs]).
            from torch.distributed.distributed_c10d import AllgatherOptions

            opts = AllgatherOptions()
            opts.timeout = datetime.timedelta(seconds=self.timeout_s)
            return self.group._allgather_base(out, mine, opts)
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
                            f"may have failed or died mid-sync{cause}. {AFTER_FAILURE}")
