"""Auto mode with a memory budget: the budget planner's inputs from the measured step, and its
plan checked against timed steps of its own.

`costs` turns the measuring step's records into `budget.LayerCost`s; `BudgetRun` holds what
the plan was made from, makes it (`make`), and checks it (`step_ended` per step, then
`verdict`): the median step time and the allocator's peak over `CHECK_STEPS` steps of the plan
against its prediction. A peak over the budget (with `PEAK_SLACK` for fragmentation) raises
the bytes the model adds to every plan by the excess and plans again; copies slower than
assumed with a step over its prediction by `STEP_MISS` plan again at the rate seen; at most
`MAX_REPLANS` times (Note [budget check]). A plan that offloads is then timed against its
rival, the fastest plan that fits without offloading, and kept only when measured faster by
enough (Note [measured rival]).

Note [budget check]: the model sees the activations its measuring step saw and the bus at
the rate measured then; allocator fragmentation, workspaces and copies slowed by the plan's
own compute are not in it. Measured misses are added back to the model's inputs (a fixed
byte excess, a lower rate), never to its result, so the plan made again is still the least
predicted step that fits.

Note [measured rival]: what offloading costs is the model's least sure part. Copies run
slower beside the plan's own compute, compute runs slower beside the copies (both use the
device's memory), and the measuring step's times move by several percent from run to run:
enough to choose a plan that offloads a layer and runs slower than one that recomputes it.
Recomputing and keeping cost what the layers' own times say, so the fastest plan without
offload is predicted well. An offloading plan, once checked, is therefore timed against that
rival over as many steps, and kept only when measured faster by at least `RIVAL_MARGIN` of
the recomputation it avoids: a smaller gain is within a few steps' noise, and the rival needs
neither the bus nor host memory. A rival whose measured peak misses the budget loses.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Optional

from . import budget as _budget
from .plan import BudgetChoice
from .schedule import COPY_MARGIN, Schedule

# Steps of a new budget plan not timed (first allocations of new block sizes), then timed.
CHECK_WARMUP_STEPS = 1
CHECK_STEPS = 3
PEAK_SLACK = 0.05  # a measured peak this far over the budget is a miss (allocator fragmentation)
STEP_MISS = 0.10  # a measured step this far over its prediction, with copies slower than assumed, is a miss
MAX_REPLANS = 2
# An offloading plan is kept against its rival without offload when measured faster by at
# least this share of the recomputation it avoids (Note [measured rival]).
RIVAL_MARGIN = 0.5
# A layer whose measured saved bytes are at most this many times its input bytes is taken as
# checkpointed by the user (a checkpoint saves its inputs only).
CHECKPOINTED_SAVES = 1.5


def costs(nbytes, inputs, fwd, bwd, eligible, checkpointed):
    """Per layer `budget.LayerCost` from the measuring step (lists, one entry a layer).

    A layer flagged `checkpointed`, or saving hardly more than its inputs, is recomputed
    whatever the plan; its recomputation's bytes are taken as the median of the other layers'.
    """
    n = len(nbytes)
    ckpt = [bool(checkpointed[i]) or (inputs[i] > 0 and nbytes[i] <= CHECKPOINTED_SAVES * inputs[i])
            for i in range(n)]
    plain = [nbytes[i] for i in range(n) if not ckpt[i]]
    full = int(statistics.median(plain)) if plain else None
    return [_budget.LayerCost(int(nbytes[i]), int(min(inputs[i], nbytes[i]) if ckpt[i] else inputs[i]),
                              float(fwd[i]), float(bwd[i]), eligible=bool(eligible[i]), checkpointed=ckpt[i],
                              full_bytes=full if ckpt[i] else None)
            for i in range(n)]


class BudgetRun:
    """One input shape's budget plan: what it was made from, and its check against timed steps."""

    def __init__(self, layer_costs, bus: _budget.Bus, budget: int, measured_peak: int, tail_s: float,
                 tail_bytes: int, memory: Optional[_budget.StepMemory] = None):
        self.bus = bus
        self.budget = budget
        self.tail_s = tail_s
        # The plan the measuring step ran: the user's checkpointed layers recomputed, every layer
        # that may be offloaded offloaded, the others (keep_first / keep_last) kept. Its
        # stretches' peaks give each layer's extra bytes (Note [memory beside the activations]).
        measured = [_budget.RECOMPUTE if c.checkpointed else _budget.OFFLOAD if c.eligible else _budget.KEEP
                    for c in layer_costs]
        self.costs, self.fixed, self.tail_bytes = _budget.calibrate(
            measured, layer_costs, bus, memory or _budget.StepMemory(measured_peak), tail_bytes)
        self.replans = 0
        self.result: Optional[_budget.BudgetPlan] = None
        # While the rival is timed: the offloading plan's prediction and its measured step.
        self.challenged: Optional[dict] = None
        self.rival: Optional[dict] = None  # the rival's prediction and measurement, once compared
        self._reset()

    def _reset(self):
        self.steps = 0
        self.samples: list = []  # ms of the timed steps
        self.peaks: list = []  # the allocator's peak of each timed step
        self.copies: list = []  # the engine's counters of each timed step

    def make(self) -> _budget.BudgetPlan:
        self.result = _budget.plan(self.costs, self.bus, self.budget, self.fixed, self.tail_s, self.tail_bytes)
        self.challenged = self.rival = None
        self._reset()
        return self.result

    def fields(self, names) -> BudgetChoice:
        """The plan for `handle.plan`: per layer what was chosen and why, and the prediction."""
        chosen = self.result.chosen
        kept = chosen.inputs_kept or [False] * len(self.costs)
        return BudgetChoice(
            kinds=list(chosen.kinds),
            inputs_kept=[k == _budget.RECOMPUTE and (on or not c.eligible)
                         for k, c, on in zip(chosen.kinds, self.costs, kept)],
            mask=[k != _budget.KEEP and c.eligible and not on for k, c, on in zip(chosen.kinds, self.costs, kept)],
            recompute=[k == _budget.RECOMPUTE and not c.checkpointed for k, c in zip(chosen.kinds, self.costs)],
            layers=[{"name": name, "kind": k, "saved_bytes": c.saved_bytes, "input_bytes": c.input_bytes,
                     "forward_ms": c.forward_s * 1e3, "backward_ms": c.backward_s * 1e3,
                     "forward_extra_bytes": c.forward_extra_bytes, "backward_extra_bytes": c.backward_extra_bytes,
                     "user_checkpointed": c.checkpointed}
                    for name, k, c in zip(names, chosen.kinds, self.costs)],
            # The points the engine lets each copied group go and fetches it back at (Note [budget points]).
            schedule=Schedule(len(self.costs), [None] * len(self.costs), dict(chosen.release_at),
                              {k: list(v) for k, v in chosen.fetch_at.items()}, list(chosen.fetch_at_start)),
            predicted_step_ms=chosen.step_s * 1e3,
            predicted_exposed_ms=chosen.exposed_s * 1e3,
            predicted_recompute_ms=chosen.recompute_s * 1e3,
            predicted_peak_bytes=chosen.peak_bytes,
            least_peak_bytes=self.result.least_peak_bytes,
            fixed_bytes=self.fixed,
            tail_bytes=self.tail_bytes,
            budget_met=self.result.feasible,
        )

    def step_ended(self, ms: float, peak: int, counters) -> bool:
        """A step of the plan ended: `ms` long, the allocator's `peak`; True once enough are timed."""
        self.steps += 1
        if self.steps > CHECK_WARMUP_STEPS:
            self.samples.append(ms)
            self.peaks.append(peak)
            self.copies.append(counters)
        return len(self.samples) >= CHECK_STEPS

    def verdict(self, d2h_bps: Optional[float]) -> dict:
        """Compare the timed steps with the prediction. On a miss (Note [budget check]) correct
        the model's inputs and return with `replan` True (then call `make` again); when an
        offloading plan is to be timed against its rival (Note [measured rival]), return with
        `rival` True, the rival now the plan; once the rival is timed, return with `switched`
        True if the offloading plan won it back, and `kept` the measurement of the plan kept."""
        chosen = self.result.chosen
        step_ms = statistics.median(self.samples)
        peak = max(self.peaks) if self.peaks else 0
        out = {"measured_step_ms": step_ms, "measured_peak_bytes": peak or None, "replan": False,
               "rival": False, "switched": False, "replans": self.replans}
        if self.challenged is not None:
            return self._rival_verdict(out)
        if self.replans < MAX_REPLANS:
            if peak > 0 and self.result.feasible and peak > self.budget * (1 + PEAK_SLACK):
                self.fixed += peak - chosen.peak_bytes
                out["replan"] = True
            if (d2h_bps is not None and d2h_bps < self.bus.d2h_bps / (1 + COPY_MARGIN)
                    and step_ms > chosen.step_s * 1e3 * (1 + STEP_MISS)):
                self.bus = _budget.Bus(d2h_bps, self.bus.h2d_bps, self.bus.window)
                out["replan"] = True
            if out["replan"]:
                self.replans += 1
                out["replans"] = self.replans
                return out
        rival = self.result.without_offload
        if rival is not None and self.result.feasible:
            self.challenged = {"prediction": chosen, "measured_step_ms": step_ms, "measured_peak_bytes": peak or None}
            self.result = dataclasses.replace(self.result, chosen=rival)
            self._reset()
            out["rival"] = True
        return out

    def _within_budget(self, peak: Optional[int]) -> bool:
        return not peak or peak <= self.budget * (1 + PEAK_SLACK)

    def _rival_verdict(self, out: dict) -> dict:
        """The rival's steps are timed: keep the offloading plan only when it is measured faster
        by `RIVAL_MARGIN` of the recomputation it avoids, and the rival's peak is not the one
        missing the budget (Note [measured rival])."""
        challenged, rival = self.challenged, self.result.chosen
        self.challenged = None
        margin_ms = RIVAL_MARGIN * max(0.0, rival.recompute_s - challenged["prediction"].recompute_s) * 1e3
        offloading_wins = not self._within_budget(out["measured_peak_bytes"]) or (
            self._within_budget(challenged["measured_peak_bytes"])
            and challenged["measured_step_ms"] <= out["measured_step_ms"] - margin_ms)
        self.rival = {"kinds": list(rival.kinds), "predicted_step_ms": rival.step_s * 1e3,
                      "measured_step_ms": out["measured_step_ms"], "measured_peak_bytes": out["measured_peak_bytes"],
                      "margin_ms": margin_ms, "won": not offloading_wins}
        if offloading_wins:
            self.result = dataclasses.replace(self.result, chosen=challenged["prediction"])
            out["switched"] = True
            out["kept"] = {k: challenged[k] for k in ("measured_step_ms", "measured_peak_bytes")}
        else:
            out["kept"] = {k: out[k] for k in ("measured_step_ms", "measured_peak_bytes")}
        return out
