"""Threads sharing one HostPool and the copy engine, and staging beside activation offload.

No deadlock (every thread is joined with a timeout), no cross-talk (each thread checks its
own tensors bit for bit), no lost block (the pool's in-use bytes return to where they were).
"""

import copy
import gc
import random
import threading

import pytest
import torch

import offload
from _activation_helpers import small_model, train_step
from offload.core import _device

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

THREADS = 8
JOIN_TIMEOUT_S = 120
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8)


def _tensors(rng: random.Random, device, tag: int):
    """A few tensors of varied dtypes and sizes (empty, odd-sized, non-contiguous), marked
    with `tag` so another thread's bytes could not pass for these."""
    out = []
    for _ in range(rng.randint(1, 5)):
        dtype = rng.choice(DTYPES)
        n = rng.choice([0, 1, 7, 513, 4099, 70001])
        gen = torch.Generator().manual_seed(rng.getrandbits(31))
        if dtype.is_floating_point:
            t = torch.randn(n, generator=gen).to(dtype)
        else:
            t = torch.randint(0, 100, (n,), generator=gen, dtype=torch.int64).to(dtype)
        if n > 1 and rng.random() < 0.3:
            t = torch.stack([t, t]).t()[:, 0]  # a strided view
        if t.numel():
            t.view(-1)[0] = tag if not dtype.is_floating_point else float(tag)
        out.append(t.to(device))
    return out


def _worker(tid, pool, device, rounds, errors, done):
    rng = random.Random(tid)
    try:
        for r in range(rounds):
            src = _tensors(rng, device, tid + 1)
            host = copy_handle = offload.copy_to_host(src, pool=pool)
            got = host.wait()
            for a, b in zip(src, got):
                assert torch.equal(a.cpu(), b), f"thread {tid} round {r}: copy_to_host"
            # Refill the same host buffers from new values of the same shapes.
            refill = [t.clone().fill_(tid + 1) if t.numel() else t.clone() for t in src]
            again = offload.copy_to_host(refill, out=copy_handle, pool=pool).wait()
            for a, b in zip(refill, again):
                assert torch.equal(a.cpu(), b), f"thread {tid} round {r}: refill"
            # Back to the device, into destinations of ours.
            dst = [torch.empty_like(t) for t in refill]
            back = offload.copy_to_device(again, device, out=dst, pool=pool).wait()
            for a, b in zip(refill, back):
                assert torch.equal(a, b), f"thread {tid} round {r}: copy_to_device"
            del host, copy_handle, got, again, back
            # An acquire/release storm: blocks of mixed sizes, each written with this
            # thread's byte and checked before it goes back.
            blocks = []
            for _ in range(rng.randint(4, 16)):
                block = pool.acquire(rng.choice([1, 512, 4096, 65537, 1 << 20]))
                block.fill_(tid + 1)
                blocks.append(block)
                if rng.random() < 0.5:
                    victim = blocks.pop(rng.randrange(len(blocks)))
                    assert bool((victim == tid + 1).all()), f"thread {tid}: a pooled block was overwritten"
            for block in blocks:
                assert bool((block == tid + 1).all()), f"thread {tid}: a pooled block was overwritten"
    except BaseException as exc:  # noqa: BLE001 (reported to the main thread)
        errors.append(f"thread {tid}: {type(exc).__name__}: {exc}")
    finally:
        done.append(tid)


def _run_threads(target, args_of):
    threads = [threading.Thread(target=target, args=args_of(i), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_TIMEOUT_S)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"threads {hung} did not finish within {JOIN_TIMEOUT_S} s (deadlock?)"


def test_concurrency_threads_share_pool_and_copy_engine(backend):
    device = _device.current_device()
    pool = offload.HostPool(slab_bytes=4 << 20)
    baseline = pool.stats()["in_use_bytes"]
    errors, done = [], []
    _run_threads(_worker, lambda i: (i, pool, device, 12, errors, done))
    assert not errors, "\n".join(errors)
    assert sorted(done) == list(range(THREADS))
    gc.collect()
    stats = pool.stats()
    assert stats["in_use_bytes"] == baseline, stats  # no block lost or leaked
    assert stats["requests"] > THREADS * 12



def test_concurrency_save_staged_during_training_step(backend, deterministic):
    """Staging and activation offload in one process, one pool: a save staged at the top of
    every step (its copy overlapping forward and backward, as real loops do) and another
    thread staging its own state at the same time. Gradients and staged values are exact."""
    device = _device.current_device()
    pool = offload.HostPool(slab_bytes=4 << 20)
    baseline = pool.stats()["in_use_bytes"]
    ref = small_model(d=32, n=4).to(device)
    model = copy.deepcopy(ref)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=1e-5)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0, pool=pool, verbose=False)
    stager = offload.AsyncStager(pool=pool)
    stager.protect(optimizer)
    side_errors, stop = [], threading.Event()

    def side_stager():  # another thread's saves, its own stager, the same pool
        try:
            mine = offload.AsyncStager(pool=pool)
            k = 0
            while not stop.is_set():
                state = {"x": torch.full((4096,), float(k), device=device), "k": k}
                staged = mine.stage(state).result()
                assert torch.equal(staged["x"].to(device), state["x"]) and staged["k"] == k
                k += 1
                stop.wait(0.002)  # saves back to back, leaving the training thread a core
            mine.close()
        except BaseException as exc:  # noqa: BLE001
            side_errors.append(f"{type(exc).__name__}: {exc}")

    side = threading.Thread(target=side_stager, daemon=True)
    side.start()
    try:
        for step in range(6):
            # Small inputs and clipped gradients keep this test model's loss finite for every
            # step on every device's random stream (unclipped, it overflows within a few steps
            # on some inputs, with or without offload, and NaN is never equal to itself).
            x = 0.1 * torch.randn(64, 32, device=device)
            expected = {n: t.detach().clone() for n, t in model.state_dict().items()}
            future = stager.stage({"model": model.state_dict(), "step": step})
            _, got = train_step(model, x)
            _, want = train_step(ref, x)
            assert all(torch.equal(a, b) and bool(a.isfinite().all()) for a, b in zip(got, want)), \
                f"step {step}: gradients"
            for m in (model, ref):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=False)
            optimizer.step()
            ref_optimizer.step()
            staged = future.result()
            assert staged["step"] == step
            for n, t in expected.items():
                assert torch.equal(staged["model"][n].to(device), t), f"step {step}: staged {n}"
            del staged, future
    finally:
        stop.set()
        side.join(timeout=JOIN_TIMEOUT_S)
    assert not side.is_alive(), "the side stager did not finish (deadlock?)"
    assert not side_errors, side_errors
    handle.disable()
    stager.close()
    gc.collect()
    assert pool.stats()["in_use_bytes"] == baseline
