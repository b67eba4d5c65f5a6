"""The first save's host memory, grown on a worker thread while that save plans and copies.

See Note [first save grows the pool beside it].
"""

from __future__ import annotations

import threading
from typing import List, Optional, Tuple

import torch

from ..core.pool import HostPool
from .object_scan import storage_bytes

# A first save of at least this many bytes grows the pool beside its planning;
# below it one ordinary slab suffices and a thread is not worth it.
GROWTH_MIN_BYTES = 64 << 20

# Note [first save grows the pool beside it]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A first save costs its planning (Python), the pool's growth (first touch of
# fresh pages and their registration with the driver: native code that releases
# the interpreter lock) and the copy. Started before planning, the growth runs
# beside it, in large slabs (the pool touches the next while the driver pins
# one). The reservation is announced to the pool before the thread starts
# (`HostPool.begin_reserve`), so the first save's copies, which start once it has
# planned, take each slab as it is added instead of growing the pool beside it:
# the copy of the first slabs overlaps the growth of the last. A growth that
# fails (the pool's limit, say) ends the reservation: the copies then grow the
# pool as they go and report the limit themselves, with its usual message.


class PoolGrowth:
    """A reservation of `pool` grown on a daemon thread (Note [first save grows the pool beside it])."""

    def __init__(self, pool: HostPool, nbytes: int, largest_block: int):
        self._thread = None
        announced = pool.begin_reserve(nbytes, largest_block)
        if not announced:
            return
        try:
            self._thread = threading.Thread(target=self._grow, args=(pool, announced),
                                            name="offload-stager-growth", daemon=True)
            self._thread.start()
        except BaseException:
            self._thread = None
            pool.cancel_reserve(announced)
            raise

    @staticmethod
    def _grow(pool: HostPool, nbytes: int) -> None:
        try:
            pool.grow_reserved(nbytes)
        except Exception:  # noqa: BLE001 - the copies report the failure (see the note)
            pass

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def first_save_bytes(tensors: List[torch.Tensor]) -> Tuple[int, int]:
    """About the host bytes a first save copies, and its largest tensor's bytes: each
    storage once, and never more of it than its tensors cover (a slice of a large
    buffer costs the slice)."""
    total, largest = storage_bytes(tensors)
    # Slack for the copy engine's packing (aligned offsets, block sizes in 2 MiB steps).
    return total + total // 256 + (2 << 20), largest


def start_growth(pool: HostPool, tensors: List[torch.Tensor], limit: int, group_bytes: int) -> Optional[PoolGrowth]:
    """Grow a native `pool` by about what a first save of `tensors` copies, beside its
    planning; None where nothing is worth growing. `limit`: the stager's limit_bytes
    (0: none); `group_bytes`: the largest block the copies pack small tensors into."""
    if not pool.native:  # torch's pinned cache keeps blocks by size: a reserve would not serve them
        return None
    try:
        nbytes, largest = first_save_bytes(tensors)
    except Exception:  # noqa: BLE001 - a tensor planning refuses (meta, say): planning says why
        return None
    if limit and nbytes > limit:
        return None  # planning raises the stager's own limit error
    # Cached free blocks (a closed stager's, say) serve the copies first: grow by the rest.
    nbytes -= pool.stats()["free_bytes"]
    if nbytes < GROWTH_MIN_BYTES:
        return None
    try:
        # Copies pack small tensors into blocks of up to group_bytes; larger ones get their own.
        return PoolGrowth(pool, nbytes, max(largest, group_bytes))
    except Exception:  # noqa: BLE001 - the pool's limit, say: the copies report it (see the note)
        return None
