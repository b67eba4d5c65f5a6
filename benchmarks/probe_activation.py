"""Where activation offload's time goes on a Llama step: a diagnostic, not a bench section.

`python benchmarks/probe_activation.py plans|host|profile [--seq 8192]` on a GPU (from a
checkout with offload installed). Each probe runs hand-made plans on an async handle
(`handle._offload` picks the layers, `handle.engine.schedule` the release and fetch points
of auto mode) next to the same step with the hooks in and nothing offloaded:

- plans:   step time (median of 6), peak above the memory between steps, and the compute
           stream's device-side waits (release points in forward, copies back in backward);
- host:    host time per step inside the engine's entry points (the hooks, the layer
           boundaries, the capture) and the Python methods the core's cycle leaves;
- profile: the compute stream's kernel time against its span (gaps: the device waiting for
           the host), and the kernels whose time changed;
- lead:    per layer of steps run back to back, the host's time to queue its forward, the
           device's time to run it, and how far the host is ahead of the device as it opens
           (0: the device waits for the host, and host time spent there is device time).

`--model qwen2` runs the frontier section's Qwen2 instead of the Llama.

benchmarks/RESULTS.md has the current figures of the sections these diagnose.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_activation  # noqa: E402
import bench_frontier  # noqa: E402
from common import Context  # noqa: E402

import offload  # noqa: E402
from offload.core import _device  # noqa: E402
from offload.activation.auto.schedule import Schedule  # noqa: E402

GiB = float(1 << 30)


def _step(model, loss_fn):
    model.zero_grad(set_to_none=False)
    loss_fn().backward()


def _plans(n):
    """(label, offloaded layers, caps, release_at, fetch_at, fetch_at_start) to compare."""
    none = [None] * n
    part = [None, 450 << 20] + [None] * (n - 2)
    return [
        ("{0} freed at layer 7, back at layer 3", (0,), none, {0: 7}, {3: [0]}, []),
        ("{0} freed at layer 7, back at layer 2", (0,), none, {0: 7}, {2: [0]}, []),
        ("{0} back as backward starts", (0,), none, {0: 7}, {}, [0]),
        ("{0, part of 1} auto's shape", (0, 1), part, {0: 7, 1: n + 1}, {4: [1], 3: [0]}, []),
    ]


def _use_first_plan(handle, n) -> str:
    """Run the first of `_plans` on the handle from the next step; its label."""
    label, layers, caps, release_at, fetch_at, at_start = _plans(n)[0]
    handle._offload = [i in layers for i in range(n)]
    handle.engine.schedule = Schedule(n, caps, release_at, fetch_at, at_start)
    return label


def probe_plans(ctx, model, loss_fn, handle, n):
    device = ctx.device

    def timed(label):
        for _ in range(3):
            _step(model, loss_fn)
        gc.collect()
        _device.synchronize(device)
        idle = _device.memory_allocated(device)
        ms, peaks, fwd, bwd = [], [], [], []
        for _ in range(6):
            _device.reset_peak_memory_stats(device)
            start, end = _device.new_event(device, timing=True), _device.new_event(device, timing=True)
            start.record(_device.current_stream(device))
            _step(model, loss_fn)
            end.record(_device.current_stream(device))
            end.synchronize()
            ms.append(start.elapsed_time(end))
            peaks.append(_device.max_memory_allocated(device) - idle)
            stats = handle.stats()
            fwd.append(stats["forward_wait_seconds"] * 1e3)
            bwd.append(stats["backward_wait_seconds"] * 1e3)
        print(f"{label:40} step {statistics.median(ms):7.2f} ms  peak {max(peaks) / GiB:5.2f} GiB  "
              f"waits: forward {statistics.median(fwd):.2f} backward {statistics.median(bwd):.2f} ms", flush=True)

    handle._offload = [False] * n
    timed("hooks in, nothing offloaded")
    for label, layers, caps, release_at, fetch_at, at_start in _plans(n):
        handle._offload = [i in layers for i in range(n)]
        handle.engine.schedule = Schedule(n, caps, release_at, fetch_at, at_start)
        timed(label)


def probe_host(ctx, model, loss_fn, handle, n):
    seconds, calls = collections.Counter(), collections.Counter()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapper

    # The engine's entry points: the saved-tensor hooks (the core's, or the Python ones without
    # it), the layer boundaries (where the core's cycle closes a group and issues its copy out),
    # the capture's start and end and the step's timings; then the Python methods, which run where
    # the core's cycle does not (csrc/python/group_cycle.h). The hooks take the sides' methods
    # through the engine's attributes set when it was made, so those are timed on the instance.
    engine = handle.engine
    hooks = engine._hooks
    engine._hooks = torch.autograd.graph.saved_tensors_hooks(timed("pack hook", hooks.pack_hook),
                                                             timed("unpack hook", hooks.unpack_hook))
    for name in ("boundary", "_copy_back", "_walk_params", "_enter", "_exit", "resolve_timing"):
        setattr(engine, name, timed(name, getattr(engine, name)))
    forward = engine.forward
    for name in ("close", "release_due", "mark_copied"):
        setattr(forward, name, timed(f"forward.{name}", getattr(forward, name)))
    side = engine.backward
    for name in ("fetch", "fetch_groups", "starts", "fetch_when_backward_reaches"):
        setattr(side, name, timed(f"backward.{name}", getattr(side, name)))
    for name, method in (("_make_ready", side.make_ready), ("_prefetch", side.prefetch), ("_release", side.release)):
        setattr(engine, name, timed(f"backward.{name.lstrip('_')}", method))

    def run(label, steps=5):
        for _ in range(3):
            _step(model, loss_fn)
        _device.synchronize(ctx.device)
        seconds.clear()
        calls.clear()
        forward, backward = [], []
        for _ in range(steps):
            _device.synchronize(ctx.device)
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=False)
            loss = loss_fn()
            t1 = time.perf_counter()
            loss.backward()
            forward.append((t1 - t0) * 1e3)
            backward.append((time.perf_counter() - t1) * 1e3)
        _device.synchronize(ctx.device)
        print(f"{label}: host forward {statistics.median(forward):.2f} ms, backward call "
              f"{statistics.median(backward):.2f} ms", flush=True)
        print("   " + ", ".join(f"{k} {seconds[k] * 1e3 / steps:.3f} ms/{calls[k] // steps}"
                                for k, _ in seconds.most_common(12)), flush=True)

    handle._offload = [False] * n
    run("hooks in, nothing offloaded")
    label = _use_first_plan(handle, n)
    run(label)


def probe_profile(ctx, model, loss_fn, handle, n):
    from torch.profiler import ProfilerActivity, profile

    def kernels(label):
        for _ in range(3):
            _step(model, loss_fn)
        _device.synchronize(ctx.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                _step(model, loss_fn)
            _device.synchronize(ctx.device)
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        by_stream = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
                by_stream[e["args"].get("stream")].append(e)
        busy = {s: sum(e["dur"] for e in v) for s, v in by_stream.items()}
        compute = max(busy, key=busy.get)
        ordered = sorted(by_stream[compute], key=lambda e: e["ts"])
        span = ordered[-1]["ts"] + ordered[-1]["dur"] - ordered[0]["ts"]
        print(f"{label}: compute stream per step: span {span / 3e3:.2f} ms, kernels {busy[compute] / 3e3:.2f} ms, "
              f"gaps {(span - busy[compute]) / 3e3:.2f} ms (the profiler's own host cost inflates gaps)", flush=True)
        per_kernel = collections.Counter()
        for e in ordered:
            per_kernel[e["name"][:90]] += e["dur"] / 3e3
        # Host-side runtime and driver calls: a call that blocks the host (a synchronizing
        # copy, an event or stream sync, a pinned or device allocation) shows here.
        api_ms, api_calls, longest = collections.Counter(), collections.Counter(), []
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
                api_ms[e["name"]] += e["dur"] / 3e3
                api_calls[e["name"]] += 1
                longest.append((e["dur"], e["name"]))
        print("   runtime calls per step: " + ", ".join(
            f"{name} {ms:.2f} ms/{api_calls[name] // 3}" for name, ms in api_ms.most_common(8)), flush=True)
        print("   longest: " + ", ".join(f"{name} {us / 1e3:.2f} ms" for us, name in sorted(longest)[-5:]), flush=True)
        return per_kernel

    handle._offload = [False] * n
    base = kernels("hooks in, nothing offloaded")
    label = _use_first_plan(handle, n)
    mine = kernels(label)
    changed = sorted((mine[k] - base[k], k) for k in set(mine) | set(base))
    print("kernels whose time changed most (ms per step):")
    for delta, name in changed[:3] + changed[-5:]:
        print(f"   {delta:+.3f}  {name}")


def probe_lead(ctx, model, loss_fn, handle, n):
    device = ctx.device
    layers = [model.get_submodule(name) for name in handle.layers]
    marks = []  # (host seconds, event on the compute stream) at the model's start, each layer's, its end

    def mark(*_):
        event = _device.new_event(device, timing=True)
        event.record(_device.current_stream(device))
        marks.append((time.perf_counter(), event))

    hooks = [model.register_forward_pre_hook(mark)] + [layer.register_forward_pre_hook(mark) for layer in layers]
    hooks.append(model.register_forward_hook(mark))

    def lead(label, paused=False, steps=8):
        with handle.paused() if paused else contextlib.nullcontext():
            for _ in range(3):
                _step(model, loss_fn)
            _device.synchronize(device)
            origin = _device.new_event(device, timing=True)
            origin.record(_device.current_stream(device))
            t0 = time.perf_counter()
            per_step = []
            for _ in range(steps):  # back to back, as a training loop runs them
                marks.clear()
                _step(model, loss_fn)
                per_step.append(list(marks))
            _device.synchronize(device)
        # ms since the origin, on the host and on the device, of each mark of each step
        host = [[(t - t0) * 1e3 for t, _ in step] for step in per_step]
        dev = [[origin.elapsed_time(e) for _, e in step] for step in per_step]

        def median(f):
            return statistics.median(f(h, d) for h, d in zip(host, dev))

        cells = [f"before the layers host {median(lambda h, d: h[1] - h[0]):.2f} / device "
                 f"{median(lambda h, d: d[1] - d[0]):.2f} ms"]
        for i in range(1, min(n, 4) + 1):
            cells.append(f"layer {i - 1} {median(lambda h, d: h[i + 1] - h[i]):.2f} / "
                         f"{median(lambda h, d: d[i + 1] - d[i]):.2f}, lead {median(lambda h, d: d[i] - h[i]):.2f}")
        cells.append(f"forward {median(lambda h, d: h[-1] - h[0]):.2f} / {median(lambda h, d: d[-1] - d[0]):.2f}")
        print(f"{label} (host / device ms):\n   " + "; ".join(cells), flush=True)

    try:
        lead("paused", paused=True)
        handle._offload = [False] * n
        lead("hooks in, nothing offloaded")
        lead(_use_first_plan(handle, n))
    finally:
        for hook in hooks:
            hook.remove()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=["plans", "host", "profile", "lead"])
    parser.add_argument("--seq", type=int, default=8192, help="the Llama's sequence length")
    parser.add_argument("--model", choices=["llama", "qwen2"], default="llama")
    args = parser.parse_args()
    device = _device.current_device()
    if not _device.is_accelerator(device):
        sys.exit("probe_activation: needs an accelerator (the plans it compares move device memory)")
    ctx = Context(device=device, quick=False)
    if args.model == "qwen2":
        model, loss_fn = bench_frontier._qwen2(ctx)
    else:
        model, loss_fn = bench_activation._llama(ctx, args.seq)
    model.config.use_cache = False
    n = model.config.num_hidden_layers
    handle = offload.enable_activation_offload(model, "async", resident_groups=n, verbose=False)
    try:
        probes = {"plans": probe_plans, "host": probe_host, "profile": probe_profile, "lead": probe_lead}
        probes[args.probe](ctx, model, loss_fn, handle, n)
    finally:
        handle.disable()


if __name__ == "__main__":
    main()
