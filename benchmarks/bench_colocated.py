"""Colocated weight update: trainer and rollout processes on one GPU, `transport="ipc"` against its baselines.

Two processes on the same GPU (torch.multiprocessing), a gloo group for control.
Rank 0 holds the source weights (the Qwen2.5-1.5B and Llama-3-8B tensor lists, bf16
or fp32 cast to bf16), rank 1 bf16 destinations. Host wall time per update on the
receiver, from a barrier both ranks leave together to its last copy completed:
- offload, load in place: `WeightSender(transport="ipc").send` / `WeightReceiver.load`
- offload, views: the receiver iterates `receive()` (no copy out of the buckets)
- one IPC handle per tensor: the sender casts each tensor and shares it on its own
  (torch's `reduce_tensor`), the receiver opens each and copies it into its parameter
- the floor: the pack's and the unpack's bytes (read + written) at the
  device-to-device copy rate measured in the same run; for views, the pack's alone.
The targets: within 1.15x of the floor, and at least 8x (1.5B) / 2.5x (8B)
faster than one handle per tensor. Needs a CUDA GPU (device IPC); skipped elsewhere.

Where the time goes, measured in the same run (one process at a time while the
other waits at a barrier, device events, median of repeats):
- pack alone: the native pack of every tensor into one preallocated buffer (one
  bucket, same dtype policy), and with the transport's own plan (its bucket size,
  two buffers alternating), against one D2D copy of the same bytes;
- unpack alone: the same for the receiver's unpack into its destinations;
- handoff: a sync of tiny buckets through the same transport (one small tensor per
  bucket), per bucket: host messages, interprocess event record and wait, and the
  switches between the two processes' work on the device; times the case's bucket
  count it is what the pipeline adds beyond its copies. The control channel's round
  trip (a host ping-pong over the gloo group) is reported beside it;
- end to end: the rows above; `unexplained_ms` is what the three parts leave.
"""

from __future__ import annotations

import pickle
import statistics
import time

import torch
import torch.distributed as dist

SECTION = "colocated"
SKIP_REASON = "needs a CUDA GPU: the colocated update shares device memory between two processes (device IPC)"


def applies(device_type: str) -> bool:
    return device_type == "cuda"


def _copy_rate(device, nbytes: int) -> float:
    """Bytes moved (read + written) per ms by one device-to-device copy of `nbytes`."""
    from offload.core import _device

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    samples = []
    for i in range(6):
        start, end = _device.new_event(device, timing=True), _device.new_event(device, timing=True)
        start.record(_device.current_stream(device))
        b.copy_(a)
        end.record(_device.current_stream(device))
        end.synchronize()
        if i:
            samples.append(start.elapsed_time(end))
    return 2 * nbytes / statistics.median(samples)


def _event_ms(fn, device, iters: int = 5) -> float:
    """Median device time of fn() on the current stream, after one warm-up."""
    from offload.core import _device

    samples = []
    for i in range(iters + 1):
        start, end = _device.new_event(device, timing=True), _device.new_event(device, timing=True)
        start.record(_device.current_stream(device))
        fn()
        end.record(_device.current_stream(device))
        end.synchronize()
        if i:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _copy_kernels(tensors: dict, bucket_bytes: int, pack: bool, device) -> dict:
    """Pack (sources -> buffer) or unpack (buffer -> destinations) alone, in this process:
    into one buffer holding everything, and with `bucket_bytes` buckets in two alternating
    buffers (the transport's plan, no other process involved); one D2D copy of the bytes."""
    from offload.core import _device
    from offload.weights.bucket_pack import BucketSpans, copy_spans
    from offload.weights.bucket_planner import plan_buckets

    items = list(tensors.items())
    out = {}
    for label, size in (("one_buffer", None), ("planned", bucket_bytes)):
        plan = plan_buckets(items, size if size else 1 << 62, dtype=torch.bfloat16, device=device)
        per_bucket = [[] for _ in range(plan.num_buckets)]
        for e in plan.entries:
            per_bucket[e.bucket].append(e)
        spans = [BucketSpans(entries) for entries in per_bucket]
        buffers = [torch.empty(max(plan.bucket_sizes), dtype=torch.uint8, device=device)
                   for _ in range(min(2, plan.num_buckets))]

        def run():
            for k, bucket in enumerate(spans):
                data = buffers[k % 2][: plan.bucket_sizes[k]]
                copy_spans(data, [tensors[e.name] for e in bucket.entries], bucket, pack=pack)

        out[f"{label}_ms"] = _event_ms(run, device)
        out[f"{label}_buckets"] = plan.num_buckets
        if label == "one_buffer":
            # One half of the buffer copied onto the other, twice the time: the same bytes
            # without a second buffer of that size (both processes share the device's memory).
            half = sum(plan.bucket_sizes) // 2
            a, b = buffers[0][:half], buffers[0][half : 2 * half]
            out["d2d_same_bytes_ms"] = 2 * _event_ms(lambda: b.copy_(a), device)
            del a, b
        del buffers
        _device.empty_cache()
    return out


def _channel_rtt_ms(rank: int, iters: int = 50) -> float:
    """Median host round trip of one small message each way over the gloo group (the control channel's path)."""
    ping = torch.zeros(5, dtype=torch.int64)
    samples = []
    for i in range(iters + 5):
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(ping, dst=1).wait()
            dist.irecv(ping, src=1).wait()
        else:
            dist.irecv(ping, src=0).wait()
            dist.isend(ping, dst=0).wait()
        if i >= 5:
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _handoff(rank: int, device, buckets: int, iters: int) -> float:
    """ms per bucket of a sync of `buckets` tiny buckets through transport 'ipc' (its fixed cost amortised)."""
    from common import time_ranks_ms

    import offload

    tiny = {f"t{i}": torch.full((128,), float(i), dtype=torch.bfloat16, device=device) for i in range(buckets)}
    if rank == 0:
        sender = offload.WeightSender(src=0, transport="ipc", dtype=torch.bfloat16, bucket_bytes=256)
        fn = lambda: sender.send(tiny)  # noqa: E731
    else:
        receiver = offload.WeightReceiver(src=0, transport="ipc")
        fn = lambda: receiver.load(tiny)  # noqa: E731
    return statistics.median(time_ranks_ms(fn, device, iters)) / buckets


def _worker(rank, init_method, quick, bench_dir, results):
    import sys

    sys.path.insert(0, bench_dir)
    from common import time_ranks_ms
    from model_shapes import llama3_8b, materialize, qwen2_5_1_5b
    from torch.multiprocessing.reductions import reduce_tensor

    import offload
    from offload.core import _device
    from offload.weights.ipc import DEFAULT_IPC_BUCKET_BYTES

    _device.set_device(torch.device("cuda", 0))  # both ranks on the same GPU
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    device = _device.current_device()
    iters = 2 if quick else 5
    out = []
    for label, shapes in [("Qwen2.5-1.5B", qwen2_5_1_5b(quick)), ("Llama-3-8B", llama3_8b(quick))]:
        for src_dtype in (torch.bfloat16, torch.float32):
            case = f"{label} {'bf16' if src_dtype == torch.bfloat16 else 'fp32->bf16'}"
            weights = materialize(shapes, src_dtype if rank == 0 else torch.bfloat16, device)
            if rank == 0:
                sender = offload.WeightSender(src=0, transport="ipc", dtype=torch.bfloat16)
                load = views = lambda: sender.send(weights)  # noqa: E731
            else:
                receiver = offload.WeightReceiver(src=0, transport="ipc")
                load = lambda: receiver.load(weights)  # noqa: E731

                def views():
                    for _ in receiver.receive():
                        pass

            ours = time_ranks_ms(load, device, iters)
            ours_views = time_ranks_ms(views, device, iters)
            phases = load()

            def per_tensor():
                if rank == 0:
                    casts = [t.to(torch.bfloat16) for t in weights.values()]
                    handles = [reduce_tensor(t) for t in casts]
                    dist.broadcast_object_list([pickle.dumps(handles)], src=0)
                    dist.barrier()  # the receiver has copied: the casts may go
                else:
                    box = [None]
                    dist.broadcast_object_list(box, src=0)
                    for (rebuild, args), dst in zip(pickle.loads(box[0]), weights.values()):
                        dst.copy_(rebuild(*args))
                    _device.synchronize(device)
                    dist.barrier()

            each = time_ranks_ms(per_tensor, device, iters)
            # Where the time goes (module docstring): each side's copies alone while the other waits.
            breakdown = {}
            bucket_bytes = DEFAULT_IPC_BUCKET_BYTES
            _device.empty_cache()  # the per-tensor baseline's casts
            dist.barrier()
            # The "one buffer" kernels take a buffer of the whole model beside both processes'
            # weights (Llama-3-8B from fp32: 15 GiB more, past an 80 GiB H100's free memory);
            # rank 0 decides for both, so that their barriers stay paired.
            room = [_device.mem_get_info(device)[0] > 1.25 * sum(t.numel() * 2 for t in weights.values())]
            dist.broadcast_object_list(room, src=0)
            if room[0]:
                if rank == 0:
                    breakdown["pack"] = _copy_kernels(weights, bucket_bytes, True, device)
                dist.barrier()
                if rank == 1:
                    breakdown["unpack"] = _copy_kernels(weights, bucket_bytes, False, device)
                dist.barrier()
                breakdown["channel_rtt_ms"] = _channel_rtt_ms(rank)
                breakdown["handoff_per_bucket_ms"] = _handoff(rank, device, 8 if quick else 64, iters)
                box = [breakdown.get("pack")]
                dist.broadcast_object_list(box, src=0)
                breakdown["pack"] = box[0]
            else:
                breakdown = None
            if rank == 1:
                dst_bytes = sum(t.numel() * 2 for t in weights.values())
                src_bytes = dst_bytes * (2 if src_dtype == torch.float32 else 1)
                bucket_bytes = phases["bytes"]
                rate = _copy_rate(device, min(bucket_bytes, 1 << 30))
                pack = (src_bytes + bucket_bytes) / rate
                unpack = (bucket_bytes + dst_bytes) / rate
                out.append(dict(case=case, tensors=len(shapes), bytes=dst_bytes, ours=ours, views=ours_views,
                                each=each, floor=pack + unpack, pack_floor=pack, unpack_floor=unpack,
                                gbps_copy=rate / 1e6, buckets=phases["buckets"], breakdown=breakdown,
                                phases={k: round(v, 3) for k, v in phases.items() if k.endswith("_ms")}))
            del weights
            _device.empty_cache()
    if rank == 1:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run(ctx):
    import bench_colocated
    from common import row, spawn_ranks

    if ctx.device.type != "cuda":
        ctx.progress(f"colocated skipped: {SKIP_REASON}")
        return []
    rows = []
    for r in spawn_ranks(bench_colocated._worker, 2, (ctx.quick,), "colocated benchmark"):
        ours, views, each = (statistics.median(r[k]) for k in ("ours", "views", "each"))
        if r["breakdown"] is not None:
            rows += _breakdown_rows(ctx, r, ours, views)
        else:
            ctx.progress(f"{r['case']}: the kernels-alone breakdown skipped: a buffer of the whole model does not "
                         "fit beside both processes' weights in this device's free memory")
        extra = dict(tensors=r["tensors"], bytes=r["bytes"], spread_ms=[min(r["ours"]), max(r["ours"])],
                     phases=r["phases"], copy_gbps=r["gbps_copy"])
        rows.append(row(SECTION, f"{r['case']} load in place vs floor", offload=ours, baseline=r["floor"], unit="ms",
                        baseline_name="pack + unpack bytes at the D2D copy rate (floor)", higher_is_better=False,
                        **extra))
        rows.append(row(SECTION, f"{r['case']} views vs pack floor", offload=views, baseline=r["pack_floor"],
                        unit="ms", baseline_name="pack bytes at the D2D copy rate (floor)", higher_is_better=False))
        rows.append(row(SECTION, f"{r['case']} load in place vs per-tensor IPC", offload=ours, baseline=each,
                        unit="ms", baseline_name="one IPC handle per tensor + copy", higher_is_better=False))
    return rows


def _breakdown_rows(ctx, r: dict, ours: float, views: float) -> list:
    """The gap to the floor in parts (module docstring), as rows and one progress line."""
    from common import row

    b = r["breakdown"]
    pack, unpack = b["pack"], b["unpack"]
    handoff = b["handoff_per_bucket_ms"] * r["buckets"]
    explained = pack["planned_ms"] + unpack["planned_ms"] + handoff
    ctx.progress(
        f"{r['case']}: end to end {ours:.2f} ms (views {views:.2f}) against a floor of {r['floor']:.2f} ms; "
        f"pack alone {pack['one_buffer_ms']:.2f} ms in one buffer, {pack['planned_ms']:.2f} ms in "
        f"{pack['planned_buckets']} buckets (D2D copy of its bytes {pack['d2d_same_bytes_ms']:.2f} ms); unpack alone "
        f"{unpack['one_buffer_ms']:.2f} / {unpack['planned_ms']:.2f} ms (D2D {unpack['d2d_same_bytes_ms']:.2f} ms); "
        f"handoff {b['handoff_per_bucket_ms'] * 1e3:.0f} us x {r['buckets']} buckets = {handoff:.2f} ms (channel "
        f"round trip {b['channel_rtt_ms'] * 1e3:.0f} us); unexplained {ours - explained:.2f} ms")
    extra = dict(breakdown=b, buckets=r["buckets"], unexplained_ms=ours - explained)
    return [
        row(SECTION, f"{r['case']} pack kernel alone, one buffer, vs pack floor", offload=pack["one_buffer_ms"],
            baseline=r["pack_floor"], unit="ms", baseline_name="pack bytes at the D2D copy rate (floor)",
            higher_is_better=False, planned_ms=pack["planned_ms"], d2d_same_bytes_ms=pack["d2d_same_bytes_ms"]),
        row(SECTION, f"{r['case']} unpack kernel alone, one buffer, vs unpack floor", offload=unpack["one_buffer_ms"],
            baseline=r["unpack_floor"], unit="ms", baseline_name="unpack bytes at the D2D copy rate (floor)",
            higher_is_better=False, planned_ms=unpack["planned_ms"], d2d_same_bytes_ms=unpack["d2d_same_bytes_ms"]),
        row(SECTION, f"{r['case']} handoff x {r['buckets']} buckets + kernels alone vs end to end", offload=explained,
            baseline=ours, unit="ms", baseline_name="load in place, end to end (measured)", higher_is_better=False,
            handoff_ms=handoff, **extra),
    ]
