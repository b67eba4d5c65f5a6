"""`offload.pack_buckets` / `offload.unpack_bucket`: tensors into buckets and back out.

Packing reads every source once, casts, and writes the bucket; unpacking gives typed
views into it or copies into existing tensors (Note [bucket plans] in bucket_planner.py).
Both directions are one `copy_spans` per bucket: the native core's multi-tensor copy,
or torch's copies where the core does not run. The receivers' checks of their
destinations live here too: they are what unpacking into a tensor requires of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..core import _backend, _device
from ..core.checks import check_has_data
from .bucket_plan import BucketEntry, BucketPlan, dtype_name, entry_label, entry_problem
from .bucket_planner import DEFAULT_ALIGNMENT, DtypePolicy, Planner, check_bucket_options, named_items
from .param_offload import params_offloaded

# Devices csrc/core/buckets.cpp copies on: the CPU loop, and the CUDA kernels when the
# core was built for CUDA (`_backend.built_for`). Anything else (Ascend, or CUDA
# with a CPU-only core) packs with torch's copies.
_NATIVE_BUCKET_DEVICES = ("cpu", "cuda")


@dataclass
class PackedBucket:
    """One packed bucket: `data` (uint8, on the sources' device) and the entries it holds."""

    index: int
    data: torch.Tensor
    entries: List[BucketEntry]


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
        problem = entry_problem(e)
        if problem is not None:
            raise ValueError(f"{fn}: metadata of {entry_label(e)} {problem}")
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
    policy = check_bucket_options(fn, bucket_bytes, dtype, keep_dtype, alignment)
    if isinstance(tensors, (dict, list, tuple)) or hasattr(tensors, "items"):
        # A container already in memory is checked whole; an iterator stays lazy
        # (a sharded model gathered one tensor at a time), and is checked as it is consumed.
        names = set()
        for name, t in named_items(tensors, fn):
            if not isinstance(name, str):
                raise TypeError(f"{fn}: tensor names must be str, got {type(name).__name__} ({name!r})")
            if name in names:
                raise ValueError(f"{fn}: tensor name {name!r} appears twice; names must be unique")
            names.add(name)
            if type(t).__name__ != "DTensor":  # gathered only when packed
                _materialize(name, t, fn)
    elif isinstance(tensors, (torch.Tensor, str, bytes)) or not hasattr(tensors, "__iter__"):
        next(named_items(tensors, fn))  # raises, naming what tensors is
    return _pack_buckets(tensors, bucket_bytes, policy, alignment, fn)


def _pack_buckets(tensors, bucket_bytes, policy: DtypePolicy, alignment: int, fn: str) -> Iterator[PackedBucket]:
    planner: Optional[Planner] = None
    pending: Dict[int, List[Tuple[torch.Tensor, BucketEntry]]] = {}
    device = None
    for name, t in named_items(tensors, fn):
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
    across buckets is assembled in `partial` (kept by the caller across buckets: name ->
    [tensor, chunks still to come]) and yielded once all its chunks have arrived, in
    whatever order (a colocated sync from many senders interleaves theirs). Assembly is
    timed as `timer`'s "unpack".
    """
    for e in bucket.entries:
        view = data[e.offset : e.offset + e.nbytes].view(e.torch_dtype)
        if e.num_chunks == 1:
            tensor = view.view(e.shape)
            yield e.name, (tensor.clone() if copy else tensor)
            continue
        with timer.phase("unpack"):
            held = partial.get(e.name)
            if held is None:
                held = partial[e.name] = [torch.empty(e.shape, dtype=e.torch_dtype, device=device), e.num_chunks]
            held[0].view(-1)[e.start : e.start + e.numel].copy_(view)
            held[1] -= 1
        if held[1] == 0:
            yield e.name, partial.pop(e.name)[0]


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


def check_destinations(fn: str, plan, dsts: dict, device, strict: bool, kept=None) -> None:
    """Every tensor of `plan` has a destination of its shape and dtype on `device`; with
    `strict`, every destination is sent. `kept(name, full_shape)`: the shape a receiver keeps
    of a tensor (its slice's), where that is not the whole. ValueError/TypeError name the tensor."""
    sent = set()
    for e in plan.entries:
        if e.name not in dsts:
            raise ValueError(f"{fn}: received tensor {e.name!r} but the target has no tensor of that name")
        shape = tuple(e.shape) if kept is None else kept(e.name, tuple(e.shape))
        if shape == tuple(e.shape):
            check_destination(fn, e, dsts[e.name], device)
        else:
            check_received_into(fn, e.name, dsts[e.name], shape, e.dtype, device, "(its slice)")
        sent.add(e.name)
    missing = [n for n in dsts if n not in sent]
    if strict and missing:
        raise ValueError(f"{fn}: the target's tensor {missing[0]!r} was not sent ({len(missing)} missing); "
                         "pass strict=False to allow it")

