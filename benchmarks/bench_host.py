"""Host time of activation offload: what the engine's hooks and wrappers cost per offloaded layer and per step.

Two measures, each against the same model with no handle at all (never wrapped: an identical
copy of it), in the same process:

- CPU (on every machine, on the CPU, one thread): 8 residual layers `x + lin2(gelu(lin1(x)))`
  of two `Linear(64, 64)`, input 4x16x64 fp32, a forward and a backward of
  `out.square().mean()` per step. The device's work is a few microseconds per layer, so the
  step time is host time: the variants are no handle; `hooks`, the same model under autograd's
  saved-tensor hooks that return what they get (the floor of any hook-based offload); `async`
  with every layer offloaded
  (`min_tensor_bytes=1, min_group_bytes=0, keep_last=0`); the same handle inside
  `handle.paused()`; `auto` (settled first: on the CPU its plan offloads nothing); `verify`, the
  async handle with `verify=True` (what its checksums cost). Host time
  per offloaded layer per step = (async - no handle) / the layers the step offloaded
  (`handle.stats()`). Targets: async at most 1.25x the no-handle step, paused at most 1.01x.
  On a machine with an accelerator the engine offloads only tensors of the accelerator, so
  this measure runs in a subprocess that sees none.
- the same tiny stack on the accelerator (cuda, npu), with the same variants: its kernels take
  microseconds, so its step is the host's time, now with the engine's calls into the
  accelerator's runtime (copies, events, stream waits) and its caching allocator; host time
  per offloaded layer as above. A clock mark waits for the device, once per block of steps.
- a group's copy out on the accelerator (native core only): the host time of one
  `copy_spans_to_host` call of SPAN_COUNT spans, enqueued as one batched copy call (CUDA 12.8+'s
  cudaMemcpyBatchAsync) against one copy call per span, alternated, the device drained between
  calls (outside the clock): what a group's spans cost the host to enqueue.
- GPU (cuda, npu): the bench's Llama (d2048, 8 layers, bf16, batch 1, `transformers` built
  from a config) at seq 2048 (and 8192 with --full): no handle, `hooks`, `async`, paused,
  `auto` and `verify` (the library's defaults otherwise), blocks of 5 back-to-back steps timed
  with device events, one block of each per round, the order reversed in every other round;
  beside each variant's device time, its host time per step (the step call's wall time): where
  it exceeds the device's, the host sets the step's pace once the device's queue runs dry. Then,
  per variant, 5 steps from an idle device timed on the host alone (`host_alone`): the host's
  own time per step, the device's left out, wherever the device's step is the shorter (a
  variant whose device step is the longer, async at the bus bound, fills the device's queue and
  waits for it: its "alone" is then the device's time).
- the engine's host time per step (cuda, npu; target at most 0.3 ms for 8 layers): the bench's
  Llama and the frontier section's Qwen2 (d1536, 8 layers, batch 2), each at a sequence 8
  times shorter than its own (256 and 512 tokens) with `min_tensor_bytes` 8 times smaller:
  the same saved tensors offloaded in the same groups, with a device step shorter than the
  host's. async on every layer (`keep_last=0`) against no handle (and identity saved-tensor
  hooks, the floor of any hook-based offload), the host's time alone per
  step (`host_alone`, 6 rounds, the order reversed in every other one); the difference is
  the engine's host time per step (a longer sequence's copies are cut in more chunks, a few
  microseconds each).

Per variant the median step of all rounds counts, its ratio to the no-handle median is the
row's; the spread is that of the rounds' medians. The rounds alternate the variants so that
drift on a shared machine lands on all of them alike; the paired ratio (`paired_ratio` in the
rows: the median over the rounds of a variant's round median over the baseline's in the same
round) also cancels drift that lasts several rounds, as a host-bound step's does (the Llama at
seq 2048 is launch-bound: its host's pace sets its step).
`python -m benchmarks --only host`; `python benchmarks/bench_host.py --cpu-measure [--quick]`
prints the CPU measure as JSON (what the section runs in a subprocess).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

SECTION = "host"
TARGETS = {"async": 1.25, "paused": 1.01}  # CPU step time at most this multiple of the no-handle step
BASELINE = "no handle (the same model, never wrapped)"
HERE = Path(__file__).resolve().parent

# CPU measure: (rounds, steps per block, warm-up steps per variant).
CPU_FULL = (6, 50, 10)
CPU_QUICK = (2, 5, 2)
CPU_LAYERS, CPU_WIDTH, CPU_INPUT = 8, 64, (4, 16, 64)
# GPU measure: rounds of one block of GPU_BLOCK back-to-back steps per variant.
GPU_ROUNDS, GPU_QUICK_ROUNDS, GPU_BLOCK, GPU_WARMUP = 8, 2, 5, 2
# Steps per variant timed on the host alone (host_alone), from an idle device: few enough that a
# step's launches stay within the device's queue while the host runs ahead.
HOST_ALONE_STEPS = 5
GPU_SEQS = (2048, 8192)
# The engine's host time per step (target: at most ENGINE_TARGET_MS for 8 layers): the bench's
# Llama (seq 2048) and the frontier section's Qwen2 (seq 4096), each at a sequence ENGINE_SHRINK
# times shorter with min_tensor_bytes as many times smaller, so that the same saved tensors are
# offloaded in the same groups (the engine's work per step) while the device's step is shorter
# than the host's: the host's wall time per step, from an idle device, is then its own.
ENGINE_SHRINK, ENGINE_ROUNDS, ENGINE_TARGET_MS = 8, 6, 0.3
# A group's copy out: spans per call (a decoder layer saves about 20 tensors), their sizes, and
# calls timed per way (alternated in rounds).
SPAN_COUNT, SPAN_SIZES, SPAN_CALLS, SPAN_ROUNDS = 20, (16 << 10, 1 << 20), 50, 6
# The variants, in the order of a round: hooks is the model with no handle under autograd's
# saved-tensor hooks that return what they get (the floor any hook-based offload pays: autograd
# calls a pack hook per saved tensor and an unpack hook per read); verify is async with
# verify=True (its checksums' cost).
VARIANTS = ("none", "hooks", "async", "paused", "auto", "verify")


def applies(device_type: str) -> bool:
    return True


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin1 = nn.Linear(width, width)
        self.lin2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.lin2(F.gelu(self.lin1(x)))


class TinyStack(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(Residual(width) for _ in range(layers))  # found as the layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass
class Variant:
    name: str
    step: Callable[[], None]  # one training step (forward, backward), inside its context


@dataclass
class Timed:
    """One variant's step times: the median of every timed step, and each round's median."""
    median_ms: float
    round_medians_ms: List[float]
    steps: int
    layers_offloaded: Optional[int] = None  # per step, from handle.stats() (None: no handle)
    offloaded_bytes: Optional[int] = None  # per step, from handle.stats() (None: no handle)
    # The host's own time per step (the call's wall time, median of every timed step): where the
    # device runs ahead of it, the step's time; where it does not, what the device's queue hides.
    host_median_ms: Optional[float] = None
    # The same on an idle device (host_alone): the host's time alone, none of the device's in it.
    host_alone_ms: Optional[float] = None

    @property
    def spread_pct(self) -> float:
        return 100.0 * (max(self.round_medians_ms) - min(self.round_medians_ms)) / max(self.median_ms, 1e-12)


@dataclass
class Measure:
    """A model's variants, timed in alternation; `none` is the baseline."""
    what: str
    variants: Dict[str, Timed] = field(default_factory=dict)
    auto_settled_after: int = 0  # steps auto mode took to settle its plan

    def paired_ratio(self, name: str) -> float:
        """The median over the rounds of `name`'s round median over the baseline's in the same
        round: drift slower than a round cancels even where it lasts for several rounds."""
        pairs = zip(self.variants[name].round_medians_ms, self.variants["none"].round_medians_ms)
        return statistics.median(a / b for a, b in pairs)


class _HostClock:
    """Wall time between marks (the CPU's work is done when a step returns)."""

    def mark(self):
        return time.perf_counter()

    def spans_ms(self, marks):
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


class _EventClock:
    """Device time between events recorded on the current stream; nothing waits between steps."""

    def __init__(self, device):
        from offload.core import _device

        self._device, self.device = _device, device

    def mark(self):
        event = self._device.new_event(self.device, timing=True)
        event.record(self._device.current_stream(self.device))
        return event

    def spans_ms(self, marks):
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]

    def synchronize(self):
        self._device.synchronize(self.device)


def alternate(variants: List[Variant], rounds: int, block: int, clock) -> Dict[str, Timed]:
    """Each round runs `block` steps of every variant, back to back, in the variants' order in
    even rounds and the reverse in odd ones; each step is timed from the mark before it to the
    mark after it. The first step of a block follows another variant's step, as in a loop that
    switches models; the median over the rounds' steps counts."""
    marks = {v.name: [] for v in variants}  # per variant: one list of marks per round
    host = {v.name: [] for v in variants}  # per variant: each step's wall time on the host, ms
    # An untimed step first: the first mark then finds the device busy, as every later block's does.
    variants[-1].step()
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            taken = [clock.mark()]
            for _ in range(block):
                host[v.name].append(_host_ms(v.step))
                taken.append(clock.mark())
            marks[v.name].append(taken)
    out = {}
    for name, per_round in marks.items():
        spans = [clock.spans_ms(taken) for taken in per_round]
        every = [s for round_spans in spans for s in round_spans]
        out[name] = Timed(statistics.median(every), [statistics.median(s) for s in spans], len(every),
                          host_median_ms=statistics.median(host[name]))
    return out


def host_alone(variants: List[Variant], steps: int, synchronize) -> Dict[str, float]:
    """Per variant, the median wall time of `steps` steps run back to back from an idle device
    (`synchronize` first): while the device's queue has room the host never waits for it, so
    this is the host's own time per step, the device's left out. Alternated, a step the device
    paces blocks the host at the full queue and its wall time is the device's."""
    out = {}
    for v in variants:
        synchronize()
        out[v.name] = statistics.median(_host_ms(v.step) for _ in range(steps))
    synchronize()
    return out


def _host_ms(step) -> float:
    """The wall time of one call of `step` on the host, in ms."""
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def _train_step(model, loss_fn):
    def step():
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop
        loss_fn().backward()

    return step


def _identity(t):
    return t


def _under_identity_hooks(step):
    def hooked_step():
        with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
            step()

    return hooked_step


def _paused(handle, step):
    def paused_step():
        with handle.paused():
            step()

    return paused_step


def _settle(handle, step) -> int:
    """Steps auto mode took to settle its plan (at most `max_tuning_steps`), then one more:
    no probe step is timed as the plan's, and the settled plan's first step allocates."""
    from offload.activation.auto.planner import max_tuning_steps

    taken = 0
    for _ in range(max_tuning_steps(len(handle.layers))):
        plan = handle.plan
        if plan is not None and plan["tuning"]["settled"]:
            break
        step()
        taken += 1
    step()
    return taken


def _offloaded(handle, step):
    """(layers, bytes) a step of `handle` offloads."""
    step()
    stats = handle.stats()
    return stats["layers_offloaded"], stats["d2h_bytes"]


def _measure_variants(what, model, loss_fn, options, rounds, block, warmup, clock, copies):
    """No handle, async, paused, auto and async with verify=True on `copies(model)` copies (one per
    handle), timed in alternation."""
    import offload

    with_async, with_auto, with_verify = copies(model), copies(model), copies(model)
    handle = offload.enable_activation_offload(with_async, "async", verbose=False, **options["async"])
    auto = offload.enable_activation_offload(with_auto, "auto", verbose=False, **options["auto"])
    verified = offload.enable_activation_offload(with_verify, "async", verbose=False, verify=True, **options["async"])
    try:
        steps = {
            "none": _train_step(model, lambda: loss_fn(model)),
            "async": _train_step(with_async, lambda: loss_fn(with_async)),
            "auto": _train_step(with_auto, lambda: loss_fn(with_auto)),
            "verify": _train_step(with_verify, lambda: loss_fn(with_verify)),
        }
        steps["paused"] = _paused(handle, steps["async"])
        steps["hooks"] = _under_identity_hooks(steps["none"])
        settled_after = _settle(auto, steps["auto"])
        for name in ("none", "hooks", "async", "paused", "verify"):
            for _ in range(warmup):
                steps[name]()
        offloaded = {"async": _offloaded(handle, steps["async"]), "auto": _offloaded(auto, steps["auto"]),
                     "paused": (0, 0), "verify": _offloaded(verified, steps["verify"])}
        variants = [Variant(name, steps[name]) for name in VARIANTS]
        timed = alternate(variants, rounds, block, clock)
        if isinstance(clock, _EventClock):  # the device runs apart from the host: time the host alone
            alone = host_alone(variants, HOST_ALONE_STEPS, clock.synchronize)
            for name, ms in alone.items():
                timed[name].host_alone_ms = ms
        for name, (layers, nbytes) in offloaded.items():
            timed[name].layers_offloaded, timed[name].offloaded_bytes = layers, nbytes
        return Measure(what, timed, settled_after)
    finally:
        handle.disable()
        auto.disable()
        verified.disable()


class _SyncedHostClock(_HostClock):
    """Wall time between marks, each taken once the device has finished what was queued: a block
    of steps then counts its device work too, which a host-bound step hides behind its host time."""

    def __init__(self, device):
        from offload.core import _device

        self._device, self.device = _device, device

    def mark(self):
        self._device.synchronize(self.device)
        return time.perf_counter()


def tiny_measure(quick: bool, device=None) -> Measure:
    """The CPU measure's model and variants on `device` (None: the CPU, in this process, whose
    engine must then see no accelerator), on one host thread. On an accelerator its kernels take
    a few microseconds each, so its step is the host's time too: what the engine's calls into the
    accelerator's runtime (copies, events, stream waits) and the allocator cost per layer."""
    rounds, block, warmup = CPU_QUICK if quick else CPU_FULL
    threads = torch.get_num_threads()
    # One thread: these steps are microseconds of work, and spinning workers on a shared machine
    # would time the other tenants.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        on = torch.device("cpu") if device is None else torch.device(device)
        model = TinyStack(CPU_LAYERS, CPU_WIDTH).to(on)
        x = torch.randn(*CPU_INPUT, device=on)
        every_layer = dict(min_tensor_bytes=1, min_group_bytes=0, keep_last=0)
        where = "CPU 1 thread" if device is None else f"{on.type} (host 1 thread)"
        what = (f"{where}, {CPU_LAYERS} residual layers of 2 Linear({CPU_WIDTH}, {CPU_WIDTH}), "
                f"input {'x'.join(map(str, CPU_INPUT))} fp32")
        clock = _HostClock() if device is None else _SyncedHostClock(on)
        return _measure_variants(what, model, lambda m: m(x).square().mean(),
                                 {"async": every_layer, "auto": dict(min_tensor_bytes=1)},
                                 rounds, block, warmup, clock, copy.deepcopy)
    finally:
        torch.set_num_threads(threads)


def cpu_measure(quick: bool) -> Measure:
    """The CPU measure, in this process (whose engine must see no accelerator), on one thread."""
    return tiny_measure(quick)


def _cpu_measure_elsewhere(quick: bool) -> Measure:
    """The CPU measure in a subprocess that sees no accelerator (the engine offloads only tensors
    of the accelerator it sees, so a CPU model would offload nothing here)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", ASCEND_RT_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cpu-measure"] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the CPU measure's subprocess exited with {done.returncode}: {done.stderr[-2000:]}")
    return _measure_from_json(done.stdout.strip().splitlines()[-1])


def _measure_to_json(measure: Measure) -> str:
    return json.dumps({"what": measure.what, "auto_settled_after": measure.auto_settled_after,
                       "variants": {name: asdict(t) for name, t in measure.variants.items()}})


def _measure_from_json(text: str) -> Measure:
    data = json.loads(text)
    return Measure(data["what"], {name: Timed(**t) for name, t in data["variants"].items()},
                   data["auto_settled_after"])


def _cpu_rows(ctx) -> list:
    from offload.core import _device

    ctx.progress("CPU measure: no handle, identity hooks, async, paused, auto, verify")
    measure = cpu_measure(ctx.quick) if _device.accelerator_type() is None else _cpu_measure_elsewhere(ctx.quick)
    return _tiny_rows(measure, "CPU", "cpu", TARGETS)


def _accelerator_tiny_rows(ctx) -> list:
    """The CPU measure's model on the accelerator: the engine's host time per offloaded layer there."""
    ctx.progress(f"tiny stack on {ctx.device.type}: no handle, identity hooks, async, paused, auto, verify")
    measure = tiny_measure(ctx.quick, ctx.device)
    return _tiny_rows(measure, f"{ctx.device.type.upper()} tiny stack", "accelerator_tiny", {})


def _tiny_rows(measure: Measure, prefix: str, kind: str, targets: dict) -> list:
    """Rows of a tiny-stack measure: each variant's step against the no-handle step, and the host
    time async adds per step and per offloaded layer; `targets` (variant -> ratio) are judged."""
    from common import row

    v = measure.variants
    none_us = v["none"].median_ms * 1e3
    layers = v["async"].layers_offloaded
    spreads = {f"{name}_round_medians_us": [m * 1e3 for m in t.round_medians_ms] for name, t in v.items()}
    common = dict(measure=kind, what=measure.what, steps_timed=v["none"].steps, **spreads)
    rows, lines = [], [f"{measure.what}: forward+backward step, median of {v['none'].steps} steps per variant",
                       f"  {'variant':8} {'step us':>9} {'x none':>7} {'paired x':>9} {'round spread':>13} "
                       f"{'layers off':>11}  target"]
    for name in VARIANTS:
        t = v[name]
        us = t.median_ms * 1e3
        target = targets.get(name)
        # Judged on the paired ratio, as the GPU rows are: the host's drift between rounds lands on
        # both sides of a round alike, not on the ratio of the medians.
        met = None if target is None else measure.paired_ratio(name) <= target
        said = "" if target is None else f"<= {target:.2f}x {'met' if met else 'MISSED'}"
        lines.append(f"  {name:8} {us:9.1f} {us / none_us:7.3f} {measure.paired_ratio(name):9.3f} "
                     f"{t.spread_pct:12.1f}% "
                     f"{'-' if t.layers_offloaded is None else t.layers_offloaded:>11}  {said}")
        if name == "none":
            continue
        label = {"hooks": "autograd's saved-tensor hooks alone (identity pack and unpack, no handle)",
                 "async": f"async, all {layers} layers offloaded", "paused": "async handle inside handle.paused()",
                 "auto": f"auto (settled, {t.layers_offloaded} layers offloaded)",
                 "verify": f"async with verify=True, all {t.layers_offloaded} layers offloaded"}[name]
        extra = dict(variant=name, layers_offloaded=t.layers_offloaded, offloaded_bytes=t.offloaded_bytes,
                     spread_pct=t.spread_pct, paired_ratio=measure.paired_ratio(name), **common)
        if target is not None:
            extra.update(target_ratio=target, target_met=met)
        rows.append(row(SECTION, f"{prefix} step, {label}" + ("" if target is None else f" (target <= {target:.2f}x)"),
                        offload=us, baseline=none_us, unit="us", baseline_name=BASELINE, higher_is_better=False,
                        **extra))
    hooks_us = v["hooks"].median_ms * 1e3 - none_us
    rows.append(row(SECTION, f"{prefix} host time autograd's saved-tensor hooks alone add per step", offload=hooks_us,
                    baseline=None, unit="us", baseline_name="identity-hooks step - no-handle step", variant="hooks",
                    **common))
    async_us = v["async"].median_ms * 1e3
    per_step = async_us - none_us
    per_layer = per_step / layers if layers else None
    rows.append(row(SECTION, f"{prefix} host time async adds per step ({layers} layers offloaded)", offload=per_step,
                    baseline=None, unit="us", baseline_name="async step - no-handle step", variant="async",
                    layers_offloaded=layers, **common))
    rows.append(row(SECTION, f"{prefix} host time per offloaded layer per step, async", offload=per_layer, baseline=None,
                    unit="us", baseline_name=f"(async step - no-handle step) / {layers} layers",
                    variant="async", layers_offloaded=layers, **common))
    lines.append(f"  async adds {per_step:.1f} us per step, "
                 + (f"{per_layer:.1f} us per offloaded layer" if per_layer is not None else "no layer offloaded")
                 + f" ({hooks_us:.1f} us of it autograd's hooks alone pay)"
                 + f"; auto settled after {measure.auto_settled_after} steps")
    for line in lines:
        print(line, flush=True)
    return rows


def _span_copy_rows(ctx) -> list:
    """Host time of one group's copy out, its spans batched into one copy call against one call each."""
    from common import row

    import offload
    from offload.core import _backend, _device
    from offload.core.copy import copy_spans_to_host

    if not _backend.native_available():
        ctx.skip("span copy rows", f"needs the compiled core: {_backend.why_not()}")
        return []
    core = _backend.core()
    ctx.progress(f"a group's copy out, {SPAN_COUNT} spans: one batched call against one call per span")
    pool = offload.default_host_pool()
    stream = _device.new_stream(ctx.device)
    rows = []
    for span_bytes in SPAN_SIZES:
        source = torch.empty(SPAN_COUNT * span_bytes, dtype=torch.uint8, device=ctx.device)
        starts = [i * span_bytes for i in range(SPAN_COUNT)]
        sizes = [span_bytes] * SPAN_COUNT
        block = pool.acquire(SPAN_COUNT * span_bytes)
        sources = [source] * SPAN_COUNT
        times = {True: [], False: []}
        before = core._batched_copies()
        try:
            for round_ in range(SPAN_ROUNDS + 1):  # the first round warms up
                for batched in ((True, False) if round_ % 2 else (False, True)):
                    core._set_batched_copies(batched)
                    for _ in range(SPAN_CALLS):
                        start = time.perf_counter()
                        handle = copy_spans_to_host(sources, starts, sizes, block, starts, pool=pool, stream=stream)
                        elapsed = time.perf_counter() - start
                        handle.wait()
                        _device.synchronize(ctx.device)
                        if round_:
                            times[batched].append(elapsed * 1e6)
        finally:
            core._set_batched_copies(before)
        batched_us, per_span_us = statistics.median(times[True]), statistics.median(times[False])
        what = f"{SPAN_COUNT} spans of {span_bytes >> 10} KiB"
        print(f"a group's copy out, {what}: {batched_us:.1f} us host time batched, {per_span_us:.1f} us one call "
              f"per span (median of {len(times[True])} calls each)", flush=True)
        rows.append(row(SECTION, f"a group's copy out ({what}), host time per call, one batched copy call",
                        offload=batched_us, baseline=per_span_us, unit="us", baseline_name="one copy call per span",
                        higher_is_better=False, measure="span_copy", spans=SPAN_COUNT, span_bytes=span_bytes,
                        calls=len(times[True])))
        del block, source, handle
    return rows


def _llama(device, seq):
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                                      max_position_embeddings=32768)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (1, seq), device=device)
    return model, (lambda m: m(input_ids=ids, labels=ids).loss)


def _gpu_rows(ctx) -> list:
    from common import row

    from offload.core import _device

    try:
        import transformers  # noqa: F401
    except ImportError:
        ctx.skip("Llama rows", "needs transformers (not installed)")
        return []
    rows = []
    rounds = GPU_QUICK_ROUNDS if ctx.quick else GPU_ROUNDS
    for seq in GPU_SEQS if ctx.full else GPU_SEQS[:1]:
        ctx.progress(f"Llama seq {seq}: no handle, identity hooks, async, paused, auto, verify")
        model, loss_fn = _llama(ctx.device, seq)
        what = f"Llama d2048 8 layers bf16, batch 1, seq {seq}"
        try:
            measure = _measure_variants(what, model, loss_fn, {"async": {}, "auto": {}}, rounds, GPU_BLOCK,
                                        GPU_WARMUP, _EventClock(ctx.device), copy.deepcopy)
        finally:
            del model, loss_fn
            gc.collect()
            _device.empty_cache()
        v = measure.variants
        none_ms = v["none"].median_ms
        print(f"{what}: median of {v['none'].steps} steps per variant ({rounds} rounds of {GPU_BLOCK} "
              f"back-to-back steps, device events)", flush=True)
        for name in VARIANTS:
            t = v[name]
            print(f"  {name:8} {t.median_ms:9.2f} ms {t.median_ms / none_ms:7.3f}x none "
                  f"(paired by round {measure.paired_ratio(name):.3f}x), round spread {t.spread_pct:.1f}%, "
                  f"host {t.host_median_ms:.2f} ms a step, {t.host_alone_ms:.2f} ms alone "
                  f"({t.host_alone_ms - v['none'].host_alone_ms:+.2f} ms)"
                  + ("" if t.layers_offloaded is None else
                     f", {t.layers_offloaded} layers, {t.offloaded_bytes / 2**30:.2f} GiB offloaded"), flush=True)
            if name == "none":
                continue
            offloaded = ("" if t.offloaded_bytes is None else
                         f"{t.layers_offloaded} layers, {t.offloaded_bytes / 2**30:.2f} GiB offloaded")
            label = {"hooks": "identity saved-tensor hooks, no handle",
                     "async": f"async ({offloaded})", "paused": "async inside paused()",
                     "auto": f"auto ({offloaded})", "verify": f"async with verify=True ({offloaded})"}[name]
            rows.append(row(SECTION, f"Llama seq{seq} step, {label}", offload=t.median_ms, baseline=none_ms,
                            unit="ms", baseline_name=BASELINE, higher_is_better=False, measure="gpu", what=what,
                            variant=name, layers_offloaded=t.layers_offloaded, offloaded_bytes=t.offloaded_bytes,
                            spread_pct=t.spread_pct, paired_ratio=measure.paired_ratio(name),
                            round_medians_ms=t.round_medians_ms, baseline_round_medians_ms=v["none"].round_medians_ms,
                            steps_timed=t.steps, auto_settled_after=measure.auto_settled_after,
                            host_median_ms=t.host_median_ms, baseline_host_median_ms=v["none"].host_median_ms,
                            host_alone_ms=t.host_alone_ms, baseline_host_alone_ms=v["none"].host_alone_ms))
    return rows


def _engine_models(ctx):
    """(description, builder of (model, loss of a model)) of the models the engine's host time is
    read on (ImportError without transformers)."""
    import bench_frontier
    import transformers  # noqa: F401

    llama_seq, qwen2_seq = GPU_SEQS[0] // ENGINE_SHRINK, bench_frontier.QWEN2_SEQ // ENGINE_SHRINK

    return [(f"Llama d2048 8 layers bf16, batch 1, seq {llama_seq}", lambda: _llama(ctx.device, llama_seq)),
            (f"Qwen2 d1536 8 layers bf16, batch 2, seq {qwen2_seq}",
             lambda: bench_frontier.qwen2_case(ctx, qwen2_seq))]


def _engine_host_rows(ctx) -> list:
    """The engine's host time per step with every layer offloaded (async, keep_last=0): the
    host's own time per step (host_alone, rounds alternated) with the handle, over the same
    model's with none; beside it, the same model's under identity saved-tensor hooks (what
    autograd's hook calls alone cost, a floor of any hook-based offload)."""
    from common import row

    import offload
    from offload.activation.engine import DEFAULT_MIN_TENSOR_BYTES
    from offload.core import _device

    try:
        models = _engine_models(ctx)
    except ImportError:
        ctx.skip("engine host time rows", "needs transformers (not installed)")
        return []
    rows = []
    clock = _EventClock(ctx.device)
    for what, build in models:
        ctx.progress(f"engine host time: {what}")
        model, loss_fn = build()
        offloaded = copy.deepcopy(model)
        handle = offload.enable_activation_offload(offloaded, "async", verbose=False, keep_last=0,
                                                   min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES // ENGINE_SHRINK)
        try:
            plain = _train_step(model, lambda: loss_fn(model))
            variants = [Variant("none", plain), Variant("hooks", _under_identity_hooks(plain)),
                        Variant("async", _train_step(offloaded, lambda: loss_fn(offloaded)))]
            for v in variants:
                for _ in range(GPU_WARMUP):
                    v.step()
            stats = handle.stats()  # of async's last warm-up step (the last variant's)
            alone = {v.name: [] for v in variants}
            for r in range(ENGINE_ROUNDS):
                for v, ms in host_alone(variants if r % 2 == 0 else variants[::-1], HOST_ALONE_STEPS,
                                        clock.synchronize).items():
                    alone[v].append(ms)
        finally:
            handle.disable()
            del model, offloaded, loss_fn, handle
            gc.collect()
            _device.empty_cache()
        none_ms, hooks_ms, async_ms = (statistics.median(alone[name]) for name in ("none", "hooks", "async"))
        engine_ms = async_ms - none_ms
        met = engine_ms <= ENGINE_TARGET_MS
        print(f"{what}: host time alone per step, median of {ENGINE_ROUNDS} rounds of {HOST_ALONE_STEPS} steps: "
              f"no handle {none_ms:.2f} ms, identity hooks {hooks_ms:.2f} ms, async {async_ms:.2f} ms "
              f"({stats['layers_offloaded']} layers, {stats['groups_offloaded']} groups, "
              f"{stats['tensors_offloaded']} tensors offloaded): the engine's {engine_ms:.3f} ms a step "
              f"({hooks_ms - none_ms:.3f} ms of it autograd's hooks alone pay), target <= {ENGINE_TARGET_MS} ms "
              f"{'met' if met else 'MISSED'}", flush=True)
        rows.append(row(SECTION, f"{what.split(',')[0]} engine host time per step, async, "
                                 f"{stats['layers_offloaded']} layers (target <= {ENGINE_TARGET_MS} ms)",
                        offload=engine_ms, baseline=None, unit="ms",
                        baseline_name="host time alone: async step - no-handle step", measure="engine_host",
                        what=what, variant="async", layers_offloaded=stats["layers_offloaded"],
                        groups_offloaded=stats["groups_offloaded"], tensors_offloaded=stats["tensors_offloaded"],
                        host_alone_ms=async_ms, baseline_host_alone_ms=none_ms, hooks_host_alone_ms=hooks_ms,
                        round_host_alone_ms=alone["async"], baseline_round_host_alone_ms=alone["none"],
                        hooks_round_host_alone_ms=alone["hooks"],
                        target=f"<= {ENGINE_TARGET_MS} ms", target_met=met))
    return rows


def run(ctx):
    from offload.core import _device

    rows = _cpu_rows(ctx)
    if _device.is_accelerator(ctx.device):
        rows += _accelerator_tiny_rows(ctx)
        rows += _span_copy_rows(ctx)
        rows += _gpu_rows(ctx)
        rows += _engine_host_rows(ctx)
        if not ctx.full:
            ctx.skip(f"Llama seq {GPU_SEQS[1]} rows", "run with --full")
    return rows


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="the host section's CPU measure, as JSON on stdout")
    parser.add_argument("--cpu-measure", action="store_true", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from offload.core import _device

    if _device.accelerator_type() is not None:
        print("bench_host.py --cpu-measure: an accelerator is visible; hide it (CUDA_VISIBLE_DEVICES=)",
              file=sys.stderr)
        return 2
    print(_measure_to_json(cpu_measure(args.quick)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
