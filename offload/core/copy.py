"""`offload.copy_to_host` / `offload.copy_to_device`: asynchronous batched transfers.

Both directions run on dedicated streams (`_device.copy_streams`), so a
device-to-host and a host-to-device transfer proceed at once and neither waits
behind compute. Each call returns a `CopyHandle` whose events the consumer stream
can wait on (no host block) or the host can wait on.

The native core packs many small tensors into one staging buffer with one kernel
and moves it with one DMA; the pure-PyTorch path below issues one `copy_` per
tensor. Both give the same results, bit for bit, and the same errors.

Layouts: a dense tensor (any permutation of strides, no gaps) keeps its strides
on the host and back. A broadcast tensor (stride 0) moves only its distinct
elements and is expanded again on arrival. Any other tensor (a slice with gaps)
moves as a contiguous copy; `copy_to_device(handle)` restores its original
strides.
"""

from __future__ import annotations

import atexit
from typing import List, Optional, Sequence

import torch

from . import _backend, _device
from .checks import check_bool, check_has_data, check_int, check_stream, is_int, resolve_copy_device
from .pool import HostPool, check_pool, default_host_pool

# The first deferred copy registers the core's copy worker to be waited for at exit
# (copy_to_host's defer): copies still being queued then are queued before the driver goes.
_worker_waited_at_exit: list = []

# Tensors below this many bytes are packed together into one transfer by the
# native core: from about 1 MiB a single DMA runs near the bus peak, below it the
# per-copy latency dominates.
DEFAULT_SMALL_BYTES = 1 << 20
# Large tensors move in chunks of this size so the two directions interleave and
# a consumer can start on the first tensors of a batch before the last arrive.
DEFAULT_CHUNK_BYTES = 64 << 20
# Packed small tensors are staged through device buffers of this size.
DEFAULT_STAGING_BYTES = 32 << 20
# Most bytes of small tensors packed into one DMA by copy_to_host: large enough to
# run the DMA near its peak, small enough to start the first DMA soon after the call.
DEFAULT_GROUP_BYTES = 8 << 20


class CopyHandle:
    """An in-flight transfer. `tensors` are valid to read once the handle is waited on."""

    def __init__(self, impl):
        self._impl = impl

    @property
    def tensors(self) -> List[torch.Tensor]:
        return list(self._impl.tensors())

    @property
    def nbytes(self) -> int:
        return int(self._impl.nbytes())

    def ready(self) -> bool:
        """True once every copy of this transfer has completed (never blocks)."""
        return bool(self._impl.query())

    def synchronize(self) -> None:
        """Block the host until the transfer is complete.

        `wait()` without the list it returns: that list is a Python object per
        tensor, work a caller that only waits need not pay.
        """
        self._impl.synchronize()

    def wait(self) -> List[torch.Tensor]:
        """Block the host until the transfer is complete; returns `tensors`."""
        self._impl.synchronize()
        return self.tensors

    def wait_stream(self, stream=None) -> None:
        """Make `stream` (default: the current one) wait for the transfer, on the device."""
        _check_options("offload.CopyHandle.wait_stream", stream)
        self._impl.wait_stream(stream)  # None: the implementation reads the current stream

    def release_sources(self, stream=None) -> None:
        """Make `stream` (default: the current one) wait for the transfer on the device, and
        let go of the device tensors it holds now rather than when the host sees the copies
        complete: a device-to-host transfer's sources, or the device tensors a
        host-to-device transfer wrote into `out=` (held so that dropping them early could not
        hand their memory on while the copy still writes it).

        Their memory returns to the caching allocator in `stream`'s order: only for
        tensors allocated on `stream` (the allocator gives a freed block to later
        allocations on the stream it was allocated on, which are queued after this
        wait). The host is not blocked. Host memory the transfer holds stays held
        until its copies complete.
        """
        _check_options("offload.CopyHandle.release_sources", stream)
        self._impl.release_sources(stream)

    def copy_seconds(self) -> Optional[float]:
        """Seconds the copies took on the copy stream, or None while they are not complete.

        Never blocks. Needs `copy_to_host(..., timing=True)`. Counts from when the copy
        stream has passed the caller's earlier work to the last copy; on the host (no
        streams), the time of the synchronous copies.
        """
        seconds = self._impl.copy_seconds()
        return None if seconds is None else float(seconds)

    def copy_timer(self):
        """The copy's timing apart from the handle: an object whose `seconds()` is
        `copy_seconds()` and whose `synchronize()` waits for the copies, holding none of the
        handle's tensors (read the seconds later without keeping the buffers alive).
        Needs `timing=True`."""
        return self._impl.timer()

    def wait_tensor(self, index: int, stream=None) -> torch.Tensor:
        """Make `stream` (default: the current one) wait only for the copy that carries
        tensors[index]; returns it. A negative `index` counts from the end, as a list's does."""
        fn = "offload.CopyHandle.wait_tensor"
        count = self._impl.size()
        if not is_int(index):
            raise TypeError(f"{fn}: index must be an int, got {type(index).__name__} {index!r}")
        if not -count <= index < count:
            raise _IndexOutOfRange(f"{fn}: index {index} is out of range for a handle of {count} tensors; "
                                   f"expected an int in [{-count}, {count})")
        _check_options(fn, stream)
        index %= count
        self._impl.wait_stream_for(index, stream)
        return self._impl.tensor(index)

    def __len__(self) -> int:
        return self._impl.size()

    def __repr__(self) -> str:
        state = "done" if self.ready() else "in flight"
        return f"CopyHandle({len(self)} tensors, {self.nbytes} bytes, {state})"


class _IndexOutOfRange(IndexError, ValueError):
    """An index past a handle's tensors: an IndexError, as a list raises, and a ValueError, as
    every other bad value given to offload is."""


def _as_list(fn: str, tensors, name: str = "tensors"):
    """Shape check for the native path (the core checks every element itself).

    Always a new list: the core converts it a batch at a time while it copies, so
    no other thread may hold (and change) it meanwhile.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got a single tensor; wrap it in a list")
    return list(tensors) if isinstance(tensors, (list, tuple)) else _check_list(fn, tensors, name)


def _check_list(fn: str, tensors, name: str = "tensors") -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got a single tensor; wrap it in a list")
    try:
        tensors = list(tensors)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be a list of tensors, got {type(tensors).__name__}") from None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        check_has_data(fn, f"{name}[{i}]", t)  # the core makes this check itself
    return tensors


def copy_to_host(
    tensors: Sequence[torch.Tensor],
    *,
    out=None,
    pool: Optional[HostPool] = None,
    stream=None,
    require_pinned: bool = True,
    small_bytes: int = DEFAULT_SMALL_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    defer: bool = False,
    timing: bool = False,
    same_sources: bool = False,
) -> CopyHandle:
    """Copy device tensors to pinned host memory, asynchronously.

    Args:
        tensors: tensors on one accelerator. Where torch has an accelerator, host
            (CPU) tensors are refused with a ValueError naming the first one
            (``tensors[i] is on cpu but a cuda tensor is expected``): they are
            already on the host, and a copy of them would not be the device's
            snapshot this call promises (use `HostPool.empty` and `copy_` for a
            pinned host-to-host copy). On a CPU-only torch the sources are CPU
            tensors and the copies land in the pool's host memory, which is not
            pinned there (nothing can pin without a driver: `pool.pinned` is False).
        out: host destinations, either a list of tensors matching `tensors` in shape
            and dtype, or a `CopyHandle` from an earlier `copy_to_host` of tensors of
            the same shapes and dtypes (its host buffers are reused, batched).
            The caller makes sure nothing still reads those buffers (wait for a
            `copy_to_device` of that handle first): the refill is not ordered
            after other streams' copies.
        pool: where host buffers come from (default: `offload.default_host_pool()`).
        stream: the copy stream (default: the device's dedicated device-to-host stream).
        require_pinned: refuse pageable `out` tensors, whose copies would block the host.
        group_bytes: most bytes of small tensors packed into one DMA (at most
            chunk_bytes). Larger groups mean fewer launches and events per call
            (worth it when the same layout is refilled often, as `out=<handle>`
            does) at the cost of three device staging buffers of this size
            while the copy runs. A handle passed as `out` keeps its own groups.
        defer: with `out=<CopyHandle>`, return once the sources are checked against
            the handle (a mismatch raises here) and the snapshot point is recorded on
            the current stream; the call queues the first group itself and a native
            worker thread, which never takes the interpreter lock, queues each later
            group as soon as the call has checked its sources. The handle's methods
            that read its events wait for that (briefly, on the host) and raise the
            worker's error if it failed. Runs synchronously where there is nothing to
            defer: one group of copies, host sources (on the host no stream order
            protects the snapshot, so a deferred copy would race with the caller's
            next writes), a handle made with an `out` list, sources that need a new
            tensor first (slices with gaps, conj/neg views), and the pure-PyTorch
            path. A later copy into the same buffers, deferred or not, lands after
            it. Until the worker has queued the copies, a device-wide synchronize
            does not cover them (use the handle's `wait()` / `wait_stream()`), and
            the worker's calls to the driver may break a CUDA graph another thread
            captures in global mode.
        timing: time the copies on the copy stream; read with `handle.copy_seconds()`.
        same_sources: with `out=<CopyHandle>` (made without `out`): every tensor must
            be at the address (`data_ptr()`) of the tensor it replaces when those
            buffers were last filled, else ValueError. For a caller whose own
            bookkeeping rests on those addresses (which tensors share memory), so it
            need not read thousands of them itself. As with any check a refill fails,
            copies of groups already queued (the first ones, which the core queues
            while it checks the rest) still land: the buffers may hold a mix.

    The copy starts after all work already queued on the current stream, so it sees
    the values as of this call. Sources are protected from reuse until it completes.
    """
    fn = "offload.copy_to_host"
    # A deferred copy converts the whole list before it lets the interpreter lock
    # go (see the core's copy_to_host): a caller's list cannot change under it, so
    # it is not copied. (`is True`: defer itself is checked below, with the other flags.)
    if not (defer is True and type(tensors) is list):
        tensors = _as_list(fn, tensors)
    _check_sizes(fn, small_bytes, chunk_bytes)
    check_int(fn, "group_bytes", group_bytes, 1)
    _check_options(fn, stream, require_pinned=require_pinned, defer=defer, timing=timing, same_sources=same_sources)
    pool = _pool_or_default(fn, pool)
    out_handle = out._impl if isinstance(out, CopyHandle) else None
    if defer and out_handle is None:
        got = "none" if out is None else type(out).__name__
        raise ValueError(f"{fn}: defer=True needs out=<CopyHandle> (an earlier copy_to_host of tensors of the "
                         f"same shapes and dtypes, whose host buffers it refills), got {got}")
    out_list = None if out is None or out_handle is not None else _as_list(fn, out, "out")
    core = _backend.core()
    if core is not None and pool.native:
        device = _source_device(fn, tensors)
        copy_stream = stream if stream is not None else _device.copy_streams(device)[0]
        if defer and not _worker_waited_at_exit:
            _worker_waited_at_exit.append(True)
            atexit.register(core.wait_copy_worker)
        return _call_native(fn, tensors, out_list, lambda: core.copy_to_host(
            tensors, pool.native_pool, copy_stream, out_list, out_handle, require_pinned, small_bytes, chunk_bytes,
            group_bytes, bool(defer), bool(timing), bool(same_sources)))
    from ._copy_fallback import copy_to_host as fallback

    tensors = _check_list(fn, tensors)
    out_list = None if out_list is None else _check_list(fn, out_list, "out")
    # The fallback runs synchronously even with defer=True (see its copy_to_host).
    return CopyHandle(fallback(tensors, pool, stream, out_list, out_handle, require_pinned, chunk_bytes, timing,
                               same_sources))


def copy_spans_to_host(tensors, starts, sizes, out, offsets, *, pool: Optional[HostPool] = None,
                       stream=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timing: bool = False) -> CopyHandle:
    """Copy byte spans of tensors' storages into one pooled host block, asynchronously.

    Span i is bytes [starts[i], starts[i] + sizes[i]) of ``tensors[i].untyped_storage()``;
    it lands at ``block[offsets[i]:offsets[i] + sizes[i]]``. `out` is the block: a uint8
    block of `pool` (``pool.acquire``), or its size in bytes (an int), for a block the
    call acquires from `pool` itself. The handle's one tensor is the block. The copy
    starts after the work queued on the current stream, as `copy_to_host`; the sources
    are held until it completes. `timing`: as `copy_to_host`'s (`handle.copy_seconds()`).

    The native core copies the spans in one call, with no tensor per span (the
    activation engine's group of a layer), enqueued as one batched copy on CUDA 12.8
    and later (one driver call for all the spans); the pure-PyTorch path makes uint8
    views of the spans and of their places in the block and copies those.
    """
    fn = "offload.copy_spans_to_host"
    tensors = _as_list(fn, tensors)
    if not (len(starts) == len(sizes) == len(offsets) == len(tensors)):
        raise ValueError(f"{fn}: tensors, starts, sizes and offsets need one entry per span, got "
                         f"{len(tensors)}, {len(starts)}, {len(sizes)} and {len(offsets)}")
    _check_sizes(fn, 0, chunk_bytes)
    _check_options(fn, stream, timing=timing)
    pool = _pool_or_default(fn, pool)
    given = isinstance(out, torch.Tensor)
    if not given and not (is_int(out) and out >= 0):
        raise TypeError(f"{fn}: out must be a HostPool block (a uint8 tensor) or its size in bytes (an int >= 0), "
                        f"got {out!r}")
    core = _backend.core()
    if core is not None and pool.native:
        device = _source_device(fn, tensors)
        copy_stream = stream if stream is not None else _device.copy_streams(device)[0]
        return _call_native(fn, tensors, None, lambda: core.copy_spans_to_host(
            tensors, list(starts), list(sizes), out if given else None, 0 if given else out, list(offsets),
            pool.native_pool, copy_stream, chunk_bytes, bool(timing)))
    from ._copy_fallback import copy_spans_to_host as fallback

    _check_list(fn, tensors)
    size = out.numel() if given else out
    for i, (t, lo, n, at) in enumerate(zip(tensors, starts, sizes, offsets)):  # the checks the core makes
        storage_bytes = t.untyped_storage().nbytes()
        if lo < 0 or n < 0 or lo + n > storage_bytes:
            raise ValueError(f"{fn}: span {i} is bytes [{lo}, {lo + n}) of a storage of {storage_bytes} bytes")
        if at < 0 or at + n > size:
            raise ValueError(f"{fn}: span {i} goes to bytes [{at}, {at + n}) of out, which has {size}")
    block = out if given else pool.acquire(out)
    return CopyHandle(fallback(tensors, starts, sizes, block, offsets, pool, stream, chunk_bytes, timing))


def copy_to_device(
    tensors,
    device=None,
    *,
    out: Optional[Sequence[torch.Tensor]] = None,
    pool: Optional[HostPool] = None,
    stream=None,
    require_pinned: bool = True,
    small_bytes: int = DEFAULT_SMALL_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timing: bool = False,
) -> CopyHandle:
    """Copy host tensors (or the result of `copy_to_host`) to the device, asynchronously.

    Args:
        tensors: a list of host tensors, or a `CopyHandle` from `copy_to_host`; a
            handle's copies are waited on by the device, and original strides of
            non-dense sources are restored.
        device: destination: the accelerator torch has here (its type, with or without
            an index, a torch.device, an index) or 'cpu' (default: the current
            accelerator, or cpu).
            Any other device (meta, or one this torch has no runtime for) is a ValueError.
        out: existing device tensors to copy into (shapes and dtypes must match).
        stream: the copy stream (default: the device's dedicated host-to-device stream).
        require_pinned: refuse pageable host sources, whose copies would block the host.
        timing: time the copies on the copy stream; read with `handle.copy_seconds()`.

    Outputs are allocated on the current stream, so the consumer that called this
    owns them; they are ready for it after `handle.wait_stream()`.
    """
    fn = "offload.copy_to_device"
    handle = tensors._impl if isinstance(tensors, CopyHandle) else None
    sources = None if handle is not None else _as_list(fn, tensors)
    out_list = None if out is None else _as_list(fn, out, "out")
    _check_sizes(fn, small_bytes, chunk_bytes)
    _check_options(fn, stream, require_pinned=require_pinned, timing=timing)
    device = resolve_copy_device(fn, device)
    pool = _pool_or_default(fn, pool)
    core = _backend.core()
    if core is not None and pool.native:
        # A handle's tensors stay in the core (None): no round trip through a Python list.
        copy_stream = stream if stream is not None else _device.copy_streams(device)[1]
        return _call_native(fn, sources or [], out_list, lambda: core.copy_to_device(
            sources, handle, device, pool.native_pool, copy_stream, out_list, require_pinned, small_bytes, chunk_bytes,
            bool(timing)))
    from ._copy_fallback import copy_to_device as fallback

    sources = _check_list(fn, handle.tensors() if handle is not None else sources)
    out_list = None if out_list is None else _check_list(fn, out_list, "out")
    return CopyHandle(fallback(sources, handle, device, pool, stream, out_list, require_pinned, chunk_bytes, timing))


def release_finished_copies() -> None:
    """Let go of the device tensors the native core still holds for device-to-host copies that
    have completed (the sources of a process's last copies are otherwise held until its next
    copy or query). The pure-PyTorch path holds none; a core built without this call lets go
    of them at its next copy."""
    release = getattr(_backend.loaded_core(), "release_finished_copies", None)
    if release is not None:
        release()


def _pool_or_default(fn: str, pool) -> HostPool:
    check_pool(fn, pool)
    return default_host_pool() if pool is None else pool


def _call_native(fn: str, tensors, out_list, call) -> CopyHandle:
    """Run the core; where its argument conversion fails, name the element that was not a tensor."""
    try:
        return CopyHandle(call())
    except TypeError:
        _check_list(fn, tensors)
        _check_list(fn, out_list or [], "out")
        raise


def _source_device(fn: str, tensors) -> torch.device:
    """The device of the first source, whose copy stream the native path picks before the core
    checks the elements (so a first element that is not a tensor is named here)."""
    if not len(tensors):
        return _device.current_device()
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"{fn}: tensors[0] must be a torch.Tensor, got {type(tensors[0]).__name__}")
    return tensors[0].device


def _check_sizes(fn: str, small_bytes: int, chunk_bytes: int) -> None:
    check_int(fn, "small_bytes", small_bytes, 0)
    check_int(fn, "chunk_bytes", chunk_bytes, 1)


def _check_options(fn: str, stream, **flags) -> None:
    """`stream` is None or a stream; each flag a bool (the core would refuse them unnamed)."""
    check_stream(fn, stream)
    for name, value in flags.items():
        check_bool(fn, name, value)

