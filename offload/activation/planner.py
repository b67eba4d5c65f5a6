"""Auto mode of activation offload: measure the first steps of an input shape, plan, check the plan.

Measuring: the first step of a new input shape offloads every eligible layer (a model that
fits only with offload still fits while measured); it gives the bandwidth of the copies
under compute, and its peak shows whether a step without offload fits. If it does (and no
budget is set) the next two or three run without offload (Note [measuring without offload]),
each held to run at the device's pace (Note [measured at the device's pace]): the last gives
per layer its saved bytes, and the least of theirs its forward and backward times. Else one
more runs with everything offloaded, and gives both. The plan is then made by
`schedule.schedule` (no budget), and checked against timed steps (Note [probes]); or by
`budget.plan` (a memory budget: keep, offload or recompute per layer), checked against its
own timed steps (budget_check.py, budget_run.py).

The planner drives the engine and the handle only through their documented interfaces
(Note [engine interface] in engine.py, Note [handle interface] in api.py).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Optional

import torch

from ..core import _device
from ..core.copy import copy_to_device, copy_to_host, release_finished_copies
from .saved_tensors import tensor_leaves
from . import budget as _budget
from .budget_check import BudgetChecks
from .budget_run import BudgetRun, costs as _costs
from .ranks import Ranks, largest_flag, smallest_value
from .stretch_peaks import StretchPeaks
from .schedule import COPY_MARGIN, planned_bytes, schedule
from .step_search import PROBE_ROUNDS, STEP_OVERHEAD_TOLERANCE, StepSearch

# Note [probes]: the model misses what it does not see (the host stalls of the resident
# window, launch-bound steps where the hooks' own cost shows, copies slowing compute on a
# shared memory bus), so a plan without a budget is run and timed. A plan is "offload the
# first k layers of the schedule's order" (a prefix keeps every planned point valid). A
# probe of a count k runs its steps alternately with steps with nothing offloaded (without
# hooks, exactly as without offload) and compares the medians: steps drift by a few percent
# within minutes on a shared machine, as much as the tolerance, so a baseline timed in a
# probe of its own would misjudge the counts probed before or after it. The model's k is
# probed first; if it costs more than STEP_OVERHEAD_TOLERANCE of its baseline, k is bisected
# down to the largest prefix that does not (`StepSearch`), and a count above zero is
# confirmed by one more probe. A probe whose overhead lies within its own noise of the
# tolerance takes more steps, and if still unsure is decided by the schedule made at the
# bus rate its copies achieved (Note [verdicts under noise] in step_search.py). After the
# first probe, if its copies ran slower than the
# schedule assumed (less COPY_MARGIN), or the probe missed the tolerance with copies late at
# the release points (RELEASE_WAIT_TOLERANCE), the schedule is made again at the rate seen
# and the search starts over (once). A step is timed from one training forward to the next
# of the same input shape, so the optimizer and data loading are in both sides alike.

# Note [measuring without offload]: layer times from a step with every layer offloaded are
# not those of a step without (the window's stalls change the device's clocks and the
# overlap), and a plan made from them would end its copies early or late. So when a step
# without offload fits (and no budget is set: a budget may keep memory free for others),
# the measured steps after the first run without offload, with kept groups that still
# record each layer's bytes and times.

# Note [measured at the device's pace]: a layer's time is read from events on the compute
# stream, which time the device's work only while the host has queued it ahead. A measuring
# step often starts with the host caught up (the step before it waited for its copies, or
# planning synchronized), and a forward whose layers the host launches barely faster than the
# device runs them (a Hugging Face layer of a few milliseconds, the hooks' own work on top)
# then runs at the host's pace: the measured layers came out up to twice their device time,
# and a schedule made from them planned copies that the real forward could not hide. So in a
# step measured without offload the stream is held (`_device.hold`) for longer than the host
# took to queue the last measured forward: the host queues the forward (and part of backward)
# during the hold, and the events then time the device's work. The hold is queued as the first
# layer opens, not as the forward starts: a model may wait for the device before its layers
# (Hugging Face's mask creation reads the attention mask, or the position ids, on the host),
# and that wait would outlast a hold queued before it, leaving the host caught up as the first
# layer starts, which then measured its host's pace. Steps that offload in the window are not
# held: their host waits for copies mid-step, which no hold outlasts.

# Note [copy waits are not compute]: a step measured with its layers offloaded in the window
# (a budget's measuring, the first step of a shape) makes the compute stream wait for copies:
# for the oldest copy out as a layer closes, and for a layer's copy back as its backward
# starts. A layer's backward is timed from its first unpack to the next layer's, so its wait
# for the copy back lands in it wherever the bus takes longer to bring a layer back than its
# backward takes to run; the last layer's wait as it closes lands in the time from the layers'
# end to backward's start. Either is the bus's time, not compute, and a plan priced from it
# predicts its steps slower than they run (by the whole exposed copy time of the measured
# step). So the engine brackets each such wait with marks of the planner's clock, and the
# measured times are taken less the waits inside them. (The window's waits between two
# layers lie outside every timed stretch.)

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
# A probe alternates steps of the probed count and steps without offload: the first of
# each are not timed (new block sizes in the allocators), then PROBE_STEPS of each are, and
# PROBE_STEPS more of each while its verdict is unsure, PROBE_ROUNDS rounds at most.
PROBE_WARMUP_STEPS = 2
PROBE_STEPS = 3
# Timed probe steps whose end the device has not passed yet, at most: a probe step is read
# when the device is done with it (no host wait, so the host keeps running ahead as in any
# other step); only beyond this many does the host wait for the oldest.
PROBE_PENDING = 2
FIT_FRACTION = 0.9  # a step without offload is tried only if its predicted peak is below this share of memory
# A layer's measured backward time is taken as at most this times its forward: a guard for a wait
# no mark brackets (Note [copy waits are not compute]); a backward is about 2x its forward.
BACKWARD_CAP = 3.0
# A first probe over the step-time tolerance whose copies ended late at the plan's release
# points (the compute stream waited there longer than this share of the copies' own time)
# makes the schedule again at a rate lowered by that share. A plan made again keeps fewer
# bytes, so only a plan that misses its check is.
RELEASE_WAIT_TOLERANCE = 0.02
# Tensors saved after the last layer (head, loss) that the measuring step marks, at most.
MAX_TAIL_SAVES = 64
# A measured step's stream is held this many times the host's time to queue the last
# measured forward, at most HOLD_CAP_S (a step measured for the first time is held HOLD_CAP_S):
# Note [measured at the device's pace].
HOLD_HOST_FACTOR = 1.5
HOLD_CAP_S = 0.25


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



class _Clock:
    """Timestamps on the compute stream (events), or the host clock on a CPU."""

    def __init__(self, device):
        self.device = device
        self.accel = _device.is_accelerator(device)

    def mark(self):
        if not self.accel:
            return time.perf_counter()
        event = _device.new_event(self.device, timing=True)
        event.record(_device.current_stream(self.device))
        return event

    def done(self, mark) -> bool:
        """Whether the device has passed `mark` (never blocks)."""
        return not self.accel or mark.query()

    def seconds(self, a, b) -> float:
        """Seconds from a to b; blocks the host until b is passed (call `done` first to avoid it)."""
        if not self.accel:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def _least_times(steps: list) -> dict:
    """Per layer (and around the layers) the least of several measured steps' times
    (`AutoPlanner._step_times`); a backward that one step did not time takes the others'."""
    first = steps[0]
    least = {"tail": min(t["tail"] for t in steps), "head_bwd": min(t["head_bwd"] for t in steps)}
    least["fwd"] = [min(t["fwd"][i] for t in steps) for i in range(len(first["fwd"]))]
    least["bwd"] = []
    for i in range(len(first["bwd"])):
        timed = [t["bwd"][i] for t in steps if t["bwd"][i] is not None]
        least["bwd"].append(min(timed) if timed else None)
    return least


def _onto(least: float, measured: float) -> float:
    """The factor that moves a time within a stretch that lasted `measured` seconds onto the
    same share of a stretch of `least` seconds (1 where that one is not shorter)."""
    return least / measured if 0 < least < measured else 1.0


def _rescaled(marks, least: float, measured: float):
    """(share, seconds) marks taken in a stretch that lasted `measured` seconds, moved onto a
    stretch of `least` seconds (`_onto`); None stays None."""
    if marks is None:
        return None
    factor = _onto(least, measured)
    return [(share, seconds * factor) for share, seconds in marks]


def _shape_key(args, kwargs):
    """The shapes and dtypes of the tensors in a forward's inputs, nested ones included."""
    leaves: list = []
    tensor_leaves(list(args) + [kwargs[k] for k in sorted(kwargs)], leaves)
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves)


def _copies_late(copies) -> float:
    """How long the compute stream waited at the release points of a step, as a share of its
    device-to-host copies' time: the median over these steps' counters (0.0 where not timed).

    The median, as the probe's step times: on a shared machine a step's copies now and then
    run much slower than usual, and summed over the probe such a step would make the plan
    again for a rate the usual steps do not see.
    """
    shares = [c["forward_wait_seconds"] / c["d2h_seconds"] for c in copies if c["d2h_seconds"] > 0]
    return statistics.median(shares) if shares else 0.0


def probe_bandwidth(device, nbytes: int = 64 << 20):
    """(d2h, h2d) bytes/s of one copy each way through the copy engine."""
    if not _device.is_accelerator(device):
        nbytes = 8 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    clock = _Clock(device)
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


class _Probe:
    """A shape's plan being timed: the schedule's order, the search, and the steps seen of this probe."""

    __slots__ = ("order", "search", "serial", "steps", "samples", "target", "pending", "replan", "schedule_at",
                 "d2h", "copies", "all_copies")

    def __init__(self, order, search, replan=None, d2h=None):
        self.order = order
        self.search = search
        # The schedule again at another device-to-host rate (bytes/s -> schedule()'s result),
        # the rate it assumed, and the copy counters of the first probe's offloading steps:
        # once that probe ends the schedule is made again if its copies ran slower.
        self.replan, self.d2h, self.copies = replan, d2h, []
        # The same, kept for the model's word on an unsure verdict, and the copy counters of
        # every offloading step of the search (the rate under compute, their median).
        self.schedule_at, self.all_copies = replan, []
        self.serial = 0  # bumped when the probed count changes, so a step of the last one is not timed
        self.steps = 0  # steps run of the current probe (the first PROBE_WARMUP_STEPS are not timed)
        self.samples = {True: [], False: []}  # timed steps (ms): of the probed count, and without offload
        self.target = PROBE_STEPS  # timed steps of each side this round of the probe ends at
        self.pending: list = []  # (start, end, offloading) of timed steps the device may not have finished

    def taken(self, offloading: bool) -> int:
        """Timed steps of one side this round: read, and not yet read."""
        return len(self.samples[offloading]) + sum(p[2] == offloading for p in self.pending)


class AutoPlanner(BudgetChecks):
    """The engine's observer while measuring; keeps one plan per input shape.

    The handle calls `before_forward` ahead of each training forward, `current_plan` for
    `handle.plan`, and `forget_step_start` when steps run paused. The observer calls
    (`opened`, `closed`, `saved_bytes`, `unpacked`, `backward_started`, `saved_after_layers`)
    come from the engine while this planner is its observer (Note [engine interface]).
    """

    def __init__(self, handle, budget: Optional[int], verbose: bool, ranks: Optional[Ranks] = None):
        self.handle = handle
        self.engine = handle.engine
        self.budget = budget
        # The ranks whose measurements every decision combines (Note [ranks agree] in ranks.py);
        # their plans are the same, so one of them reports it.
        self.ranks = ranks if ranks is not None else Ranks()
        self.verbose = verbose and self.ranks.first
        self.clock = _Clock(self.engine.device)
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
        self.tuning = {}  # key -> _Probe while its plan is being checked against measured steps
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
        self.records = {}
        self.inputs = {}
        self.backward_mark = None
        self.tail_marks = []
        self.waits = []
        if self.engine.on_accel:
            _device.reset_peak_memory_stats(self.engine.device)
        self.reserved = _device.memory_reserved(self.engine.device)
        self.memory.start()
        self.hold_pending = self.measure_without_offload  # held as the first layer opens
        self.forward_host_start = time.perf_counter()
        return False

    def _hold(self) -> None:
        """Hold the compute stream as a step measured without offload starts (Note [measured at
        the device's pace]): longer than the host took to queue the last measured forward."""
        queued = self.forward_host_s
        seconds = HOLD_CAP_S if queued is None else min(HOLD_CAP_S, HOLD_HOST_FACTOR * queued)
        self.held_s = seconds if _device.hold(self.engine.device, seconds) else 0.0

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

    # ---- checking the plan against measured steps
    def _tune(self, key) -> None:
        """Time the step that just ended if it ran this shape's current probe; move the search
        on; set the count the next step runs: the probed one and none, in alternation."""
        probe = self.tuning.get(key)
        if probe is None:
            self.last_start = None
            return
        mark = self.clock.mark()
        last, self.last_start = self.last_start, None
        if last is not None and last[1] == key and last[2] == probe.serial:
            probe.steps += 1
            ran = last[3]
            if ran:
                # The step that just ended: its counters are the engine's until the next capture.
                probe.all_copies.append(self.engine.counters)
                if probe.replan is not None:
                    probe.copies.append(self.engine.counters)
            if probe.steps > PROBE_WARMUP_STEPS and probe.taken(ran) < probe.target:
                probe.pending.append((last[0], mark, ran))
        else:  # a new probe, or the shape changed in between: warm up again
            probe.steps = 0
            probe.pending = []
        # Read, oldest first, the timed steps the device has finished; wait only past PROBE_PENDING.
        # Ranks that agree read each step at the same point whatever their devices' progress: a
        # probe is judged at a step all of them reach with the same samples (Note [ranks agree]).
        clock = self.clock
        covered = all(probe.taken(ran) >= probe.target for ran in (True, False))  # no more steps join this round
        while probe.pending and (len(probe.pending) > PROBE_PENDING or covered
                                 or (not self.ranks.many and clock.done(probe.pending[0][1]))):
            start, end, ran = probe.pending.pop(0)
            probe.samples[ran].append(clock.seconds(start, end) * 1e3)
        search = probe.search
        k = search.probe
        if min(len(samples) for samples in probe.samples.values()) >= probe.target:
            probe.samples = self.ranks.agree(key, f"probe of {k} layers", probe.samples, largest=(True, False))
            if self._rescheduled(key, probe) or search.judge(
                    k, probe.samples[True], probe.samples[False], probe.target >= PROBE_STEPS * PROBE_ROUNDS,
                    lambda: self._model_count(probe)) is not None:
                search = probe.search
                probe.samples = {True: [], False: []}
                probe.target = PROBE_STEPS
                probe.serial += 1
                probe.steps = 0
            else:  # unsure: more steps of the same probe, alternated as before
                probe.target += PROBE_STEPS
        plan = self.plans[key]
        plan["tuning"]["step_ms"] = {str(n): ms for n, ms in sorted(search.step_ms.items())}
        plan["tuning"]["baseline_ms"] = {str(n): ms for n, ms in sorted(search.baseline_ms.items())}
        plan["tuning"]["verdicts"] = list(search.verdicts)
        if search.probe is None:
            k = search.final
            self._apply(key, probe.order, k)
            del self.tuning[key]
            plan["tuning"]["settled"] = True
            self._fresh_segments()
            if self.verbose:
                base = search.baseline_ms.get(k)
                mine = search.step_ms.get(k)
                print(
                    f"offload.activation auto: inputs {plan['input_shapes']} settled on {k} of "
                    f"{len(probe.order)} eligible layers ({plan['offloaded_bytes'] / 2**20:.1f} MiB offloaded)"
                    + (f", step {mine:.2f} ms vs {base:.2f} ms without offload, alternated" if base and mine else ""),
                    flush=True,
                )
            return
        # Even steps of a probe run the probed count, odd ones nothing (without hooks).
        offloading = probe.steps % 2 == 0
        self._apply(key, probe.order, search.probe if offloading else 0)
        self.last_start = (mark, key, probe.serial, offloading)

    def _rescheduled(self, key, probe) -> bool:
        """After the first probe: make the schedule again if its copies ran slower than it
        assumed (with its margin), or ended late at its release points, and start the search
        over on the new one.

        The rate measured while measuring comes from copies that ran partly while compute
        stalled on the window; under a plan's full compute they may run slower. Copies at the
        planned rate may still end late where a layer saves its bytes later in its forward
        than the schedule assumed: if the probe missed the tolerance, the rate is then lowered
        by that share (`RELEASE_WAIT_TOLERANCE`). Once per shape (Note [probes]).
        """
        replan, probe.replan = probe.replan, None
        copies, probe.copies = probe.copies, []
        if replan is None:
            return False
        measured = self.ranks.agree(key, "first probe's copies", {"rate": self._copy_rate(copies),
                                                                  "late": _copies_late(copies)},
                                    largest=("late",), smallest=("rate",))
        rate, late = measured["rate"], measured["late"]
        if rate is None:
            return False
        # Late copies are worth a new schedule only where their waits cost the probe its
        # check: a plan that passes with them keeps its bytes (what the 3% is for).
        missed = statistics.median(probe.samples[True]) > (1 + probe.search.tolerance) * statistics.median(
            probe.samples[False])
        if rate >= probe.d2h / (1 + COPY_MARGIN) and not (missed and late > RELEASE_WAIT_TOLERANCE):
            return False
        measured = rate
        if late > RELEASE_WAIT_TOLERANCE:
            rate = min(rate, probe.d2h) / (1 + late)
        plan_schedule, order, exposed = replan(rate)
        plan = self.plans[key]
        plan.update(schedule=plan_schedule, caps=plan_schedule.caps, predicted_exposed_ms=exposed * 1e3,
                    d2h_gbps_under_compute=measured / 1e9, copies_late=late, d2h_gbps_replanned=rate / 1e9)
        plan["model_mask"] = [i in order for i in range(len(plan["mask"]))]
        plan["tuning"]["model_layers"] = len(order)
        probe.order = order
        probe.search = StepSearch(len(order), probe.search.tolerance)
        if self.verbose:
            print(f"offload.activation auto: inputs {plan['input_shapes']}: the copies ran at {measured / 1e9:.1f} GB/s "
                  f"under the plan's compute (planned {probe.d2h / 1e9:.1f}), the compute stream waiting for them "
                  f"{late:.1%} of their time at its release points; planned again at {rate / 1e9:.1f} GB/s: "
                  f"{planned_bytes(plan['layer_bytes'], plan['model_mask'], plan['caps']) / 2**20:.1f} MiB",
                  flush=True)
        return True

    def _model_count(self, probe) -> Optional[int]:
        """The count the schedule offloads at the device-to-host rate the search's copies achieved
        under compute (their median): the model's word on an unsure verdict. None (the search's
        own count) where the rate is not timed or lies within COPY_MARGIN of the planned one,
        which the schedule's margin already covers (Note [verdicts under noise])."""
        if probe.schedule_at is None or probe.d2h is None:
            return None
        rate = smallest_value(self.ranks, self.key, "probes' copies", self._copy_rate(probe.all_copies))
        if rate is None or rate >= probe.d2h / (1 + COPY_MARGIN):
            return None
        return len(probe.schedule_at(rate)[1])

    def _copy_rate(self, copies):
        """Bytes/s the device-to-host copies of a step achieved: the median over these steps'
        counters (None: not timed). The median, as in `_copies_late`."""
        self.engine.resolve_timing(block=True)  # the probe's samples are taken: waiting costs none
        rates = [c["d2h_bytes"] / c["d2h_seconds"] for c in copies if c["d2h_bytes"] > 0 and c["d2h_seconds"] > 0]
        return statistics.median(rates) if rates else None

    def _apply(self, key, order, k) -> None:
        plan = self.plans[key]
        chosen = set(order[:k])
        mask = [i in chosen for i in range(len(plan["mask"]))]
        plan["mask"] = mask
        plan["offload"] = [name for name, m in zip(self.handle.layers, mask) if m]
        plan["offloaded_bytes"] = planned_bytes(plan["layer_bytes"], mask, plan.get("caps"))

    # ---- observer
    def layer_inputs(self, index: int, nbytes: int) -> None:
        """The handle: layer `index` of the measured step took `nbytes` of tensor inputs."""
        self.inputs[index] = nbytes

    def opened(self, group) -> None:
        if self.hold_pending:  # the step's first layer (Note [measured at the device's pace])
            self.hold_pending = False
            begun = time.perf_counter()
            self._hold()
            self.forward_host_start += time.perf_counter() - begun  # the forward's queueing time leaves it out
        self.records.setdefault(group.layer, {})["open"] = self.clock.mark()
        if self.backward_mark is None:
            self.memory.layer_opened(group.layer)

    def closed(self, group) -> None:
        if group.layer == len(self.handle.layers) - 1 and self.backward_mark is None:
            self.memory.end(("tail", group.layer))  # the head and the loss, to backward's first unpack
            if self.forward_host_start is not None:
                # To the layers' end only: a model may wait for the device after them (a loss
                # read on the host), and that wait would count the hold itself.
                self.forward_host_s = time.perf_counter() - self.forward_host_start
        record = self.records.setdefault(group.layer, {})
        record["close"] = self.clock.mark()
        record["bytes"] = group.nbytes
        record["capped"] = group.capped
        record["span_ends"] = group.auto.span_ends if group.auto is not None else None

    def saved_bytes(self, group) -> None:
        """The group's layer has saved the next PROFILE_POINTS-th share of its bytes."""
        self.records.setdefault(group.layer, {}).setdefault("profile", []).append((group.capped, self.clock.mark()))

    def unpacked(self, group) -> None:
        record = self.records.setdefault(group.layer, {})
        if "unpack" not in record:  # the layer's backward begins
            record["unpack"] = self.clock.mark()
            self.memory.end(("backward", group.layer))

    def backward_started(self) -> None:
        self.backward_mark = self.clock.mark()

    def wait_begins(self):
        """The compute stream is about to wait for a copy (the window's copy out, or a copy back
        before a layer's backward): a mark where the wait starts."""
        return self.clock.mark()

    def wait_ended(self, layer, begun, backward: bool) -> None:
        """The wait that began at `begun` ended: after layer `layer` closed (forward) or as its
        backward started (Note [copy waits are not compute])."""
        self.waits.append((layer, backward, begun, self.clock.mark()))

    def saved_after_layers(self, m: int) -> None:
        """The m-th tensor saved after the last layer: when, and the step's peak memory so far."""
        if m <= MAX_TAIL_SAVES:
            self.tail_marks.append((m, self.clock.mark(), self.memory.so_far()))

    # ---- planning
    def _saved_marks(self, record):
        """A layer's (share of its bytes saved, seconds into its forward) marks, or None."""
        marks, size = record.get("profile"), record.get("capped", 0)
        if not marks or size <= 0 or "open" not in record:
            return None
        return [(capped / size, max(0.0, self.clock.seconds(record["open"], mark))) for capped, mark in marks]

    def _before_peak(self, last_close, peak: int):
        """(m, seconds after the last layer's end) of the last tensor saved after the last layer
        before the measured step reached its peak (memory let go there lowers the peak); None
        if the peak came before any (inside the layers)."""
        if last_close is None:
            return None
        before = [(m, mark) for m, mark, so_far in self.tail_marks if so_far < peak]
        if not before:
            return None
        m, mark = before[-1]
        return m, max(0.0, self.clock.seconds(last_close, mark))

    def _step_times(self) -> dict:
        """The measured step's times in seconds: per layer its forward (`fwd`) and backward
        (`bwd`, None where not timed), and around the layers the head and loss (`tail`: from
        the last layer's end to backward's start) and their backward (`head_bwd`: from there
        to the last layer's backward). Reads the step's events (the host waits for them)."""
        n = len(self.handle.layers)
        fwd, bwd = [0.0] * n, [None] * n
        first_unpack = {}
        for i in range(n):
            record = self.records.get(i, {})
            if "open" in record and "close" in record:
                fwd[i] = self.clock.seconds(record["open"], record["close"])
            if "unpack" in record:
                first_unpack[i] = record["unpack"]
        for i in range(1, n):
            if i in first_unpack and i - 1 in first_unpack:
                bwd[i] = max(0.0, self.clock.seconds(first_unpack[i], first_unpack[i - 1]))
        last_close = self.records.get(n - 1, {}).get("close")
        tail = head_bwd = 0.0
        if last_close is not None and self.backward_mark is not None:
            tail = max(0.0, self.clock.seconds(last_close, self.backward_mark))
            if n - 1 in first_unpack:
                head_bwd = max(0.0, self.clock.seconds(self.backward_mark, first_unpack[n - 1]))
        # Note [copy waits are not compute]
        for layer, backward, begun, ended in self.waits:
            waited = max(0.0, self.clock.seconds(begun, ended))
            if backward and layer is not None and bwd[layer] is not None:
                bwd[layer] = max(0.0, bwd[layer] - waited)
            elif not backward and layer == n - 1:
                tail = max(0.0, tail - waited)
        return {"fwd": fwd, "bwd": bwd, "tail": tail, "head_bwd": head_bwd}

    def _plan(self, key) -> dict:
        handle = self.handle
        n = len(handle.layers)
        nbytes = [self.records.get(i, {}).get("bytes", 0) for i in range(n)]
        last = self._step_times()
        times = _least_times([last] + self.earlier_times)
        self.earlier_times = []
        fwd, bwd, tail, head_bwd = times["fwd"], times["bwd"], times["tail"], times["head_bwd"]
        # The marks are the last step's: moved onto the least times, each at the same share of
        # its stretch (a mark past the layer's end would close a part after the layer does).
        saved = [_rescaled(self._saved_marks(self.records.get(i, {})), fwd[i], last["fwd"][i]) for i in range(n)]
        spans = [self.records.get(i, {}).get("span_ends") or None for i in range(n)]
        last_close = self.records.get(n - 1, {}).get("close")
        before_peak = None
        if self.budget is None:
            before_peak = self._before_peak(last_close, self.memory.step_peak)
            if before_peak is not None:
                before_peak = (before_peak[0], before_peak[1] * _onto(tail, last["tail"]))
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

            self.tuning[key] = _Probe(order, StepSearch(sum(mask)), replan, d2h)
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
