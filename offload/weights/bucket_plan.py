"""The bucket plan's records: where each tensor (or chunk of one) lives in which bucket.

`BucketEntry` and `BucketPlan` are plain data (`to_dict` / `from_dict`) that another
process receives and unpacks by; `BucketPlan.validate` checks that a plan agrees with
itself before anything is unpacked by it. How tensors are placed is bucket_planner.py's
(Note [bucket plans]); how bytes move in and out, bucket_pack.py's.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..core.checks import check_int, is_int

# Casts the kernels implement; everything else is copied as raw bytes.
CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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
def dtype_itemsize(dtype: torch.dtype) -> int:
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


def entry_problem(e: BucketEntry) -> Optional[str]:
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
        if source != dtype and not (source in CASTABLE and dtype in CASTABLE):
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
        return (f"holds elements [{e.start}, {e.start + e.numel}) of a tensor of shape {list(e.shape)} "
                f"({total} elements)")
    itemsize = dtype_itemsize(dtype)
    if e.nbytes != e.numel * itemsize:
        return f"claims {e.nbytes} bytes for {e.numel} {e.dtype} elements ({e.numel * itemsize} bytes)"
    if e.offset % itemsize:
        return f"starts at byte {e.offset}, not a multiple of the {e.dtype} element size ({itemsize})"
    return None


def entry_label(e) -> str:
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

        Checks each entry against itself (see `entry_problem`), against the
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
            problem = entry_problem(e)
            if problem is not None:
                raise ValueError(f"{fn}: {entry_label(e)} {problem}")
            if e.bucket >= self.num_buckets:
                raise ValueError(f"{fn}: {entry_label(e)} is in bucket {e.bucket} but the plan has "
                                 f"{self.num_buckets} buckets")
            size = self.bucket_sizes[e.bucket]
            if e.offset + e.nbytes > size and e.nbytes:
                raise ValueError(f"{fn}: {entry_label(e)} claims bytes [{e.offset}, {e.offset + e.nbytes}) of "
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


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n

