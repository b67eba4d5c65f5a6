"""Auto mode without a budget: the plan checked against timed steps, and the count of its
layers searched, from steps of the probed count alternated with steps without offload.

`Prober` is a part of `AutoPlanner` (planner.py): the planner hands it a new plan to check and
calls it ahead of each training forward of the shape. search.py judges a probe's steps (Note
[verdicts under noise]); the prober times them, moves the search on and puts its count into
the plan.
"""

from __future__ import annotations

import statistics
from typing import Optional

from .memory import fresh_segments
from .ranks import smallest_value
from .schedule import COPY_MARGIN, planned_bytes
from .search import PROBE_ROUNDS, StepSearch
from .shared import Shared, copy_rate

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
# bus rate its copies achieved (Note [verdicts under noise] in search.py). After the
# first probe, if its copies ran slower than the
# schedule assumed (less COPY_MARGIN), or the probe missed the tolerance with copies late at
# the release points (RELEASE_WAIT_TOLERANCE), the schedule is made again at the rate seen
# and the search starts over (once). A step is timed from one training forward to the next
# of the same input shape, so the optimizer and data loading are in both sides alike.

# A probe alternates steps of the probed count and steps without offload: the first of
# each are not timed (new block sizes in the allocators), then PROBE_STEPS of each are, and
# PROBE_STEPS more of each while its verdict is unsure, PROBE_ROUNDS rounds at most.
PROBE_WARMUP_STEPS = 2
PROBE_STEPS = 3
# Timed probe steps whose end the device has not passed yet, at most: a probe step is read
# when the device is done with it (no host wait, so the host keeps running ahead as in any
# other step); only beyond this many does the host wait for the oldest.
PROBE_PENDING = 2
# A first probe over the step-time tolerance whose copies ended late at the plan's release
# points (the compute stream waited there longer than this share of the copies' own time)
# makes the schedule again at a rate lowered by that share. A plan made again keeps fewer
# bytes, so only a plan that misses its check is.
RELEASE_WAIT_TOLERANCE = 0.02


def copies_late(copies) -> float:
    """How long the compute stream waited at the release points of a step, as a share of its
    device-to-host copies' time: the median over these steps' counters (0.0 where not timed).

    The median, as the probe's step times: on a shared machine a step's copies now and then
    run much slower than usual, and summed over the probe such a step would make the plan
    again for a rate the usual steps do not see.
    """
    shares = [c["forward_wait_seconds"] / c["d2h_seconds"] for c in copies if c["d2h_seconds"] > 0]
    return statistics.median(shares) if shares else 0.0


class Probe:
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


class Prober:
    """Checks a shape's plan without a budget against timed steps and settles its count
    (Note [probes]).

    Built by `AutoPlanner` with the planner's `Shared` record (the handle, the engine, the
    clock, the ranks, the plans it settles); the probes and the step their timing starts at are
    its own. The planner starts a probe with a new plan (`start`) and calls `tune` ahead of
    each training forward of a planned shape.
    """

    def __init__(self, shared: Shared):
        self.shared = shared
        self.tuning: dict = {}  # key -> Probe while its plan is being checked against timed steps
        # (mark, key, probe serial, whether it offloaded) of the last training forward of a planned shape
        self.last_start = None

    def start(self, key, probe: Probe) -> None:
        """Check the plan of shape `key` (the planner's, just made) with `probe`."""
        self.tuning[key] = probe

    def probing(self, key) -> bool:
        """Whether shape `key`'s plan is still being checked."""
        return key in self.tuning

    def forget_step_start(self) -> None:
        """Steps ran outside the plan (paused, or measured): a probe times from one forward to the next."""
        self.last_start = None

    def tune(self, key) -> None:
        """Time the step that just ended if it ran this shape's current probe; move the search
        on; set the count the next step runs: the probed one and none, in alternation."""
        probe = self.tuning.get(key)
        if probe is None:
            self.last_start = None
            return
        mark = self.shared.clock.mark()
        self._step_ended(key, probe, mark)
        self._read_finished(probe)
        self._judge(key, probe)
        search = probe.search
        tuning = self.shared.plans[key].tuning
        tuning.step_ms = {str(n): ms for n, ms in sorted(search.step_ms.items())}
        tuning.baseline_ms = {str(n): ms for n, ms in sorted(search.baseline_ms.items())}
        tuning.verdicts = list(search.verdicts)
        if search.probe is None:
            self._settle(key, probe)
            return
        # Even steps of a probe run the probed count, odd ones nothing (without hooks).
        offloading = probe.steps % 2 == 0
        self._apply(key, probe.order, search.probe if offloading else 0)
        self.last_start = (mark, key, probe.serial, offloading)

    def _step_ended(self, key, probe: Probe, mark) -> None:
        """Count the step that ended at `mark`, and queue its time if it is one of this probe's
        timed steps; a new probe, or a shape changed in between, warms up again."""
        last, self.last_start = self.last_start, None
        if last is not None and last[1] == key and last[2] == probe.serial:
            probe.steps += 1
            ran = last[3]
            if ran:
                # The step that just ended: its counters are the engine's until the next capture.
                engine = self.shared.engine
                probe.all_copies.append(engine.counters)
                if probe.replan is not None:
                    probe.copies.append(engine.counters)
            if probe.steps > PROBE_WARMUP_STEPS and probe.taken(ran) < probe.target:
                probe.pending.append((last[0], mark, ran))
        else:
            probe.steps = 0
            probe.pending = []

    def _read_finished(self, probe: Probe) -> None:
        """Read, oldest first, the timed steps the device has finished; wait only past PROBE_PENDING.

        Ranks that agree read each step at the same point whatever their devices' progress: a
        probe is judged at a step all of them reach with the same samples (Note [ranks agree]).
        """
        clock = self.shared.clock
        covered = all(probe.taken(ran) >= probe.target for ran in (True, False))  # no more steps join this round
        while probe.pending and (len(probe.pending) > PROBE_PENDING or covered
                                 or (not self.shared.ranks.many and clock.done(probe.pending[0][1]))):
            start, end, ran = probe.pending.pop(0)
            probe.samples[ran].append(clock.seconds(start, end) * 1e3)

    def _judge(self, key, probe: Probe) -> None:
        """Once both sides of the probe have their timed steps: the verdict (or the schedule made
        again), and the next probe; an unsure verdict takes more steps of the same probe."""
        search = probe.search
        k = search.probe
        if min(len(samples) for samples in probe.samples.values()) < probe.target:
            return
        probe.samples = self.shared.ranks.agree(key, f"probe of {k} layers", probe.samples, largest=(True, False))
        if self._rescheduled(key, probe) or search.judge(
                k, probe.samples[True], probe.samples[False], probe.target >= PROBE_STEPS * PROBE_ROUNDS,
                lambda: self._model_count(key, probe)) is not None:
            probe.samples = {True: [], False: []}
            probe.target = PROBE_STEPS
            probe.serial += 1
            probe.steps = 0
        else:  # unsure: more steps of the same probe, alternated as before
            probe.target += PROBE_STEPS

    def _settle(self, key, probe: Probe) -> None:
        """The search is done: its count goes into the plan, which settles."""
        search = probe.search
        plan = self.shared.plans[key]
        k = search.final
        self._apply(key, probe.order, k)
        del self.tuning[key]
        plan.tuning.settled = True
        fresh_segments(self.shared.engine)
        if self.shared.verbose:
            base = search.baseline_ms.get(k)
            mine = search.step_ms.get(k)
            print(
                f"offload.activation auto: inputs {plan.input_shapes} settled on {k} of "
                f"{len(probe.order)} eligible layers ({plan.offloaded_bytes / 2**20:.1f} MiB offloaded)"
                + (f", step {mine:.2f} ms vs {base:.2f} ms without offload, alternated" if base and mine else ""),
                flush=True,
            )

    def _rescheduled(self, key, probe: Probe) -> bool:
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
        measured = self.shared.ranks.agree(key, "first probe's copies",
                                           {"rate": copy_rate(self.shared.engine, copies),
                                            "late": copies_late(copies)},
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
        self._replan(key, probe, replan(rate), measured, rate, late)
        return True

    def _replan(self, key, probe: Probe, scheduled, measured: float, rate: float, late: float) -> None:
        """Put the schedule made again at `rate` (`scheduled`: schedule()'s result) into the
        plan, and start the search over on its order."""
        plan_schedule, order, exposed = scheduled
        plan = self.shared.plans[key]
        plan.schedule, plan.caps, plan.predicted_exposed_ms = plan_schedule, plan_schedule.caps, exposed * 1e3
        plan.d2h_gbps_under_compute, plan.copies_late, plan.d2h_gbps_replanned = measured / 1e9, late, rate / 1e9
        plan.model_mask = [i in order for i in range(len(plan.mask))]
        plan.tuning.model_layers = len(order)
        probe.order = order
        probe.search = StepSearch(len(order), probe.search.tolerance)
        if self.shared.verbose:
            print(f"offload.activation auto: inputs {plan.input_shapes}: the copies ran at "
                  f"{measured / 1e9:.1f} GB/s under the plan's compute (planned {probe.d2h / 1e9:.1f}), "
                  f"the compute stream waiting for them {late:.1%} of their time at its release points; "
                  f"planned again at {rate / 1e9:.1f} GB/s: "
                  f"{planned_bytes(plan.layer_bytes, plan.model_mask, plan.caps) / 2**20:.1f} MiB",
                  flush=True)

    def _model_count(self, key, probe: Probe) -> Optional[int]:
        """The count the schedule offloads at the device-to-host rate the search's copies achieved
        under compute (their median): the model's word on an unsure verdict. None (the search's
        own count) where the rate is not timed or lies within COPY_MARGIN of the planned one,
        which the schedule's margin already covers (Note [verdicts under noise])."""
        if probe.schedule_at is None or probe.d2h is None:
            return None
        rate = smallest_value(self.shared.ranks, key, "probes' copies", copy_rate(self.shared.engine, probe.all_copies))
        if rate is None or rate >= probe.d2h / (1 + COPY_MARGIN):
            return None
        return len(probe.schedule_at(rate)[1])

    def _apply(self, key, order, k) -> None:
        """Offload the first `k` layers of the schedule's `order` in shape `key`'s plan."""
        plan = self.shared.plans[key]
        chosen = set(order[:k])
        mask = [i in chosen for i in range(len(plan.mask))]
        plan.mask = mask
        plan.offload = [name for name, m in zip(self.shared.handle.layers, mask) if m]
        plan.offloaded_bytes = planned_bytes(plan.layer_bytes, mask, plan.caps)
