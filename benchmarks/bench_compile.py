"""Activation offload under a whole-model torch.compile, side by side in one run.

Per model (the activation section's block stack, and its Llama at seq 2048 with `transformers`;
small ones with --quick), each variant on its own copy of the model, compile caches reset
between them:

- `compiled`: `torch.compile(model)`, no offload (the baseline of every ratio);
- `torch_offload`: the same with torch's own compile-time offload pass
  (`torch._functorch.config.enable_activation_offloading`, on its separate stream, waits sunk,
  reloads prefetched), where this torch has it and on an accelerator;
- `async` and `auto`: `enable_activation_offload(model, mode)`, then `torch.compile(model)`;
  auto is also timed against `compiled` in alternation, both alive at once (its target's row);
- `eager` and `eager_async`: the model not compiled, without and with async offload (the peak
  that offload lowers in eager, which the compiled async should lower at least as much).

Each row: median step time (device events) against the compiled step, peak activation memory
above the idle model on an accelerator, bytes offloaded per step (`handle.stats()`), and the
graph breaks the variant's compile added (`torch._dynamo.utils.counters`). On an accelerator
the async step is also held against its bus bound, the activation section's: the compiled
forward's time or the offloaded bytes over the measured device-to-host bandwidth (the larger),
plus the same for backward and host-to-device. Targets: the async peak at most eager async's,
async within 1.05x of its bus bound, auto at most 1.03x the compiled step. Behind --full (or
`--only compile`): every variant compiles its model.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Optional

import torch

SECTION = "compile"
FULL_ONLY = True  # each variant compiles the model: minutes on one GPU, behind --full (or --only compile)
VARIANTS = ("compiled", "torch_offload", "async", "auto", "eager", "eager_async")
BASELINE = "the model compiled whole, no offload"
BUS_BOUND_TARGET = 1.05  # async step at most this multiple of its bus bound
AUTO_TARGET = 1.03  # auto step at most this multiple of the compiled step without offload


def applies(device_type: str) -> bool:
    return True


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _torch_offload_patch():
    """torch's own compile-time offload pass switched on, or None where this torch has none."""
    import torch._functorch.config as config  # a submodule torch does not import on every version

    if not hasattr(config, "enable_activation_offloading"):
        return None
    options = {"enable_activation_offloading": True}
    for name in ("activation_offload_separate_stream", "activation_offload_sink_wait", "activation_reload_prefetch"):
        if hasattr(config, name):
            options[name] = True
    return config.patch(**options)


def _measure(ctx, name: str, base, loss_of, min_tensor_bytes: int) -> dict:
    """One variant on its own copy of `base`: median step ms, peak bytes (None on the host),
    bytes offloaded per step, graph breaks its compile added."""
    import offload
    from common import time_and_peak, time_ms

    from offload.core import _device

    model = copy.deepcopy(base)
    torch._dynamo.reset()
    handle = None
    if name in ("async", "auto", "eager_async"):
        handle = offload.enable_activation_offload(model, "auto" if name == "auto" else "async",
                                                   min_tensor_bytes=min_tensor_bytes, verbose=False)
    runs = model if name.startswith("eager") else torch.compile(model)
    patch = _torch_offload_patch() if name == "torch_offload" else None
    scope = patch if patch is not None else contextlib.nullcontext()
    breaks = _graph_breaks()

    def step():
        model.zero_grad(set_to_none=False)  # gradients stay allocated: part of the idle model
        with scope:
            loss_of(runs).backward()

    try:
        step()  # the compile, and the gradients' first allocation
        breaks = _graph_breaks() - breaks
        timing, peak = time_and_peak(step, ctx.device, warmup=1 if ctx.quick else 3, iters=3 if ctx.quick else 10)
        if not _device.is_accelerator(ctx.device):
            peak = None  # the host has no allocator statistics
        stats = handle.stats() if handle is not None else {}
        plan = stats.get("compiled_plan") or {}
        result = {"ms": timing["median_ms"], "peak": peak, "offloaded": stats.get("d2h_bytes", 0),
                  "fetched": stats.get("h2d_bytes", 0), "graph_breaks": breaks,
                  "layers_offloaded": sum(plan.get("offload", [])), "plan_notes": list(plan.get("notes", []))}
        if name == "compiled":  # its forward alone (grad on: the training graph), for the bus bound
            result["forward_ms"] = time_ms(lambda: loss_of(runs), ctx.device, warmup=1,
                                           iters=3 if ctx.quick else 10)["median_ms"]
        return result
    finally:
        _release(handle)


def _alternated_auto(ctx, base, loss_of, min_tensor_bytes: int) -> dict:
    """Auto mode against the model compiled without offload, their steps taken in alternation with
    both compiled and alive at once: variants measured one after the other, minutes apart, drift
    by more than the 3% sought on a step of a few milliseconds."""
    import offload
    from common import compare_ms

    torch._dynamo.reset()
    plain, auto = copy.deepcopy(base), copy.deepcopy(base)
    handle = offload.enable_activation_offload(auto, "auto", min_tensor_bytes=min_tensor_bytes, verbose=False)
    compiled = {id(plain): torch.compile(plain), id(auto): torch.compile(auto)}

    def step(model):
        model.zero_grad(set_to_none=False)
        loss_of(compiled[id(model)]).backward()

    try:
        step(plain)
        step(auto)
        ours, theirs = compare_ms(lambda: step(auto), lambda: step(plain), ctx.device,
                                  warmup=1 if ctx.quick else 3, iters=3 if ctx.quick else 15)
        plan = handle.stats().get("compiled_plan") or {}
        return {"auto_ms": ours["median_ms"], "compiled_ms": theirs["median_ms"],
                "layers_offloaded": sum(plan.get("offload", []))}
    finally:
        _release(handle)


def _release(handle) -> None:
    """After a variant: its handle disabled, its compiled code and memory let go for the next one."""
    from offload.core import _device

    if handle is not None:
        handle.disable()
    torch._dynamo.reset()
    gc.collect()
    _device.empty_cache()


def _print_variant(label: str, name: str, r: dict) -> None:
    """One variant's figures as soon as it is measured: each compiles its model, minutes in all."""
    peak = "-" if r["peak"] is None else f"{r['peak'] / 2**30:.3f} GiB"
    print(f"  {label} {name:14} {r['ms']:9.2f} ms, peak {peak:>10}, {r['offloaded'] / 2**20:8.1f} MiB offloaded, "
          f"{r['graph_breaks']} graph breaks" + "".join(f"; {note}" for note in r.get("plan_notes", [])), flush=True)


def _bus_bound_ms(base: dict, r: dict, bandwidth) -> Optional[float]:
    """`common.bus_bound_ms` of variant `r`, the compiled step `base` timing its passes; None without
    a measured bus."""
    from common import bus_bound_ms

    d2h_bw, h2d_bw = bandwidth
    if not d2h_bw or not h2d_bw or "forward_ms" not in base:
        return None
    forward_ms = base["forward_ms"]
    return bus_bound_ms(forward_ms, max(base["ms"] - forward_ms, 0.0), r["offloaded"], r["fetched"], d2h_bw, h2d_bw)


def _rows(ctx, label: str, results: dict, bandwidth) -> list:
    from common import row

    base = results["compiled"]
    rows = []
    for name, r in results.items():
        if name == "auto_alternated":
            continue
        extra = dict(variant=name, offloaded_bytes=r["offloaded"], graph_breaks=r["graph_breaks"], peak_bytes=r["peak"],
                     layers_offloaded=r.get("layers_offloaded"), plan_notes=r.get("plan_notes"))
        if name != "compiled":
            rows.append(row(SECTION, f"{label} {name} step", offload=r["ms"], baseline=base["ms"], unit="ms",
                            baseline_name=BASELINE, higher_is_better=False, **extra))
        if r["peak"] is not None and base["peak"]:
            targets = {}
            eager = results.get("eager_async")
            if name == "async" and eager is not None and eager["peak"] is not None:
                targets = dict(target="<= eager async's peak", target_met=r["peak"] <= eager["peak"],
                               eager_async_peak_bytes=eager["peak"])
            rows.append(row(SECTION, f"{label} {name} peak", offload=r["peak"] / 2**30, baseline=base["peak"] / 2**30,
                            unit="GiB", baseline_name=BASELINE, higher_is_better=False, **extra, **targets))
    paired = results.get("auto_alternated")
    if paired is not None:
        ratio = paired["auto_ms"] / paired["compiled_ms"]
        print(f"  {label} auto {paired['auto_ms']:.2f} ms against compiled {paired['compiled_ms']:.2f} ms, "
              f"alternated ({ratio:.3f}x, {paired['layers_offloaded']} layers offloaded)", flush=True)
        rows.append(row(SECTION, f"{label} auto step, alternated", offload=paired["auto_ms"],
                        baseline=paired["compiled_ms"], unit="ms", baseline_name=BASELINE, higher_is_better=False,
                        variant="auto_alternated", layers_offloaded=paired["layers_offloaded"], target=f"<= {AUTO_TARGET:.2f}x",
                        target_met=ratio <= AUTO_TARGET))
    bound = _bus_bound_ms(base, results["async"], bandwidth) if "async" in results else None
    if bound:
        ms = results["async"]["ms"]
        print(f"  {label} async {ms:.1f} ms against its bus bound {bound:.1f} ms ({ms / bound:.2f}x)", flush=True)
        rows.append(row(SECTION, f"{label} async vs bus bound", offload=ms, baseline=bound, unit="ms",
                        baseline_name="bus bound", higher_is_better=False, target=f"<= {BUS_BOUND_TARGET:.2f}x",
                        target_met=ms <= BUS_BOUND_TARGET * bound))
    return rows


def _cases(ctx):
    """(label, model, loss of the module that runs it, min_tensor_bytes) per model this run takes."""
    from bench_activation import llama_case, stack_case

    min_bytes = 0 if ctx.quick else 1 << 20
    model, loss_of = stack_case(ctx)
    yield ("blocks 4x32 quick" if ctx.quick else "blocks 8x4096 bs2 seq4096"), model, loss_of, min_bytes
    del model, loss_of
    try:
        import transformers  # noqa: F401
    except ImportError:
        ctx.skip("compile: Llama rows", "needs transformers (not installed)")
        return
    seq = 32 if ctx.quick else 2048
    model, loss_of = llama_case(ctx, seq)
    yield f"llama seq{seq}", model, loss_of, min_bytes


def run(ctx):
    from bench_activation import _bandwidth

    from offload.core import _device

    bandwidth = _bandwidth(ctx.device) if _device.is_accelerator(ctx.device) else (None, None)
    threads = torch.get_num_threads()
    if not _device.is_accelerator(ctx.device):
        torch.set_num_threads(1)  # tiny CPU models: no spin-wait contention on a shared host
    rows = []
    try:
        for label, model, loss_of, min_bytes in _cases(ctx):
            results = {}
            for name in VARIANTS:
                served = _device.is_accelerator(ctx.device) and _torch_offload_patch() is not None
                if name == "torch_offload" and not served:
                    ctx.skip(f"compile: {label} torch_offload", "torch's offload pass needs an accelerator and a "
                             "torch that has it")
                    continue
                ctx.progress(f"compile: {label}: {name}")
                try:
                    results[name] = _measure(ctx, name, model, loss_of, min_bytes)
                    _print_variant(label, name, results[name])
                except Exception as exc:  # noqa: BLE001 - torch's own pass is marked experimental
                    if name != "torch_offload":
                        raise
                    # A failure of torch's pass on this model is a finding of the comparison, not
                    # a reason to lose the other variants' rows.
                    ctx.skip(f"compile: {label} torch_offload", f"torch's offload pass failed: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
            ctx.progress(f"compile: {label}: auto against compiled, alternated")
            results["auto_alternated"] = _alternated_auto(ctx, model, loss_of, min_bytes)
            rows += _rows(ctx, label, results, bandwidth)
            del model
    finally:
        torch.set_num_threads(threads)
    return rows
