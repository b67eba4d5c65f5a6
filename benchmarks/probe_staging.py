"""Where a steady staged save's time goes on the device: a diagnostic, not a bench section.

`python benchmarks/probe_staging.py [--count 4000] [--kib 256] [--saves 20] [--trace DIR]`
on a GPU (from a checkout with offload installed). It stages one state dict of `count`
bf16 tensors of `kib` KiB again and again, as the staging bench does (the tensors
changed and the device synchronized before each save), and reports, per steady save:

- host:   the caller-blocked time (inside `stage()`), the staging time (`stage()` to
          `result()` returned) and the copy time the core timed on its copy stream;
- device: from a profiler trace of a few saves (CUPTI timestamps, on the host clock):
          when the first device-to-host DMA starts after `stage()` is entered, how long
          the DMAs take from the first start to the last end, their own rate, the gaps
          between them, and how long after the last DMA `result()` returns.

With `--phases` the stager's own steps (resolving the tree, the ring, the core's copy
call, the future's wait) are marked in the trace too, and their start and end after
`stage()` is entered are printed beside the DMAs'.

The staging time is the bench's measure (bytes over it, against the 50 GB/s target):
this splits it into the host's time before the first DMA, the DMA span and the host's
time after the last, so a change can be aimed at the part that is long.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_staging import _state  # noqa: E402  (the bench's own state dict)

import offload  # noqa: E402
from offload.core import _device  # noqa: E402


def _save(stager, state, device, marks: bool = False):
    """One save as the bench times it; (blocked ms, staged ms, the save's metrics)."""
    def mark(name):
        return torch.profiler.record_function(name) if marks else contextlib.nullcontext()

    for t in state["model"].values():
        t.add_(1)
    _device.synchronize(device)
    t0 = time.perf_counter()
    with mark("probe.stage"):
        future = stager.stage(state)
    t1 = time.perf_counter()
    with mark("probe.result"):
        future.result()
    t2 = time.perf_counter()
    del future
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, stager.metrics()[-1]


# The stager's steps marked by --phases: (owner, attribute) wrapped in a profiler range.
_PHASES = [
    ("AsyncStager", "_resolve"), ("AsyncStager", "_acquire_set"), ("AsyncStager", "_enqueue"),
    ("AsyncStager", "_read_timings"), ("StagingFuture", "__init__"), ("StagingFuture", "_finish"),
    ("StagingFuture", "_staged_dict"), (None, "copy_to_host"), ("CopyHandle", "synchronize"),
]


def _mark_phases() -> None:
    """Wraps each of _PHASES in a profiler range named after it (this process only)."""
    from offload.core import copy as _copy
    from offload.staging import stager as staging

    def marked(name, fn):
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return wrapper

    for owner, attr in _PHASES:
        target = staging if owner is None else getattr(staging, owner, None) or getattr(_copy, owner)
        name = f"phase.{attr}" if owner is None else f"phase.{owner}.{attr}"
        setattr(target, attr, marked(name, getattr(target, attr)))


class _Trace:
    """A Chrome trace of the traced saves, read once: its complete events, each save's host
    marks ((enter, stage() returned, result() returned), in us) and the device-to-host DMAs
    ((start, end, bytes), sorted)."""

    def __init__(self, path: str):
        with open(path) as f:
            self.events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        # The host-side ranges, not their copies on the GPU timeline.
        self.marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in self.events
                            if e.get("cat") == "user_annotation")
        stages = [m for m in self.marks if m[2] == "probe.stage"]
        results = [m for m in self.marks if m[2] == "probe.result"]
        self.saves = [(enter, returned, result_end)
                      for (enter, returned, _), (_, result_end, _) in zip(stages, results)]
        self.dmas = sorted((e["ts"], e["ts"] + e["dur"], int((e.get("args") or {}).get("bytes", 0)))
                           for e in self.events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", ""))

    def dmas_of(self, save) -> list:
        enter, _, result_end = save
        return [d for d in self.dmas if enter <= d[0] <= result_end]


def _phase_rows(trace: _Trace) -> list:
    """Per phase, the median start and end (us after `stage()` is entered) over the traced saves."""
    seen: dict = {}
    for enter, _, result_end in trace.saves:
        for start, end, name in trace.marks:
            if enter <= start <= result_end:
                seen.setdefault(name, []).append((start - enter, end - enter))
    return sorted((statistics.median(s for s, _ in v), statistics.median(e for _, e in v), name, len(v))
                  for name, v in seen.items())


def _edges(trace: _Trace) -> list:
    """The last traced save's host events (ranges and driver calls) before its first DMA and
    after its last, as (us from that DMA, duration us, name): what delays the first and what
    the host does once the last is done."""
    if not trace.saves:
        return []
    enter, _, end = trace.saves[-1]
    dmas = trace.dmas_of(trace.saves[-1])
    if not dmas:
        return []
    first, last = dmas[0][0], dmas[-1][1]
    host = [e for e in trace.events if e.get("cat") in ("user_annotation", "cuda_runtime", "cuda_driver", "cpu_op")]
    before = [(e["ts"] - first, e["dur"], e["name"]) for e in host if enter <= e["ts"] < first]
    after = [(e["ts"] - last, e["dur"], e["name"]) for e in host if last - 50 <= e["ts"] + e["dur"] and e["ts"] <= end]
    return [("before the first DMA", sorted(before)), ("around and after the last DMA", sorted(after))]


def _trace_rows(trace: _Trace) -> list:
    """Per profiled save: the DMA timeline against the host marks, in microseconds."""
    rows = []
    for save in trace.saves:
        enter, returned, result_end = save
        mine = trace.dmas_of(save)
        if not mine:
            continue
        busy = sum(end - start for start, end, _ in mine)
        gaps = [b[0] - a[1] for a, b in zip(mine, mine[1:])]
        nbytes = sum(d[2] for d in mine)
        rows.append({
            "dmas": len(mine),
            "first_dma_after_us": mine[0][0] - enter,
            "stage_returned_us": returned - enter,
            "dma_span_us": mine[-1][1] - mine[0][0],
            "dma_busy_us": busy,
            "dma_gbps": nbytes / busy / 1e3 if busy else None,
            "gaps_us": sum(gaps),
            "largest_gap_us": max(gaps, default=0.0),
            "result_after_last_dma_us": result_end - mine[-1][1],
            "total_us": result_end - enter,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--kib", type=int, default=256)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--traced", type=int, default=4, help="saves profiled after the timed ones")
    parser.add_argument("--trace", default=None, help="keep the Chrome trace in this folder")
    parser.add_argument("--phases", action="store_true", help="mark the stager's steps in the traced saves")
    args = parser.parse_args()
    device = _device.current_device()
    if not _device.is_accelerator(device):
        raise SystemExit("probe_staging.py needs an accelerator")
    state = _state(args.count, args.kib * 512, device)
    nbytes = args.count * args.kib * 1024
    stager = offload.AsyncStager()
    try:
        timed = [_save(stager, state, device) for _ in range(args.saves)]
        steady = timed[2:]
        blocked = statistics.median(b for b, _, _ in steady)
        staged = statistics.median(s for _, s, _ in steady)
        copy = statistics.median(m["copy_ms"] for _, _, m in steady if m["copy_ms"] is not None)
        print(f"{args.count} x {args.kib} KiB, saves 3-{args.saves}, medians: caller blocked {blocked:.3f} ms, "
              f"staging {staged:.3f} ms ({nbytes / staged / 1e6:.2f} GB/s), "
              f"core's copy time {copy:.3f} ms ({nbytes / copy / 1e6:.2f} GB/s)")
        folder = args.trace or tempfile.mkdtemp()
        if args.phases:
            _mark_phases()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.traced):
                _save(stager, state, device, marks=True)
        path = os.path.join(folder, f"staging_{args.count}x{args.kib}k.json")
        prof.export_chrome_trace(path)
    finally:
        stager.close()
    trace = _Trace(path)
    rows = _trace_rows(trace)
    if not rows:
        print("no device-to-host copies in the trace (a profiler without CUPTI?)")
        return
    print("traced saves (us; the profiler slows the host, not the DMAs):")
    keys = list(rows[0])
    print(" ".join(f"{k:>24}" for k in keys))
    for r in rows:
        print(" ".join(f"{r[k]:>24.1f}" if isinstance(r[k], float) else f"{r[k]:>24}" for k in keys))
    for title, edge in _edges(trace):
        print(f"last traced save, host events {title} (us from that DMA, duration us):")
        for at, dur, name in edge[:60]:
            print(f"  {at:10.1f} {dur:8.1f}  {name}")
    if args.phases:
        print("host ranges, medians over the traced saves (us after stage() is entered):")
        for start, end, name, count in _phase_rows(trace):
            print(f"  {start:10.1f} {end:10.1f}  {name} (x{count})")


if __name__ == "__main__":
    main()
