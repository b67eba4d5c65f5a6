"""offload.HostPool: size classes, reuse, limits, reserve/trim, statistics, threads,
and that a block is never reused while a copy still reads it."""

import random
import threading

import pytest
import torch

import offload
from offload.core import _backend, _device

MiB = 1 << 20


def small_pool(**kwargs):
    kwargs.setdefault("slab_bytes", 4 * MiB)
    return offload.HostPool(**kwargs)


@pytest.mark.native
@pytest.mark.parametrize(
    "nbytes, expected",
    [(0, 512), (1, 512), (512, 512), (513, 1024), (MiB, MiB), (MiB + 1, 2 * MiB),
     (5 * MiB + 1, 6 * MiB), (1280 * MiB, 1280 * MiB)],
)
def test_pool_size_class(nbytes, expected):
    # 1.25 GiB costs 1.25 GiB, not the 2 GiB a power-of-two cache would take.
    assert _backend.core().HostPool.size_class(nbytes) == expected


@pytest.mark.native
def test_pool_reuses_a_released_block():
    pool = small_pool()
    first = pool.acquire(3000)
    ptr = first.data_ptr()
    del first
    second = pool.acquire(4000)  # same 4 KiB class
    assert second.data_ptr() == ptr
    stats = pool.stats()
    assert stats["requests"] == 2 and stats["cache_hits"] == 1 and stats["slabs"] == 1


@pytest.mark.native
def test_pool_views_keep_the_block_alive():
    pool = small_pool()
    block = pool.acquire(4096)
    view = block[100:200]
    ptr = block.data_ptr()
    del block
    assert pool.stats()["in_use_bytes"] == 4096
    other = pool.acquire(4096)
    assert other.data_ptr() != ptr  # still referenced through the view
    del view
    assert pool.stats()["in_use_bytes"] == 4096


@pytest.mark.native
def test_pool_large_requests_get_their_own_slab_without_power_of_two_rounding():
    pool = small_pool()
    t = pool.acquire(5 * MiB + 1)
    stats = pool.stats()
    assert stats["in_use_bytes"] == 6 * MiB
    assert stats["reserved_bytes"] == 6 * MiB
    del t


def test_pool_acquire_gives_writable_memory_of_the_right_size(backend):
    pool = small_pool()
    t = pool.acquire(12345)
    assert t.dtype == torch.uint8 and t.shape == (12345,) and t.device.type == "cpu"
    t.fill_(7)
    assert int(t.sum()) == 7 * 12345
    typed = pool.empty((3, 5), torch.bfloat16)
    assert typed.shape == (3, 5) and typed.dtype == torch.bfloat16 and typed.is_contiguous()
    assert pool.pinned == _device.pinned_memory_supported()


def test_pool_limit_raises_an_actionable_error(backend):
    pool = small_pool(limit_bytes=4 * MiB)
    held = pool.acquire(3 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match=r"(?s)limit.*OFFLOAD_HOST_POOL_LIMIT"):
        pool.acquire(3 * MiB)
    del held


def test_pool_limit_from_environment(backend, monkeypatch):
    monkeypatch.setenv("OFFLOAD_HOST_POOL_LIMIT", "8MiB")
    pool = small_pool()
    assert pool.limit_bytes == 8 * MiB
    pool.limit_bytes = "16MiB"
    assert pool.limit_bytes == 16 * MiB
    monkeypatch.setenv("OFFLOAD_HOST_POOL_LIMIT", "lots")
    with pytest.raises(ValueError, match="OFFLOAD_HOST_POOL_LIMIT"):
        small_pool()


@pytest.mark.parametrize("nbytes", [1, 513, 400_000, MiB + 1])
def test_pool_block_bytes_is_what_an_acquire_holds(backend, nbytes):
    pool = small_pool()
    block = pool.acquire(nbytes)
    assert pool.block_bytes(nbytes) == pool.stats()["in_use_bytes"] >= nbytes
    del block
    with pytest.raises(ValueError, match="HostPool.block_bytes: nbytes must be an int >= 0, got -1"):
        pool.block_bytes(-1)
    with pytest.raises(TypeError, match="HostPool.block_bytes: nbytes must be an int >= 0, got float"):
        pool.block_bytes(1.5)


def test_pool_rejects_bad_arguments(backend):
    with pytest.raises(ValueError, match="slab_bytes"):
        offload.HostPool(slab_bytes=0)
    with pytest.raises(ValueError, match="limit_bytes"):
        offload.HostPool(limit_bytes=-1)
    pool = small_pool()
    with pytest.raises(ValueError, match="nbytes must be an int >= 0, got -5"):
        pool.acquire(-5)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        pool.acquire(1.5)
    with pytest.raises(TypeError, match="dtype"):
        pool.empty(4, "float32")


@pytest.mark.native
def test_pool_reservation_api_checks_its_arguments_and_announces_nothing_on_the_fallback(backend):
    pool = small_pool()
    with pytest.raises(ValueError, match="HostPool.begin_reserve: nbytes must be an int >= 0, got -1"):
        pool.begin_reserve(-1)
    with pytest.raises(TypeError, match="HostPool.begin_reserve: largest_block must be an int >= 0, got float"):
        pool.begin_reserve(MiB, 1.5)
    with pytest.raises(TypeError, match="HostPool.grow_reserved: nbytes must be an int >= 0, got str"):
        pool.grow_reserved("1")
    with pytest.raises(ValueError, match="HostPool.cancel_reserve: nbytes must be an int >= 0, got -1"):
        pool.cancel_reserve(-1)
    with pytest.raises(ValueError, match="HostPool: touch_threads must be an int >= 1, got 0"):
        offload.HostPool(touch_threads=0)
    assert (pool.native_pool is None) == (not pool.native)
    announced = pool.begin_reserve(6 * MiB)
    if not pool.native:
        assert announced == 0  # torch's pinned cache keeps blocks by size: a reserve would not serve them
    pool.grow_reserved(announced)
    assert pool.stats()["reserved_bytes"] == (announced if pool.native else 0)
    block = pool.acquire(MiB)  # served by the grown slab, or by torch's allocator
    assert pool.stats()["reserved_bytes"] == (announced if pool.native else MiB)
    del block


def test_pool_limit_reclaims_free_slabs_before_failing():
    pool = small_pool(limit_bytes=8 * MiB)
    a = pool.acquire(6 * MiB)  # a slab of its own
    del a
    b = pool.acquire(7 * MiB)  # needs 8 MiB: only fits once the free 6 MiB slab is returned
    assert pool.stats()["reserved_bytes"] <= 8 * MiB
    del b


@pytest.mark.native
def test_pool_reserve_then_acquire_hits_the_reserved_slabs():
    pool = small_pool()  # 4 MiB slabs: a reservation grows in slabs of 8 MiB
    pool.reserve(16 * MiB)
    stats = pool.stats()
    assert stats["slabs"] == 2 and stats["reserved_bytes"] == 16 * MiB
    blocks = [pool.acquire(MiB) for _ in range(16)]
    assert pool.stats()["slabs"] == 2
    del blocks


def _acquire_on_thread(pool, count, nbytes):
    got = []
    thread = threading.Thread(target=lambda: got.extend(pool.acquire(nbytes) for _ in range(count)), daemon=True)
    thread.start()
    return thread, got


@pytest.mark.native
def test_pool_acquires_wait_for_a_reservation_another_thread_grows():
    pool = small_pool()  # reservation slabs of 8 MiB; a last one of at most half of that joins the one before
    announced = pool.begin_reserve(18 * MiB)
    assert announced == 18 * MiB
    waiter, got = _acquire_on_thread(pool, 12, MiB)
    waiter.join(0.3)
    assert waiter.is_alive(), "an acquire with a reservation announced must wait for its slabs, not grow"
    assert pool.stats()["slabs"] == 0
    pool.grow_reserved(announced)
    waiter.join(10)
    assert not waiter.is_alive() and len(got) == 12
    stats = pool.stats()
    assert (stats["slabs"], stats["reserved_bytes"]) == (2, 18 * MiB)  # 8 + 10 MiB: nothing grown beside them
    for i, t in enumerate(got):
        t.fill_(i)
    assert [int(t[0]) for t in got] == list(range(12))  # twelve distinct blocks


@pytest.mark.native
def test_pool_cancelled_reservation_lets_waiting_acquires_grow():
    pool = small_pool()
    announced = pool.begin_reserve(16 * MiB)
    big, got_big = _acquire_on_thread(pool, 1, 10 * MiB)  # larger than the reservation's slabs: never waits
    big.join(10)
    assert not big.is_alive() and got_big[0].numel() == 10 * MiB
    waiter, got = _acquire_on_thread(pool, 1, MiB)
    waiter.join(0.3)
    assert waiter.is_alive()
    pool.cancel_reserve(announced)  # the grower failed, say: the acquire grows a slab of its own
    waiter.join(10)
    assert not waiter.is_alive() and got[0].numel() == MiB
    assert pool.stats()["reserved_bytes"] == 10 * MiB + 4 * MiB


@pytest.mark.native
def test_pool_hands_out_older_slab_tails_before_growing():
    pool = offload.HostPool(limit_bytes=32 * MiB, slab_bytes=16 * MiB)
    held = [pool.acquire(10 * MiB), pool.acquire(10 * MiB), pool.acquire(4 * MiB)]  # two slabs, 6 + 2 MiB left
    held.append(pool.acquire(5 * MiB))  # a 6 MiB block: the first slab's tail, within the limit
    stats = pool.stats()
    assert stats["slabs"] == 2 and stats["reserved_bytes"] == 32 * MiB
    grown = offload.HostPool(slab_bytes=16 * MiB)
    first = grown.acquire(MiB)
    grown.reserve(20 * MiB)  # a slab of its own; the first slab keeps 15 MiB uncarved
    rest = [grown.acquire(MiB) for _ in range(35)]  # 20 from the reserved slab, 15 from the first one's tail
    assert grown.stats()["slabs"] == 2 and grown.stats()["reserved_bytes"] == 36 * MiB
    del held, first, rest


@pytest.mark.native
def test_pool_cuts_a_wholly_free_slab_afresh_before_growing():
    pool = small_pool()  # 4 MiB slabs
    held = [pool.acquire(2 * MiB), pool.acquire(2 * MiB)]
    del held  # cached as two 2 MiB blocks: no use to 256 KiB requests
    small = [pool.acquire(256 << 10) for _ in range(16)]  # the slab, cut into 256 KiB blocks
    stats = pool.stats()
    assert (stats["slabs"], stats["reserved_bytes"], stats["recycled_slabs"]) == (1, 4 * MiB, 1)
    for i, t in enumerate(small):
        t.fill_(i)
    assert [int(t[-1]) for t in small] == list(range(16))
    more = pool.acquire(MiB)  # the slab is in use: the pool grows
    assert pool.stats()["slabs"] == 2
    del small, more


@pytest.mark.native
def test_pool_trim_returns_only_wholly_free_slabs():
    pool = small_pool()
    keep = pool.acquire(MiB)
    assert pool.trim() == 0  # the slab still has a live block
    del keep
    assert pool.trim() == 4 * MiB
    stats = pool.stats()
    assert stats["reserved_bytes"] == 0 and stats["slabs"] == 0 and stats["free_bytes"] == 0
    again = pool.acquire(MiB)  # the pool grows again after a trim
    assert again.numel() == MiB


def test_pool_statistics(backend):
    pool = small_pool()
    a = pool.acquire(1000)
    b = pool.acquire(MiB)
    stats = pool.stats()
    for key in ("reserved_bytes", "in_use_bytes", "peak_in_use_bytes", "requests", "cache_hits", "slabs",
                "recycled_slabs", "allocation_seconds", "registration_seconds", "limit_bytes"):
        assert key in stats, key
    assert stats["requests"] == 2
    assert stats["in_use_bytes"] >= 1000 + MiB
    peak = stats["peak_in_use_bytes"]
    del a, b
    stats = pool.stats()
    assert stats["in_use_bytes"] == 0 and stats["peak_in_use_bytes"] == peak


def test_pool_threads_acquire_and_release_without_overlap(backend):
    pool = small_pool()
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        held = []
        try:
            for step in range(150):
                t = pool.acquire(rng.choice([100, 4000, 70_000, 300_000]))
                t.fill_(seed)
                held.append(t)
                if len(held) > 4 or rng.random() < 0.3:
                    victim = held.pop(rng.randrange(len(held)))
                    # Nobody else wrote into this block while we held it.
                    if not bool((victim == seed).all()):
                        errors.append(f"thread {seed}: block overwritten at step {step}")
            held.clear()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.stats()["in_use_bytes"] == 0
    assert pool.stats()["requests"] == 8 * 150


@pytest.mark.cuda
def test_pool_block_not_reused_while_a_copy_still_reads_it(backend, device):
    """Drop a host block while its host-to-device copy is held back, take a new
    block of the same size and overwrite it: the device must still get the old data."""
    pool = small_pool()
    n = 8 * MiB
    host = pool.acquire(n)
    host.fill_(11)
    _device.spin(device, 200_000_000)  # ~0.1 s: the copy stream waits for it
    handle = offload.copy_to_device([host], device, pool=pool)
    del host
    fresh = pool.acquire(n)
    fresh.fill_(99)  # would land in the in-flight block if it were reused
    (result,) = handle.wait()
    assert bool((result == 11).all())
    del fresh


@pytest.mark.cuda
def test_pool_pinned_growth_is_registered(device):
    pool = offload.HostPool(slab_bytes=64 * MiB)
    t = pool.acquire(MiB)
    assert t.is_pinned()
    if pool.native:
        assert pool.stats()["registration_seconds"] > 0


def test_pool_errors_name_offload_hostpool(backend):
    """Every HostPool error says which call refused what, as offload.HostPool..."""
    pool = small_pool()
    cases = [
        (lambda: offload.HostPool(slab_bytes=0), ValueError, "offload.HostPool: slab_bytes must be > 0"),
        (lambda: offload.HostPool(limit_bytes="lots"), ValueError, "offload.HostPool: limit_bytes"),
        (lambda: offload.HostPool(touch_threads=0), ValueError, "offload.HostPool: touch_threads"),
        (lambda: pool.acquire(-1), ValueError, "offload.HostPool.acquire: nbytes"),
        (lambda: pool.block_bytes(1.5), TypeError, "offload.HostPool.block_bytes: nbytes"),
        (lambda: pool.empty(-2), ValueError, r"offload.HostPool.empty: size must not have negative dimensions, got \[-2\]"),
        (lambda: pool.empty((2, "a")), TypeError, "offload.HostPool.empty: size must be an int or a sequence of ints"),
        (lambda: pool.empty(2, "float32"), TypeError, "offload.HostPool.empty: dtype must be a torch.dtype"),
        (lambda: pool.owns(3), TypeError, "offload.HostPool.owns: tensor must be a torch.Tensor, got int"),
        (lambda: pool.record_stream("x", None), TypeError, "offload.HostPool.record_stream: tensor must be a torch.Tensor"),
        (lambda: pool.reserve(-1), ValueError, "offload.HostPool.reserve: nbytes"),
        (lambda: pool.begin_reserve(-1), ValueError, "offload.HostPool.begin_reserve: nbytes"),
        (lambda: setattr(pool, "limit_bytes", "x"), ValueError, "offload.HostPool.limit_bytes"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    if pool.native:
        with pytest.raises(TypeError, match="offload.HostPool.record_stream: stream must be a stream"):
            pool.record_stream(pool.acquire(16), 5)
    with pytest.raises(torch.OutOfMemoryError, match="offload.HostPool"):
        small_pool(limit_bytes=MiB).acquire(2 * MiB)


def test_pool_settles_only_announced_reservations(backend):
    """grow_reserved / cancel_reserve of bytes begin_reserve did not announce is a ValueError,
    not a growth or a cancellation the core would make of nothing."""
    pool = small_pool()
    with pytest.raises(ValueError, match=r"offload.HostPool.grow_reserved: nbytes \(4096\) is more than begin_reserve"):
        pool.grow_reserved(4096)
    with pytest.raises(ValueError, match=r"offload.HostPool.cancel_reserve: nbytes \(1\) is more than begin_reserve"):
        pool.cancel_reserve(1)
    pool.grow_reserved(0)  # nothing to settle: fine
    announced = pool.begin_reserve(6 * MiB)
    pool.cancel_reserve(announced)
    if announced:
        with pytest.raises(ValueError, match="is more than begin_reserve announced"):
            pool.cancel_reserve(announced)  # settled once already
