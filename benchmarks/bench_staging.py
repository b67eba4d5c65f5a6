"""Checkpoint staging: offload.AsyncStager against `.cpu()` and DCP's DefaultStager.

Two state dicts: 4 GiB of bf16 in 64 tensors, and 4,000 tensors of 256 KiB (on
the CPU, quick mode: tiny sizes). Ten consecutive saves each, the tensors changed
between saves; per save the caller-blocked time (inside `stage()`) and the staging
time (until the host copy is complete), reported for the first save (buffers
allocated) and as the median of saves 2-10. Baselines that take seconds per save
(.cpu(), a fresh DefaultStager per save) run SLOW_SAVES saves instead; a row's
label says which saves its medians cover on each side. DefaultStager runs with the
options dcp.async_save gives it and with its own defaults (with --full: two more option
sets). Then a training loop of bf16 transformer-style blocks with a staged save every
step, against no save (3 alternated rounds of 10 steps, 5 with --full).

Timing is wall clock on the host (what the training loop sees), with the device
synchronized before each save so one save's copy does not spill into the next.

torch 2.11's DefaultStager raises KeyError on its second stage(); where reusing
one fails, the baseline goes on with a fresh DefaultStager per save (the failed
run's first save counts as the first) and its name says so (each save then
allocates its host buffers again).

The training loop runs steps back to back, as training does, and divides the
time of a run of steps by their number: the host queues a step's work while the
device still runs the previous one, so a save's host work overlaps the device's.
A second row times each step alone (device synchronized before it), where the
device idles while the host stages: it shows the host cost of a save, not what
a training loop pays.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from common import gbps, row, summarize, time_host_ms

import offload
from offload.core import _device

SECTION = "staging"
SAVES = 10
# Baselines that take seconds per save of 4 GiB (.cpu(), a fresh DefaultStager per
# save) run this many saves, so the section fits in a few minutes; the median of
# saves 2-n is as stable for them (no reuse to warm up).
SLOW_SAVES = 3


def applies(device_type: str) -> bool:
    return True


def _state(count: int, numel: int, device) -> dict:
    return {"model": {f"layer{i}.weight": torch.randn(numel, device=device).to(torch.bfloat16) for i in range(count)}}


def _bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


class _Naive:
    name = ".cpu()"

    def stage(self, state):
        return {"model": {k: v.cpu() for k, v in state["model"].items()}}

    def close(self):
        pass


def _stagers(device, full: bool):
    """(name, factory) for every stager this torch has; DefaultStager in its option combinations:
    every one with `full`, else the first and the last (the two the figure and the headline show)."""
    out = [(".cpu()", _Naive)]
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return out
    accel = _device.is_accelerator(device)
    combos = [
        (False, False, False, False),  # what dcp.async_save builds when given no stager
        (True, False, False, False),
        (True, False, True, True),
        (True, True, True, True),  # DefaultStager()'s defaults
    ]
    combos = [c for c in combos if accel or not c[3]]  # non_blocking needs an accelerator
    if not full:
        combos = list(dict.fromkeys([combos[0], combos[-1]]))
    for pinned, shared, asynchronous, non_blocking in combos:
        options = StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=shared,
            use_async_staging=asynchronous,
            use_non_blocking_copy=non_blocking,
        )
        name = f"DefaultStager(pin={int(pinned)},shm={int(shared)},async={int(asynchronous)},nb={int(non_blocking)})"
        out.append((name, lambda options=options: DefaultStager(options)))
    return out


@dataclass
class Saves:
    """What a run of saves measured: per save the caller-blocked and staging ms, and the error
    that ended the run early (`None` when every save ran)."""

    blocked: List[float] = field(default_factory=list)
    staged: List[float] = field(default_factory=list)
    error: Optional[str] = None


def _run_saves(make, state, device, fresh_each: bool = False, saves: int = SAVES) -> Saves:
    """`saves` saves; a failing save ends the run with its error recorded and the saves before
    it kept.

    fresh_each: a new stager per save (closed after it), for stagers that cannot be reused.
    """
    out = Saves()
    stager = make()
    try:
        for save in range(saves):
            if fresh_each and save:
                stager.close()
                stager = make()
            for t in state["model"].values():
                t.add_(1)  # the training step between saves
            _device.synchronize(device)
            t0 = time.perf_counter()
            staged = stager.stage(state)
            t1 = time.perf_counter()
            if isinstance(staged, Future):
                staged = staged.result()
            if hasattr(stager, "synchronize_staging") and not isinstance(stager, offload.AsyncStager):
                stager.synchronize_staging()
            t2 = time.perf_counter()
            out.blocked.append((t1 - t0) * 1e3)
            out.staged.append((t2 - t0) * 1e3)
            del staged  # the upload finished: its buffers may be reused
    except Exception as error:  # DefaultStager on torch 2.11 fails its second stage()
        out.error = f"{type(error).__name__}: {error}"[:120]
    finally:
        stager.close()
    return out


def _baseline_saves(name, make, state, device):
    """(name as reported, Saves): a stager that fails when reused is measured fresh per save.

    Its first save, made before the reuse failed, was a fresh stager's first save too, so it
    counts, and the fresh ones only add the rest."""
    result = _run_saves(make, state, device, saves=SLOW_SAVES if make is _Naive else SAVES)
    if result.error is None or not name.startswith("DefaultStager"):
        return name, result
    kept_blocked, kept_staged = result.blocked[:1], result.staged[:1]
    rest = _run_saves(make, state, device, fresh_each=True, saves=SLOW_SAVES - len(kept_staged))
    if rest.error is not None:
        return name, result
    fresh = Saves(kept_blocked + rest.blocked, kept_staged + rest.staged)
    return f"{name} fresh per save (reuse raised {result.error.split(':')[0]})", fresh


def _later_saves(ours: int, theirs: int) -> str:
    """The saves a row's medians cover: offload's saves 2-n, and the baseline's where it ran fewer."""
    return f"saves 2-{ours} (median)" if theirs == ours else f"saves 2-{ours} (median; baseline: saves 2-{theirs})"


def _size_cases(quick: bool):
    if quick:
        return [("64 tensors x 64 KiB", 64, 32 << 10), ("400 tensors x 4 KiB", 400, 2 << 10)]
    return [("64 tensors x 64 MiB (4 GiB)", 64, 32 << 20), ("4000 tensors x 256 KiB", 4000, 128 << 10)]


def _marks(name, drawn, headline, label, panel, group, said=None) -> dict:
    """A staging row's figure fields (for the baselines drawn) and headline (the first case's chosen baseline)."""
    out = dict(figure="staging_weight_sync", panel=panel, group=group) if name in drawn else {}
    if said and headline:
        out["headline"] = f"Checkpoint staging: {said}, {label}"
    return out


def _staging_rows(ctx) -> list:
    rows = []
    device = ctx.device
    for case_index, (label, count, numel) in enumerate(_size_cases(ctx.quick)):
        state = _state(count, numel, device)
        nbytes = _bytes(state)
        results = {}
        for name, make in [("offload.AsyncStager", offload.AsyncStager)] + _stagers(device, ctx.full):
            ctx.progress(f"{label}: {name}")
            if name == "offload.AsyncStager":
                # The first save is timed with the pool's growth in it: pinned memory an earlier
                # case or section left cached (the pool would cut it afresh) is given back first.
                offload.default_host_pool().trim()
                results[name] = _run_saves(make, state, device)
            else:
                shown, result = _baseline_saves(name, make, state, device)
                results[shown] = result
        ours = results.pop("offload.AsyncStager")
        if ours.error is not None:
            raise RuntimeError(f"offload.AsyncStager failed: {ours.error}")
        o_blocked, o_staged = ours.blocked, ours.staged
        o_first, o_steady = o_staged[0], statistics.median(o_staged[1:])
        stagers = [name for name in results if name.startswith("DefaultStager")]
        # The headline's baseline: DefaultStager()'s defaults where this device has them, else the
        # stager dcp.async_save builds. The figure shows those two and the .cpu() loop.
        headline = next((n for n in stagers if "pin=1,shm=1,async=1,nb=1" in n), stagers[0] if stagers else None)
        drawn = {".cpu()"} | ({stagers[0], stagers[-1]} if stagers else set())
        for name, result in results.items():
            common = {"size_bytes": nbytes, "tensors": count, "offload_saves": len(o_staged)}
            if result.error is not None:
                rows.append(row(SECTION, f"{label}: staging, saves 2-{len(o_staged)}", offload=gbps(nbytes, o_steady),
                                baseline=None, unit="GB/s", baseline_name=f"{name} failed: {result.error}", **common))
                continue
            b_blocked, b_staged = result.blocked, result.staged
            common["baseline_saves"] = len(b_staged)  # medians over its saves 2-n
            saves = _later_saves(len(o_staged), len(b_staged))
            lead = case_index == 0 and name == headline
            rows.append(row(SECTION, f"{label}: staging, first save", offload=gbps(nbytes, o_first),
                            baseline=gbps(nbytes, b_staged[0]), unit="GB/s", baseline_name=name, **common,
                            **_marks(name, drawn, lead, label, "gbps", f"staging {label}: first save", "first save")))
            rows.append(row(SECTION, f"{label}: staging, {saves}", offload=gbps(nbytes, o_steady),
                            baseline=gbps(nbytes, statistics.median(b_staged[1:])), unit="GB/s",
                            baseline_name=name, **common,
                            **_marks(name, drawn, lead, label, "gbps", f"staging {label}: later saves")))
            rows.append(row(SECTION, f"{label}: caller blocked, {saves}",
                            offload=statistics.median(o_blocked[1:]), baseline=statistics.median(b_blocked[1:]),
                            unit="ms", baseline_name=name, higher_is_better=False, **common,
                            **_marks(name, drawn, lead, label, "blocked", f"staging {label}", "caller blocked")))
        del state
        _device.empty_cache()
    return rows


class _Block(torch.nn.Module):
    """Pre-norm attention + MLP, the shape of a transformer layer."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def _loop_ms(step, device, steps: int, rounds: int, warmup: int = 2) -> dict:
    """ms per step of `steps` steps run back to back (one synchronize per round), as training runs."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(rounds):
        _device.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _device.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3 / steps)
    return summarize(samples)


def _training_rows(ctx) -> list:
    device = ctx.device
    dim, heads, layers, batch, seq = (64, 4, 2, 2, 32) if ctx.quick else (1024, 16, 8, 8, 2048)
    model = torch.nn.Sequential(*[_Block(dim, heads) for _ in range(layers)]).to(device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(batch, seq, dim, device=device, dtype=torch.bfloat16)

    def step(save=None):
        if save is not None:
            # Saved at the top of the step, as the DCP tutorial does: the copy of
            # the weights the last step wrote overlaps this step's forward and
            # backward, and optimizer.step() waits for it (protect / result()).
            save()
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    def state():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    step()  # optimizer state exists from here on
    ours = offload.AsyncStager()
    protection = ours.protect(optimizer)
    iters = 5 if ctx.quick else 20 if ctx.full else 10
    steps, rounds = (3, 2) if ctx.quick else (10, 5) if ctx.full else (10, 3)

    def our_step():
        step(lambda: ours.stage(state()))

    ctx.progress("training loop: no save / offload.AsyncStager every step, back to back")
    plain, staged = [], []
    for _ in range(rounds):  # alternating, so drift on a shared machine lands on both alike
        plain.append(_loop_ms(step, device, steps, 1)["median_ms"])
        staged.append(_loop_ms(our_step, device, steps, 1)["median_ms"])
    plain, staged = summarize(plain), summarize(staged)
    ctx.progress("training loop: each step alone (device idle while the host stages)")
    plain_alone = time_host_ms(step, device, warmup=2, iters=iters)
    staged_alone = time_host_ms(our_step, device, warmup=2, iters=iters)
    metrics = ours.metrics()
    state_bytes = metrics[-1]["bytes"]
    blocked = statistics.median(m["blocked_ms"] for m in metrics[-iters:])
    protection.remove()
    ours.close()
    case = f"train step, {layers} bf16 blocks d={dim}, save every step ({state_bytes >> 20} MiB)"
    rows = [
        row(SECTION, case, offload=staged["median_ms"], baseline=plain["median_ms"], unit="ms/step",
            baseline_name="same loop without saves", higher_is_better=False, spread_pct=staged["spread_pct"],
            blocked_ms_per_save=blocked),
        row(SECTION, f"{case}, each step alone (device idle during the save's host work)",
            offload=staged_alone["median_ms"], baseline=plain_alone["median_ms"], unit="ms/step",
            baseline_name="same steps without saves", higher_is_better=False,
            spread_pct=staged_alone["spread_pct"]),
    ]
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return rows
    accel = _device.is_accelerator(device)
    options = StagingOptions(True, False, accel, accel)
    name = f"DefaultStager(pin=1,async={int(accel)},nb={int(accel)})"
    pending = []
    stagers = [DefaultStager(options)]

    def their_save(fresh: bool):
        if fresh:  # torch 2.11 cannot reuse one: a new stager (and new host buffers) per save
            stagers.append(DefaultStager(options))
            stagers.pop(0).close()
        pending.append(stagers[-1].stage(state()))

    def their_wait(*_):
        # torch's tutorial: staging must be complete before optimizer.step() changes the weights.
        while pending:
            out = pending.pop()
            if isinstance(out, Future):
                out.result()

    hook = optimizer.register_step_pre_hook(their_wait)
    # Its steps take ten times ours (a third of a second at full size): one round unless --full.
    their_rounds = rounds if ctx.full else 1
    ctx.progress("training loop: DefaultStager every step")
    try:
        try:
            theirs_ms = _loop_ms(lambda: step(lambda: their_save(False)), device, steps, their_rounds)
        except Exception as error:  # torch 2.11: KeyError on the second stage() of one stager
            pending.clear()
            name = f"{name} fresh per save (reuse raised {type(error).__name__})"
            theirs_ms = _loop_ms(lambda: step(lambda: their_save(True)), device, steps, their_rounds)
        rows.append(row(SECTION, "train step with a save every step", offload=staged["median_ms"],
                        baseline=theirs_ms["median_ms"], unit="ms/step", higher_is_better=False,
                        baseline_name=name))
    except Exception as error:
        rows.append(row(SECTION, "train step with a save every step", offload=staged["median_ms"], baseline=None,
                        unit="ms/step", baseline_name=f"{name} failed: {type(error).__name__}: {error}"[:120]))
    finally:
        hook.remove()
        for stager in stagers:
            stager.close()
    return rows


def run(ctx) -> list:
    return _staging_rows(ctx) + _training_rows(ctx)
