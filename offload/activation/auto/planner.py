"""Auto mode of activation offload: measure the first steps of an input shape, plan, check the plan.

Measuring: the first step of a new input shape offloads every eligible layer (a model that
fits only with offload still fits while measured); it gives the bandwidth of the copies
under compute, and its peak shows whether a step without offload fits. If it does (and no
budget is set) the next two or three run without offload (Note [measuring without offload]),
each held to run at the device's pace (Note [measured at the device's pace] in
measure.py): the last gives per layer its saved bytes, and the least of theirs its
forward and backward times. Else one more runs with everything offloaded, and gives both.
The plan is then made by `schedule.schedule` (no budget), and checked against timed steps
(Note [probes] in probes.py); or by `budget.plan` (a memory budget: keep, offload or
recompute per layer), checked against its own timed steps (budget_checks.py, budget_plan.py).

The planner is built from parts, each handed the planner's `Shared` record (shared.py): the
step measurer (measure.py: the engine's observer while a step is measured, and the reading the
plan is made from), the prober (probes.py: a plan without a budget checked against timed
steps) and the budget checker (budget_checks.py: a budget plan checked against its own). This
file decides what each step of a shape runs and makes the plan.

The planner drives the engine and the handle only through their documented interfaces
(Note [engine interface] in ../engine.py, Note [handle interface] in ../api.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ...core import _device
from ...core.copy import copy_to_device, copy_to_host
from ..saved_tensors import tensor_leaves
from . import budget as _budget
from .budget_checks import BudgetChecker
from .budget_plan import BudgetRun, costs as _costs
from .measure import StepMeasurer
from .memory import fresh_segments
from .plan import Plan, Tuning
from .probes import PROBE_STEPS, PROBE_WARMUP_STEPS, Probe, Prober
from .ranks import Ranks, largest_flag
from .schedule import Schedule, StepInputs, planned_bytes, schedule
from .search import PROBE_ROUNDS, STEP_OVERHEAD_TOLERANCE, StepSearch
from .shared import Clock, Shared

# Note [measuring without offload]: layer times from a step with every layer offloaded are
# not those of a step without (the window's stalls change the device's clocks and the
# overlap), and a plan made from them would end its copies early or late. So when a step
# without offload fits (and no budget is set: a budget may keep memory free for others),
# the measured steps after the first run without offload, with kept groups that still
# record each layer's bytes and times.

# Measuring steps of a new input shape: the first offloads every eligible layer (kernels and
# the pool warm up, the bus is measured under compute, and the peak shows whether a step
# without offload fits); the rest are measured, then the plan is made.
MEASURE_STEPS = 2
# Measured steps without offload: at least MIN_MEASURED_WITHOUT_OFFLOAD, each layer's times
# the least of theirs (a shared device slows a stretch of one step now and then, and nothing
# makes a step faster than its device's work); at most MEASURE_WITHOUT_OFFLOAD_STEPS while the
# allocator takes new device memory in each (their times include those allocations).
MIN_MEASURED_WITHOUT_OFFLOAD = 2
MEASURE_WITHOUT_OFFLOAD_STEPS = 3
FIT_FRACTION = 0.9  # a step without offload is tried only if its predicted peak is below this share of memory
# A layer's measured backward time is taken as at most this times its forward: a guard for a wait
# no mark brackets (Note [copy waits are not compute] in measure.py); a backward is about
# 2x its forward.
BACKWARD_CAP = 3.0


def max_tuning_steps(layers: int) -> int:
    """Steps auto mode takes at most to settle one input shape with `layers` eligible layers.

    The first measuring step and at most MEASURE_WITHOUT_OFFLOAD_STEPS more; then probes of
    PROBE_WARMUP_STEPS + 2 x PROBE_STEPS x PROBE_ROUNDS steps each at most: the plan's, a
    bisection over the layers, the same again when the plan is made anew at the copies' rate,
    and the confirmation of the count it settles on (4 + 26 x (3 + 2 x log2 layers) with the
    defaults; a probe whose verdict is clear takes 8).
    """
    probe = PROBE_WARMUP_STEPS + 2 * PROBE_STEPS * PROBE_ROUNDS
    bisection = math.ceil(math.log2(max(layers, 1)))
    return 1 + MEASURE_WITHOUT_OFFLOAD_STEPS + probe * (3 + 2 * bisection)


def _shape_key(args, kwargs):
    """The shapes and dtypes of the tensors in a forward's inputs, nested ones included (a
    torch.Size hashes and compares as the tuple of its sizes)."""
    if not kwargs:
        # The common call, model(batch): read every step of a settled plan, so the walk below
        # (which makes the same key) is skipped where every input is a plain tensor.
        key = [(a.shape, a.dtype) for a in args if type(a) is torch.Tensor]
        if len(key) == len(args):
            return tuple(key)
    leaves: list = []
    tensor_leaves(list(args) + [kwargs[k] for k in sorted(kwargs)], leaves)
    return tuple([(t.shape, t.dtype) for t in leaves])


def probe_bandwidth(device, nbytes: int = 64 << 20):
    """(d2h, h2d) bytes/s of one copy each way through the copy engine."""
    if not _device.is_accelerator(device):
        nbytes = 8 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    clock = Clock(device)
    out = []
    for _ in range(2):  # the first round allocates the pool's blocks
        a = clock.mark()
        handle = copy_to_host([src])
        handle.synchronize()
        b = clock.mark()
        back = copy_to_device(handle, device)
        back.wait_stream()
        c = clock.mark()
        _device.synchronize(device)
        out = [nbytes / max(clock.seconds(a, b), 1e-9), nbytes / max(clock.seconds(b, c), 1e-9)]
    return out[0], out[1]


@dataclasses.dataclass
class _Chosen:
    """What the schedule (no budget) or the budget plan chose for a shape."""

    mask: list  # per layer: offloaded
    exposed: float  # predicted seconds of copies compute waits for
    step: float  # predicted seconds of a step
    schedule: Optional[Schedule] = None  # the engine's points (the budget plan's are in `run`)
    caps: Optional[list] = None  # per layer: the bytes its group may offload (None: all)
    order: Optional[list] = None  # the schedule's layers in the order a probe's prefix takes them
    run: Optional[BudgetRun] = None  # the budget plan, to be checked against its steps


class AutoPlanner:
    """Auto mode's planner: one plan per input shape, and what each step of a shape runs.

    The handle calls `before_forward` ahead of each training forward, `current_plan` for
    `handle.plan`, `forget_step_start` when steps run paused, and `layer_inputs` while a step
    is measured (Note [handle interface] in ../api.py). It is built from three parts, each
    handed the planner's `Shared` record (shared.py: the handle, the engine, the ranks, the
    clock, the plans):
    - `measurer` (measure.py's `StepMeasurer`): the engine's observer while a step is
      measured, and the reading the plan is made from;
    - `prober` (probes.py's `Prober`): a plan without a budget checked against timed steps;
    - `budget_checker` (budget_checks.py's `BudgetChecker`): a budget plan checked against its own.
    When a shape is measured, when it is planned, and the plan made, are the planner's own.
    """

    def __init__(self, handle, budget: Optional[int], verbose: bool, process_group=None):
        ranks = Ranks(process_group)
        # The ranks whose measurements every decision combines (Note [ranks agree] in ranks.py);
        # their plans are the same, so one of them reports it.
        self.shared = Shared(handle=handle, engine=handle.engine, ranks=ranks, clock=Clock(handle.engine.device),
                             verbose=verbose and ranks.first)
        self.measurer = StepMeasurer(self.shared, by_stretch=budget is not None)
        self.prober = Prober(self.shared)
        self.budget_checker = BudgetChecker(self.shared, budget)
        self.budget = budget
        self.key = None  # the input shape of the last training forward
        self.measuring = None  # (key, steps measured)
        # Measured steps run without offload (their layers' times are those of a step without
        # copies) when a step without offload fits on the device and there is no budget.
        self.measure_without_offload = False
        self.bus = (None, None)  # (d2h, h2d) GB/s of the first measuring step's copies
        self.bandwidth = None  # (d2h, h2d) bytes/s of one copy each way on an idle bus, once probed
        # The input shape of the last forward if its settled plan offloads nothing (its steps run unhooked).
        self.unhooked_shape = None

    def current_plan(self) -> Optional[Plan]:
        """The plan of the last training forward's input shape (None: not planned yet)."""
        return self.shared.plans.get(self.key)

    def forget_step_start(self) -> None:
        """Steps ran outside the plan (paused): a probe times from one hooked forward to the next."""
        self.prober.forget_step_start()

    def layer_inputs(self, index: int, nbytes: int) -> None:
        """The handle: layer `index` of the measured step took `nbytes` of tensor inputs."""
        self.measurer.layer_inputs(index, nbytes)

    def before_forward(self, args, kwargs) -> bool:
        """Set the plan of this training forward's input shape; True when it runs without hooks.

        A shape whose settled plan offloads nothing costs a shape check per step and nothing
        else: its layers are unwrapped (no boundary, no clock, no hooks), until a shape that
        needs them comes.
        """
        key = _shape_key(args, kwargs)
        if key == self.unhooked_shape and self.measuring is None:
            return True
        if self.measuring is not None and self.shared.engine.backward_seen:
            self._measured_step_ended()
        self.key = key
        self.measurer.not_measuring()
        if key in self.shared.plans:
            return self._run_plan(key)
        self._measure(key)
        return False

    def _measured_step_ended(self) -> None:
        """A measured step ended: plan its shape if it is measured enough."""
        self.measurer.step_ended()
        measured_key, steps = self.measuring
        steps += 1
        if self._measured_enough(measured_key, steps):
            self.shared.plans[measured_key] = plan = self._plan(measured_key)
            self.measuring = None
            if plan.tuning.settled and not self.budget_checker.checking(measured_key):
                fresh_segments(self.shared.engine)
        else:
            if self.measure_without_offload and steps > 1:  # a step measured without offload ended
                self.measurer.keep_times()
            self.measuring = (measured_key, steps)

    def _run_plan(self, key) -> bool:
        """The next step runs shape `key`'s plan (or its probe's count, or its budget plan under
        check); True when it runs without hooks."""
        handle = self.shared.handle
        self.prober.tune(key)
        self.budget_checker.check(key)
        plan = self.shared.plans[key]
        mask = list(plan.mask)
        recompute = list(plan.budget.recompute) if plan.budget is not None else [False] * len(mask)
        handle.set_offloaded(mask)
        handle.set_recomputed(recompute)
        self.shared.engine.use_plan(plan.schedule, observer=None)
        # Nothing offloaded: a settled plan, or a probe's step without offload (the baseline
        # the probed count is timed against is the step exactly as without offload).
        unhooked = not any(mask) and not any(recompute)
        # A budget plan still under check goes through here each step to be timed.
        checked = self.prober.probing(key) or self.budget_checker.checking(key)
        self.unhooked_shape = key if unhooked and not checked else None
        handle.set_layers_wrapped(not unhooked)
        return unhooked

    def _measure(self, key) -> None:
        """The next step of shape `key`, not planned yet, is measured."""
        handle = self.shared.handle
        self.unhooked_shape = None
        handle.set_layers_wrapped(True)
        self.prober.forget_step_start()
        self.budget_checker.forget_step_start()
        if self.measuring is None or self.measuring[0] != key:
            self.measuring = (key, 0)
            self.measure_without_offload = False
            self.measurer.new_shape()
        # Every eligible layer offloaded, in the window; or, once a step without offload is
        # known to fit, none (kept groups: each layer's bytes and times are still recorded).
        keep = handle.keep
        handle.set_offloaded([False] * len(keep) if self.measure_without_offload else [not k for k in keep])
        handle.set_recomputed([False] * len(keep))
        self.shared.engine.use_plan(None, observer=self.measurer)
        self.measurer.start(hold=self.measure_without_offload)

    def _measured_enough(self, key, steps: int) -> bool:
        """After measuring step `steps` of shape `key`: whether to plan now.

        See Note [measuring without offload].
        """
        engine, ranks = self.shared.engine, self.shared.ranks
        device = engine.device
        if steps == 1:
            stats = engine.stats()
            _, total = _device.mem_get_info(device)
            measured = ranks.agree(
                key, "first measured step",
                {"d2h": stats["d2h_gbps"], "h2d": stats["h2d_gbps"], "total": total,
                 "without_offload": self.measurer.memory.step_peak + stats["d2h_bytes"]},  # at most
                largest=("without_offload",), smallest=("d2h", "h2d", "total"))
            self.bus = (measured["d2h"], measured["h2d"])
            total = measured["total"]
            self.measure_without_offload = self.budget is None and (
                not total or measured["without_offload"] <= FIT_FRACTION * total)
            return MEASURE_STEPS <= 1
        if self.measure_without_offload:
            grew = largest_flag(ranks, key, "measured step", _device.memory_reserved(device) > self.measurer.reserved)
            return steps > MIN_MEASURED_WITHOUT_OFFLOAD and (not grew or steps > MEASURE_WITHOUT_OFFLOAD_STEPS)
        return steps >= MEASURE_STEPS

    # ---- planning
    def _plan(self, key) -> Plan:
        """Shape `key`'s plan from its measured steps; its check against timed steps begins."""
        handle = self.shared.handle
        n = len(handle.layers)
        reading = self.measurer.read(n, with_before_peak=self.budget is None)
        m = self._agreed(key, reading)
        eligible = [not k for k in handle.keep]
        inputs = _step_inputs(m)
        chosen = self._scheduled(inputs, eligible) if self.budget is None else self._budget_run(m, eligible)
        plan = _new_plan(key, handle.layers, m, eligible, chosen, reading.held_s, self.budget)
        fits = self.measure_without_offload or not m["total"] or m["peak"] + plan.eligible_bytes <= (
            FIT_FRACTION * m["total"])
        if self.budget is None and fits and any(chosen.mask):
            # Timed against the step without offload (see the module docstring); the plan in
            # use meanwhile is the probe's, and `mask` becomes the settled one.
            def replan(d2h_bps):
                return schedule(eligible, dataclasses.replace(inputs, d2h_bps=d2h_bps))

            self.prober.start(key, Probe(chosen.order, StepSearch(sum(chosen.mask)), replan, m["d2h"]))
            plan.tuning.settled, plan.tuning.checked = False, True
            plan.model_mask = list(chosen.mask)
        missed = ""
        if chosen.run is not None:
            # A warning points at before_forward (through _measured_step_ended and this).
            missed = self.budget_checker.start(key, plan, chosen.run, stacklevel=4)
        if self.shared.verbose:
            _print_plan(plan, n, missed)
        return plan

    def _agreed(self, key, reading) -> dict:
        """What the plan is made from: the measured step (backward times capped, the bus rates
        added), as every rank combines it (Note [ranks agree])."""
        fwd, bwd = reading.fwd, _capped_backward(reading.fwd, reading.bwd)
        d2h, h2d = self._bus_rates()
        _, total = _device.mem_get_info(self.shared.engine.device)
        return self.shared.ranks.agree(key, "plan", {
            "nbytes": reading.nbytes, "inputs": reading.inputs, "peak": reading.peak,
            # What the head and the loss hold on top of the layers as backward starts.
            "tail_bytes": reading.tail_bytes,
            "fwd": fwd, "bwd": bwd, "tail": reading.tail, "head_bwd": reading.head_bwd, "d2h": d2h, "h2d": h2d,
            "total": total, "before_peak": reading.before_peak,
            "saved": reading.saved, "spans": reading.spans, "at_start": reading.at_start, **reading.stretch_peaks,
        }, largest=("nbytes", "inputs", "peak", "tail_bytes", "at_start", "forward_peaks", "tail_peaks",
                    "backward_peaks"),
            smallest=("fwd", "bwd", "tail", "head_bwd", "d2h", "h2d", "total"))

    def _bus_rates(self):
        """(d2h, h2d) bytes/s the plan assumes: the measuring steps' copies, or a copy on an idle bus."""
        stats = self.shared.engine.stats()
        d2h_gbps, h2d_gbps = self.bus if self.measure_without_offload else (stats["d2h_gbps"], stats["h2d_gbps"])
        d2h = d2h_gbps * 1e9 if d2h_gbps else None
        h2d = h2d_gbps * 1e9 if h2d_gbps else None
        if self.budget is None or d2h is None or h2d is None:
            if self.bandwidth is None:
                self.bandwidth = probe_bandwidth(self.shared.engine.device)
            idle_d2h, idle_h2d = self.bandwidth
            if self.budget is None:
                # The schedule starts from the faster of the two: the first measuring step's
                # copies may be slowed by what else the step does first, and a rate too high
                # is corrected once the plan's own copies are timed (Prober._rescheduled).
                d2h, h2d = max(d2h or 0, idle_d2h), max(h2d or 0, idle_h2d)
            else:  # the window's plans keep the rate measured under it where there is one
                d2h, h2d = d2h or idle_d2h, h2d or idle_h2d
        return d2h, h2d

    def _scheduled(self, inputs: StepInputs, eligible: list) -> _Chosen:
        """No budget: hide the copies, what the bus moves before backward starts, freed at planned points."""
        plan_schedule, order, exposed = schedule(eligible, inputs)
        mask = [i in order for i in range(len(eligible))]
        step = sum(inputs.fwd) + inputs.tail + inputs.head_bwd + sum(inputs.bwd) + exposed
        return _Chosen(mask, exposed, step, schedule=plan_schedule, caps=plan_schedule.caps, order=order)

    def _budget_run(self, m: dict, eligible: list) -> _Chosen:
        """A budget: keep, offload or recompute each layer, the least step that fits (budget.py)."""
        handle, n = self.shared.handle, len(eligible)
        memory = _budget.StepMemory(m["peak"], m["at_start"], m["forward_peaks"], m["tail_peaks"][n - 1],
                                    m["backward_peaks"])
        run = BudgetRun(_costs(m["nbytes"], m["inputs"], m["fwd"], m["bwd"], eligible, handle.checkpointed),
                        _budget.Bus(m["d2h"], m["h2d"], self.shared.engine.resident_groups), self.budget, m["peak"],
                        m["tail"] + m["head_bwd"], m["tail_bytes"], memory)
        run.make()
        mask = run.fields(handle.layers).mask
        return _Chosen(mask, run.result.chosen.exposed_s, run.result.chosen.step_s, run=run)


def _capped_backward(fwd: list, bwd: list) -> list:
    """Per layer the backward time the plan assumes.

    Waits the engine bracketed are out of these times already; the cap at 3x forward (a layer's
    backward is about 2x its forward, 3x with recomputation) keeps any other stall out of the
    compute the plan hides copies under. A backward not timed is its forward times the median
    ratio of those timed.
    """
    bwd = [min(b, BACKWARD_CAP * f) if b is not None and f > 0 else b for b, f in zip(bwd, fwd)]
    ratios = [b / f for b, f in zip(bwd, fwd) if b is not None and f > 0]
    ratio = sorted(ratios)[len(ratios) // 2] if ratios else 2.0
    return [b if b is not None else ratio * f for b, f in zip(bwd, fwd)]


def _step_inputs(m: dict) -> StepInputs:
    """The schedule's inputs from the agreed measurements (`AutoPlanner._agreed`)."""
    return StepInputs(m["nbytes"], m["fwd"], m["bwd"], m["tail"], m["head_bwd"], m["d2h"], m["h2d"],
                      m["before_peak"], m["saved"], m["spans"])


def _new_plan(key, layers: list, m: dict, eligible: list, chosen: _Chosen, held_s: float,
              budget: Optional[int]) -> Plan:
    """Shape `key`'s plan as made, before a probe or a budget check updates it (times in ms, rates in GB/s)."""
    nbytes, fwd, d2h = m["nbytes"], m["fwd"], m["d2h"]
    eligible_bytes = sum(b for b, e in zip(nbytes, eligible) if e)
    mask, before_peak = chosen.mask, m["before_peak"]
    return Plan(
        input_shapes=[list(shape) for shape, _ in key],
        mask=mask,
        offload=[name for name, on in zip(layers, mask) if on],
        offloaded_bytes=planned_bytes(nbytes, mask, chosen.caps),
        eligible_bytes=eligible_bytes,
        hideable_bytes=min(eligible_bytes, int(sum(fwd) * d2h)),
        layer_bytes=nbytes,
        caps=chosen.caps,
        schedule=chosen.schedule,
        forward_ms=[f * 1e3 for f in fwd],
        saved_ms=[None if s is None else [[share, t * 1e3] for share, t in s] for s in m["saved"]],
        backward_ms=[b * 1e3 for b in m["bwd"]],
        tail_ms=m["tail"] * 1e3,
        before_peak=None if before_peak is None else [before_peak[0], before_peak[1] * 1e3],
        head_backward_ms=m["head_bwd"] * 1e3,
        d2h_gbps=d2h / 1e9,
        h2d_gbps=m["h2d"] / 1e9,
        predicted_exposed_ms=chosen.exposed * 1e3,
        predicted_step_ms=chosen.step * 1e3,
        measured_hold_ms=held_s * 1e3,
        budget_bytes=budget,
        measured_peak_bytes=m["peak"],
        tuning=Tuning(settled=True, tolerance=STEP_OVERHEAD_TOLERANCE, model_layers=sum(mask), checked=False),
    )


def _print_plan(plan: Plan, n: int, missed: str) -> None:
    """Say what the plan is (verbose)."""
    budget = plan.budget
    print(
        f"offload.activation auto plan for inputs {plan.input_shapes}: offload {len(plan.offload)} "
        f"of {n} layers ({plan.offloaded_bytes / 2**20:.1f} of {plan.eligible_bytes / 2**20:.1f} MiB "
        f"eligible), predicted exposed copy time {plan.predicted_exposed_ms:.2f} ms of a "
        f"{plan.predicted_step_ms:.2f} ms step at {plan.d2h_gbps:.1f}/{plan.h2d_gbps:.1f} GB/s"
        + (f", recompute {len(plan.recomputed)} (predicted peak {budget.predicted_peak_bytes / 2**20:.1f} "
           f"MiB)" if budget is not None else "")
        + ("; timing it against a step without offload" if plan.tuning.checked else "")
        + missed,
        flush=True,
    )
