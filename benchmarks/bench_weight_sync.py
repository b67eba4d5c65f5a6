"""Trainer-to-rollout weight sync between two processes: WeightSender/Receiver against NCCL by hand.

Two ranks (torch.multiprocessing): rank 0 holds fp32 weights (the Qwen2.5-1.5B and
Llama-3-8B-like tensor lists), rank 1 holds bf16 destinations. Measured on rank 0,
host wall time per sync, with both ranks in step (a barrier before each repeat):
- offload: `WeightSender(dtype=bf16).send(weights)` / `WeightReceiver.load(dsts)`
  (plan broadcast, pack with cast, two pipelined bucket broadcasts, load in place)
- the ceiling: one `dist.broadcast` of a single buffer of all the bf16 bytes
- the usual way: cast each tensor and broadcast it, one collective per tensor
The issue's bar on two GPUs: at least 85% of the ceiling's bandwidth and 5x the
per-tensor broadcast. On a CPU-only machine a quick gloo variant runs the same code.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SECTION = "weight_sync"


def applies(device_type: str) -> bool:
    if device_type == "cpu":
        return True  # the quick two-process gloo variant
    from offload import _device

    return device_type == "cuda" and _device._module("cuda").device_count() >= 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, device, iters):
    from offload import _device

    samples = []
    for i in range(iters + 1):  # the first is warm-up
        dist.barrier()
        _device.synchronize(device)
        t0 = time.perf_counter()
        fn()
        _device.synchronize(device)
        if i:
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def _worker(rank, port, quick, device_type, bench_dir, results):
    import sys

    sys.path.insert(0, bench_dir)
    from model_shapes import llama3_8b, materialize, qwen2_5_1_5b

    import offload
    from offload import _device

    if device_type == "cuda":
        _device._module("cuda").set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    device = _device.current_device()
    iters = 2 if quick else 5
    out = []
    for label, shapes in [("Qwen2.5-1.5B", qwen2_5_1_5b(quick)), ("Llama-3-8B", llama3_8b(quick))]:
        if rank == 0:
            weights = materialize(shapes, torch.float32, device)
            sender = offload.WeightSender(src=0, dtype=torch.bfloat16, bucket_bytes=(1 << 20) if quick else None)
            ours = _timed(lambda: sender.send(weights), device, iters)
            phases = sender.send(weights)
        else:
            weights = materialize(shapes, torch.bfloat16, device)
            receiver = offload.WeightReceiver(src=0)
            ours = _timed(lambda: receiver.load(weights), device, iters)
            phases = receiver.load(weights)
        nbytes = sum(t.numel() * 2 for t in weights.values())
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        one = _timed(lambda: dist.broadcast(flat, src=0), device, iters)
        del flat

        def per_tensor():
            for t in weights.values():
                dist.broadcast(t.to(torch.bfloat16) if rank == 0 else t, src=0)

        each = _timed(per_tensor, device, iters)
        if rank == 0:
            out.append(dict(label=label, bytes=nbytes, tensors=len(shapes), ours=ours, one=one, each=each,
                            phases=phases))
        del weights
        _device.empty_cache()
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run(ctx):
    import statistics
    from pathlib import Path

    from common import gbps, row

    device_type = ctx.device.type
    spawn = mp.get_context("spawn")
    results = spawn.SimpleQueue()
    port = _free_port()
    bench_dir = str(Path(__file__).resolve().parent)
    # The runner loads this file without registering it in sys.modules; spawn pickles
    # the target by module name, so take it from a regular import of the same file.
    import bench_weight_sync

    procs = [spawn.Process(target=bench_weight_sync._worker, args=(r, port, ctx.quick, device_type, bench_dir, results))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    if any(p.exitcode != 0 for p in procs) or results.empty():
        raise RuntimeError(f"weight_sync benchmark ranks exited with {[p.exitcode for p in procs]}")
    rows = []
    for r in results.get():
        ours, one, each = (statistics.median(r[k]) for k in ("ours", "one", "each"))
        phases = {k: round(v, 3) for k, v in r["phases"].items() if k.endswith("_ms")}
        rows.append(row(SECTION, f"{r['label']} fp32->bf16 vs one big broadcast", offload=gbps(r["bytes"], ours),
                        baseline=gbps(r["bytes"], one), unit="GB/s", baseline_name="one dist.broadcast (ceiling)",
                        sync_ms=ours, spread_ms=[min(r["ours"]), max(r["ours"])], phases=phases,
                        tensors=r["tensors"]))
        rows.append(row(SECTION, f"{r['label']} fp32->bf16", offload=ours, baseline=each, unit="ms",
                        baseline_name="cast + dist.broadcast per tensor", higher_is_better=False))
    return rows
