"""Auto mode of activation offload: measure the first steps of an input shape, plan, check the plan.

Measuring: the first step of a new input shape offloads every eligible layer (a model that
fits only with offload still fits while measured); it gives the bandwidth of the copies
under compute, and its peak shows whether a step without offload fits. If it does (and no
budget is set) the next two or three run without offload (Note [measuring without offload]),
each held to run at the device's pace (Note [measured at the device's pace] in
step_measure.py): the last gives per layer its saved bytes, and the least of theirs its
forward and backward times. Else one more runs with everything offloaded, and gives both.
The plan is then made by `schedule.schedule` (no budget), and checked against timed steps
(Note [probes] in probes.py); or by `budget.plan` (a memory budget: keep, offload or
recompute per layer), checked against its own timed steps (budget_check.py, budget_run.py).

Three concerns, three files: this one decides what each step of a shape runs and makes the
plan; step_measure.py records a measured step (the planner as the engine's observer) and reads
its times; probes.py checks a plan without a budget against timed steps.

The planner drives the engine and the handle only through their documented interfaces
(Note [engine interface] in engine.py, Note [handle interface] in api.py).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Optional

import torch

from ..core import _device
from ..core.copy import copy_to_device, copy_to_host, release_finished_copies
from .saved_tensors import tensor_leaves
from . import budget as _budget
from .budget_check import BudgetChecks
from .budget_run import BudgetRun, costs as _costs
from .probes import PROBE_STEPS, PROBE_WARMUP_STEPS, PlanProbes, Probe
from .ranks import Ranks, largest_flag
from .stretch_peaks import StretchPeaks
from .schedule import planned_bytes, schedule
from .step_measure import Clock, StepMeasure, least_times, onto, rescaled
from .step_search import PROBE_ROUNDS, STEP_OVERHEAD_TOLERANCE, StepSearch

# Note [measuring without offload]: layer times from a step with every layer offloaded are
# not those of a step without (the window's stalls change the device's clocks and the
# overlap), and a plan made from them would end its copies early or late. So when a step
# without offload fits (and no budget is set: a budget may keep memory free for others),
# the measured steps after the first run without offload, with kept groups that still
# record each layer's bytes and times.

# Note [fresh segments]: the steps before a plan settles (measuring with every layer offloaded,
# probes, a budget plan's checks and its rival) leave the device allocator's cache cut into
# blocks sized for those plans, and the settled plan's own allocations then split and merge
# them every step: the same plan runs measurably slower than when started on a fresh cache. So
# the cached blocks are given back once, as a shape's plan settles (the next step's first
# allocations go to the driver again, as in any first step). Garbage is collected first, and
# the core lets go of the sources of the last copies (held until a later copy sees them done:
# a plan that offloads nothing makes none, and would hold a layer's activations for good):
# blocks still held would otherwise stay as segments of their own and cut up the new ones the
# same way.

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
# no mark brackets (Note [copy waits are not compute] in step_measure.py); a backward is about
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
    """The shapes and dtypes of the tensors in a forward's inputs, nested ones included."""
    leaves: list = []
    tensor_leaves(list(args) + [kwargs[k] for k in sorted(kwargs)], leaves)
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves)


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


class AutoPlanner(StepMeasure, PlanProbes, BudgetChecks):
    """The engine's observer while measuring; keeps one plan per input shape.

    The handle calls `before_forward` ahead of each training forward, `current_plan` for
    `handle.plan`, and `forget_step_start` when steps run paused. The observer calls
    (`opened`, `closed`, `saved_bytes`, `unpacked`, `backward_started`, `saved_after_layers`)
    come from the engine while this planner is its observer (Note [engine interface]); they
    are `StepMeasure`'s. Its bases split its methods by concern over one shared state, set
    up here: `StepMeasure` (a measured step), `PlanProbes` (a plan without a budget checked
    against timed steps), `BudgetChecks` (a budget plan checked against its own).
    """

    def __init__(self, handle, budget: Optional[int], verbose: bool, ranks: Optional[Ranks] = None):
        self.handle = handle
        self.engine = handle.engine
        self.budget = budget
        # The ranks whose measurements every decision combines (Note [ranks agree] in ranks.py);
        # their plans are the same, so one of them reports it.
        self.ranks = ranks if ranks is not None else Ranks()
        self.verbose = verbose and self.ranks.first
        self.clock = Clock(self.engine.device)
        self.plans = {}
        self.key = None
        self.measuring = None  # (key, steps measured)
        # Measured steps run without offload (their layers' times are those of a step without
        # copies) when a step without offload fits on the device and there is no budget.
        self.measure_without_offload = False
        self.bus = (None, None)  # (d2h, h2d) GB/s of the first measuring step's copies
        self.reserved = 0  # the allocator's device memory as the current measured step started
        self.records = {}
        self.backward_mark = None  # when the measured step's backward started
        self.tail_marks: list = []  # (m, mark, peak bytes so far) of the tensors saved after the last layer
        self.waits: list = []  # (layer, in backward, begun, ended) of the compute stream's waits for copies
        self.bandwidth = None
        self.tuning = {}  # key -> Probe while its plan is being checked against measured steps
        # (mark, key, probe serial, whether it offloaded) of the last training forward of a planned shape
        self.last_start = None
        # The input shape of the last forward if its settled plan offloads nothing (its steps run unhooked).
        self.unhooked_shape = None
        self.warned_budget = False  # a budget the plan cannot meet is warned about once per handle
        self.inputs = {}  # layer -> bytes of its tensor inputs in the measured step (what a checkpoint saves)
        self.budget_runs = {}  # key -> BudgetRun while a budget plan is checked against its steps
        # The measured step's memory, stretch by stretch with a budget (Note [memory beside the
        # activations] in budget.py).
        self.memory = StretchPeaks(self.engine.device, by_stretch=budget is not None)
        self.budget_start = None  # (mark, key) of the last training forward of a budget plan being checked
        # When the host began a measured step's forward, the seconds it took to queue its layers,
        # and the hold the last measured step was given (Note [measured at the device's pace]).
        self.forward_host_start = None
        self.forward_host_s = None
        self.held_s = 0.0
        self.hold_pending = False  # the measured step's first layer has yet to open and hold
        self.earlier_times: list = []  # `_step_times` of the shape's earlier steps measured without offload

    def current_plan(self):
        return self.plans.get(self.key)

    def forget_step_start(self) -> None:
        """Steps ran outside the plan (paused): a probe times from one hooked forward to the next."""
        self.last_start = None

    def before_forward(self, args, kwargs) -> bool:
        """Set the plan of this training forward's input shape; True when it runs without hooks.

        A shape whose settled plan offloads nothing costs a shape check per step and nothing
        else: its layers are unwrapped (no boundary, no clock, no hooks), until a shape that
        needs them comes.
        """
        key = _shape_key(args, kwargs)
        if key == self.unhooked_shape and self.measuring is None:
            return True
        if self.measuring is not None and self.engine.backward_seen:
            self.memory.end(None)  # the first layer's backward, to the step's end
            measured_key, steps = self.measuring
            steps += 1
            if self._measured_enough(measured_key, steps):
                self.plans[measured_key] = plan = self._plan(measured_key)
                self.measuring = None
                if plan["tuning"]["settled"] and measured_key not in self.budget_runs:
                    self._fresh_segments()
            else:
                if self.measure_without_offload and steps > 1:  # a step measured without offload ended
                    self.earlier_times.append(self._step_times())
                self.measuring = (measured_key, steps)
        self.key = key
        self.hold_pending = False
        handle = self.handle
        if key in self.plans:
            self._tune(key)
            self._check_budget(key)
            mask = list(self.plans[key]["mask"])
            recompute = list(self.plans[key].get("recompute") or [False] * len(mask))
            handle.set_offloaded(mask)
            handle.set_recomputed(recompute)
            self.engine.use_plan(self.plans[key].get("schedule"), observer=None)
            # Nothing offloaded: a settled plan, or a probe's step without offload (the baseline
            # the probed count is timed against is the step exactly as without offload).
            unhooked = not any(mask) and not any(recompute)
            # A budget plan still under check goes through here each step to be timed.
            self.unhooked_shape = key if unhooked and key not in self.tuning and key not in self.budget_runs else None
            handle.set_layers_wrapped(not unhooked)
            return unhooked
        self.unhooked_shape = None
        handle.set_layers_wrapped(True)
        self.last_start = self.budget_start = None
        if self.measuring is None or self.measuring[0] != key:
            self.measuring = (key, 0)
            self.measure_without_offload = False
            self.held_s = 0.0
            self.earlier_times = []
        # Every eligible layer offloaded, in the window; or, once a step without offload is
        # known to fit, none (kept groups: each layer's bytes and times are still recorded).
        keep = handle.keep
        handle.set_offloaded([False] * len(keep) if self.measure_without_offload else [not k for k in keep])
        handle.set_recomputed([False] * len(keep))
        self.engine.use_plan(None, observer=self)
        self._start_measured_step()
        return False

    def _fresh_segments(self) -> None:
        """A shape's plan settled: give the allocator's cached blocks back (Note [fresh segments])."""
        if self.engine.on_accel:
            gc.collect()
            _device.synchronize(self.engine.device)
            release_finished_copies()
        _device.empty_cache()

    def _measured_enough(self, key, steps: int) -> bool:
        """After measuring step `steps` of shape `key`: whether to plan now.

        See Note [measuring without offload].
        """
        device = self.engine.device
        if steps == 1:
            stats = self.engine.stats()
            _, total = _device.mem_get_info(device)
            measured = self.ranks.agree(
                key, "first measured step",
                {"d2h": stats["d2h_gbps"], "h2d": stats["h2d_gbps"], "total": total,
                 "without_offload": self.memory.step_peak + stats["d2h_bytes"]},  # at most
                largest=("without_offload",), smallest=("d2h", "h2d", "total"))
            self.bus = (measured["d2h"], measured["h2d"])
            total = measured["total"]
            self.measure_without_offload = self.budget is None and (
                not total or measured["without_offload"] <= FIT_FRACTION * total)
            return MEASURE_STEPS <= 1
        if self.measure_without_offload:
            grew = largest_flag(self.ranks, key, "measured step", _device.memory_reserved(device) > self.reserved)
            return steps > MIN_MEASURED_WITHOUT_OFFLOAD and (not grew or steps > MEASURE_WITHOUT_OFFLOAD_STEPS)
        return steps >= MEASURE_STEPS

    # ---- planning
    def _plan(self, key) -> dict:
        handle = self.handle
        n = len(handle.layers)
        nbytes = [self.records.get(i, {}).get("bytes", 0) for i in range(n)]
        last = self._step_times()
        times = least_times([last] + self.earlier_times)
        self.earlier_times = []
        fwd, bwd, tail, head_bwd = times["fwd"], times["bwd"], times["tail"], times["head_bwd"]
        # The marks are the last step's: moved onto the least times, each at the same share of
        # its stretch (a mark past the layer's end would close a part after the layer does).
        saved = [rescaled(self._saved_marks(self.records.get(i, {})), fwd[i], last["fwd"][i]) for i in range(n)]
        spans = [self.records.get(i, {}).get("span_ends") or None for i in range(n)]
        last_close = self.records.get(n - 1, {}).get("close")
        before_peak = None
        if self.budget is None:
            before_peak = self._before_peak(last_close, self.memory.step_peak)
            if before_peak is not None:
                before_peak = (before_peak[0], before_peak[1] * onto(tail, last["tail"]))
        # Waits the engine bracketed are out of these times already; the cap at 3x forward (a
        # layer's backward is about 2x its forward, 3x with recomputation) keeps any other
        # stall out of the compute the plan hides copies under.
        bwd = [min(b, BACKWARD_CAP * f) if b is not None and f > 0 else b for b, f in zip(bwd, fwd)]
        ratios = [b / f for b, f in zip(bwd, fwd) if b is not None and f > 0]
        ratio = sorted(ratios)[len(ratios) // 2] if ratios else 2.0
        bwd = [b if b is not None else ratio * f for b, f in zip(bwd, fwd)]
        stats = self.engine.stats()
        d2h_gbps, h2d_gbps = self.bus if self.measure_without_offload else (stats["d2h_gbps"], stats["h2d_gbps"])
        d2h = d2h_gbps * 1e9 if d2h_gbps else None
        h2d = h2d_gbps * 1e9 if h2d_gbps else None
        if self.budget is None or d2h is None or h2d is None:
            if self.bandwidth is None:
                self.bandwidth = probe_bandwidth(self.engine.device)
            idle_d2h, idle_h2d = self.bandwidth
            if self.budget is None:
                # The schedule starts from the faster of the two: the first measuring step's
                # copies may be slowed by what else the step does first, and a rate too high
                # is corrected once the plan's own copies are timed (_rescheduled).
                d2h, h2d = max(d2h or 0, idle_d2h), max(h2d or 0, idle_h2d)
            else:  # the window's plans keep the rate measured under it where there is one
                d2h, h2d = d2h or idle_d2h, h2d or idle_h2d
        eligible = [not k for k in handle.keep]
        peak = self.memory.step_peak
        _, total = _device.mem_get_info(self.engine.device)
        m = self.ranks.agree(key, "plan", {
            "nbytes": nbytes, "inputs": [self.inputs.get(i, 0) for i in range(n)], "peak": peak,
            # What the head and the loss hold on top of the layers as backward starts.
            "tail_bytes": max(0, peak - self.tail_marks[0][2]) if self.tail_marks else 0,
            "fwd": fwd, "bwd": bwd, "tail": tail, "head_bwd": head_bwd, "d2h": d2h, "h2d": h2d, "total": total,
            "before_peak": before_peak,
            "saved": saved, "spans": spans, "at_start": self.memory.at_start, **self.memory.per_layer(n),
        }, largest=("nbytes", "inputs", "peak", "tail_bytes", "at_start", "forward_peaks", "tail_peaks",
                    "backward_peaks"),
            smallest=("fwd", "bwd", "tail", "head_bwd", "d2h", "h2d", "total"))
        nbytes, inputs, peak, tail_bytes = m["nbytes"], m["inputs"], m["peak"], m["tail_bytes"]
        fwd, bwd, tail, head_bwd, d2h, h2d, total = (m[name] for name in ("fwd", "bwd", "tail", "head_bwd", "d2h",
                                                                           "h2d", "total"))
        saved, spans, before_peak = m["saved"], m["spans"], m["before_peak"]
        run = None
        plan_schedule = caps = None
        if self.budget is None:
            # Hide the copies: what the bus moves before backward starts, freed at planned points.
            plan_schedule, order, exposed = schedule(eligible, nbytes, fwd, bwd, tail, head_bwd, d2h, h2d,
                                                     before_peak, saved, spans)
            caps = plan_schedule.caps
            mask = [i in order for i in range(n)]
            step = sum(fwd) + tail + head_bwd + sum(bwd) + exposed
        else:  # keep, offload or recompute each layer: the least step that fits (budget.py)
            memory = _budget.StepMemory(peak, m["at_start"], m["forward_peaks"], m["tail_peaks"][n - 1],
                                        m["backward_peaks"])
            run = BudgetRun(_costs(nbytes, inputs, fwd, bwd, eligible, handle.checkpointed),
                            _budget.Bus(d2h, h2d, self.engine.resident_groups), self.budget, peak, tail + head_bwd,
                            tail_bytes, memory)
            run.make()
            mask = run.fields(handle.layers)["mask"]
            exposed, step = run.result.chosen.exposed_s, run.result.chosen.step_s
        eligible_bytes = sum(b for b, e in zip(nbytes, eligible) if e)
        offloaded = planned_bytes(nbytes, mask, caps)
        plan = {
            "input_shapes": [list(shape) for shape, _ in key],
            "mask": mask,
            "offload": [name for name, m in zip(handle.layers, mask) if m],
            "offloaded_bytes": offloaded,
            "eligible_bytes": eligible_bytes,
            "hideable_bytes": min(eligible_bytes, int(sum(fwd) * d2h)),
            "layer_bytes": nbytes,
            "caps": caps,
            "schedule": plan_schedule,
            "forward_ms": [f * 1e3 for f in fwd],
            # Per layer: [share of its bytes saved, ms into its forward] (see saved_by), or None.
            "saved_ms": [None if m is None else [[share, t * 1e3] for share, t in m] for m in saved],
            "backward_ms": [b * 1e3 for b in bwd],
            "tail_ms": tail * 1e3,
            # The last tensor saved after the layers before the step's peak: (its count, ms after
            # the last layer's end); copies run until it and the memory goes there.
            "before_peak": None if before_peak is None else [before_peak[0], before_peak[1] * 1e3],
            "head_backward_ms": head_bwd * 1e3,
            "d2h_gbps": d2h / 1e9,
            "h2d_gbps": h2d / 1e9,
            "predicted_exposed_ms": exposed * 1e3,
            "predicted_step_ms": step * 1e3,
            "measured_hold_ms": self.held_s * 1e3,  # the measured step's stream held at its start
            "budget_bytes": self.budget,
            "measured_peak_bytes": peak,
            "tuning": {"settled": True, "tolerance": STEP_OVERHEAD_TOLERANCE, "step_ms": {}, "model_layers": sum(mask),
                       "checked": False},
        }
        fits = self.measure_without_offload or not total or peak + eligible_bytes <= FIT_FRACTION * total
        if self.budget is None and fits and any(mask):
            # Timed against the step without offload (see the module docstring); the plan in
            # use meanwhile is the probe's, and `mask` becomes the settled one.
            def replan(d2h_bps):
                return schedule(eligible, nbytes, fwd, bwd, tail, head_bwd, d2h_bps, h2d, before_peak, saved, spans)

            self.tuning[key] = Probe(order, StepSearch(sum(mask)), replan, d2h)
            plan["tuning"].update(settled=False, checked=True)
            plan["model_mask"] = list(mask)
        missed = ""
        if run is not None:
            self._use_budget_plan(key, plan, run)
            self.budget_runs[key] = run
            missed = self._budget_missed(plan)
        if self.verbose:
            print(
                f"offload.activation auto plan for inputs {plan['input_shapes']}: offload {len(plan['offload'])} "
                f"of {n} layers ({offloaded / 2**20:.1f} of {eligible_bytes / 2**20:.1f} MiB eligible), "
                f"predicted exposed copy time {plan['predicted_exposed_ms']:.2f} ms of a "
                f"{plan['predicted_step_ms']:.2f} ms step at {plan['d2h_gbps']:.1f}/{plan['h2d_gbps']:.1f} GB/s"
                + (f", recompute {len(plan['recomputed'])} (predicted peak {plan['predicted_peak_bytes'] / 2**20:.1f} "
                   f"MiB)" if run is not None else "")
                + ("; timing it against a step without offload" if plan["tuning"]["checked"] else "")
                + missed,
                flush=True,
            )
        return plan
