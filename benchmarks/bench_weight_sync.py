"""Trainer-to-rollout weight sync between two processes: WeightSender/Receiver against NCCL by hand.

Two ranks (torch.multiprocessing): rank 0 holds fp32 weights (the Qwen2.5-1.5B and
Llama-3-8B-like tensor lists), rank 1 holds bf16 destinations. Measured on rank 0,
host wall time per sync, with both ranks in step (a barrier before each repeat):
- offload: `WeightSender(dtype=bf16).send(weights)` / `WeightReceiver.load(dsts)`
  (plan broadcast, pack with cast, two pipelined bucket broadcasts, load in place)
- the ceiling: one `dist.broadcast` of a single buffer of all the bf16 bytes
- the usual way: cast each tensor and broadcast it, one collective per tensor
The target on two GPUs: at least 85% of the ceiling's bandwidth and 5x the
per-tensor broadcast. A row "ceiling" prints per-tensor time / one-big-broadcast
time: the most any bucketing can gain over the per-tensor loop on this link (over
NVLink about 2x, so 5x cannot be reached there). With --full, extra rows sweep the
bucket size and `reserve_sms=0` (pack kernels take every SM) to show where the time goes.

host_cache (one GPU, a one-rank group): a training-like loop (matmuls reading the
weights, then an in-place update) takes a snapshot after each update and calls
`wait_snapshot()` before the next update. "Blocked" is the host time inside
`snapshot()` plus the device time the compute stream spends in that wait (events
on either side of it); the bar is at most 5% of the snapshot's copy time (events
on the copy stream). Also printed: the step time against the same loop without
snapshots. On a CPU-only machine a quick gloo variant runs the same code.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

SECTION = "weight_sync"
REQUIRES = ("transformers",)  # the tensor lists come from transformers' model configs


# The collective backend of each device type; the CPU runs the quick two-process gloo variant.
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def applies(device_type: str) -> bool:
    return device_type in _BACKENDS  # host_cache on one accelerator; the sync itself where there are two


def _gpus() -> int:
    from offload.core import _device

    kind = _device.accelerator_type()
    return 0 if kind is None else _device.device_count(kind)


def _worker(rank, init_method, quick, device_type, full, bench_dir, results):
    import sys

    sys.path.insert(0, bench_dir)
    from common import time_ranks_ms
    from model_shapes import label, llama3_8b, materialize, qwen2_5_1_5b

    import offload
    from offload.core import _device

    if device_type != "cpu":
        _device.set_device(torch.device(device_type, rank))
    dist.init_process_group(_BACKENDS[device_type], init_method=init_method, rank=rank, world_size=2)
    device = _device.current_device()
    iters = 2 if quick else 5
    out = []
    for name, shapes in [("Qwen2.5-1.5B", qwen2_5_1_5b(quick)), ("Llama-3-8B", llama3_8b(quick))]:
        weights = materialize(shapes, torch.float32 if rank == 0 else torch.bfloat16, device)
        # (bucket MiB, reserve_sms): the defaults first, then, with --full, the sweep (same on both ranks).
        sweep = [(b, None) for b in (64, 128, 512, 1024)] + [(None, 0)]
        configs = [(None, None)] + (sweep if full and not quick else [])
        variants = {}
        for bucket_mib, reserve in configs:
            kw = {} if reserve is None else {"reserve_sms": reserve}
            if rank == 0:
                bucket = (1 << 20) if quick else (None if bucket_mib is None else bucket_mib << 20)
                sender = offload.WeightSender(src=0, dtype=torch.bfloat16, bucket_bytes=bucket, **kw)
                sync = lambda: sender.send(weights)  # noqa: E731
            else:
                receiver = offload.WeightReceiver(src=0, **kw)
                sync = lambda: receiver.load(weights)  # noqa: E731
            samples = time_ranks_ms(sync, device, iters)
            variants[(bucket_mib, reserve)] = (samples, sync())
            if rank == 0 and bucket_mib is None and reserve is None:
                default_bucket = sender.bucket_bytes
        ours, phases = variants[(None, None)]
        nbytes = sum(t.numel() * 2 for t in weights.values())
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        one = time_ranks_ms(lambda: dist.broadcast(flat, src=0), device, iters)
        del flat

        def per_tensor():
            for t in weights.values():
                dist.broadcast(t.to(torch.bfloat16) if rank == 0 else t, src=0)

        each = time_ranks_ms(per_tensor, device, iters)
        if rank == 0:
            out.append(dict(label=label(name, quick), bytes=nbytes, tensors=len(shapes), ours=ours, one=one, each=each,
                            phases=phases, default_bucket=default_bucket,
                            variants={k: v[0] for k, v in variants.items() if k != (None, None)}))
        del weights
        _device.empty_cache()
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(target, world, ctx, what):
    """Run target(rank, init_method, quick, device_type, full, bench_dir, results) on `world` processes; its result."""
    from common import spawn_ranks

    return spawn_ranks(target, world, (ctx.quick, ctx.device.type, ctx.full), f"weight_sync benchmark ({what})")


def run(ctx):
    # The runner loads this file without registering it in sys.modules; spawn pickles
    # the target by module name, so take it from a regular import of the same file.
    import bench_weight_sync

    rows = []
    ctx.progress("host_cache snapshot beside a training loop (one rank)")
    rows.extend(_host_cache_rows(_spawn(bench_weight_sync._cache_worker, 1, ctx, "host_cache")))
    if ctx.device.type == "cpu" or _gpus() >= 2:
        ctx.progress("sync between two ranks")
        rows.extend(_sync_rows(_spawn(bench_weight_sync._worker, 2, ctx, "sync")))
    else:
        ctx.skip("sync between two ranks", "needs 2 GPUs")
    return rows


def _sync_rows(results):
    import statistics

    from common import gbps, row

    rows = []
    for index, r in enumerate(results):
        ours, one, each = (statistics.median(r[k]) for k in ("ours", "one", "each"))
        phases = {k: round(v, 3) for k, v in r["phases"].items() if k.endswith("_ms")}
        rows.append(row(SECTION, f"{r['label']} fp32->bf16 vs one big broadcast", offload=gbps(r["bytes"], ours),
                        baseline=gbps(r["bytes"], one), unit="GB/s", baseline_name="one dist.broadcast (ceiling)",
                        sync_ms=ours, spread_ms=[min(r["ours"]), max(r["ours"])], phases=phases,
                        tensors=r["tensors"]))
        said = {"headline": f"Weight sync fp32->bf16: {r['label']}"} if index == len(results) - 1 else {}
        rows.append(row(SECTION, f"{r['label']} fp32->bf16", offload=ours, baseline=each, unit="ms",
                        baseline_name="cast + dist.broadcast per tensor", higher_is_better=False, bytes=r["bytes"],
                        figure="staging_weight_sync", panel="gbps", group=f"weight sync {r['label']}", **said))
        # The most any bucketing can gain over the per-tensor loop on this link.
        rows.append(row(SECTION, f"{r['label']} ceiling: one big broadcast", offload=one, baseline=each, unit="ms",
                        baseline_name="cast + dist.broadcast per tensor", higher_is_better=False))
        for (bucket_mib, reserve), samples in r["variants"].items():
            what = f"bucket {bucket_mib} MiB" if bucket_mib is not None else \
                f"bucket {r['default_bucket'] >> 20} MiB, reserve_sms={reserve}"
            rows.append(row(SECTION, f"{r['label']} {what} vs one big broadcast",
                            offload=gbps(r["bytes"], statistics.median(samples)), baseline=gbps(r["bytes"], one),
                            unit="GB/s", baseline_name="one dist.broadcast (ceiling)",
                            sync_ms=statistics.median(samples)))
    return rows


# ---------------------------------------------------------------- host_cache on one GPU


def _cache_worker(rank, init_method, quick, device_type, full, bench_dir, results):
    """A one-rank world: snapshots of fp32 weights taken beside a training-like loop."""
    import statistics
    import sys

    sys.path.insert(0, bench_dir)
    from model_shapes import label, materialize, qwen2_5_1_5b

    import offload
    from offload.core import _device

    dist.init_process_group(_BACKENDS[device_type], init_method=init_method, rank=rank, world_size=1)
    device = _device.current_device()
    on_accel = _device.is_accelerator(device)
    weights = materialize(qwen2_5_1_5b(quick), torch.float32, device)
    params = list(weights.values())
    nbytes = sum(t.numel() * t.element_size() for t in params)
    # "Forward and backward": matmuls that read the large weights, sized so that the
    # work between a snapshot and the next update lasts about twice the copy, as
    # in a real step (a 1.5B model's step is far longer than its 6 GB copy).
    mats = [t for t in params if t.dim() == 2 and min(t.shape) >= 256][:16]
    x = [torch.randn(512 if not quick else 16, m.shape[1], device=device) for m in mats]
    delta = [torch.full_like(p, 1e-3) for p in params]

    def fwd_bwd(repeats):
        for _ in range(repeats):
            for a, m in zip(x, mats):
                a @ m.t()

    def update():
        torch._foreach_add_(params, delta)

    def event():
        if not on_accel:
            return time.perf_counter()
        e = _device.new_event(device, timing=True)
        e.record(_device.current_stream(device))
        return e

    def ms(a, b):
        if not on_accel:
            return (b - a) * 1e3
        b.synchronize()
        return a.elapsed_time(b)

    sender = offload.WeightSender(src=0, mode="host_cache", keep_versions=2)
    # Size the compute: one snapshot's copy time, then repeats for about 2x that.
    sender.snapshot(weights)
    copy_ms = sender.snapshot_ms()
    fwd_bwd(1)  # warm-up (library handles, kernels)
    t0 = event()
    fwd_bwd(1)
    one_ms = max(ms(t0, event()), 1e-3)
    repeats = max(1, round(2 * copy_ms / one_ms))
    steps = 4 if quick else 12 if full else 8  # the first two snapshots are not timed

    def loop(snapshots):
        blocked, waits, hosts, copies, step_ms, first = [], [], [], [], [], None
        for i in range(steps):
            s0 = event()
            if snapshots and i:
                a = event()
                sender.wait_snapshot()  # the update below overwrites what the snapshot reads
                waits.append(ms(a, event()))
            update()
            if snapshots:
                h0 = time.perf_counter()
                v = sender.snapshot(weights)
                hosts.append((time.perf_counter() - h0) * 1e3)
            fwd_bwd(repeats)
            step_ms.append(ms(s0, event()))
            if snapshots:
                copies.append(sender.snapshot_ms(v))
        _device.synchronize(device)
        if snapshots:
            # Steady state: from the third snapshot on, versions reuse the host buffers.
            first = hosts[0]
            hosts, waits, copies, step_ms = hosts[2:], waits[1:], copies[2:], step_ms[2:]
            blocked = [h + w for h, w in zip(hosts, waits)]
        return dict(step=statistics.median(step_ms[1:] if not snapshots else step_ms),
                    blocked=blocked, host=hosts, wait=waits, copy=copies, first_host=first)

    base = loop(False)
    snap = loop(True)
    results.put(dict(label=label("Qwen2.5-1.5B", quick), bytes=nbytes, tensors=len(params), repeats=repeats, compute_ms=repeats * one_ms,
                     base_step=base["step"], **{k: v for k, v in snap.items()}))
    dist.destroy_process_group()


def _host_cache_rows(r):
    import statistics

    from common import gbps, row

    copy = statistics.median(r["copy"])
    blocked = statistics.median(r["blocked"])
    detail = dict(copy_ms=copy, blocked_ms=blocked, blocked_max_ms=max(r["blocked"]),
                  snapshot_host_ms=statistics.median(r["host"]), wait_ms=statistics.median(r["wait"]),
                  first_snapshot_host_ms=r["first_host"], compute_between_ms=r["compute_ms"],
                  copy_gbps=gbps(r["bytes"], copy), bytes=r["bytes"], tensors=r["tensors"])
    return [
        # offload = blocked time, baseline = the copy it hides: ratio >= 20 meets "blocked <= 5%".
        row(SECTION, f"host_cache {r['label']} fp32: trainer blocked per snapshot", offload=blocked, baseline=copy,
            unit="ms", baseline_name="the snapshot's D2H copy (events)", higher_is_better=False, **detail,
            headline=f"Weight snapshot (host_cache): trainer blocked, {r['label']}", figure="staging_weight_sync",
            panel="blocked", group=f"weight snapshot {r['label']}"),
        row(SECTION, f"host_cache {r['label']} fp32: train step with a snapshot each step", offload=r["step"],
            baseline=r["base_step"], unit="ms/step", baseline_name="same loop without snapshots",
            higher_is_better=False),
    ]
