"""Auto mode without a budget: the plan checked against timed steps, and the count of its
layers searched, from steps of the probed count alternated with steps without offload.

`PlanProbes` is a base class of `AutoPlanner` (planner.py), split out by concern: it shares the
planner's state (`handle`, `engine`, `plans`, `tuning`, `key`, `clock`, `ranks`, `verbose`,
`last_start`, `_fresh_segments`). step_search.py judges a probe's steps (Note [verdicts under
noise]); this side times them, moves the search on and puts its count into the plan.
"""

from __future__ import annotations

import statistics
from typing import Optional

from .ranks import smallest_value
from .schedule import COPY_MARGIN, planned_bytes
from .step_search import PROBE_ROUNDS, StepSearch

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


class PlanProbes:
    """The probing side of the planner (see `AutoPlanner`)."""

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
        plan_schedule, order, exposed = replan(rate)
        plan = self.plans[key]
        plan.update(schedule=plan_schedule, caps=plan_schedule.caps, predicted_exposed_ms=exposed * 1e3,
                    d2h_gbps_under_compute=measured / 1e9, copies_late=late, d2h_gbps_replanned=rate / 1e9)
        plan["model_mask"] = [i in order for i in range(len(plan["mask"]))]
        plan["tuning"]["model_layers"] = len(order)
        probe.order = order
        probe.search = StepSearch(len(order), probe.search.tolerance)
        if self.verbose:
            print(f"offload.activation auto: inputs {plan['input_shapes']}: the copies ran at "
                  f"{measured / 1e9:.1f} GB/s under the plan's compute (planned {probe.d2h / 1e9:.1f}), the compute stream waiting for them "
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
        counters (None: not timed). The median, as in `copies_late`."""
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

