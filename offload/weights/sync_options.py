"""What a `WeightSender` and a `WeightReceiver` share: the defaults, the checks of the arguments
they both take, and the double buffer of buckets (sync.py, receiver.py, many_senders.py,
many_receiver.py)."""

from __future__ import annotations

from typing import List, Optional

import torch

from ..core import _device
from ..core.checks import check_int
from ..core.pool import HostPool
from .bucket_pack import copy_spans
from .link import check_group_args

PHASES = ("gather", "pack", "host_copy", "transfer", "unpack")
MODES = ("device", "host_cache")
TRANSPORTS = ("nccl", "ipc")
# Buckets default to at most this (less where free memory is short,
# `offload.default_bucket_bytes`): the first pack and the last unpack are not
# overlapped with the wire (Note [bucket pipeline]), so a smaller bucket fills and
# drains the pipeline sooner; above a few hundred MiB a broadcast gains nothing.
DEFAULT_SYNC_BUCKET_BYTES = 256 << 20
# SMs left free for the collective while a bucket is packed or unpacked beside it
# (Note [SMs left to the collective]). NCCL runs one block per channel and uses at
# most 32 channels within a node by default (NCCL_MAX_NCHANNELS); a block needs
# most of an SM's register file.
DEFAULT_RESERVE_SMS = 32


def _check_version(fn: str, version) -> None:
    """A version tag given to a sender: an int >= 0, or None (the next one, or the latest snapshot)."""
    if version is not None:
        check_int(fn, "version", version, 0, "a version tag, or None")


def _check_common(fn: str, group, src, ranks, backend, reserve_sms) -> Optional[List[int]]:
    """The arguments a sender and a receiver share, checked before torch.distributed is asked
    (those that need the group, such as whether src is in it, are checked once it is known);
    returns `ranks` as a list."""
    check_int(fn, "src", src, 0, "the global rank of the sender")
    check_int(fn, "reserve_sms", reserve_sms, 0)
    return check_group_args(fn, group, ranks, backend)


def _check_many(fn: str, group, transport) -> None:
    """What `senders=` (Note [many senders]) goes with: over process groups it builds itself, or
    colocated (transport 'ipc', Note [colocated senders]) with the pair's group or channel."""
    if transport == "ipc":
        return
    if group is not None:
        raise ValueError(f"{fn}: senders= builds a group per sender from ranks= (or the world), which every rank "
                         "of the world must know; pass ranks=, not group (but with transport 'ipc': the group of "
                         "this device's trainer and rollout ranks)")


def _check_transport(fn: str, transport, channel) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"{fn}: transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if channel is not None and transport != "ipc":
        raise ValueError(f"{fn}: channel is the control channel of transport 'ipc'; transport {transport!r} uses "
                         "the group")


class BucketBuffers:
    """Two bucket buffers, grown (never shrunk) to the largest bucket of a sync."""

    def __init__(self):
        self.slots: List[Optional[torch.Tensor]] = [None, None]

    def get(self, slot: int, nbytes: int, device, pool: Optional[HostPool] = None) -> torch.Tensor:
        buf = self.slots[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            if pool is not None:  # host buckets that are copied up: pinned, from the pool
                buf = pool.acquire(max(nbytes, 1))
            else:
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self.slots[slot] = buf
        return buf[:nbytes]


class SenderBuckets:
    """A sender's two bucket buffers on the device (Note [bucket pipeline] in sync.py), and for a send
    from host memory (a host_cache snapshot) two pinned host buckets, packed on the host and copied up
    on the current stream, which owns the device buffers."""

    def __init__(self):
        self.device_buffers = BucketBuffers()
        self.host_buffers = BucketBuffers()
        self._uploads: List = [None, None]  # events: a host bucket's upload is done, the slot free again

    def pack(self, slot: int, size: int, device, sources, spans, timer, host_pool: Optional[HostPool] = None,
             max_blocks=None) -> torch.Tensor:
        """Bucket `slot` of `size` bytes packed from `sources` on `device` (on the host and copied up
        where `host_pool` is given: the sources are host tensors), for its broadcast."""
        data = self.device_buffers.get(slot, size, device)
        if host_pool is None:
            with timer.phase("pack"):
                copy_spans(data, sources, spans, pack=True, max_blocks=max_blocks)
            return data
        if self._uploads[slot] is not None:
            self._uploads[slot].synchronize()  # the host writes this slot next
        host = self.host_buffers.get(slot, size, torch.device("cpu"), host_pool)
        with timer.phase("pack"):
            copy_spans(host, sources, spans, pack=True)
        with timer.phase("host_copy"):
            data.copy_(host, non_blocking=True)
        self._uploads[slot] = _device.new_event(device)
        self._uploads[slot].record(_device.current_stream(device))
        return data
