"""Activation memory frontier: auto mode with a memory budget against checkpointing or
offloading the first k layers.

For budgets from the step's peak without offload down to full checkpointing's, the budget
plan's (peak, step time) against the hand-written plans: "checkpoint the first k layers"
(torch's non-reentrant checkpoint, as the planner's recompute) and "offload the first k
layers" (mode async). Each budget row compares the plan's step with the fastest hand-written
plan whose measured peak is at or below the plan's own measured peak (ratio > 1: the planner
is faster). Models: the activation section's stack of blocks and its Llama at seq 8192 (quick:
their small shapes on the CPU, where the device keeps no memory statistics and the peaks are
the planner's predictions).
"""

from __future__ import annotations

import gc

import torch
from bench_activation import _llama, _measure, _stack
from common import row

import offload
from offload.core import _device

SECTION = "frontier"
GiB = float(1 << 30)
SETTLE_STEPS = 40  # steps a budget plan may take to be measured, made and checked


def applies(device_type: str) -> bool:
    return True


def _handle(model, ctx, mode, **kw):
    import warnings

    with warnings.catch_warnings():  # keep_first covering every layer warns that nothing is offloaded
        warnings.simplefilter("ignore")
        return offload.enable_activation_offload(model, mode, min_tensor_bytes=0 if ctx.quick else (1 << 20),
                                                 verbose=False, **kw)


def _point(ctx, model, loss_fn, iters, handle, settle=False):
    """(step ms, peak activation bytes, handle stats) of the model with `handle` active."""
    def step():
        model.zero_grad(set_to_none=False)
        loss_fn().backward()

    if settle:
        for _ in range(SETTLE_STEPS):
            plan = handle.plan
            if plan is not None and plan.get("check", {}).get("settled"):
                break
            step()
    try:
        return _measure(ctx, model, loss_fn, "frontier", iters, handle)
    finally:
        handle.disable()
        gc.collect()
        _device.empty_cache()


def _model_frontier(ctx, name, model, loss_fn):
    iters = 2 if ctx.quick else 5
    probe = _handle(model, ctx, "auto", memory_budget_bytes=1 << 50)
    n = len(probe.layers)
    _point(ctx, model, loss_fn, iters, probe, settle=True)
    plan = probe.plan
    keep_all, least = plan["predicted_peak_bytes"], plan["least_peak_bytes"]
    stats_device = _device.is_accelerator(ctx.device)
    curves = {}
    for family in ("checkpoint", "offload"):
        for k in range(n + 1):
            ctx.progress(f"{name}: {family} first {k}")
            if family == "checkpoint":
                handle = _handle(model, ctx, "async", keep_first=n, keep_last=0)
                handle.set_recomputed([i < k for i in range(n)])
            else:
                handle = _handle(model, ctx, "async", keep_first=0, keep_last=n - k)
            ms, peak, _ = _point(ctx, model, loss_fn, iters, handle)
            curves.setdefault(family, []).append((k, ms, peak))
    rows = []
    none_ms = curves["checkpoint"][0][1]
    for family, points in curves.items():
        for k, ms, peak in points:
            rows.append(row(SECTION, f"{name} {family} first {k}", offload=ms, baseline=none_ms, unit="ms",
                            baseline_name="no offload", higher_is_better=False, peak_bytes=peak, family=family, k=k))
    steps = 3 if ctx.quick else 8
    for j in range(steps):
        budget = int(keep_all - (keep_all - least) * j / (steps - 1))
        ctx.progress(f"{name}: budget {budget / GiB:.2f} GiB")
        handle = _handle(model, ctx, "auto", memory_budget_bytes=budget)
        ms, peak, stats = _point(ctx, model, loss_fn, iters, handle, settle=True)
        plan = stats["plan"] or {}
        own_peak = peak if stats_device else plan.get("predicted_peak_bytes", 0)
        fitting = [(m, f, k) for f, points in curves.items() for k, m, p in points
                   if (p if stats_device else 0) <= own_peak]
        best = min(fitting) if fitting else (None, None, None)
        line = (f"  budget {budget / GiB:.3f} GiB: plan {plan.get('kinds')} {ms:.1f} ms peak {own_peak / GiB:.3f} GiB "
                f"(predicted {plan.get('predicted_step_ms', 0):.1f} ms, {plan.get('predicted_peak_bytes', 0) / GiB:.3f}"
                f" GiB); best hand-written at or below its peak: {best[1]} first {best[2]} {best[0]}")
        print(line, flush=True)
        label = f"{budget / GiB:.2f} GiB" if budget >= GiB / 8 else f"{budget / 2**20:.2f} MiB"
        rows.append(row(SECTION, f"{name} budget {label}", offload=ms, baseline=best[0], unit="ms",
                        baseline_name="best of checkpoint / offload first k at or below its peak",
                        higher_is_better=False, budget_bytes=budget, peak_bytes=peak,
                        predicted_step_ms=plan.get("predicted_step_ms"),
                        predicted_peak_bytes=plan.get("predicted_peak_bytes"),
                        predicted_recompute_ms=plan.get("predicted_recompute_ms"),
                        measured_step_ms=plan.get("check", {}).get("measured_step_ms"),
                        kinds=plan.get("kinds"), budget_met=plan.get("budget_met"),
                        baseline_family=best[1], baseline_k=best[2]))
    return rows


def run(ctx):
    threads = torch.get_num_threads()
    if not _device.is_accelerator(ctx.device):
        torch.set_num_threads(1)
    try:
        rows = []
        model, loss_fn = _stack(ctx)
        rows += _model_frontier(ctx, "blocks 4x32 quick" if ctx.quick else "blocks 8x4096 bs2 seq4096", model, loss_fn)
        del model, loss_fn
        gc.collect()
        _device.empty_cache()
        try:
            import transformers  # noqa: F401
        except ImportError:
            ctx.progress("transformers is not installed: Llama rows skipped")
            return rows
        seq = 32 if ctx.quick else 8192
        model, loss_fn = _llama(ctx, seq)
        rows += _model_frontier(ctx, f"llama seq{seq}", model, loss_fn)
        return rows
    finally:
        torch.set_num_threads(threads)
