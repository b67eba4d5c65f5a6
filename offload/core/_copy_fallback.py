"""The pure-PyTorch transfer path: one `copy_(non_blocking=True)` per tensor.

It is the reference the native core is tested against and what runs when the
core is not built. Same streams, events and errors as the native path; no packing.
Stream ownership: sources belong to the caller's stream and are `record_stream`ed
on the copy stream; host blocks are protected by torch's pinned allocator, which
records an event on every non-blocking copy; device outputs are allocated on the
caller's stream (their consumer) and recorded on the copy stream.
`copy_to_host(..., defer=True)` runs synchronously here (the copies are queued
before it returns, as without defer; there is no worker thread); `timing=True`
times the copies with a `Span` on the copy stream.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import _device
from .layout import compact, dense_view, is_dense
from .timing import Span


class PyTransfer:
    """The fallback's in-flight transfer (the native one is offload._C.Transfer)."""

    def __init__(self, device, outputs, event, nbytes, restore, timing=None, origins=None):
        self._device = device
        self._outputs = outputs
        self._event = event  # recorded on the copy stream after the last copy; None on CPU
        self._nbytes = nbytes
        self._restore = restore  # per output: original (sizes, strides) to restore, or None
        self._timing = timing  # timing=True: a Span of the copies; None when not timed
        self._origins = origins  # copy_to_host without out: where the sources were at the last fill

    def tensors(self) -> List[torch.Tensor]:
        return self._outputs

    def size(self) -> int:
        return len(self._outputs)

    def tensor(self, index: int) -> torch.Tensor:
        return self._outputs[index]

    def nbytes(self) -> int:
        return self._nbytes

    def device(self):
        return self._device

    def restore_specs(self):
        return self._restore

    def query(self) -> bool:
        return self._event is None or self._event.query()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def wait_stream(self, stream) -> None:
        """`stream` (None: the device's current stream) waits for the transfer; nothing to wait for on the CPU."""
        if self._event is None:
            return
        if stream is None:
            stream = _device.current_stream(self._device)
        stream.wait_event(self._event)

    def wait_stream_for(self, index: int, stream) -> None:
        self.wait_stream(stream)

    def copy_seconds(self) -> Optional[float]:
        """Seconds the copies took, or None while they run (never blocks)."""
        return self.timer("offload.CopyHandle.copy_seconds").seconds()

    def timer(self, fn: str = "offload.CopyHandle.copy_timer") -> "PyTimer":
        if self._timing is None:
            raise ValueError(f"{fn}: this copy was not timed; pass timing=True to offload.copy_to_host or "
                             "offload.copy_to_device")
        return PyTimer(self._timing)

    def release_sources(self, stream) -> None:
        # The sources are protected by record_stream here, so there is nothing to drop:
        # the allocator reuses them once the copy stream has passed them.
        self.wait_stream(stream)


class PyTimer:
    """A timed copy's timing, apart from its transfer (the core's CopyTimer)."""

    def __init__(self, span: Span):
        self._span = span

    def seconds(self) -> Optional[float]:
        ms = self._span.ms(wait=False)
        return None if ms is None else ms / 1e3

    def synchronize(self) -> None:
        if self._span.end_event is not None:
            self._span.end_event.synchronize()


def _describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} and dtype {str(t.dtype).replace('torch.', '')}"


def _check_source(fn: str, i: int, t: torch.Tensor, expected_type: str, first: Optional[torch.Tensor]) -> None:
    if t.is_meta or t.device.type == "meta":
        raise ValueError(f"{fn}: tensors[{i}] is a meta tensor, which has no data to copy")
    if t.layout != torch.strided:
        raise ValueError(f"{fn}: tensors[{i}] has layout {t.layout}; only strided (dense) tensors can be copied")
    if t.device.type != expected_type:
        where = "an accelerator" if expected_type != "cpu" else "the host"
        raise ValueError(
            f"{fn}: tensors[{i}] is on {t.device} but a {expected_type} tensor is expected (data on {where})"
        )
    if first is not None and t.device != first.device:
        raise ValueError(
            f"{fn}: tensors[{i}] is on {t.device} but tensors[0] is on {first.device}; all tensors must share one device"
        )


def _check_out(fn: str, i: int, src: torch.Tensor, dst: torch.Tensor, device_type: str, require_pinned: bool) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"{fn}: out[{i}] has {_describe(dst)} but tensors[{i}] has {_describe(src)}")
    if dst.device.type != device_type:
        raise ValueError(f"{fn}: out[{i}] is on {dst.device} but a {device_type} tensor is expected")
    if device_type == "cpu" and require_pinned and _device.pinned_memory_supported() and dst.numel() \
            and not dst.is_pinned():
        raise ValueError(
            f"{fn}: out[{i}] is not pinned, so the copy would block the host; pass pinned memory "
            "(offload.HostPool.empty, tensor.pin_memory()) or require_pinned=False"
        )


def _check_count(fn: str, tensors, out) -> None:
    if out is not None and len(out) != len(tensors):
        raise ValueError(f"{fn}: out has {len(out)} tensors but tensors has {len(tensors)}")


def _check_to_host(fn: str, tensors, out, out_handle, require_pinned, same_sources):
    """What the core checks before a copy to the host: device sources, `out` (or `out_handle`'s
    buffers) matching them, and with `same_sources` the sources where the buffers were last
    filled from. Returns (out, refilled, now): the host buffers given (or None), the list of the
    sources' addresses at the buffers' last fill (the core's SourceKeys::data: one list, shared
    by every transfer into the buffers of a transfer made without out; None where there is
    none), and the sources' addresses now where a transfer keeps them (else None)."""
    device_type = _device.compute_device_type()
    for i, t in enumerate(tensors):
        _check_source(fn, i, t, device_type, tensors[0])
    refilled = getattr(out_handle, "_origins", None)  # that list, when out_handle has one
    if same_sources and refilled is None:
        got = "none" if out_handle is None else "a handle made with an out list"
        raise ValueError(f"{fn}: same_sources=True needs out=<CopyHandle> from a copy_to_host without out "
                         f"(whose buffers the engine made), got {got}")
    # The sources' addresses now (before any conj/neg view is resolved), where they are kept.
    now = [t.data_ptr() for t in tensors] if refilled is not None or (out is None and out_handle is None) else None
    if out_handle is not None:
        out = out_handle.tensors()
    _check_count(fn, tensors, out)
    if out is not None:
        for i, (t, o) in enumerate(zip(tensors, out)):
            _check_out(fn, i, t, o, "cpu", require_pinned)
    if same_sources:
        for i, (was, at) in enumerate(zip(refilled, now)):
            if tensors[i].nbytes and was != at:
                raise ValueError(f"{fn}: same_sources=True, but tensors[{i}] is at {at:#x} while the buffers "
                                 f"of out (a CopyHandle) were last filled from {was:#x}")
    return out, refilled, now


@torch.no_grad()  # copies, not differentiable ops: outputs carry no graph, as the core's do
def copy_to_host(tensors, pool, stream, out, out_handle, require_pinned, chunk_bytes, timing=False,
                 same_sources=False) -> PyTransfer:
    out, refilled, now = _check_to_host("offload.copy_to_host", tensors, out, out_handle, require_pinned,
                                        same_sources)
    device = tensors[0].device if tensors else _device.current_device()
    on_accel = _device.is_accelerator(device)
    copy_stream = (stream or _device.copy_streams(device)[0]) if on_accel else None

    if on_accel and any(t.is_conj() or t.is_neg() for t in tensors):
        # copy_ applies a conj/neg flag to its target after the copy; for a pinned
        # target that happens on the host, before a non_blocking DMA has landed.
        # Resolve the flags on the device instead, on the caller's stream.
        tensors = [t.resolve_conj().resolve_neg() for t in tensors]
    # Sources that are neither dense nor broadcast are made contiguous on the
    # caller's stream, before the start event, so the copy stream sees them.
    bases, expanded, restore = [], [], []
    for t in tensors:
        base, was_expanded = compact(t)
        dense = is_dense(base)
        bases.append(base if dense or out is not None else base.contiguous())
        expanded.append(was_expanded)
        restore.append(None if dense or out is not None else (tuple(t.shape), tuple(t.stride())))

    start = None
    if on_accel:
        start = _device.new_event(device)
        start.record(_device.current_stream(device))
        copy_stream.wait_event(start)
    timed = Span(device, copy_stream) if timing else None  # after the wait for the caller: the copies only
    outputs, nbytes = [], 0
    with _device.stream_context(copy_stream):
        for i, (t, base) in enumerate(zip(tensors, bases)):
            if out is not None:
                host = out[i]
                _chunked_copy(host, t, chunk_bytes)
                outputs.append(host)
            else:
                host = dense_view(pool.acquire(base.numel() * base.element_size()), base)
                _chunked_copy(host, base, chunk_bytes)
                outputs.append(host.expand(t.shape) if expanded[i] else host)
            nbytes += base.numel() * base.element_size()
            _device.record_stream(base, copy_stream)
            _device.record_stream(t, copy_stream)
    end = _end_event(device, copy_stream, timed)
    if refilled is not None:
        refilled[:] = now  # copied: the buffers' new origin, for every handle sharing the list
    return PyTransfer(device, outputs, end, nbytes, restore, timed, refilled if refilled is not None else now)


def copy_spans_to_host(tensors, starts, sizes, block, offsets, pool, stream, chunk_bytes, timing) -> PyTransfer:
    """Byte spans of the tensors' storages into `block`: uint8 views of each span and of its
    place, copied as `copy_to_host(out=...)` copies; the transfer's one tensor is `block`."""
    spans = [torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), lo, (n,))
             for t, lo, n in zip(tensors, starts, sizes)]
    places = [block[at : at + n] for at, n in zip(offsets, sizes)]
    copied = copy_to_host(spans, pool, stream, places, None, True, chunk_bytes, timing)
    return PyTransfer(copied.device(), [block], copied._event, copied.nbytes(), [None], copied._timing)


def _chunked_copy(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> None:
    """dst.copy_(src) in pieces of about chunk_bytes along the first dimension."""
    nbytes = src.numel() * src.element_size()
    if src.dim() == 0 or nbytes <= chunk_bytes or src.shape[0] <= 1:
        dst.copy_(src, non_blocking=True)
        return
    rows_per_chunk = max(1, chunk_bytes // max(1, nbytes // src.shape[0]))
    for start in range(0, src.shape[0], rows_per_chunk):
        dst[start : start + rows_per_chunk].copy_(src[start : start + rows_per_chunk], non_blocking=True)


def _check_to_device(fn: str, sources, device, pool, out, require_pinned) -> None:
    """What the core checks before a copy to the device: host sources (pinned, or the pool's own
    blocks, where asked), and `out` matching them on the destination."""
    for i, h in enumerate(sources):
        _check_source(fn, i, h, "cpu", sources[0])
        # The pool's own blocks count as pinned, as in the core: where the accelerator has no
        # pinned host memory, they are the host memory copies are made for.
        if require_pinned and _device.is_accelerator(device) and h.numel() and not h.is_pinned() \
                and not pool.owns(h):
            raise ValueError(
                f"{fn}: tensors[{i}] is not pinned, so the copy would block the host; pass pinned memory "
                "(offload.copy_to_host results, offload.HostPool.empty, tensor.pin_memory()) or require_pinned=False"
            )
    _check_count(fn, sources, out)
    if out is not None:
        for i, (h, o) in enumerate(zip(sources, out)):
            _check_out(fn, i, h, o, device.type, require_pinned)
            if o.device != device:
                raise ValueError(f"{fn}: out[{i}] is on {o.device} but the destination is {device}")


@torch.no_grad()  # copies, not differentiable ops: outputs carry no graph, as the core's do
def copy_to_device(sources, handle, device, pool, stream, out, require_pinned, chunk_bytes, timing=False) -> PyTransfer:
    _check_to_device("offload.copy_to_device", sources, device, pool, out, require_pinned)
    restore = handle.restore_specs() if handle is not None else [None] * len(sources)
    on_accel = _device.is_accelerator(device)
    copy_stream = (stream or _device.copy_streams(device)[1]) if on_accel else None
    consumer = _device.current_stream(device) if on_accel else None

    # Outputs are allocated here, on the consumer's stream; the copy stream waits
    # for everything the consumer queued so far (earlier users of that memory) and
    # for the device-to-host copies that fill the sources.
    targets, nbytes = _device_targets(sources, handle, device, out, restore, on_accel)
    if on_accel:
        start = _device.new_event(device)
        start.record(consumer)
        copy_stream.wait_event(start)
        if handle is not None:
            handle.wait_stream(copy_stream)
    elif handle is not None:
        handle.synchronize()
    timed = Span(device, copy_stream) if timing else None  # after the waits: the copies only

    outputs = []
    with _device.stream_context(copy_stream):
        for i, (base, dst, was_expanded, final) in enumerate(targets):
            if out is not None:
                _chunked_copy(dst, sources[i], chunk_bytes)
                result = dst
            else:
                _chunked_copy(dst, base, chunk_bytes)
                result = dst
                if final is not None:
                    final.copy_(dst)  # restores the source's original strides
                    _device.record_stream(final, copy_stream)
                    result = final
                elif was_expanded:
                    result = dst.expand(sources[i].shape)
            _device.record_stream(dst, copy_stream)
            pool.record_stream(sources[i], copy_stream)
            outputs.append(result)
    end = _end_event(device, copy_stream, timed)
    return PyTransfer(device, outputs, end, nbytes, [None] * len(outputs), timed)


def _device_targets(sources, handle, device, out, restore, on_accel):
    """Per source of a copy to the device: (its dense base, its destination, whether it was
    expanded, the tensor its original strides are restored into or None), allocated on the
    current stream; and the bytes to copy."""
    compacted = [compact(h) for h in sources]  # (base, was_expanded) per source
    if handle is not None and on_accel and any(
        not is_dense(base) or (out is not None and (out[i].stride() != h.stride() or not is_dense(h)))
        for i, (h, (base, _)) in enumerate(zip(sources, compacted))
    ):
        # Here and in the copies the host reads these sources itself (a contiguous() copy, or
        # the layout change copy_ makes on the CPU): only once the device-to-host copy that
        # fills them has completed, which a device-side wait does not give.
        handle.synchronize()
    targets, nbytes = [], 0
    for i, (base, was_expanded) in enumerate(compacted):
        if not is_dense(base):
            base = base.contiguous()
        if out is not None:
            dst = out[i]
        else:
            dst = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=device)
        final = None
        if out is None and restore[i] is not None:
            sizes, strides = restore[i]
            final = torch.empty_strided(sizes, strides, dtype=base.dtype, device=device)
        targets.append((base, dst, was_expanded, final))
        nbytes += base.numel() * base.element_size()
    return targets, nbytes


def _end_event(device, copy_stream, timed: Optional[Span]):
    """The event a transfer's waits use, recorded on the copy stream after its last copy
    (the end of `timed` where the copies are timed); None on the host."""
    if timed is not None:
        return timed.stop(copy_stream).end_event
    if not _device.is_accelerator(device):
        return None
    end = _device.new_event(device)
    end.record(copy_stream)
    return end
