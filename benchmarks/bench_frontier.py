"""Activation memory frontier: auto mode with a memory budget against checkpointing or
offloading the first k layers; auto mode without a budget run three times per shape.

For budgets from the step's peak without offload down to full checkpointing's, the budget
plan's (peak, step time) against the hand-written plans: "checkpoint the first k layers"
(torch's non-reentrant checkpoint, as the planner's recompute) and "offload the first k
layers" (mode async). Each budget row compares the plan's step with the fastest hand-written
plan whose measured peak is at or below the plan's own measured peak (ratio > 1: the planner is
faster). Where that plan checkpoints, the two run alternated, step by step, while the plan's
handle stays on (its baseline steps are torch's own checkpoint with the handle paused): the same
plan timed minutes apart moves by several percent on a shared host, more than the 1% compared.
Otherwise the hand-written plan is timed again right after the plan. One more budget row per
shape sits at full checkpointing's measured activation peak plus 10% ("checkpointing's memory"):
the plan's step against full checkpointing's, alternated, with the plan's own predicted saving
beside the measured one.

Auto mode without a budget is enabled three times afresh on each shape and settled: the rows
say whether the three chose the same layers, the last one's step against steps without offload
alternated with it (`handle.paused()`), and the share of what its own measurements say the bus
can hide (forward time x device-to-host rate) that it offloads.

What the copies alone cost each shape's step: the first one and two layers' saved bytes copied
out and back with plain side-stream copies and no engine (`bare_copies.py`), and the first
layer's copied out only, each against plain steps alternated. No plan of those layers costs
less; what auto mode's probes of the same counts cost beyond it is the engine's own.

Shapes: the activation section's stack of blocks and its Llama at seq 8192, and two that auto
mode was not tuned on: a stack of fewer blocks with an MLP twice as wide, and a Qwen2 model
(grouped-query attention, biased projections) built from a config with random weights (quick:
small shapes on the CPU, where the device keeps no memory statistics and the peaks are the
planner's predictions). On one GPU each shape takes one to two minutes: the hand-written points
`TIMED_STEPS` timed steps each, 6 budgets, up to 40 steps for a budget plan to settle and up to
`max_tuning_steps` for each of the three auto runs (typically 30-60 steps).
"""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
from bare_copies import BareCopies
from bench_activation import Block, Stack, _alternated, _alternated_paused, _llama, _measure, _stack
from common import row

import offload
from offload.activation.auto.planner import max_tuning_steps
from offload.core import _device

SECTION = "frontier"
FULL_ONLY = True  # about ten minutes on one GPU: behind --full (or --only frontier)
GiB = float(1 << 30)
SETTLE_STEPS = 40  # steps a budget plan may take to be measured, made and checked
BUDGETS = 6  # budgets of the sweep, from the peak without offload to the least any plan reaches
AUTO_RUNS = 3  # auto mode without a budget, enabled afresh and settled this many times per shape
ALTERNATED_ROUNDS = 12  # rounds of the last auto run against steps without offload, alternated
CHECKPOINT_MEMORY_SLACK = 0.10  # the "checkpointing's memory" budget: its activation peak plus this share
# Timed steps per point, their median taken: neighbouring points differ by 1-5%, and with 3 steps one
# step's jitter decides the median (a point could come out faster than a plan recomputing less).
TIMED_STEPS = 7
# Rounds of a budget plan's steps alternated with its checkpointing baseline's: the same plan timed
# minutes apart moves by several percent on a shared host, more than the 1% compared.
ALTERNATED_BASELINE_ROUNDS = 9


def applies(device_type: str) -> bool:
    return True


def _handle(model, ctx, mode, **kw):
    import warnings

    with warnings.catch_warnings():  # keep_first covering every layer warns that nothing is offloaded
        warnings.simplefilter("ignore")
        return offload.enable_activation_offload(model, mode, min_tensor_bytes=0 if ctx.quick else (1 << 20),
                                                 verbose=False, **kw)


def _point(ctx, model, loss_fn, iters, handle, settle=False, then=None):
    """(step ms, peak activation bytes, handle stats) of the model with `handle` active; with
    `then`, a fourth item: what `then(handle, ms, peak, stats)` returns, called before the
    handle is disabled."""
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
        result = _measure(ctx, model, loss_fn, "frontier", iters, handle)
        return result if then is None else result + (then(handle, *result),)
    finally:
        handle.disable()
        gc.collect()
        _device.empty_cache()


def _model_frontier(ctx, name, model, loss_fn):
    iters = 2 if ctx.quick else TIMED_STEPS
    probe = _handle(model, ctx, "auto", memory_budget_bytes=1 << 50)
    n = len(probe.layers)
    layers = [model.get_submodule(layer) for layer in probe.layers]
    _point(ctx, model, loss_fn, iters, probe, settle=True)
    plan = probe.plan
    keep_all, least = plan["predicted_peak_bytes"], plan["least_peak_bytes"]
    stats_device = _device.is_accelerator(ctx.device)
    # The idle model with its gradients (zeroed, not freed): a budget counts it, the peaks do not.
    model.zero_grad(set_to_none=False)
    gc.collect()
    _device.synchronize(ctx.device)
    idle = _device.memory_allocated(ctx.device)
    curves = {}
    for family in ("checkpoint", "offload"):
        for k in range(0 if family == "checkpoint" else 1, n + 1):  # offloading none: checkpointing none
            ctx.progress(f"{name}: {family} first {k}")
            ms, peak, _ = _point(ctx, model, loss_fn, iters, _hand_written(ctx, model, n, family, k))
            curves.setdefault(family, []).append((k, ms, peak))
    rows = []
    none_ms = curves["checkpoint"][0][1]
    for family, points in curves.items():
        for k, ms, peak in points:
            rows.append(row(SECTION, f"{name} {family} first {k}", offload=ms, baseline=none_ms, unit="ms",
                            baseline_name="no offload", higher_is_better=False, peak_bytes=peak, family=family, k=k,
                            figure="frontier", model=name))
    steps = 3 if ctx.quick else BUDGETS
    for j in range(steps):
        budget = int(keep_all - (keep_all - least) * j / (steps - 1))
        ctx.progress(f"{name}: budget {budget / GiB:.2f} GiB")
        handle = _handle(model, ctx, "auto", memory_budget_bytes=budget)

        def own_peak_of(peak, stats):
            """The plan's measured peak (its predicted one where the device keeps no statistics)."""
            return peak if stats_device else (stats["plan"] or {}).get("predicted_peak_bytes", 0)

        def baseline(handle, ms, peak, stats):
            """The fastest hand-written plan at or below the plan's peak; where it checkpoints,
            its steps alternated with the plan's (torch's checkpoint, the handle paused)."""
            own_peak = own_peak_of(peak, stats)
            fitting = [(m, f, k) for f, points in curves.items() for k, m, p in points
                       if (p if stats_device else 0) <= own_peak]
            best = min(fitting) if fitting else (None, None, None)
            return best, _alternated_with_checkpointing(ctx, model, loss_fn, handle, best[2]) if (
                best[1] == "checkpoint") else None

        ms, peak, stats, (best, alternated) = _point(ctx, model, loss_fn, iters, handle, settle=True, then=baseline)
        plan = stats["plan"] or {}
        own_peak = own_peak_of(peak, stats)
        swept = best[0]
        if best[0] is not None:
            # Timed again right after the plan: the sweep ran minutes earlier, and a device's
            # clocks drift by a percent or two over that, as much as the 1% compared.
            best = (_point(ctx, model, loss_fn, iters, _hand_written(ctx, model, n, best[1], best[2]))[0],
                    best[1], best[2])
        rival = (plan.get("check") or {}).get("rival")
        verdict = "none" if rival is None else (
            f"{rival['kinds']} {rival['measured_step_ms']:.1f} ms, {'won' if rival['won'] else 'lost'} "
            f"(margin {rival['margin_ms']:.1f} ms)")
        kept = sum(plan.get("inputs_kept") or [])
        # The prediction is of the whole step's memory; the peaks here are above the idle model.
        predicted_peak = plan.get("predicted_peak_bytes", 0) - (idle if stats_device else 0)
        line = (f"  budget {budget / GiB:.3f} GiB: plan {plan.get('kinds')} (inputs kept {kept}) {ms:.1f} ms peak "
                f"{own_peak / GiB:.3f} GiB "
                f"(predicted {plan.get('predicted_step_ms', 0):.1f} ms, {predicted_peak / GiB:.3f}"
                f" GiB); best hand-written at or below its peak: {best[1]} first {best[2]} {best[0]} (in the sweep "
                f"{swept}); rival without offload: {verdict}"
                + ("" if alternated is None else f"; alternated: plan {alternated[0]:.1f} ms, checkpoint first "
                   f"{best[2]} {alternated[1]:.1f} ms"))
        print(line, flush=True)
        label = f"{budget / GiB:.2f} GiB" if budget >= GiB / 8 else f"{budget / 2**20:.2f} MiB"
        # Against checkpointing, the steps alternated (both sides at the same moments of the host).
        plan_ms, baseline_ms = alternated if alternated is not None else (ms, best[0])
        rows.append(row(SECTION, f"{name} budget {label}", offload=plan_ms, baseline=baseline_ms, unit="ms",
                        baseline_name="best of checkpoint / offload first k at or below its peak",
                        alternated=alternated is not None, sequential_ms=ms, baseline_sequential_ms=best[0],
                        higher_is_better=False, budget_bytes=budget, peak_bytes=peak,
                        predicted_step_ms=plan.get("predicted_step_ms"),
                        predicted_peak_bytes=plan.get("predicted_peak_bytes"),
                        predicted_activation_peak_bytes=predicted_peak,
                        predicted_recompute_ms=plan.get("predicted_recompute_ms"),
                        measured_step_ms=plan.get("check", {}).get("measured_step_ms"),
                        kinds=plan.get("kinds"), inputs_kept=plan.get("inputs_kept"),
                        budget_met=plan.get("budget_met"), rival=rival,
                        baseline_family=best[1], baseline_k=best[2], baseline_in_sweep_ms=swept,
                        figure="frontier", model=name))
    rows += _checkpoint_memory(ctx, name, model, loss_fn, iters, n, curves["checkpoint"][n][2], idle, least)
    rows += _auto_runs(ctx, name, model, loss_fn, curves["checkpoint"][0])
    rows += _copy_floor(ctx, name, model, loss_fn, layers)
    return rows


def _checkpointed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def _checkpointing_first(model, handle, k):
    """Steps inside run "checkpoint the first k layers" written with torch's own checkpoint, the
    auto handle paused (its plan stays for the steps after)."""
    modules = [model.get_submodule(name) for name in handle.layers[:k]]
    own = [module.__dict__.get("forward") for module in modules]  # the handle's wrapper, if any
    for module in modules:
        module.forward = functools.partial(_checkpointed, module.forward)
    try:
        with handle.paused():
            yield
    finally:
        for module, forward in zip(modules, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _alternated_with_checkpointing(ctx, model, loss_fn, handle, k):
    """(plan, checkpoint the first k) median step ms, their steps alternated (`_alternated`)."""
    rounds = 2 if ctx.quick else ALTERNATED_BASELINE_ROUNDS
    return _alternated(ctx, model, loss_fn, rounds, contextlib.nullcontext,
                       lambda: _checkpointing_first(model, handle, k))


def _hand_written(ctx, model, n, family, k):
    """A handle running "checkpoint the first k layers" or "offload the first k layers"."""
    if family == "checkpoint":
        handle = _handle(model, ctx, "async", keep_first=n, keep_last=0)
        handle.set_recomputed([i < k for i in range(n)])
        return handle
    return _handle(model, ctx, "async", keep_first=0, keep_last=n - k)


def _checkpoint_memory(ctx, name, model, loss_fn, iters, n, ckpt_peak, idle, least):
    """The budget plan at full checkpointing's measured activation peak plus 10% (the idle model
    on top: a budget is the step's whole device memory) against full checkpointing's step, timed
    right after it; the plan's predicted saving beside the measured one. Without memory
    statistics (CPU) the budget is the least peak the planner predicts, plus 10%."""
    stats_device = _device.is_accelerator(ctx.device)
    if stats_device:
        budget = idle + int(ckpt_peak * (1 + CHECKPOINT_MEMORY_SLACK))
    else:
        budget = int(least * (1 + CHECKPOINT_MEMORY_SLACK))
    ctx.progress(f"{name}: checkpointing's memory, budget {budget / GiB:.2f} GiB")
    handle = _handle(model, ctx, "auto", memory_budget_bytes=budget)
    ms, peak, stats, alternated = _point(
        ctx, model, loss_fn, iters, handle, settle=True,
        then=lambda handle, *_: _alternated_with_checkpointing(ctx, model, loss_fn, handle, n))
    ckpt_ms = _point(ctx, model, loss_fn, iters, _hand_written(ctx, model, n, "checkpoint", n))[0]
    plan = stats["plan"] or {}
    # The plan's model of full checkpointing: its own step less what it recomputes and leaves
    # exposed, plus every layer's forward again (user-checkpointed layers recompute already).
    predicted_ckpt_ms = None
    if plan.get("layers"):
        predicted_ckpt_ms = (plan["predicted_step_ms"] - plan["predicted_recompute_ms"] - plan["predicted_exposed_ms"]
                             + sum(layer["forward_ms"] for layer in plan["layers"] if not layer["user_checkpointed"]))
    predicted_saving = None if predicted_ckpt_ms is None else predicted_ckpt_ms - plan["predicted_step_ms"]
    plan_ms, full_ms = alternated  # steps alternated: both sides at the same moments of the host
    print(f"  checkpointing's memory +10% ({budget / GiB:.3f} GiB): plan {plan.get('kinds')} (inputs kept "
          f"{sum(plan.get('inputs_kept') or [])}) {ms:.1f} ms, peak "
          f"{peak / GiB:.3f} GiB; full checkpointing {ckpt_ms:.1f} ms, peak {ckpt_peak / GiB:.3f} GiB; alternated "
          f"{plan_ms:.1f} / {full_ms:.1f} ms; saving measured {full_ms - plan_ms:.1f} ms (alternated), predicted "
          f"{'-' if predicted_saving is None else f'{predicted_saving:.1f}'} ms", flush=True)
    return [row(SECTION, f"{name} at checkpointing's memory +10%", offload=plan_ms, baseline=full_ms, unit="ms",
                baseline_name="full checkpointing, steps alternated", higher_is_better=False, budget_bytes=budget,
                peak_bytes=peak, checkpoint_peak_bytes=ckpt_peak, kinds=plan.get("kinds"),
                budget_met=plan.get("budget_met"), sequential_ms=ms, baseline_sequential_ms=ckpt_ms,
                predicted_step_ms=plan.get("predicted_step_ms"), predicted_checkpoint_ms=predicted_ckpt_ms,
                predicted_saving_ms=predicted_saving, measured_saving_ms=full_ms - plan_ms)]


def _settle(model, loss_fn, handle):
    """Steps until auto mode's plan without a budget has settled (at most max_tuning_steps)."""
    for _ in range(max_tuning_steps(len(handle.layers))):
        plan = handle.plan
        if plan is not None and plan["tuning"]["settled"]:
            break
        model.zero_grad(set_to_none=False)
        loss_fn().backward()
    return handle.plan


def _auto_runs(ctx, name, model, loss_fn, none_point):
    """Auto mode without a budget, AUTO_RUNS times afresh: the same plan each time? The last
    run's step against steps without offload, alternated; what it offloads of what its own
    measurements say the bus can hide; its measured peak against the step without offload's."""
    _, none_ms, none_peak = none_point
    stats_device = _device.is_accelerator(ctx.device)
    chosen = []
    for run in range(AUTO_RUNS):
        ctx.progress(f"{name}: auto without a budget, run {run + 1} of {AUTO_RUNS}")
        handle = _handle(model, ctx, "auto")
        try:
            plan = _settle(model, loss_fn, handle)
            chosen.append(tuple(plan["offload"]) if plan is not None else None)
            if run + 1 < AUTO_RUNS:
                continue
            rounds = 2 if ctx.quick else ALTERNATED_ROUNDS
            mine, paused = _alternated_paused(ctx, model, loss_fn, handle, rounds)
            _, peak, _ = _measure(ctx, model, loss_fn, "frontier auto", 2, handle)
        finally:
            handle.disable()
            gc.collect()
            _device.empty_cache()
    same = len(set(chosen)) == 1
    plan = plan or {}
    hideable = plan.get("hideable_bytes") or 0
    offloaded = plan.get("offloaded_bytes") or 0
    removed = none_peak - peak if stats_device else None
    verdicts = plan.get("tuning", {}).get("verdicts", [])
    print(f"  auto without a budget, {AUTO_RUNS} runs: {'the same plan' if same else 'DIFFERENT plans'} "
          f"({[len(c or ()) for c in chosen]} layers); last run {mine:.1f} vs {paused:.1f} ms without offload, "
          f"alternated = {mine / paused:.3f}x; offloads {offloaded / GiB:.3f} of {hideable / GiB:.3f} GiB the bus "
          f"can hide ({100 * offloaded / max(hideable, 1):.0f}%)"
          + ("" if removed is None else f", peak lowered by {removed / GiB:.3f} GiB")
          + f"; verdicts by the model: {sum(v['by'] == 'model' for v in verdicts)} of {len(verdicts)}", flush=True)
    return [
        row(SECTION, f"{name} auto x{AUTO_RUNS} same plan", offload=float(len(set(chosen))), baseline=1.0,
            unit="distinct plans", baseline_name="one plan", higher_is_better=False, same_plan=same,
            layers=[list(c or ()) for c in chosen]),
        row(SECTION, f"{name} auto vs none, alternated", offload=mine, baseline=paused, unit="ms",
            baseline_name="no offload (paused), steps alternated", higher_is_better=False,
            none_step_ms=none_ms, verdicts=verdicts),
        row(SECTION, f"{name} auto offloaded vs hideable", offload=offloaded / GiB, baseline=hideable / GiB,
            unit="GiB", baseline_name="what its measurements say the bus can hide (forward x D2H)",
            share=offloaded / hideable if hideable else None, peak_removed_bytes=removed,
            layer_bytes=plan.get("layer_bytes")),
    ]


def _copy_floor(ctx, name, model, loss_fn, layers):
    """Bare copies of the first layers' saved bytes (`BareCopies`) against plain steps, alternated:
    the step's cost of the copies alone, beside which auto mode's probes (the engine's plan at
    one or two layers, against steps without offload) tell what the engine adds."""
    rounds = 2 if ctx.quick else ALTERNATED_ROUNDS
    min_tensor_bytes = 0 if ctx.quick else (1 << 20)
    rows, costs = [], []
    for count, back in ((1, False), (1, True), (2, True)):
        count = min(count, len(layers))
        way = "out and back" if back else "out"
        bare = BareCopies(model, layers, count, back, min_tensor_bytes)
        try:
            mine, plain = _alternated(ctx, model, loss_fn, rounds, bare.active, contextlib.nullcontext)
        finally:
            bare.remove()
        costs.append(f"{count} {way} {mine / plain:.3f}x ({bare.bytes_per_step / 2**20:.1f} MiB)")
        rows.append(row(SECTION, f"{name} bare copies, {count} layer{'s' * (count > 1)} {way}", offload=mine,
                        baseline=plain, unit="ms", baseline_name="no offload, steps alternated",
                        higher_is_better=False, layers=count, back=back, copied_bytes=bare.bytes_per_step))
    print(f"  bare copies with no engine, layers: {'; '.join(costs)}", flush=True)
    return rows


class WideBlock(Block):
    """A block whose MLP is `mlp` times the hidden size wide."""

    def __init__(self, d, heads, mlp):
        super().__init__(d, heads)
        self.up = torch.nn.Linear(d, mlp * d, bias=False)
        self.down = torch.nn.Linear(mlp * d, d, bias=False)


def _wide_stack(ctx):
    """Fewer blocks, MLP 8x: a layer's forward is mostly two wide matmuls and saves more bytes."""
    d, heads, n, mlp, batch, seq = (32, 4, 3, 8, 2, 32) if ctx.quick else (2048, 16, 4, 8, 2, 8192)
    dtype = torch.bfloat16 if _device.is_accelerator(ctx.device) else torch.float32
    with torch.device(ctx.device):
        model = Stack(d, heads, 0)
        model.blocks = torch.nn.ModuleList(WideBlock(d, heads, mlp) for _ in range(n))
        model = model.to(dtype)
    x = torch.randn(batch, seq, d, device=ctx.device, dtype=dtype)
    return model, lambda: model(x)


QWEN2_SEQ = 4096  # the frontier's Qwen2 case: batch 2 of this many tokens


def _qwen2(ctx):
    model, loss_of = qwen2_case(ctx)
    return model, lambda: loss_of(model)


def qwen2_case(ctx, seq=None):
    """A Qwen2 model from a config (random weights): grouped-query attention (2 key/value heads),
    biased q/k/v projections, another sequence and batch than the Llama; `seq` tokens a
    sequence (None: QWEN2_SEQ, or 32 with ctx.quick). With its loss as a function of the module
    that runs it (the model itself, or a copy of it)."""
    import transformers

    if ctx.quick:
        config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        batch, seq = 2, seq or 32
    else:
        config = transformers.Qwen2Config(vocab_size=32000, hidden_size=1536, intermediate_size=8960,
                                          num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=2,
                                          max_position_embeddings=32768)
        batch, seq = 2, seq or QWEN2_SEQ
    config._attn_implementation = "sdpa"
    with torch.device(ctx.device):
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16 if _device.is_accelerator(ctx.device) else torch.float32).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=ctx.device)
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def run(ctx):
    threads = torch.get_num_threads()
    if not _device.is_accelerator(ctx.device):
        torch.set_num_threads(1)
    try:
        rows = []
        seq = 32 if ctx.quick else 8192
        shapes = [
            ("blocks 4x32 quick" if ctx.quick else "blocks 8x4096 bs2 seq4096", _stack, False),
            ("wide blocks 3x32 mlp8 quick" if ctx.quick else "wide blocks 4x2048 mlp8 bs2 seq8192", _wide_stack, False),
            (f"llama seq{seq}", lambda c: _llama(c, seq), True),
            ("qwen2 quick" if ctx.quick else "qwen2 8x1536 gqa bs2 seq4096", _qwen2, True),
        ]
        for name, build, needs_transformers in shapes:
            if needs_transformers and _missing_transformers():
                ctx.skip(f"{name} rows", "needs transformers (not installed)")
                continue
            model, loss_fn = build(ctx)
            if getattr(model, "config", None) is not None:
                # Training makes no use of the key/value cache, and torch's checkpoint of a layer
                # (the alternated baselines) would fill it twice.
                model.config.use_cache = False
            rows += _model_frontier(ctx, name, model, loss_fn)
            del model, loss_fn
            gc.collect()
            _device.empty_cache()
        return rows
    finally:
        torch.set_num_threads(threads)


def _missing_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return True
    return False
