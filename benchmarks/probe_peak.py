"""What is live on the device at a training step's peak, by where it was allocated: a diagnostic,
not a bench section.

`python benchmarks/probe_peak.py [--model blocks|llama] [--variants compiled_async eager_async]`
(from a checkout with offload installed, on an accelerator). For each variant it runs the bench's
model (the activation section's block stack, or its Llama at seq 2048) with async offload, three
warm-up steps, then records the allocator's allocations and frees through one more step and
prints, at the step's peak:

- the peak above the memory allocated when the step began (the idle model and its gradients);
- the bytes allocated in the step and still live there, summed by allocation site (the first
  stack frame in offload, in inductor's generated code, or in the model; else the innermost);
- the largest of those blocks with their stacks.

Where a compiled step's peak stands above eager's, this says what holds it: restored groups
(offload's transport), the compiled backward's outputs (each parameter's gradient, alive until
its graph returns), or inductor's own buffers. A block is named by the site that allocated it:
inductor's generated code hands a dead buffer's memory to a later buffer of the same size
(`reinterpret_tensor(...)  # reuse`), so a restored group's block may hold a gradient by the
peak and still count under `group_prefetch`; read the sizes beside the sites.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import torch

HERE = Path(__file__).resolve().parent
# Files whose frames name a site better than the allocator's innermost frame.
_SITE_MARKS = ("torchinductor", "/offload/", "bench_activation", "modeling_")


@dataclass
class PeakComposition:
    """A step's peak from an allocator trace: bytes above the step's start, the trace event at
    which it came, and the live blocks allocated in the step, summed per site, largest first."""

    peak_bytes: int
    at_event: int
    by_site: List[Tuple[str, int, int]] = field(default_factory=list)  # (site, bytes, blocks)
    largest: List[Tuple[int, List[str]]] = field(default_factory=list)  # (bytes, stack), largest first


def site_of(frames) -> str:
    """The frame that names where a block was allocated (see _SITE_MARKS), as file:line function."""
    chosen = next((f for f in frames if any(mark in f["filename"] for mark in _SITE_MARKS)), None)
    if chosen is None and frames:
        chosen = frames[0]
    if chosen is None:
        return "(no stack)"
    return f"{Path(chosen['filename']).name}:{chosen['line']} {chosen['name']}"


def peak_composition(trace: List[dict], top: int = 12) -> PeakComposition:
    """The peak of the bytes allocated and not yet freed over `trace` (an allocator's device trace:
    `alloc` and `free_completed` events with `addr`, `size` and `frames`), counted from the trace's
    start; a free of a block allocated before the trace began is not counted."""
    live: Dict[int, dict] = {}
    current = peak = 0
    at_event, at_peak = -1, {}
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_event, at_peak = current, i, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    sites: Dict[str, List[int]] = {}
    for event in at_peak.values():
        entry = sites.setdefault(site_of(event.get("frames", [])), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    by_site = sorted(((s, b, n) for s, (b, n) in sites.items()), key=lambda row: -row[1])[:top]
    largest = [(e["size"], [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in e.get("frames", [])[:6]])
               for e in sorted(at_peak.values(), key=lambda e: -e["size"])[:top]]
    return PeakComposition(peak, at_event, by_site, largest)


def _case(ctx, model: str):
    from bench_activation import llama_case, stack_case

    return stack_case(ctx) if model == "blocks" else llama_case(ctx, 2048)


def _measure(ctx, model_name: str, variant: str) -> PeakComposition:
    import offload
    from offload.core import _device

    torch._dynamo.reset()
    gc.collect()
    _device.empty_cache()
    base, loss_of = _case(ctx, model_name)
    model = copy.deepcopy(base)
    del base
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=1 << 20, verbose=False)
    runs = torch.compile(model) if variant.startswith("compiled") else model

    def step():
        model.zero_grad(set_to_none=False)
        loss_of(runs).backward()

    try:
        for _ in range(3):
            step()
        _device.synchronize(ctx.device)
        _device.record_memory_history(ctx.device, True)
        try:
            step()
            _device.synchronize(ctx.device)
            snapshot = _device.memory_snapshot(ctx.device)
        finally:
            _device.record_memory_history(ctx.device, False)
        index = ctx.device.index or 0
        return peak_composition(snapshot["device_traces"][index])
    finally:
        handle.disable()


def _print(label: str, found: PeakComposition) -> None:
    gib = float(1 << 30)
    print(f"{label}: peak {found.peak_bytes / gib:.3f} GiB above the step's start (trace event {found.at_event})")
    for site, nbytes, blocks in found.by_site:
        print(f"   {nbytes / gib:7.3f} GiB  {blocks:4d} blocks  {site}")
    print("   largest blocks:")
    for nbytes, stack in found.largest:
        print(f"   {nbytes / gib:7.3f} GiB  " + " | ".join(stack))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["blocks", "llama"], default="blocks")
    parser.add_argument("--variants", nargs="+", choices=["compiled_async", "eager_async"],
                        default=["compiled_async", "eager_async"])
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from common import Context

    from offload.core import _device

    device = _device.current_device()
    if not _device.is_accelerator(device):
        print("probe_peak: needs an accelerator (the allocator's trace is a device allocator's)", file=sys.stderr)
        return 2
    for variant in args.variants:
        _print(f"{args.model} {variant}", _measure(Context(device=device), args.model, variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
