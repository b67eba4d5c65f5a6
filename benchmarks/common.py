"""What every benchmark shares: event timers, a result row, and the run context.

A benchmark module `bench_<topic>.py` defines:
    SECTION = "<topic>"
    REQUIRES = ("transformers",)               # optional: modules without which it is skipped
    FULL_ONLY = True                           # optional: runs only with --full (or named in --only)
    def applies(device_type: str) -> bool      # 'cuda', 'npu' or 'cpu'
    def run(ctx: Context) -> list[dict]        # rows made with `row(...)`
and `python -m benchmarks` (benchmarks/runner.py) finds and runs it. Rows a section
leaves out are recorded with `ctx.skip(what, reason)`; sizes that only `--full` runs
are chosen with `ctx.full`.

Fields of a row beyond `row()`'s own that the report reads:
    headline="<capability: case>"   the row stands for its capability in the headline table
    target_met=True|False           the section's target for this row (with target="<= 1.05x",
                                    or target_ratio=); a missed one shows as MISSED in the report
    figure="activation"             (a) with model=, way=, peak_bytes=
    figure="transfer"               (b) with direction=, bytes_per_tensor=, tensors=
    figure="staging_weight_sync"    (c) with panel="blocked"|"gbps", group=, and bytes= on ms rows
    figure="frontier"               (d) with model=, peak_bytes=, and family=, k= or budget_bytes=
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from offload.core import _device


def missing(module: str) -> bool:
    """Whether `module` cannot be imported, without importing it."""
    if module in sys.modules:
        return sys.modules[module] is None  # None marks a module known to be absent
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def host_memory() -> str:
    """How rows name the host buffers a baseline copies into: "pinned" where the runtime pins
    host memory, "host" on a CPU-only torch, which has no pinned memory."""
    return "pinned" if _device.pinned_memory_supported() else "host"


@dataclass
class Context:
    device: torch.device
    quick: bool = False  # smaller sizes and fewer repeats (CPU, smoke runs)
    full: bool = False  # the long sizes and sweeps (--full) beside the default selection
    progress: Callable[[str], None] = print
    notes: dict = field(default_factory=dict)  # measured ceilings shared between sections
    skipped: list = field(default_factory=list)  # {"what", "reason"} of rows left out

    def skip(self, what: str, reason: str) -> None:
        """Record rows left out (a model that needs a missing package, a case that needs 2 GPUs)."""
        self.skipped.append({"what": what, "reason": reason})
        self.progress(f"skipped {what}: {reason}")

    @property
    def device_type(self) -> str:
        return self.device.type


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 10) -> dict:
    """Median and spread of fn() in milliseconds, timed with device events after warm-up.

    Each repeat is timed on its own, so the spread shows noise from other tenants.
    """
    for _ in range(warmup):
        fn()
    _device.synchronize(device)
    samples = []
    for _ in range(iters):
        # What fn returns (outputs, handles) is released after the end event, on
        # both sides alike: freeing thousands of outputs is not part of the transfer.
        if _device.is_accelerator(device):
            start, end = _device.new_event(device, timing=True), _device.new_event(device, timing=True)
            start.record(_device.current_stream(device))
            result = fn()
            end.record(_device.current_stream(device))
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            result = fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        del result
    return summarize(samples)


def time_and_peak(step: Callable[[], object], device: torch.device, warmup: int, iters: int) -> tuple:
    """(`time_ms` of `step`, the device's peak allocated bytes while it ran above what was allocated
    before it: 0 on the host). Garbage is collected and the device synchronized first, so the
    idle reading holds only what outlives a step."""
    import gc

    gc.collect()
    _device.synchronize(device)
    idle = _device.memory_allocated(device)
    _device.reset_peak_memory_stats(device)
    timing = time_ms(step, device, warmup=warmup, iters=iters)
    return timing, _device.max_memory_allocated(device) - idle


def compare_ms(offload_fn: Callable[[], object], baseline_fn: Callable[[], object], device: torch.device,
               warmup: int = 3, iters: int = 10):
    """(offload, baseline) timings taken in alternation, so that drift on a shared
    machine (another tenant's traffic on the bus) lands on both sides alike."""
    a, b = [], []
    for _ in range(iters):
        a.append(time_ms(offload_fn, device, warmup=warmup, iters=1)["median_ms"])
        b.append(time_ms(baseline_fn, device, warmup=warmup if not b else 1, iters=1)["median_ms"])
        warmup = 1
    return summarize(a), summarize(b)


def time_host_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 10) -> dict:
    """Wall-clock of fn() including a device synchronize at the end (for host-side work)."""
    for _ in range(warmup):
        fn()
        _device.synchronize(device)
    samples = []
    for _ in range(iters):
        _device.synchronize(device)
        t0 = time.perf_counter()
        fn()
        _device.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


def time_ranks_ms(fn: Callable[[], object], device: torch.device, iters: int) -> list:
    """Host wall-clock ms of fn() in each of `iters` repeats after one warm-up, every rank of the
    process group leaving a barrier together before each and its device drained at both ends:
    a transfer between processes, timed as each side sees it."""
    import torch.distributed as dist

    samples = []
    for i in range(iters + 1):  # the first is warm-up (buffers allocated and shared, plans sent)
        dist.barrier()
        _device.synchronize(device)
        t0 = time.perf_counter()
        fn()
        _device.synchronize(device)
        if i:
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def summarize(samples_ms) -> dict:
    samples = sorted(samples_ms)
    return {
        "median_ms": statistics.median(samples),
        "min_ms": samples[0],
        "max_ms": samples[-1],
        "spread_pct": 100.0 * (samples[-1] - samples[0]) / max(statistics.median(samples), 1e-9),
        "samples": len(samples),
    }


def bus_bound_ms(forward_ms: float, backward_ms: float, d2h_bytes: int, h2d_bytes: int, d2h_gbps: float,
                 h2d_gbps: float) -> float:
    """A step's floor where its copies do not hide under compute: per pass, the larger of the pass's
    time without offload and the bytes it copies over the measured bus."""
    return max(forward_ms, d2h_bytes / (d2h_gbps * 1e9) * 1e3) + max(backward_ms, h2d_bytes / (h2d_gbps * 1e9) * 1e3)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")


def row(
    section: str,
    case: str,
    *,
    offload: float,
    baseline: Optional[float],
    unit: str,
    baseline_name: str,
    higher_is_better: bool = True,
    **extra,
) -> dict:
    """One line of the table: offload and the PyTorch baseline side by side, and their ratio.

    ratio > 1 always means offload is better, whatever the unit.
    """
    ratio = None
    if baseline not in (None, 0) and offload not in (None, 0):
        ratio = offload / baseline if higher_is_better else baseline / offload
    return {
        "section": section,
        "case": case,
        "offload": offload,
        "baseline": baseline,
        "baseline_name": baseline_name,
        "unit": unit,
        "ratio": ratio,
        **extra,
    }


def spawn_ranks(target, world: int, args: tuple, what: str):
    """Run target(rank, init_method, *args, bench_dir, results) in `world` spawned processes
    and return what rank 0 put in `results`; `what` names the run in the error when a rank fails."""
    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    results = spawn.SimpleQueue()
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    # A file rendezvous: a TCP port picked free here could be taken before rank 0 binds it.
    folder = tempfile.mkdtemp(prefix="offload-bench-ranks-")
    init_method = "file://" + os.path.join(folder, "rdzv")
    procs = [spawn.Process(target=target, args=(r, init_method, *args, bench_dir, results)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=900)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(folder, ignore_errors=True)
    if any(p.exitcode != 0 for p in procs) or results.empty():
        raise RuntimeError(f"{what} ranks exited with {[p.exitcode for p in procs]}")
    return results.get()
