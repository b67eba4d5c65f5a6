"""Copy engine and host pool against PyTorch's own copies, in one run.

Baselines: `host.copy_(dev, non_blocking=True)` into preallocated pinned memory
(one call per tensor; also for refills of an earlier copy's buffers, with and without
the core's deferred enqueue), `.to(device, non_blocking=True)`, pageable `.cpu()`, two
side streams for both directions at once, and `torch.empty(pin_memory=True)` for
pool growth and cached allocation. The bus peak is torch's 1 GiB pinned copy.
"""

from __future__ import annotations

import time

import torch

import offload
from common import compare_ms, gbps, host_memory, row, summarize
from offload.core import _device

SECTION = "copy"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def applies(device_type: str) -> bool:
    return True  # on the CPU it measures the engine's host-side cost


def _pinned(nbytes: int) -> torch.Tensor:
    return _device.empty_pinned(nbytes)


def _single_tensor_sweep(ctx, sizes, iters):
    dev, rows = ctx.device, []
    for size in sizes:
        ctx.progress(f"single tensor {size // KiB} KiB")
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
        host = _pinned(size)
        handle = offload.copy_to_host([src])
        reps = iters if size < 64 * MiB else max(3, iters // 4)
        t_off, t_torch = compare_ms(lambda: offload.copy_to_host([src], out=handle).wait_stream(),
                                    lambda: host.copy_(src, non_blocking=True), dev, iters=reps)
        rows.append(row(SECTION, f"D2H 1 x {_fmt(size)}", offload=gbps(size, t_off["median_ms"]),
                        baseline=gbps(size, t_torch["median_ms"]), unit="GB/s",
                        baseline_name=f"{host_memory()} copy_(non_blocking)", size_bytes=size, plot="D2H",
                        spread_pct=t_off["spread_pct"], figure="transfer", direction="D2H", bytes_per_tensor=size,
                        tensors=1))
        dst = torch.empty_like(src)
        t_off, t_torch = compare_ms(lambda: offload.copy_to_device([host], dev, out=[dst]).wait_stream(),
                                    lambda: dst.copy_(host, non_blocking=True), dev, iters=reps)
        rows.append(row(SECTION, f"H2D 1 x {_fmt(size)}", offload=gbps(size, t_off["median_ms"]),
                        baseline=gbps(size, t_torch["median_ms"]), unit="GB/s",
                        baseline_name=f"{host_memory()} copy_(non_blocking)", size_bytes=size, plot="H2D",
                        spread_pct=t_off["spread_pct"], figure="transfer", direction="H2D", bytes_per_tensor=size,
                        tensors=1))
        if size == sizes[-1]:
            ctx.notes["bus_peak_d2h_gbps"] = rows[-2]["baseline"]
            ctx.notes["bus_peak_h2d_gbps"] = rows[-1]["baseline"]
        del src, host, dst, handle
    return rows


def _copy_each(hosts, srcs) -> None:
    """PyTorch's way for many tensors: one pinned non_blocking copy_ per tensor."""
    for host, src in zip(hosts, srcs):
        host.copy_(src, non_blocking=True)


def _joined(handle):
    """Make the current stream wait for `handle` and keep it (and its outputs) for the timer."""
    handle.wait_stream()
    return handle


def _many_tensors(ctx, count, each, iters, headline=False):
    """D2H and H2D of `count` tensors of `each` bytes; `headline`: these rows stand for the copy engine."""
    dev = ctx.device
    ctx.progress(f"{count} x {each // KiB} KiB")
    srcs = [torch.randint(0, 255, (each,), dtype=torch.uint8, device=dev) for _ in range(count)]
    total = count * each
    hosts = [_pinned(each) for _ in range(count)]
    handle = offload.copy_to_host(srcs)

    t_off, t_torch = compare_ms(lambda: _joined(offload.copy_to_host(srcs, out=handle)),
                                lambda: _copy_each(hosts, srcs), dev, iters=iters)
    peak = max(ctx.notes.get("bus_peak_d2h_gbps", 0), 1e-9)
    shape = dict(figure="transfer", bytes_per_tensor=each, tensors=count)
    out = [row(SECTION, f"D2H {count} x {_fmt(each)}", offload=gbps(total, t_off["median_ms"]),
               baseline=gbps(total, t_torch["median_ms"]), unit="GB/s", baseline_name="copy_ per tensor",
               of_bus_peak=gbps(total, t_off["median_ms"]) / peak, spread_pct=t_off["spread_pct"], direction="D2H",
               **shape, **({"headline": f"Copy to host: {count} x {_fmt(each)}"} if headline else {}))]
    host_list = handle.wait()

    def torch_h2d():
        # copy=True: on the CPU subset .to() of a CPU tensor would return it uncopied.
        return [h.to(dev, non_blocking=True, copy=True) for h in hosts]

    t_off, t_torch = compare_ms(lambda: _joined(offload.copy_to_device(host_list, dev)), torch_h2d, dev,
                                iters=iters)
    peak = max(ctx.notes.get("bus_peak_h2d_gbps", 0), 1e-9)
    out.append(row(SECTION, f"H2D {count} x {_fmt(each)}", offload=gbps(total, t_off["median_ms"]),
                   baseline=gbps(total, t_torch["median_ms"]), unit="GB/s",
                   baseline_name=".to(non_blocking) per tensor",
                   of_bus_peak=gbps(total, t_off["median_ms"]) / peak, spread_pct=t_off["spread_pct"],
                   direction="H2D", **shape,
                   **({"headline": f"Copy to device: {count} x {_fmt(each)}"} if headline else {})))
    return out


def _refill(ctx, count, each, iters):
    """The steady state of a checkpoint stager: the same tensors copied again into the
    buffers of an earlier copy (`out=handle`), with the core's worker queueing the copies
    (`defer=True`) and without; host time of the call (what a training loop waits for)
    and time from the call to the copy's end, against a `copy_` per tensor."""
    dev = ctx.device
    ctx.progress(f"refill {count} x {each // KiB} KiB")
    srcs = [torch.randint(0, 255, (each,), dtype=torch.uint8, device=dev) for _ in range(count)]
    hosts = [_pinned(each) for _ in range(count)]
    first = offload.copy_to_host(srcs, group_bytes=32 * MiB)  # the stager's group size
    first.wait()
    total = count * each

    def timed(call, finish):
        _device.synchronize(dev)
        t0 = time.perf_counter()
        result = call()
        t1 = time.perf_counter()
        finish(result)
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    cases = {
        "defer": (lambda: offload.copy_to_host(srcs, out=first, defer=True), lambda h: h.wait()),
        "sync": (lambda: offload.copy_to_host(srcs, out=first), lambda h: h.wait()),
        "torch": (lambda: _copy_each(hosts, srcs), lambda _: _device.synchronize(dev)),
    }
    samples = {name: ([], []) for name in cases}
    for rep in range(iters + 2):  # in alternation; the first two rounds warm up
        for name, (call, finish) in cases.items():
            blocked, done = timed(call, finish)
            if rep >= 2:
                samples[name][0].append(blocked)
                samples[name][1].append(done)
    med = {name: (summarize(b)["median_ms"], summarize(d)["median_ms"]) for name, (b, d) in samples.items()}
    label = f"D2H refill {count} x {_fmt(each)}"
    return [
        row(SECTION, f"{label}: caller blocked, defer=True", offload=med["defer"][0], baseline=med["torch"][0],
            unit="ms", baseline_name="copy_ per tensor (host time of the loop)", higher_is_better=False,
            synchronous_ms=med["sync"][0]),
        row(SECTION, f"{label}: call to copy done, defer=True", offload=gbps(total, med["defer"][1]),
            baseline=gbps(total, med["torch"][1]), unit="GB/s", baseline_name="copy_ per tensor",
            synchronous_gbps=gbps(total, med["sync"][1])),
    ]


def _both_directions(ctx, size, iters):
    dev = ctx.device
    ctx.progress(f"both directions at once, {_fmt(size)} each")
    down_src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
    down_dst = _pinned(size)
    up_src = _pinned(size)
    up_dst = torch.empty(size, dtype=torch.uint8, device=dev)
    s1, s2 = _device.new_stream(dev), _device.new_stream(dev)
    current = _device.current_stream(dev)

    def torch_both():
        for s in (s1, s2):
            s.wait_stream(current)
        with _device.stream_context(s1):
            down_dst.copy_(down_src, non_blocking=True)
        with _device.stream_context(s2):
            up_dst.copy_(up_src, non_blocking=True)
        current.wait_stream(s1)
        current.wait_stream(s2)

    handle = offload.copy_to_host([down_src])

    def offload_both():
        a = offload.copy_to_host([down_src], out=handle)
        b = offload.copy_to_device([up_src], dev, out=[up_dst])
        a.wait_stream()
        b.wait_stream()

    t_off, t_torch = compare_ms(offload_both, torch_both, dev, iters=iters)
    return [row(SECTION, f"D2H+H2D at once {_fmt(size)} each", offload=gbps(2 * size, t_off["median_ms"]),
                baseline=gbps(2 * size, t_torch["median_ms"]), unit="GB/s",
                baseline_name="copy_ on two side streams", spread_pct=t_off["spread_pct"])]


def _pageable(ctx, size, iters):
    dev = ctx.device
    ctx.progress(f"pageable .cpu() {_fmt(size)}")
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
    handle = offload.copy_to_host([src])
    t_off, t_torch = compare_ms(lambda: offload.copy_to_host([src], out=handle).wait_stream(), lambda: src.cpu(),
                                dev, iters=iters)
    return [row(SECTION, f"D2H {_fmt(size)} vs pageable", offload=gbps(size, t_off["median_ms"]),
                baseline=gbps(size, t_torch["median_ms"]), unit="GB/s", baseline_name="pageable .cpu()")]


def _pool_growth(ctx, size):
    ctx.progress(f"pool growth by {_fmt(size)}")
    t0 = time.perf_counter()
    pinned = _pinned(size)
    t_torch = time.perf_counter() - t0
    del pinned
    _device.host_empty_cache()
    pool = offload.HostPool(slab_bytes=size)
    t0 = time.perf_counter()
    pool.reserve(size)
    t_off = time.perf_counter() - t0
    stats = pool.stats()
    pool.trim()
    return [row(SECTION, f"pool growth {_fmt(size)}", offload=t_off * 1e3, baseline=t_torch * 1e3, unit="ms",
                baseline_name=_empty_name(), higher_is_better=False,
                registration_ms=stats["registration_seconds"] * 1e3,
                headline=f"{'Pinned host' if host_memory() == 'pinned' else 'Host'} pool: grow by {_fmt(size)}")]


def _cached_acquire(ctx, iters):
    ctx.progress("cached acquire/release")
    pool = offload.HostPool()
    pool.reserve(4 * MiB)

    def per_op_us(fn):
        for _ in range(100):
            fn()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return summarize(samples)["median_ms"]  # the values are microseconds here

    t_off = per_op_us(lambda: pool.acquire(MiB))
    t_torch = per_op_us(lambda: _pinned(MiB))
    return [row(SECTION, "cached acquire+release 1 MiB", offload=t_off, baseline=t_torch, unit="us",
                baseline_name=_empty_name(), higher_is_better=False)]


def _empty_name() -> str:
    """PyTorch's way of getting host memory here: pinned where the runtime pins, plain on a CPU-only torch."""
    return f"torch.empty(pin_memory={_device.pinned_memory_supported()})"


def _fmt(nbytes: int) -> str:
    if nbytes >= GiB:
        return f"{nbytes // GiB} GiB"
    if nbytes >= MiB:
        return f"{nbytes // MiB} MiB"
    return f"{nbytes // KiB} KiB"


def run(ctx) -> list:
    if ctx.quick:
        rows = _single_tensor_sweep(ctx, [64 * KiB, MiB, 16 * MiB], iters=5)
        rows += _many_tensors(ctx, 200, 256 * KiB, iters=3, headline=True)
        rows += _many_tensors(ctx, 400, 16 * KiB, iters=3)
        rows += _pool_growth(ctx, 64 * MiB)
        rows += _cached_acquire(ctx, iters=2000)
        return rows
    rows = _single_tensor_sweep(ctx, [64 * KiB, MiB, 16 * MiB, 256 * MiB, GiB], iters=20)
    rows += _many_tensors(ctx, 2000, 256 * KiB, iters=10, headline=True)
    rows += _many_tensors(ctx, 4096, 16 * KiB, iters=10)
    if _device.is_accelerator(ctx.device):  # on the host a deferred copy runs synchronously
        rows += _refill(ctx, 4000, 256 * KiB, iters=10)
    rows += _both_directions(ctx, GiB, iters=10)
    rows += _pageable(ctx, GiB, iters=3)
    rows += _pool_growth(ctx, 4 * GiB)
    rows += _cached_acquire(ctx, iters=10000)
    return rows
