"""`offload.HostPool`: a cache of pinned host blocks shared by every transfer.

Two implementations behind one class:
- native (`offload._C.HostPool`): slabs of ordinary memory, first-touched by
  several threads and then registered with the driver (far faster than
  cudaHostAlloc), carved into size classes; a block goes back to its free list
  only after the events of every copy that used it have completed.
- fallback (pure PyTorch): blocks come from torch's own caching pinned allocator,
  which already delays reuse behind recorded copies; this class adds the limit and
  the statistics. On a CPU-only torch it hands out plain host memory.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _backend, _device
from .checks import check_int, check_stream, is_int, parse_bytes
from .timing import Span


def _limit_from_env() -> int:
    raw = os.environ.get("OFFLOAD_HOST_POOL_LIMIT")
    return 0 if raw in (None, "") else parse_bytes(raw, "OFFLOAD_HOST_POOL_LIMIT")


# Named in every error about a limit: that 0 is no limit is what a user setting one needs to know.
_LIMIT_RULE = "limit_bytes (bytes, 0 for no limit)"

# Pinned slabs are large because registering with the driver costs per call; a
# CPU-only torch (CI, the pure-logic build) has nothing to register, so it grows
# by less and keeps tests light.
DEFAULT_SLAB_BYTES = 256 << 20
DEFAULT_CPU_SLAB_BYTES = 16 << 20


class HostPool:
    """Pinned host memory, cached by size class and reused only when no copy still uses it.

    Args:
        limit_bytes: most host memory the pool may hold, in bytes (an int >= 0 or a string
            such as '8GiB'); 0 means no limit. None: ``OFFLOAD_HOST_POOL_LIMIT`` when set,
            else no limit.
        slab_bytes: how much the pool grows by at a time, in bytes (> 0; an int or a
            string such as '256MiB'); requests larger than this get a slab of their own.
            None: 256 MiB (16 MiB on a CPU-only torch).

    Blocks are handed out as uint8 host tensors (`acquire`) or typed tensors (`empty`);
    a block returns to the pool when the last tensor viewing it dies, and is reused
    only after every stream recorded on it (`record_stream`; offload's copies record
    themselves) has passed that point.
    """

    def __init__(self, limit_bytes=None, slab_bytes=None, *, touch_threads: int = 8):
        fn = "offload.HostPool"
        limit = _limit_from_env() if limit_bytes is None else parse_bytes(limit_bytes, f"{fn}: {_LIMIT_RULE}")
        if slab_bytes is None:
            slab = DEFAULT_SLAB_BYTES if _device.pinned_memory_supported() else DEFAULT_CPU_SLAB_BYTES
        else:
            # A negative int is refused by the same rule as 0 (parse_bytes would say ">= 0").
            slab = slab_bytes if is_int(slab_bytes) and slab_bytes < 0 else parse_bytes(slab_bytes, f"{fn}: slab_bytes")
        if slab <= 0:
            raise ValueError(f"{fn}: slab_bytes must be > 0 bytes (how much the pool grows by at a time), "
                             f"got {slab_bytes!r}")
        check_int("offload.HostPool", "touch_threads", touch_threads, 1)
        core = _backend.core()
        device_type = _device.compute_device_type()
        if core is not None:
            if device_type != "cpu":
                # The driver context must exist before host memory can be registered with it.
                torch.empty(0, device=_device.current_device())
            self._impl = core.HostPool(device_type, limit, slab, touch_threads)
            if _device.pinned_memory_supported() and not self._impl.pinned():
                # The core cannot pin host memory for this accelerator (no driver
                # registration built for it, or the runtime refuses it here): torch's
                # own pinned allocator keeps copies asynchronous there.
                self._impl = _FallbackPool(limit)
        else:
            self._impl = _FallbackPool(limit)
        self.native = not isinstance(self._impl, _FallbackPool)
        # Bytes begin_reserve announced that no grow_reserved / cancel_reserve has settled.
        self._announced = 0
        self._announce_lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of `nbytes` bytes (contents undefined)."""
        check_int("offload.HostPool.acquire", "nbytes", nbytes)
        return self._impl.allocate(nbytes)

    def empty(self, size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A contiguous host tensor of `size` (an int or a sequence of ints >= 0) and `dtype`
        backed by a pooled block."""
        fn = "offload.HostPool.empty"
        dims = [size] if is_int(size) else size
        if not isinstance(dims, (tuple, list, torch.Size)) or not all(is_int(n) for n in dims):
            raise TypeError(f"{fn}: size must be an int or a sequence of ints, got {size!r}")
        if any(n < 0 for n in dims):
            raise ValueError(f"{fn}: size must not have negative dimensions, got {list(dims)}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
        size = torch.Size(dims)
        nbytes = size.numel() * dtype.itemsize
        return self.acquire(nbytes)[:nbytes].view(dtype).view(size)

    def block_bytes(self, nbytes: int) -> int:
        """What an acquire of `nbytes` adds to this pool's in-use bytes: the block's size class."""
        check_int("offload.HostPool.block_bytes", "nbytes", nbytes)
        return int(self._impl.size_class(nbytes))

    def record_stream(self, tensor: torch.Tensor, stream) -> bool:
        """Keep `tensor`'s block from reuse until `stream` reaches this point. True if pooled here."""
        fn = "offload.HostPool.record_stream"
        _check_tensor(fn, tensor)
        if stream is None:
            return False
        check_stream(fn, stream)  # the fallback pool records nothing, so it would never look
        try:
            return self._impl.record_stream(tensor, stream)
        except TypeError:  # the core's argument conversion: not a stream of this accelerator
            raise TypeError(f"{fn}: stream must be a stream of the accelerator or None, "
                            f"got {type(stream).__name__}") from None

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory is a block this pool handed out."""
        _check_tensor("offload.HostPool.owns", tensor)
        if tensor.layout != torch.strided or tensor.is_meta:  # no storage of bytes: nothing pooled
            return False
        return self._impl.owns(tensor)

    def reserve(self, nbytes) -> None:
        """Grow ahead of the hot path so later acquires of up to `nbytes` hit the cache."""
        self._impl.reserve(parse_bytes(nbytes, "offload.HostPool.reserve: nbytes"))

    # Note [reservation grown on another thread]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # reserve() in two steps, for a caller that grows the pool on a worker thread
    # while its own thread acquires (the stager's first save): `begin_reserve`
    # announces the growth, and from then on an acquire that finds no room waits
    # for the next slab of it instead of growing the pool beside it; `grow_reserved`
    # (on any thread) grows it slab by slab, so acquires take each slab as it is
    # added. Each `begin_reserve` that returned bytes needs exactly one
    # `grow_reserved` or `cancel_reserve` of those bytes, or waiting acquires wait on.
    # A fallback pool announces nothing (torch's pinned cache keeps blocks by size,
    # so a reserve would not serve other sizes): `begin_reserve` returns 0 there.

    def begin_reserve(self, nbytes: int, largest_block: int = 0) -> int:
        """Announce a growth of about `nbytes` (see Note [reservation grown on another thread]);
        returns the bytes to pass to `grow_reserved` or `cancel_reserve` (0: nothing to grow).
        `largest_block`: the largest acquire expected, so no slab is smaller. Raises
        torch.OutOfMemoryError where the growth would pass `limit_bytes`."""
        check_int("offload.HostPool.begin_reserve", "nbytes", nbytes)
        check_int("offload.HostPool.begin_reserve", "largest_block", largest_block)
        if not self.native:
            return 0
        announced = int(self._impl.begin_reserve(nbytes, largest_block))
        with self._announce_lock:
            self._announced += announced
        return announced

    def grow_reserved(self, nbytes: int) -> None:
        """Grow the bytes `begin_reserve` announced (blocks the calling thread, not the interpreter)."""
        if self._settle("offload.HostPool.grow_reserved", nbytes):
            self._impl.grow_reserved(nbytes)

    def cancel_reserve(self, nbytes: int) -> None:
        """Give up the bytes `begin_reserve` announced: waiting acquires grow the pool themselves."""
        if self._settle("offload.HostPool.cancel_reserve", nbytes):
            self._impl.cancel_reserve(nbytes)

    def _settle(self, fn: str, nbytes: int) -> bool:
        """Take `nbytes` off the announced reservations (ValueError past them); whether any remain to act on.

        The core trusts its caller to settle only what `begin_reserve` returned:
        checked here, so a stray call is an error that names the call, not a
        growth or a cancellation of bytes nobody announced.
        """
        check_int(fn, "nbytes", nbytes)
        if not nbytes:
            return False
        with self._announce_lock:
            if nbytes > self._announced:
                raise ValueError(f"{fn}: nbytes ({nbytes}) is more than begin_reserve announced and no "
                                 f"grow_reserved or cancel_reserve has settled yet ({self._announced}); pass "
                                 "what begin_reserve returned")
            self._announced -= nbytes
        return True

    @property
    def native_pool(self):
        """The compiled core's pool this one wraps (what the core's copies take); None for the fallback."""
        return self._impl if self.native else None

    def trim(self) -> int:
        """Give every wholly free slab back to the system; returns the bytes released."""
        return self._impl.trim()

    def stats(self) -> dict:
        """reserved/in-use/peak bytes, requests, cache hits, slabs (and those cut afresh for other
        sizes instead of growing: recycled_slabs), allocation and registration seconds."""
        out = dict(self._impl.stats())
        out["native"] = self.native
        out["pinned"] = self.pinned
        return out

    @property
    def pinned(self) -> bool:
        return bool(self._impl.pinned())

    @property
    def limit_bytes(self) -> int:
        """Most host memory the pool may hold, in bytes; 0: no limit. Set it with an int >= 0 or
        a string such as '8GiB'."""
        return int(self._impl.limit())

    @limit_bytes.setter
    def limit_bytes(self, value) -> None:
        self._impl.set_limit(parse_bytes(value, f"offload.HostPool.{_LIMIT_RULE}"))


def _check_tensor(fn: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: tensor must be a torch.Tensor, got {type(tensor).__name__}")


class _FallbackPool:
    """The pure-PyTorch pool: torch's pinned allocator plus a limit and statistics."""

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._live: dict = {}  # data_ptr -> (StorageWeakRef, nbytes) of blocks handed out
        self._requests = 0
        self._swept_at = 0  # live entries after the last sweep: sweeping is amortised O(1)
        self._in_use = 0  # bytes of the entries in _live (some may have died since the sweep)
        self._peak = 0
        self._alloc_seconds = 0.0

    def _sweep(self, force: bool = True) -> int:
        """Forget blocks whose tensors died; bytes still handed out.

        Unforced sweeps run only once the table has doubled since the last one, so
        thousands of live blocks do not make every acquire walk them all.
        """
        if force or len(self._live) >= 2 * self._swept_at + 64:
            self._live = {ptr: (ref, n) for ptr, (ref, n) in self._live.items() if not ref.expired()}
            self._swept_at = len(self._live)
            self._in_use = sum(n for _, n in self._live.values())
        return self._in_use

    def allocate(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._requests += 1
            in_use = self._sweep(force=False)
            if self._limit and in_use + nbytes > self._limit:
                in_use = self._sweep()
            if self._limit and in_use + nbytes > self._limit:
                raise torch.OutOfMemoryError(
                    f"offload.HostPool: cannot acquire {nbytes} bytes: {in_use} of the {self._limit}-byte "
                    "limit are in use; raise it (0: no limit) with HostPool(limit_bytes=...), "
                    "pool.limit_bytes = ... or OFFLOAD_HOST_POOL_LIMIT"
                )
            span = Span()
            block = _device.empty_pinned(nbytes)
            self._alloc_seconds += span.stop().ms() / 1e3
            self._live[block.data_ptr()] = (StorageWeakRef(block.untyped_storage()), nbytes)
            self._in_use += nbytes
            self._peak = max(self._peak, in_use + nbytes)
            return block

    @staticmethod
    def size_class(nbytes: int) -> int:
        # Counted as asked (torch's pinned allocator rounds its own blocks up to a
        # power of two, out of this pool's sight).
        return nbytes

    def record_stream(self, tensor, stream) -> bool:
        # torch's pinned allocator records an event itself on every non_blocking copy.
        return False

    def owns(self, tensor) -> bool:
        with self._lock:
            entry = self._live.get(tensor.untyped_storage().data_ptr())
            return entry is not None and not entry[0].expired()

    def reserve(self, nbytes: int) -> None:
        if nbytes:
            _device.empty_pinned(nbytes)  # cached by torch's allocator once freed

    def trim(self) -> int:
        _device.host_empty_cache()
        return 0

    def stats(self) -> dict:
        with self._lock:
            in_use = self._sweep()
            return {
                "reserved_bytes": in_use,
                "in_use_bytes": in_use,
                "peak_in_use_bytes": self._peak,
                "requests": self._requests,
                "cache_hits": 0,
                "slabs": 0,
                "recycled_slabs": 0,
                "pending_blocks": 0,
                "allocation_seconds": self._alloc_seconds,
                "registration_seconds": 0.0,
                "limit_bytes": self._limit,
            }

    def pinned(self) -> bool:
        return _device.pinned_memory_supported()

    def limit(self) -> int:
        return self._limit

    def set_limit(self, value: int) -> None:
        self._limit = value


_default_pool: Optional[HostPool] = None
_default_pool_core = None  # whether the compiled core was in use when it was made
_default_lock = threading.Lock()


def check_pool(fn: str, pool) -> Optional[HostPool]:
    """`pool` as given to a public function: an offload.HostPool, or None for the default one."""
    if pool is not None and not isinstance(pool, HostPool):
        raise TypeError(f"{fn}: pool must be an offload.HostPool or None, got {type(pool).__name__}")
    return pool


def default_host_pool() -> HostPool:
    """The process-wide pool that offload's copies use unless given another."""
    global _default_pool, _default_pool_core
    with _default_lock:
        core = _backend.native_available()
        if _default_pool is None or _default_pool_core != core:  # tests switch the core off and on
            _default_pool, _default_pool_core = HostPool(), core
        return _default_pool
