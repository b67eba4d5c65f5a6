"""`offload.plan_buckets`: which tensors go in which bucket, at which offset, in which dtype.

A bucket is one uint8 buffer of at most `bucket_bytes` holding many tensors at
aligned offsets, each possibly cast to a target dtype on the way in: moving a
handful of large buffers runs at the bandwidth of the link, one tensor at a time
does not. The planner places tensors one at a time (`Planner`), so a packer can
stream; the records it makes are bucket_plan.py's, the packing bucket_pack.py's.
See Note [bucket plans] and Note [dtype policy].
"""

from __future__ import annotations

import fnmatch
import re
from typing import List, Optional, Tuple

import torch

from ..core import _device
from ..core.checks import check_int, is_int, resolve_device
from .bucket_plan import CASTABLE, BucketEntry, BucketPlan, dtype_itemsize, dtype_name

# Offsets in a bucket are multiples of this: 256 bytes is the device allocator's
# own alignment, so a view into a bucket is as aligned as a fresh tensor and the
# kernels can use 16-byte vector loads and stores on every tensor.
DEFAULT_ALIGNMENT = 256
# Default bucket size: 1/32 of free device memory (a sender and a receiver each
# keep two buckets in flight, so at most 1/16 of what is free), clamped to
# [64 MiB, 1 GiB]. Above ~64 MiB a broadcast or DMA runs at its peak; more only
# costs memory. On a CPU-only torch: 256 MiB.
MIN_DEFAULT_BUCKET_BYTES = 64 << 20
MAX_DEFAULT_BUCKET_BYTES = 1 << 30
CPU_DEFAULT_BUCKET_BYTES = 256 << 20

# Note [bucket plans]
# ~~~~~~~~~~~~~~~~~~~
# The planner assigns each named tensor a place, a `BucketEntry`: plain data
# (`to_dict`/`from_dict`) that another process can receive and unpack by. A
# tensor larger than what is left of a bucket is split into chunks across
# buckets, so a large fused tensor does not need a bucket of its size. The
# planner streams: it needs only names, shapes and dtypes, one tensor at a time,
# so `pack_buckets` can consume an iterator (a sharded model gathered one tensor
# at a time) and yield each bucket as soon as it is full. Packing reads every
# source once, casts, and writes the bucket: one multi-tensor kernel per (source
# dtype, bucket dtype) pair on CUDA, a parallel C++ loop on the CPU,
# `torch._foreach_copy_` when the core is not built; work is queued on the
# current stream. Unpacking gives zero-copy typed views into the bucket, or
# copies into existing tensors (load in place) with the same one-launch machinery.
#
# Note [dtype policy]
# ~~~~~~~~~~~~~~~~~~~
# `dtype` applies to floating-point tensors of fp64/fp32/fp16/bf16 only; integer,
# bool and fp8 tensors always keep their dtype (they are copied as raw bytes), as
# do tensors whose name matches a `keep_dtype` pattern (fnmatch strings such as
# ``"*.mlp.gate.weight"`` or compiled regular expressions).


def default_bucket_bytes(device=None) -> int:
    """The bucket size used when none is given: 1/32 of `device`'s free memory within
    [MIN_DEFAULT_BUCKET_BYTES, MAX_DEFAULT_BUCKET_BYTES]; CPU_DEFAULT_BUCKET_BYTES on the host."""
    return _default_bucket_bytes("offload.default_bucket_bytes", device)


def _default_bucket_bytes(fn: str, device) -> int:
    device = resolve_device(fn, device)
    if not _device.is_accelerator(device):
        return CPU_DEFAULT_BUCKET_BYTES
    free, _ = _device.mem_get_info(device)
    size = min(MAX_DEFAULT_BUCKET_BYTES, max(MIN_DEFAULT_BUCKET_BYTES, free // 32))
    return size - size % DEFAULT_ALIGNMENT


class DtypePolicy:
    """Which dtype each tensor gets in a bucket: `dtype` unless the name matches `keep_dtype`
    (Note [dtype policy])."""

    def __init__(self, dtype: Optional[torch.dtype] = None, keep_dtype=(), fn: str = "offload.pack_buckets"):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: dtype must be a torch.dtype or None, got {dtype!r}")
        if dtype is not None and dtype not in CASTABLE:
            raise ValueError(
                f"{fn}: dtype must be one of {', '.join(dtype_name(d) for d in CASTABLE)} or None, got {dtype}"
            )
        if isinstance(keep_dtype, (str, re.Pattern)):
            keep_dtype = [keep_dtype]
        if not isinstance(keep_dtype, (list, tuple, set, frozenset)):
            raise TypeError(f"{fn}: keep_dtype must be a name pattern (str or re.Pattern) or a sequence of them, "
                            f"got {type(keep_dtype).__name__}")
        patterns = []
        for p in keep_dtype:
            if isinstance(p, re.Pattern):
                patterns.append(p)
            elif isinstance(p, str):
                patterns.append(re.compile(fnmatch.translate(p)))
            else:
                raise TypeError(f"{fn}: keep_dtype entries must be str or re.Pattern, got {type(p).__name__}")
        self.dtype = dtype
        self.patterns = patterns

    def target(self, name: str, source: torch.dtype) -> torch.dtype:
        if self.dtype is None or source not in CASTABLE:
            return source
        if any(p.fullmatch(name) for p in self.patterns):
            return source
        return self.dtype


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _check_layout(fn: str, bucket_bytes, alignment) -> None:
    """bucket_bytes (None: the default, sized later) and alignment, checked against each other."""
    check_int(fn, "alignment", alignment, 1)
    if alignment & (alignment - 1):
        raise ValueError(f"{fn}: alignment must be a power of two, got {alignment}")
    if bucket_bytes is None:
        return
    if not is_int(bucket_bytes):
        raise TypeError(f"{fn}: bucket_bytes must be an int of at least alignment ({alignment} bytes) or None for "
                        f"the default, got {type(bucket_bytes).__name__} {bucket_bytes!r}")
    if bucket_bytes < alignment:  # one rule for 0 and negative sizes too
        raise ValueError(
            f"{fn}: bucket_bytes ({bucket_bytes}) is smaller than one alignment unit ({alignment} bytes); "
            "raise bucket_bytes or lower alignment"
        )


def check_bucket_options(fn: str, bucket_bytes, dtype, keep_dtype, alignment) -> DtypePolicy:
    """The cast policy of buckets (`dtype`, `keep_dtype`) and their layout (`bucket_bytes`, None
    for the default, and `alignment`), checked for an object that packs later (a sender) at its
    construction, with its own name, rather than at its first pack."""
    policy = DtypePolicy(dtype, keep_dtype, fn)
    _check_layout(fn, bucket_bytes, alignment)
    return policy


class Planner:
    """Places tensors one at a time; reports buckets as they close (streaming)."""

    def __init__(self, bucket_bytes, alignment: int, policy: DtypePolicy, fn: str, device=None):
        _check_layout(fn, bucket_bytes, alignment)
        if bucket_bytes is None:
            bucket_bytes = _default_bucket_bytes(fn, device)
        self.fn = fn
        self.bucket_bytes = bucket_bytes
        self.alignment = alignment
        self.policy = policy
        self.bucket = 0
        self.cursor = 0  # next free (aligned) byte of the open bucket
        self.used = 0  # end of the last entry in the open bucket
        self.sizes: List[int] = []
        self.names = set()
        self.open_entries = 0  # entries placed in the open bucket

    def _close(self) -> int:
        self.sizes.append(self.used)
        closed = self.bucket
        self.bucket += 1
        self.cursor = self.used = self.open_entries = 0
        return closed

    def add(self, name: str, shape, source: torch.dtype) -> Tuple[List[BucketEntry], List[int]]:
        """Entries for one tensor, and the indices of buckets this closed (complete, packable now)."""
        if not isinstance(name, str):
            raise TypeError(f"{self.fn}: tensor names must be str, got {type(name).__name__} ({name!r})")
        if name in self.names:
            raise ValueError(f"{self.fn}: tensor name {name!r} appears twice; names must be unique")
        self.names.add(name)
        target = self.policy.target(name, source)
        itemsize = dtype_itemsize(target)
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        common = dict(name=name, dtype=dtype_name(target), shape=shape, source_dtype=dtype_name(source))
        closed: List[int] = []
        total = numel * itemsize
        # Every tensor starts at least at its natural alignment, whatever `alignment` is.
        self.cursor = min(_align_up(self.cursor, itemsize), self.bucket_bytes)
        if total == 0:  # takes no room; offset 0 is valid in any bucket, however little it holds
            self.open_entries += 1
            return [BucketEntry(bucket=self.bucket, offset=0, nbytes=0, numel=0, **common)], closed
        if self.cursor + total <= self.bucket_bytes:
            entry = BucketEntry(bucket=self.bucket, offset=self.cursor, nbytes=total, numel=numel, **common)
            self.used = self.cursor + total
            self.cursor = min(_align_up(self.cursor + total, self.alignment), self.bucket_bytes)
            self.open_entries += 1
            return [entry], closed
        if total <= self.bucket_bytes:
            closed.append(self._close())
            entry = BucketEntry(bucket=self.bucket, offset=0, nbytes=total, numel=numel, **common)
            self.used = total
            self.cursor = min(_align_up(total, self.alignment), self.bucket_bytes)
            self.open_entries = 1
            return [entry], closed
        return self._split(common, numel, itemsize, closed), closed

    def _split(self, common: dict, numel: int, itemsize: int, closed: List[int]) -> List[BucketEntry]:
        """The chunks of a tensor larger than a bucket (`common`: the fields its entries share), from
        the open bucket on; the index of each bucket it fills is appended to `closed`."""
        # Chunks hold whole alignment units, so the next chunk starts aligned in
        # both the bucket and the source (a multiple of alignment bytes in, too).
        unit = max(1, self.alignment // itemsize)
        if unit * itemsize > self.bucket_bytes:
            raise ValueError(
                f"{self.fn}: tensor {common['name']!r} ({common['dtype']}) needs buckets of at least "
                f"{unit * itemsize} bytes, got bucket_bytes={self.bucket_bytes}"
            )
        pieces = []
        start = 0
        while start < numel:
            fit = (self.bucket_bytes - self.cursor) // itemsize // unit * unit
            if fit == 0:
                closed.append(self._close())
                continue
            count = min(fit, numel - start)
            pieces.append((self.bucket, self.cursor, start, count))
            self.used = self.cursor + count * itemsize
            self.cursor = min(_align_up(self.used, self.alignment), self.bucket_bytes)
            self.open_entries += 1
            start += count
        entries = [
            BucketEntry(bucket=b, offset=o, nbytes=c * itemsize, chunk=i, num_chunks=len(pieces), start=s, numel=c,
                        **common)
            for i, (b, o, s, c) in enumerate(pieces)
        ]
        return entries

    def finish(self) -> List[int]:
        """Close the last bucket (if it holds anything); returns its index."""
        return [self._close()] if self.open_entries else []


def named_items(tensors, fn: str):
    """(name, tensor) pairs from a mapping or an iterable of pairs, lazily."""
    if isinstance(tensors, torch.Tensor) or isinstance(tensors, (str, bytes)) or not (
            hasattr(tensors, "items") or hasattr(tensors, "__iter__")):
        what = "a tensor" if isinstance(tensors, torch.Tensor) else type(tensors).__name__
        raise TypeError(f"{fn}: tensors must be a mapping or an iterable of (name, tensor) pairs, got {what}")
    items = tensors.items() if hasattr(tensors, "items") else tensors
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"{fn}: item {i} must be a (name, tensor) pair, got {type(item).__name__}")
        name, t = item
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
        yield name, t


def plan_buckets(
    tensors,
    bucket_bytes: Optional[int] = None,
    *,
    dtype: Optional[torch.dtype] = None,
    keep_dtype=(),
    alignment: int = DEFAULT_ALIGNMENT,
    device=None,
) -> BucketPlan:
    """Place named tensors (a mapping or (name, tensor) pairs) into buckets; reads only shapes and dtypes.

    Meta tensors and DTensors (their global shape) are fine here: nothing is read.
    `bucket_bytes` defaults to `default_bucket_bytes(device)`.
    """
    fn = "offload.plan_buckets"
    if device is not None:
        resolve_device(fn, device)
    planner = Planner(bucket_bytes, alignment, DtypePolicy(dtype, keep_dtype, fn), fn, device)
    entries: List[BucketEntry] = []
    for name, t in named_items(tensors, fn):
        new, _ = planner.add(name, t.shape, t.dtype)
        entries.extend(new)
    planner.finish()
    return BucketPlan(entries, planner.sizes, planner.bucket_bytes, alignment)

