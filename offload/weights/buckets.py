"""`offload.plan_buckets` / `offload.pack_buckets` / `offload.unpack_bucket`: many tensors as few flat buffers.

A bucket is one uint8 buffer of at most `bucket_bytes` holding many tensors at
aligned offsets, each possibly cast to a target dtype on the way in: moving a
handful of large buffers runs at the bandwidth of the link, one tensor at a time
does not. See Note [bucket plans] and Note [dtype policy].
"""

from __future__ import annotations

import fnmatch
import functools
import operator
import re
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..core import _backend, _device
from ..core.checks import check_has_data, check_int, is_int, resolve_device
from .param_offload import params_offloaded

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

# Casts the kernels implement; everything else is copied as raw bytes.
_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# Devices csrc/core/buckets.cpp copies on: the CPU loop, and the CUDA kernels when the
# core was built for CUDA (`_backend.built_for`). Anything else (Ascend, or CUDA
# with a CPU-only core) packs with torch's copies.
_NATIVE_BUCKET_DEVICES = ("cpu", "cuda")

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



def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def _dtype_or_none(name: str):
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def parse_dtype(name: str, what: str) -> torch.dtype:
    dtype = _dtype_or_none(name)  # cached: the pack path parses one per entry per bucket
    if dtype is None:
        raise ValueError(f"{what}: {name!r} is not a torch dtype name")
    return dtype


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class BucketEntry:
    """Where (a chunk of) one tensor lives: plain data, picklable, `to_dict()` for JSON.

    `dtype` is the dtype in the bucket; `start`/`numel` are the elements of the
    flattened tensor this chunk holds (the whole tensor when `num_chunks == 1`).
    """

    name: str
    dtype: str
    shape: Tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int
    chunk: int = 0
    num_chunks: int = 1
    start: int = 0
    numel: int = 0
    source_dtype: str = ""

    def to_dict(self) -> dict:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "BucketEntry":
        """The entry `to_dict()` made. Checks the keys and the type of each value (TypeError /
        ValueError naming the key); whether the values agree is `BucketPlan.validate`'s to check."""
        return _entry_from_dict("offload.BucketEntry.from_dict", "data", data)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, f"offload: metadata of tensor {self.name!r}")


# The keys of `BucketEntry.to_dict()`: those without a default are required by `from_dict`.
_ENTRY_REQUIRED = ("name", "dtype", "shape", "bucket", "offset", "nbytes")
_ENTRY_OPTIONAL = ("chunk", "num_chunks", "start", "numel", "source_dtype")
_ENTRY_INTS = ("bucket", "offset", "nbytes", "chunk", "num_chunks", "start", "numel")


def _check_keys(fn: str, what: str, data, required: Sequence[str], optional: Sequence[str] = ()) -> None:
    """`data` is a dict with every key of `required`, and no key outside `required` and `optional`."""
    if not isinstance(data, dict):
        raise TypeError(f"{fn}: {what} must be a dict (as to_dict() makes), got {type(data).__name__}")
    expected = f"expected keys {', '.join(required)}" + (f" (and optionally {', '.join(optional)})" if optional else "")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{fn}: {what} lacks key(s) {', '.join(map(repr, missing))}; {expected}")
    unknown = [k for k in data if k not in required and k not in optional]
    if unknown:
        raise ValueError(f"{fn}: {what} has unknown key(s) {', '.join(map(repr, unknown))}; {expected}")


def _int_from(fn: str, what: str, value) -> int:
    """An int read from plain data: an int or anything with `__index__` (a numpy integer), never a bool."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{fn}: {what} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def _entry_from_dict(fn: str, what: str, data) -> "BucketEntry":
    _check_keys(fn, what, data, _ENTRY_REQUIRED, _ENTRY_OPTIONAL)
    fields = dict(data)
    for key in ("name", "dtype", "source_dtype"):
        if key in fields and not isinstance(fields[key], str):
            raise TypeError(f"{fn}: {what}['{key}'] must be a str, got {type(fields[key]).__name__}")
    shape = fields["shape"]
    if not isinstance(shape, (list, tuple)):
        raise TypeError(f"{fn}: {what}['shape'] must be a list of ints, got {type(shape).__name__}")
    fields["shape"] = tuple(_int_from(fn, f"{what}['shape'][{i}]", n) for i, n in enumerate(shape))
    for key in _ENTRY_INTS:
        if key in fields:
            fields[key] = _int_from(fn, f"{what}['{key}']", fields[key])
    return BucketEntry(**fields)


def _is_count(value) -> bool:
    return is_int(value) and value >= 0


def _entry_problem(e: BucketEntry) -> Optional[str]:
    """What is wrong with one entry on its own (a sentence to follow its name), or None.

    An entry that disagrees with itself (shape against numel and nbytes, a chunk
    outside its tensor, a cast the packer never makes) would make unpacking read
    the wrong bytes or fill part of a tensor without a word.
    """
    if not isinstance(e.name, str):
        return f"has a name of type {type(e.name).__name__}; names are str"
    dtype = _dtype_or_none(e.dtype)
    if dtype is None:
        return f"has dtype {e.dtype!r}, which is not a torch dtype name"
    if e.source_dtype:
        source = _dtype_or_none(e.source_dtype)
        if source is None:
            return f"has source_dtype {e.source_dtype!r}, which is not a torch dtype name"
        if source != dtype and not (source in _CASTABLE and dtype in _CASTABLE):
            return f"says {e.source_dtype} was packed as {e.dtype}, a cast the packer never makes"
    if not isinstance(e.shape, (tuple, list)) or not all(_is_count(s) for s in e.shape):
        return f"has shape {e.shape!r}; a shape is a sequence of ints >= 0"
    for field in ("bucket", "offset", "nbytes", "chunk", "start", "numel"):
        if not _is_count(getattr(e, field)):
            return f"has {field}={getattr(e, field)!r}; expected an int >= 0"
    if not _is_count(e.num_chunks) or e.num_chunks < 1 or e.chunk >= e.num_chunks:
        return f"is chunk {e.chunk} of {e.num_chunks!r}; expected 0 <= chunk < num_chunks"
    total = _numel(e.shape)
    if e.num_chunks == 1 and (e.start != 0 or e.numel != total):
        return (f"has shape {list(e.shape)} ({total} elements) but holds elements [{e.start}, {e.start + e.numel}) "
                "in its only chunk")
    if e.start + e.numel > total:
        return f"holds elements [{e.start}, {e.start + e.numel}) of a tensor of shape {list(e.shape)} ({total} elements)"
    itemsize = _itemsize(dtype)
    if e.nbytes != e.numel * itemsize:
        return f"claims {e.nbytes} bytes for {e.numel} {e.dtype} elements ({e.numel * itemsize} bytes)"
    if e.offset % itemsize:
        return f"starts at byte {e.offset}, not a multiple of the {e.dtype} element size ({itemsize})"
    return None


def _entry_label(e) -> str:
    return f"tensor {e.name!r} (chunk {e.chunk})" if getattr(e, "num_chunks", 1) != 1 else f"tensor {e.name!r}"


@dataclass
class BucketPlan:
    """Every entry, and the bytes used in each bucket (a bucket's buffer needs only that much)."""

    entries: List[BucketEntry]
    bucket_sizes: List[int]
    bucket_bytes: int
    alignment: int

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    def bucket_entries(self, index: int) -> List[BucketEntry]:
        """The entries of bucket `index` (an int >= 0; none past the last bucket)."""
        check_int("offload.BucketPlan.bucket_entries", "index", index, 0)
        return [e for e in self.entries if e.bucket == index]

    def validate(self, fn: str = "offload.BucketPlan.validate") -> "BucketPlan":
        """Raise ValueError naming the tensor unless the plan is consistent; returns the plan.

        Checks each entry against itself (see `_entry_problem`), against the
        buckets (index in range, bytes inside the bucket's size), and each tensor's
        chunks against each other (same dtype and shape, every chunk once, the
        elements covered in order without gap or overlap). A receiver runs this on
        every plan it is sent, before it unpacks by it.
        """
        if not _is_count(self.bucket_bytes) or self.bucket_bytes == 0:
            raise ValueError(f"{fn}: bucket_bytes must be an int > 0, got {self.bucket_bytes!r}")
        if not _is_count(self.alignment) or self.alignment == 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"{fn}: alignment must be a power of two, got {self.alignment!r}")
        for i, size in enumerate(self.bucket_sizes):
            if not _is_count(size) or size > self.bucket_bytes:
                raise ValueError(f"{fn}: bucket {i} has size {size!r}; expected an int in [0, bucket_bytes="
                                 f"{self.bucket_bytes}]")
        chunks: Dict[str, List[BucketEntry]] = {}
        for e in self.entries:
            if not isinstance(e, BucketEntry):
                raise TypeError(f"{fn}: entries must be BucketEntry, got {type(e).__name__}")
            problem = _entry_problem(e)
            if problem is not None:
                raise ValueError(f"{fn}: {_entry_label(e)} {problem}")
            if e.bucket >= self.num_buckets:
                raise ValueError(f"{fn}: {_entry_label(e)} is in bucket {e.bucket} but the plan has "
                                 f"{self.num_buckets} buckets")
            size = self.bucket_sizes[e.bucket]
            if e.offset + e.nbytes > size and e.nbytes:
                raise ValueError(f"{fn}: {_entry_label(e)} claims bytes [{e.offset}, {e.offset + e.nbytes}) of "
                                 f"bucket {e.bucket}, which holds {size} bytes")
            chunks.setdefault(e.name, []).append(e)
        for name, parts in chunks.items():
            first = parts[0]
            if len(parts) != first.num_chunks or any(
                (p.dtype, tuple(p.shape), p.source_dtype, p.num_chunks)
                != (first.dtype, tuple(first.shape), first.source_dtype, first.num_chunks) for p in parts
            ):
                raise ValueError(f"{fn}: tensor {name!r} has {len(parts)} entries that disagree with each other "
                                 f"(num_chunks {[p.num_chunks for p in parts]}, dtypes {[p.dtype for p in parts]}, "
                                 f"shapes {[list(p.shape) for p in parts]}); a name appears once, or once per chunk")
            expected = 0
            for k, p in enumerate(sorted(parts, key=lambda p: p.chunk)):
                if p.chunk != k or p.start != expected:
                    raise ValueError(f"{fn}: tensor {name!r}: chunk {p.chunk} starts at element {p.start}; "
                                     f"expected chunk {k} at element {expected} (chunks cover the tensor in order)")
                expected += p.numel
            if expected != _numel(first.shape):  # a single chunk was checked against its shape above
                raise ValueError(f"{fn}: tensor {name!r}: its {first.num_chunks} chunks hold {expected} elements of "
                                 f"{_numel(first.shape)} (shape {list(first.shape)})")
        return self

    def to_dict(self) -> dict:
        return {
            "entries": [e.to_dict() for e in self.entries],
            "bucket_sizes": list(self.bucket_sizes),
            "bucket_bytes": self.bucket_bytes,
            "alignment": self.alignment,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "BucketPlan":
        """The plan `to_dict()` made (keys entries, bucket_sizes, bucket_bytes, alignment).
        Checks the keys and the type of each value (TypeError / ValueError naming the key);
        `validate()` checks that the entries agree with each other and with the buckets."""
        fn = "offload.BucketPlan.from_dict"
        _check_keys(fn, "data", data, ("entries", "bucket_sizes", "bucket_bytes", "alignment"))
        for key in ("entries", "bucket_sizes"):
            if not isinstance(data[key], (list, tuple)):
                raise TypeError(f"{fn}: data['{key}'] must be a list, got {type(data[key]).__name__}")
        return cls(
            [_entry_from_dict(fn, f"data['entries'][{i}]", e) for i, e in enumerate(data["entries"])],
            [_int_from(fn, f"data['bucket_sizes'][{i}]", n) for i, n in enumerate(data["bucket_sizes"])],
            _int_from(fn, "data['bucket_bytes']", data["bucket_bytes"]),
            _int_from(fn, "data['alignment']", data["alignment"]),
        )


@dataclass
class PackedBucket:
    """One packed bucket: `data` (uint8, on the sources' device) and the entries it holds."""

    index: int
    data: torch.Tensor
    entries: List[BucketEntry]


class DtypePolicy:
    """Which dtype each tensor gets in a bucket: `dtype` unless the name matches `keep_dtype`
    (Note [dtype policy])."""

    def __init__(self, dtype: Optional[torch.dtype] = None, keep_dtype=(), fn: str = "offload.pack_buckets"):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: dtype must be a torch.dtype or None, got {dtype!r}")
        if dtype is not None and dtype not in _CASTABLE:
            raise ValueError(
                f"{fn}: dtype must be one of {', '.join(dtype_name(d) for d in _CASTABLE)} or None, got {dtype}"
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
        if self.dtype is None or source not in _CASTABLE:
            return source
        if any(p.fullmatch(name) for p in self.patterns):
            return source
        return self.dtype


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


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
        itemsize = _itemsize(target)
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
        # Split: chunks hold whole alignment units, so the next chunk starts aligned in
        # both the bucket and the source (a multiple of alignment bytes in, too).
        unit = max(1, self.alignment // itemsize)
        if unit * itemsize > self.bucket_bytes:
            raise ValueError(
                f"{self.fn}: tensor {name!r} ({dtype_name(target)}) needs buckets of at least "
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
        return entries, closed

    def finish(self) -> List[int]:
        """Close the last bucket (if it holds anything); returns its index."""
        return [self._close()] if self.open_entries else []


def _named_items(tensors, fn: str):
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
    for name, t in _named_items(tensors, fn):
        new, _ = planner.add(name, t.shape, t.dtype)
        entries.extend(new)
    planner.finish()
    return BucketPlan(entries, planner.sizes, planner.bucket_bytes, alignment)


# ---------------------------------------------------------------- pack


def _materialize(name: str, t: torch.Tensor, fn: str) -> torch.Tensor:
    """A local dense tensor for `t`: DTensors are gathered here (one tensor at a time)."""
    full_tensor = getattr(t, "full_tensor", None)
    if full_tensor is not None and type(t).__name__ == "DTensor":
        check_has_data(fn, f"the local shard of tensor {name!r}", t._local_tensor)  # before the gather reads it
        t = full_tensor()
    if t.is_meta:
        raise ValueError(f"{fn}: tensor {name!r} is a meta tensor, which has no data to pack")
    if t.layout != torch.strided:
        raise ValueError(f"{fn}: tensor {name!r} has layout {t.layout}; only strided (dense) tensors can be packed")
    if not t.is_contiguous():
        raise ValueError(
            f"{fn}: tensor {name!r} is not contiguous (shape {list(t.shape)}, stride {list(t.stride())}); "
            "pass t.contiguous()"
        )
    check_has_data(fn, f"tensor {name!r}", t)
    return t.detach()


def _check_device(fn: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{fn}: tensor {name!r} is on {t.device} but the bucket is on {device}")


def pack_into(data: torch.Tensor, sources: Sequence[torch.Tensor], entries: Sequence[BucketEntry], fn: str) -> None:
    """Write each entry's elements of its source (cast to the entry's dtype) into `data`, on the current stream."""
    _check_bucket(fn, data, entries)
    for s, e in zip(sources, entries):
        _check_device(fn, e.name, s, data.device)
    _copy_spans(data, sources, entries, pack=True)


class BucketSpans:
    """The arguments of one bucket's native copy, built once per plan and reused by every sync.

    A weight sync packs the same plan again and again; only the tensors change.
    `live` indexes the entries with elements (empty tensors are skipped).
    """

    __slots__ = ("entries", "live", "starts", "numels", "offsets", "dtypes")

    def __init__(self, entries: Sequence[BucketEntry]):
        self.entries = list(entries)
        self.live = [i for i, e in enumerate(self.entries) if e.numel]
        live = [self.entries[i] for i in self.live]
        self.starts = [e.start for e in live]
        self.numels = [e.numel for e in live]
        self.offsets = [e.offset for e in live]
        self.dtypes = [e.torch_dtype for e in live]


def bucket_spans(plan: "BucketPlan") -> List[BucketSpans]:
    """Each bucket's native copy arguments (BucketSpans), in bucket order: built once per plan,
    reused by every sync of that plan."""
    per_bucket: List[list] = [[] for _ in range(plan.num_buckets)]
    for e in plan.entries:
        per_bucket[e.bucket].append(e)
    return [BucketSpans(entries) for entries in per_bucket]


def _copy_spans(data: torch.Tensor, tensors, entries, pack: bool) -> None:
    copy_spans(data, tensors, BucketSpans(entries), pack)


def copy_spans(data: torch.Tensor, tensors: Sequence[torch.Tensor], spans: BucketSpans, pack: bool,
               max_blocks: int = 0) -> None:
    """Bucket <- tensors (pack) or tensors <- bucket: one native call, or views and `_foreach_copy_`.

    Unchecked: the caller has validated `tensors` against `spans.entries`.
    `max_blocks` caps the blocks of each CUDA launch (0: fill the device).
    """
    if len(spans.live) != len(spans.entries):
        tensors = [tensors[i] for i in spans.live]
    core = _backend.core()
    name = "pack_bucket" if pack else "unpack_bucket"
    device_type = data.device.type
    if (core is not None and hasattr(core, name) and device_type in _NATIVE_BUCKET_DEVICES
            and _backend.built_for(device_type)):
        args = (data, list(tensors), spans.starts, spans.numels, spans.offsets, spans.dtypes)
        # Passed only when set, so a core built before the argument existed still loads.
        getattr(core, name)(*args, **({"max_blocks": int(max_blocks)} if max_blocks else {}))
        return
    live = [spans.entries[i] for i in spans.live]
    in_bucket = [_typed_view(data, e) for e in live]
    in_tensors = [t.reshape(-1)[e.start : e.start + e.numel] for t, e in zip(tensors, live)]
    if pack:
        _foreach_copy(in_bucket, in_tensors)
    else:
        _foreach_copy(in_tensors, in_bucket)


def _foreach_copy(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    if not dsts:
        return
    if _device.is_accelerator(dsts[0].device):
        torch._foreach_copy_(dsts, srcs)
    else:  # the CPU foreach is a loop of copy_ too; skip its overhead
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def _typed_view(data: torch.Tensor, e: BucketEntry) -> torch.Tensor:
    return data[e.offset : e.offset + e.nbytes].view(e.torch_dtype)


def _check_bucket(fn: str, data: torch.Tensor, entries: Sequence[BucketEntry]) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        what = f"{data.dtype} tensor of shape {list(data.shape)}" if isinstance(data, torch.Tensor) else type(data)
        raise TypeError(f"{fn}: a bucket must be a 1-D uint8 tensor, got {what}")
    if not data.is_contiguous():
        raise ValueError(f"{fn}: the bucket must be contiguous")
    size = data.numel()
    for e in entries:
        if not isinstance(e, BucketEntry):
            raise TypeError(f"{fn}: entries must be BucketEntry, got {type(e).__name__}")
        problem = _entry_problem(e)
        if problem is not None:
            raise ValueError(f"{fn}: metadata of {_entry_label(e)} {problem}")
        if e.offset + e.nbytes > size:
            raise ValueError(
                f"{fn}: metadata of tensor {e.name!r} (chunk {e.chunk}) does not match bucket {e.bucket}: "
                f"it claims bytes [{e.offset}, {e.offset + e.nbytes}) for {e.numel} {e.dtype} elements, "
                f"but the bucket has {size} bytes"
            )


def pack_buckets(
    tensors,
    bucket_bytes: Optional[int] = None,
    *,
    dtype: Optional[torch.dtype] = None,
    keep_dtype=(),
    alignment: int = DEFAULT_ALIGNMENT,
) -> Iterator[PackedBucket]:
    """Pack named tensors into buckets; yields each `PackedBucket` as soon as it is full.

    Args:
        tensors: a mapping name -> tensor (a state dict) or an iterable of (name,
            tensor) pairs, consumed lazily; all on one device; contiguous. DTensors
            are gathered (`full_tensor()`) one at a time as they are packed.
            A mapping, list or tuple is checked at the call; an iterator as it is consumed.
        bucket_bytes: the most bytes per bucket (default: `default_bucket_bytes()`).
        dtype: cast floating-point tensors to this dtype (see the dtype policy).
        keep_dtype: names (fnmatch patterns or regexes) that keep their own dtype.
        alignment: every tensor starts at a multiple of this many bytes.

    The packs are queued on the current stream; buckets are fresh tensors owned by it.
    Arguments are checked at the call (TypeError / ValueError naming the argument),
    not when the returned iterator is first advanced.
    """
    fn = "offload.pack_buckets"
    # Checked here, at the call: the generator below runs only when first iterated.
    policy = DtypePolicy(dtype, keep_dtype, fn)
    _check_layout(fn, bucket_bytes, alignment)
    if isinstance(tensors, (dict, list, tuple)) or hasattr(tensors, "items"):
        # A container already in memory is checked whole; an iterator stays lazy
        # (a sharded model gathered one tensor at a time), and is checked as it is consumed.
        names = set()
        for name, t in _named_items(tensors, fn):
            if not isinstance(name, str):
                raise TypeError(f"{fn}: tensor names must be str, got {type(name).__name__} ({name!r})")
            if name in names:
                raise ValueError(f"{fn}: tensor name {name!r} appears twice; names must be unique")
            names.add(name)
            if type(t).__name__ != "DTensor":  # gathered only when packed
                _materialize(name, t, fn)
    elif isinstance(tensors, (torch.Tensor, str, bytes)) or not hasattr(tensors, "__iter__"):
        next(_named_items(tensors, fn))  # raises, naming what tensors is
    return _pack_buckets(tensors, bucket_bytes, policy, alignment, fn)


def _pack_buckets(tensors, bucket_bytes, policy: DtypePolicy, alignment: int, fn: str) -> Iterator[PackedBucket]:
    planner: Optional[Planner] = None
    pending: Dict[int, List[Tuple[torch.Tensor, BucketEntry]]] = {}
    device = None
    for name, t in _named_items(tensors, fn):
        if planner is None:
            device = t.device
            planner = Planner(bucket_bytes, alignment, policy, fn, device if device.type != "meta" else None)
        entries, closed = planner.add(name, t.shape, t.dtype)
        local = _materialize(name, t, fn)
        if local.device != device:
            raise ValueError(f"{fn}: tensor {name!r} is on {local.device} but earlier tensors are on {device}")
        for e in entries:  # before the closed buckets: a split tensor's chunks may be in them
            pending.setdefault(e.bucket, []).append((local, e))
        for index in closed:
            yield _pack_pending(pending.pop(index, []), index, planner.sizes[index], device, fn)
    if planner is None:
        return
    for index in planner.finish():
        yield _pack_pending(pending.pop(index, []), index, planner.sizes[index], device, fn)


def _pack_pending(items, index: int, size: int, device, fn: str) -> PackedBucket:
    data = torch.empty(size, dtype=torch.uint8, device=device)
    entries = [e for _, e in items]
    pack_into(data, [t for t, _ in items], entries, fn)
    return PackedBucket(index, data, entries)


# ---------------------------------------------------------------- unpack


def unpack_bucket(
    data: torch.Tensor,
    entries: Sequence[BucketEntry],
    out: Optional[Union[Dict[str, torch.Tensor], Sequence[torch.Tensor]]] = None,
) -> List[Tuple[str, torch.Tensor]]:
    """The tensors of one bucket: zero-copy views, or copies into `out` (load in place).

    Without `out`: (name, view) pairs; a whole tensor is viewed in its shape and
    bucket dtype, a chunk of a split tensor as a 1-D view of its elements.
    With `out` (a mapping name -> tensor, or a list matching `entries`): each entry
    is copied into its destination (the chunk's element range for split tensors) in
    one launch on the current stream; shapes and dtypes must match the metadata.
    Returns (name, destination) pairs.
    """
    fn = "offload.unpack_bucket"
    if isinstance(entries, (BucketEntry, torch.Tensor, str)) or not hasattr(entries, "__iter__"):
        raise TypeError(f"{fn}: entries must be a sequence of BucketEntry, got {type(entries).__name__}")
    entries = list(entries)
    _check_bucket(fn, data, entries)
    if out is None:
        views = []
        for e in entries:
            view = _typed_view(data, e)
            views.append((e.name, view.view(e.shape) if e.num_chunks == 1 else view))
        return views
    dsts = _destinations(fn, out, entries)
    load_into(data, dsts, entries, fn)
    return [(e.name, d) for e, d in zip(entries, dsts)]


def _destinations(fn: str, out, entries: List[BucketEntry]) -> List[torch.Tensor]:
    if isinstance(out, (torch.Tensor, str)) or not (hasattr(out, "items") or hasattr(out, "__iter__")):
        raise TypeError(f"{fn}: out must be a mapping name -> tensor or a list of tensors, got {type(out).__name__}")
    if hasattr(out, "items"):
        missing = [e.name for e in entries if e.name not in out]
        if missing:
            raise ValueError(f"{fn}: out has no tensor named {missing[0]!r} (the bucket holds it)")
        return [out[e.name] for e in entries]
    out = list(out)
    if len(out) != len(entries):
        raise ValueError(f"{fn}: out has {len(out)} tensors but the bucket holds {len(entries)} entries")
    return out


def check_destination(fn: str, e: BucketEntry, dst: torch.Tensor, device: torch.device) -> None:
    """Raise naming the tensor unless `dst` can receive entry `e` in place."""
    check_received_into(fn, e.name, dst, tuple(e.shape), e.dtype, device, "in the bucket")


def check_received_into(fn: str, name: str, dst, shape: tuple, dtype: str, device: torch.device,
                        arrives: str) -> None:
    """Raise naming the tensor unless `dst` can take tensor `name` in place: `shape` and `dtype` (its
    name, as buckets spell it) as it arrives (`arrives` says how: "in the bucket", "(its slice)"),
    contiguous, with data, on `device`."""
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"{fn}: destination of tensor {name!r} must be a torch.Tensor, got {type(dst).__name__}")
    if tuple(dst.shape) != shape:
        raise ValueError(f"{fn}: tensor {name!r} has shape {list(shape)} {arrives} but the destination "
                         f"has shape {list(dst.shape)}")
    if dtype_name(dst.dtype) != dtype:
        raise ValueError(f"{fn}: tensor {name!r} is {dtype} {arrives} but the destination is {dtype_name(dst.dtype)}")
    if dst.is_meta or dst.layout != torch.strided or not dst.is_contiguous():
        raise ValueError(f"{fn}: the destination of tensor {name!r} must be a contiguous strided tensor with data")
    check_has_data(fn, f"the destination of tensor {name!r}", dst)
    if dst.device != device:
        raise ValueError(f"{fn}: the destination of tensor {name!r} is on {dst.device} but the bucket is on {device}")


def load_into(data: torch.Tensor, dsts: Sequence[torch.Tensor], entries: Sequence[BucketEntry], fn: str) -> None:
    """Copy each entry of `data` into its destination, on the current stream (checked)."""
    for e, d in zip(entries, dsts):
        check_destination(fn, e, d, data.device)
    _copy_spans(data, [d.detach() for d in dsts], entries, pack=False)


def bucket_tensors(data: torch.Tensor, bucket, partial: dict, timer, device, copy: bool = False):
    """Yield (name, tensor) for what bucket `bucket` (a BucketSpans) completes in `data`.

    A tensor whole in the bucket is a view of `data` (a clone with `copy=True`); one split
    across buckets is assembled in `partial` (name -> tensor, kept by the caller across
    buckets) and yielded with its last chunk. Assembly is timed as `timer`'s "unpack".
    """
    for e in bucket.entries:
        view = data[e.offset : e.offset + e.nbytes].view(e.torch_dtype)
        if e.num_chunks == 1:
            tensor = view.view(e.shape)
            yield e.name, (tensor.clone() if copy else tensor)
            continue
        with timer.phase("unpack"):
            whole = partial.get(e.name)
            if whole is None:
                whole = partial[e.name] = torch.empty(e.shape, dtype=e.torch_dtype, device=device)
            whole.view(-1)[e.start : e.start + e.numel].copy_(view)
        if e.chunk + 1 == e.num_chunks:
            yield e.name, partial.pop(e.name)


def destinations(fn: str, target) -> dict:
    """name -> tensor that a receiver's `load` writes into: a module's state or a mapping."""
    if isinstance(target, torch.nn.Module):
        return {n: t.detach() for n, t in target.state_dict(keep_vars=True).items()}
    if hasattr(target, "items"):
        return {n: t.detach() for n, t in target.items()}
    raise TypeError(f"{fn}: target must be a module or a mapping name -> tensor, got {type(target).__name__}")


def check_not_parked(fn: str, target) -> None:
    """A parked module's state dict is its host mirror, which its reload would overwrite: refuse it.
    Checked with the destinations, after the header, so the sender is not left waiting."""
    if isinstance(target, torch.nn.Module) and params_offloaded(target):
        raise ValueError(f"{fn}: the target {type(target).__name__} is parked by offload.offload_params; call "
                         "offload.reload_params(target) before loading weights into it")


def check_destinations(fn: str, plan, dsts: dict, device, strict: bool) -> None:
    """Every tensor of `plan` has a destination of its shape and dtype on `device`; with
    `strict`, every destination is sent. ValueError/TypeError name the tensor."""
    sent = set()
    for e in plan.entries:
        if e.name not in dsts:
            raise ValueError(f"{fn}: received tensor {e.name!r} but the target has no tensor of that name")
        check_destination(fn, e, dsts[e.name], device)
        sent.add(e.name)
    missing = [n for n in dsts if n not in sent]
    if strict and missing:
        raise ValueError(f"{fn}: the target's tensor {missing[0]!r} was not sent ({len(missing)} missing); "
                         "pass strict=False to allow it")

