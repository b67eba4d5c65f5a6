"""Activation offload: training-step time and peak device memory against PyTorch's own ways.

Models: a stack of 8 transformer blocks (hidden 4096, 32 heads, MLP 4x, bf16, batch 2,
sequence 4096 on a GPU) and, with --full (or --quick, tiny), a Llama-architecture model
from `transformers` built from a config with random weights, at two sequence lengths.
Columns, in one process:
no offload; `save_on_cpu(pin_memory=True)`; per-layer activation checkpointing; offload
`sync`, `async`, `auto`; offload with checkpointing.

Peak memory is peak activation memory: the peak above the model with its gradients
allocated (gradients are zeroed, not freed, between steps), as users read a memory budget.
Counting gradients instead would put the peak of every checkpointed column at the end of
backward, where all gradients exist and only the first layer's input (the model's input,
not an activation) is left to offload, so it could not show what offload saves.

Auto mode times its plan against steps without offload in its first steps; its column
warms up until the plan has settled, then measures like the others.

Besides step time (ratio to no offload) and peak device memory it reports the exposed
copy time and the bus bound: forward time of the
no-offload step vs offloaded bytes over the measured device-to-host bandwidth (the larger
of the two), plus the same for backward with host-to-device. Offload with checkpointing is
also timed against checkpointing alone with their steps alternated (`_alternated_checkpoint`),
and the settled auto plan against steps without offload (`handle.paused()`) likewise
(`_alternated_paused`).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch
import torch.nn.functional as F
from common import bus_bound_ms, gbps, host_memory, row, time_and_peak, time_ms
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.core import _device
from offload.activation.auto.planner import max_tuning_steps

SECTION = "activation"
ALTERNATED_ROUNDS = 15
GiB = float(1 << 30)


def applies(device_type: str) -> bool:
    return True


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.n2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Stack(nn.Module):
    def __init__(self, d, heads, n):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n))
        self.checkpointing = False

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return x.float().square().mean()

    def set_checkpointing(self, on: bool) -> None:
        self.checkpointing = on


def _llama(ctx, seq):
    model, loss_of = llama_case(ctx, seq)
    return model, lambda: loss_of(model)


def llama_case(ctx, seq):
    """The bench's Llama (a tiny one with ctx.quick) and its loss as a function of the module that runs it
    (the model itself, or a compiled wrapper of it)."""
    import transformers

    if ctx.quick:
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    else:
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                          num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                                          max_position_embeddings=32768)
    config._attn_implementation = "sdpa"
    with torch.device(ctx.device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16 if _device.is_accelerator(ctx.device) else torch.float32).train()

    def set_checkpointing(on: bool) -> None:
        if on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()

    model.set_checkpointing = set_checkpointing
    ids = torch.randint(0, config.vocab_size, (1, seq), device=ctx.device)
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def _stack(ctx):
    model, loss_of = stack_case(ctx)
    return model, lambda: loss_of(model)


def stack_case(ctx):
    """The block stack (a small one with ctx.quick) and its loss as a function of the module that runs it."""
    d, heads, n, batch, seq = (32, 4, 4, 2, 32) if ctx.quick else (4096, 32, 8, 2, 4096)
    dtype = torch.bfloat16 if _device.is_accelerator(ctx.device) else torch.float32
    with torch.device(ctx.device):
        model = Stack(d, heads, n).to(dtype)
    x = torch.randn(batch, seq, d, device=ctx.device, dtype=dtype)
    return model, lambda m: m(x)


def _bandwidth(device, rounds: int = 3):
    """Measured (d2h, h2d) GB/s of one large copy through the copy engine, each way.

    Device-side, both ways: the compute stream waits for the copy (`wait_stream`) between
    the timing events, so no host wait lands in the timed region. The best of `rounds`
    rounds of 5 copies each counts: another tenant's traffic only ever slows a copy, and a
    low figure would make the bus bound (and the hideable bytes) look easier than they are.
    """
    if not _device.is_accelerator(device):
        return None, None
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    host = offload.copy_to_host([src]).wait()
    d2h_ms, h2d_ms = [], []
    for _ in range(rounds):
        d2h_ms.append(time_ms(lambda: offload.copy_to_host([src], out=host).wait_stream(), device,
                              warmup=1, iters=5)["min_ms"])
        h2d_ms.append(time_ms(lambda: offload.copy_to_device(host, device).wait_stream(), device,
                              warmup=1, iters=5)["min_ms"])
    return gbps(src.numel(), min(d2h_ms)), gbps(src.numel(), min(h2d_ms))


def _measure(ctx, model, loss_fn, column, iters, handle=None):
    """Median step time, peak activation bytes (above the idle model and its gradients), counters."""
    wrapper = contextlib.nullcontext
    if column == "save_on_cpu":
        def wrapper():
            return torch.autograd.graph.save_on_cpu(pin_memory=_device.pinned_memory_supported())

    def step():
        model.zero_grad(set_to_none=False)  # gradients stay allocated: part of the idle model
        with wrapper():
            loss = loss_fn()
        loss.backward()

    warmup = 1 if ctx.quick else 2
    for _ in range(warmup):
        step()
    if column.startswith("auto"):
        # Auto mode settles after 2-3 measured steps and a few probes of 14-26 steps each (more
        # while a verdict is unsure), at most max_tuning_steps: no probe step is timed as the plan's.
        for _ in range(max_tuning_steps(len(handle.layers))):
            plan = handle.plan
            if plan is not None and plan["tuning"]["settled"]:
                break
            step()
        step()  # one step of the settled plan before timing it (its first allocates)
    model.zero_grad(set_to_none=False)
    timing, peak = time_and_peak(step, ctx.device, warmup=0, iters=iters)
    stats = handle.stats() if handle is not None else None
    # The spread tells a plan that is sometimes slow from one that always is.
    print(f"  .. {column}: step ms min {timing['min_ms']:.1f} median {timing['median_ms']:.1f} "
          f"max {timing['max_ms']:.1f}", flush=True)
    return timing["median_ms"], peak, stats


def _forward_ms(ctx, model, loss_fn, iters):
    def forward():
        loss_fn()  # the graph is dropped right away; its activations were saved all the same

    return time_ms(forward, ctx.device, warmup=1, iters=iters)["median_ms"]


def _columns(ctx, name, model, loss_fn, bandwidth):
    iters = 2 if ctx.quick else 5
    # Alternated comparisons (the targets of auto and of offload with checkpointing): medians of
    # more rounds, since a launch-bound step (Llama seq 2048) varies by several percent from
    # step to step on these hosts, more than the 3% sought.
    rounds = 2 if ctx.quick else ALTERNATED_ROUNDS
    results = {}
    quiet = {"verbose": ctx.quick is False}
    for column in ("none", "save_on_cpu", "checkpoint", "sync", "async", "auto", "async+checkpoint"):
        ctx.progress(f"{name}: {column}")
        handle = None
        if column == "checkpoint" or column.endswith("+checkpoint"):
            model.set_checkpointing(True)
        if column in ("sync", "async", "auto", "async+checkpoint"):
            mode = column.split("+")[0]
            handle = offload.enable_activation_offload(model, mode, min_tensor_bytes=0 if ctx.quick else (1 << 20),
                                                       **quiet)
        try:
            results[column] = _measure(ctx, model, loss_fn, column, iters, handle)
            if column == "auto":
                auto_alternated = _alternated_paused(ctx, model, loss_fn, handle, rounds)
        finally:
            if handle is not None:
                handle.disable()
            model.set_checkpointing(False)
            gc.collect()
            _device.empty_cache()
    forward = _forward_ms(ctx, model, loss_fn, iters)
    results["alternated"] = _alternated_checkpoint(ctx, model, loss_fn, rounds)
    results["auto_alternated"] = auto_alternated
    return results, forward


def _alternated(ctx, model, loss_fn, rounds, ours, theirs):
    """(ours, theirs) median step ms, the two taken in alternation: each round runs a step
    inside the context `ours()` and one inside `theirs()`, so that drift between the columns
    (3-5% within a run on these hosts) lands on both alike.

    The steps run back to back, as a training loop runs them: the host issues the next step
    while the device still runs this one, and each step's time is the device's, from an event
    at its start to one at the next step's start. Synchronizing before each timed step instead
    starts every step on an idle device, waiting for the host's first launches, and so counts
    host work of the hooks that a training loop hides behind the previous step's backward.
    The first round is not counted (it starts on an idle device).
    """

    def step():
        model.zero_grad(set_to_none=False)
        loss_fn().backward()

    accelerator = _device.is_accelerator(ctx.device)

    def mark():
        if not accelerator:
            return time.perf_counter()
        event = _device.new_event(ctx.device, timing=True)
        event.record(_device.current_stream(ctx.device))
        return event

    _device.synchronize(ctx.device)
    marks = [mark()]
    for _ in range(rounds + 1):
        for context in (ours, theirs):
            with context():
                step()
            marks.append(mark())
    _device.synchronize(ctx.device)
    if accelerator:
        spans = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    else:
        spans = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    spans = spans[2:]  # the first round
    return statistics.median(spans[0::2]), statistics.median(spans[1::2])


def _alternated_paused(ctx, model, loss_fn, handle, rounds):
    """(offloaded, paused) median step ms of a settled handle, steps alternated: steps inside
    `handle.paused()` run exactly as without offload, and the plan stays."""
    return _alternated(ctx, model, loss_fn, rounds, contextlib.nullcontext, handle.paused)


def _alternated_checkpoint(ctx, model, loss_fn, rounds):
    """(async+checkpoint, checkpoint) median step ms, the two taken in alternation.

    The columns above run one after the other, and on these shared hosts a launch-bound
    model's steps drift between columns by more than the difference sought (Llama at seq
    2048: checkpointing alone 37-63 ms in different columns of one process). Here each round
    times a step of each, one handle active for one and paused for the other (a paused step
    runs as without offload), so drift lands on both alike (see `_alternated`). (A handle
    enabled and disabled every round put the wrapping's garbage, and the collector runs it
    brings, into the offloaded side only.)
    """
    model.set_checkpointing(True)
    handle = offload.enable_activation_offload(model, "async", min_tensor_bytes=0 if ctx.quick else (1 << 20),
                                               verbose=False)
    try:
        return _alternated(ctx, model, loss_fn, rounds, contextlib.nullcontext, handle.paused)
    finally:
        handle.disable()
        model.set_checkpointing(False)
        gc.collect()
        _device.empty_cache()


def _report(ctx, name, results, forward_ms, bandwidth, headline=False):
    """Rows of one model; `headline`: its async rows stand for activation offload in the headline table."""
    rows = []
    none_ms, none_peak, _ = results["none"]
    d2h_bw, h2d_bw = bandwidth
    backward_ms = max(none_ms - forward_ms, 0.0)
    lines = [f"{name}: forward {forward_ms:.1f} ms, backward {backward_ms:.1f} ms; bus "
             f"{d2h_bw or 0:.1f} GB/s d2h, {h2d_bw or 0:.1f} GB/s h2d"]
    lines.append(f"  {'column':18} {'step ms':>9} {'x none':>7} {'peak GiB':>9} {'exposed ms':>11} "
                 f"{'offloaded GiB':>14} {'bus bound ms':>13}")
    alternated = results.pop("alternated")
    auto_alternated = results.pop("auto_alternated")
    for column, (ms, peak, stats) in results.items():
        exposed = offloaded = bound = None
        if stats is not None:
            exposed = stats["exposed_seconds"] * 1e3
            offloaded = stats["d2h_bytes"]
            if d2h_bw and h2d_bw:
                bound = bus_bound_ms(forward_ms, backward_ms, offloaded, stats["h2d_bytes"], d2h_bw, h2d_bw)
        lines.append(
            f"  {column:18} {ms:9.1f} {ms / none_ms:7.2f} {peak / GiB:9.2f} "
            f"{'-' if exposed is None else f'{exposed:.1f}':>11} "
            f"{'-' if offloaded is None else f'{offloaded / GiB:.2f}':>14} "
            f"{'-' if bound is None else f'{bound:.1f}':>13}"
        )
        extra = {"peak_bytes": peak, "exposed_ms": exposed, "offloaded_bytes": offloaded, "bus_bound_ms": bound,
                 "forward_ms": forward_ms, "backward_ms": backward_ms}
        if stats is not None and stats.get("plan"):
            plan = stats["plan"]
            extra.update(auto_offloaded_bytes=plan["offloaded_bytes"], auto_hideable_bytes=plan["hideable_bytes"],
                         auto_layers=plan["offload"], auto_model_layers=plan["tuning"]["model_layers"],
                         auto_probe_step_ms=plan["tuning"]["step_ms"], auto_settled=plan["tuning"]["settled"])
        rows.append(row(SECTION, f"{name} {column} step", offload=ms, baseline=none_ms, unit="ms",
                        baseline_name="no offload", higher_is_better=False, figure="activation", model=name,
                        way=column, **extra))
        said = {"headline": f"Activation offload (async): peak, {name}"} if headline and column == "async" else {}
        rows.append(row(SECTION, f"{name} {column} peak", offload=peak / GiB, baseline=none_peak / GiB,
                        unit="GiB", baseline_name="no offload", higher_is_better=False, **said))
        if column == "async" and bound:
            rows.append(row(SECTION, f"{name} async vs bus bound", offload=ms, baseline=bound, unit="ms",
                            baseline_name="bus bound", higher_is_better=False))
    if "save_on_cpu" in results:
        said = {"headline": f"Activation offload (async): step, {name}"} if headline else {}
        rows.append(row(SECTION, f"{name} async vs save_on_cpu", offload=results["async"][0],
                        baseline=results["save_on_cpu"][0], unit="ms",
                        baseline_name="save_on_cpu(pin_memory)" if host_memory() == "pinned" else "save_on_cpu",
                        higher_is_better=False, **said))
    rows.append(row(SECTION, f"{name} async+ckpt vs ckpt", offload=results["async+checkpoint"][0],
                    baseline=results["checkpoint"][0], unit="ms", baseline_name="checkpointing",
                    higher_is_better=False))
    for case, said, pair, baseline_name in (
        ("async+ckpt vs ckpt", "async+checkpoint vs checkpoint", alternated, "checkpointing"),
        ("auto vs none", "auto vs no offload", auto_alternated, "no offload (paused)"),
    ):
        rows.append(row(SECTION, f"{name} {case}, alternated", offload=pair[0], baseline=pair[1], unit="ms",
                        baseline_name=f"{baseline_name}, steps alternated", higher_is_better=False))
        lines.append(f"  {said}, steps alternated: {pair[0]:.1f} vs {pair[1]:.1f} ms = {pair[0] / pair[1]:.3f}x")
    auto_stats = results["auto"][2]
    if auto_stats and auto_stats.get("plan"):
        plan = auto_stats["plan"]
        hideable = min(plan["eligible_bytes"], forward_ms * 1e-3 * (d2h_bw or plan["d2h_gbps"]) * 1e9)
        removed = none_peak - results["auto"][1]  # what offload took off the peak, measured
        rows.append(row(SECTION, f"{name} auto peak removed vs hideable", offload=removed / GiB,
                        baseline=hideable / GiB, unit="GiB", baseline_name="what the bus can hide (forward x D2H)",
                        offloaded_bytes=plan["offloaded_bytes"]))
        lines.append(f"  auto offloads {len(plan['offload'])} layers (model: {plan['tuning']['model_layers']}; "
                     f"probed steps ms by layers offloaded: {plan['tuning']['step_ms']}, against steps "
                     f"without offload alternated with them: {plan['tuning'].get('baseline_ms')}"
                     + (f"; planned again at {plan['d2h_gbps_replanned']:.1f} GB/s (its copies ran at "
                        f"{plan['d2h_gbps_under_compute']:.1f} GB/s under its compute, waited for "
                        f"{plan['copies_late']:.1%} of their time at its release points)"
                        if plan.get("d2h_gbps_replanned") else "") + "), "
                     f"{plan['offloaded_bytes'] / GiB:.2f} GiB "
                     f"= {100 * plan['offloaded_bytes'] / max(hideable, 1):.0f}% of what the bus can hide "
                     f"({hideable / GiB:.2f} GiB); peak lowered by {removed / GiB:.2f} GiB "
                     f"(a layer still copying when backward starts is served from the device: no saving)")
    for line in lines:
        print(line, flush=True)
    return rows


def run(ctx):
    threads = torch.get_num_threads()
    if not _device.is_accelerator(ctx.device):
        # Tiny CPU models: one thread avoids spin-wait contention on shared machines,
        # which otherwise turns 5 ms steps into seconds.
        torch.set_num_threads(1)
    try:
        return _run(ctx)
    finally:
        torch.set_num_threads(threads)


def _run(ctx):
    bandwidth = _bandwidth(ctx.device)
    ctx.notes["activation_bus_gbps"] = bandwidth
    rows = []
    model, loss_fn = _stack(ctx)
    name = "blocks 4x32 quick" if ctx.quick else "blocks 8x4096 bs2 seq4096"
    results, forward = _columns(ctx, name, model, loss_fn, bandwidth)
    rows += _report(ctx, name, results, forward, bandwidth, headline=True)
    del model, loss_fn
    gc.collect()
    _device.empty_cache()
    if not (ctx.quick or ctx.full):
        ctx.skip("Llama rows (seq 2048 and 8192)", "run with --full")
        return rows
    try:
        import transformers  # noqa: F401
    except ImportError:
        ctx.skip("Llama rows", "needs transformers (not installed)")
        return rows
    for seq in ((32,) if ctx.quick else (2048, 8192)):
        model, loss_fn = _llama(ctx, seq)
        name = f"llama seq{seq}"
        results, forward = _columns(ctx, name, model, loss_fn, bandwidth)
        rows += _report(ctx, name, results, forward, bandwidth)
        del model, loss_fn
        gc.collect()
        _device.empty_cache()
    return rows
