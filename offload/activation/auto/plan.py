"""Auto mode's plan for one input shape, as a typed record (`Plan`), and the dict users read.

The planner (planner.py) makes a `Plan` from a shape's measured steps; the prober (probes.py)
and the budget checker (budget_checks.py) update its fields as their timed steps decide.
`handle.plan` and `stats()["plan"]` give `Plan.to_dict()`: a plain dict made at that edge
(times in ms, rates in GB/s), its keys those docs/activation.md documents. A key of a part
that has not run (a probe's replan, a budget plan's) is absent from the dict, not None.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional

from .schedule import Schedule


@dataclasses.dataclass
class Tuning:
    """A plan without a budget checked against timed steps (Note [probes] in probes.py)."""

    settled: bool  # the plan is final: no probe of it runs (True with a budget: its check is `Plan.check`)
    tolerance: float  # the share of its baseline a probed count's step may cost
    model_layers: int  # layers the model (the schedule, or the budget plan) offloads
    checked: bool  # the plan is timed against steps without offload
    step_ms: Dict[str, float] = dataclasses.field(default_factory=dict)  # layers offloaded (text) -> probed ms
    baseline_ms: Optional[Dict[str, float]] = None  # the same, of the steps without offload (None: none timed yet)
    verdicts: Optional[list] = None  # the search's verdicts, in order (None: no probe step yet)

    def to_dict(self) -> dict:
        out = {"settled": self.settled, "tolerance": self.tolerance, "step_ms": dict(self.step_ms),
               "model_layers": self.model_layers, "checked": self.checked}
        if self.baseline_ms is not None:
            out["baseline_ms"] = dict(self.baseline_ms)
        if self.verdicts is not None:
            out["verdicts"] = list(self.verdicts)
        return out


class TimedPlan(NamedTuple):
    """A budget plan timed before the one in use (its check's history)."""

    measured_step_ms: Optional[float]  # median of its timed steps
    measured_peak_bytes: Optional[int]  # the allocator's peak over them (None: not measured)
    predicted_step_ms: float
    predicted_peak_bytes: int


@dataclasses.dataclass
class BudgetCheck:
    """A budget plan checked against its own timed steps (Note [budget check] in budget_plan.py)."""

    replans: int  # times planned again on a measured miss
    rival: Optional[dict]  # the plan without offload it was timed against, once compared (Note [measured rival])
    predicted_step_ms: float  # the plan in use's prediction
    predicted_peak_bytes: int
    settled: bool = False  # the check is done: the plan in use stays
    measured_step_ms: Optional[float] = None  # median of the plan's timed steps (None: not timed yet)
    measured_peak_bytes: Optional[int] = None  # the allocator's peak over them (None: not measured)
    history: Optional[List[TimedPlan]] = None  # the plans timed before this one, oldest first (None: none)

    def timed(self) -> TimedPlan:
        return TimedPlan(self.measured_step_ms, self.measured_peak_bytes, self.predicted_step_ms,
                         self.predicted_peak_bytes)

    def to_dict(self) -> dict:
        out = {"settled": self.settled, "replans": self.replans, "measured_step_ms": self.measured_step_ms,
               "measured_peak_bytes": self.measured_peak_bytes, "rival": self.rival}
        if self.history is not None:
            out["history"] = [h._asdict() for h in self.history]
        out["predicted_step_ms"] = self.predicted_step_ms
        out["predicted_peak_bytes"] = self.predicted_peak_bytes
        return out


@dataclasses.dataclass
class BudgetChoice:
    """A budget plan (budget_plan.py's `BudgetRun.fields`): per layer what was chosen, and its prediction."""

    kinds: List[str]  # per layer: keep, offload or recompute
    inputs_kept: List[bool]  # per layer: recomputed with its inputs on the device (keep_first / keep_last ones always)
    mask: List[bool]  # per layer: its group copied to the host
    recompute: List[bool]  # per layer: run under the plan's checkpoint (not the user's)
    layers: List[dict]  # per layer: name, kind, measured bytes and times, user_checkpointed (as users read it)
    schedule: Schedule  # the points the engine lets each copied group go and fetches it back at
    predicted_step_ms: float
    predicted_exposed_ms: float  # of the step, waiting for copies
    predicted_recompute_ms: float  # of the step, recomputing
    predicted_peak_bytes: int
    least_peak_bytes: int  # the least peak any plan reaches (what the budget must be at least)
    fixed_bytes: int  # what the step holds besides the activations (parameters, optimizer state)
    tail_bytes: int  # what the head and the loss hold on top of the layers as backward starts
    budget_met: bool  # the predicted peak fits the budget

    # The keys `Plan.to_dict` takes from here; the others are the plan's own fields.
    OWN = ("kinds", "inputs_kept", "recompute", "layers", "predicted_recompute_ms", "predicted_peak_bytes",
           "least_peak_bytes", "fixed_bytes", "tail_bytes", "budget_met")


@dataclasses.dataclass
class Plan:
    """One input shape's plan: what the planner measured and chose, as the parts update it."""

    input_shapes: List[List[int]]  # the forward's input tensors' shapes
    mask: List[bool]  # per layer: offloaded (a probe's count while probing)
    offload: List[str]  # the offloaded layers' names
    offloaded_bytes: int  # bytes the plan offloads a step
    eligible_bytes: int  # saved bytes of the layers that may be offloaded
    hideable_bytes: int  # of those, what the bus moves in the forward's time
    layer_bytes: List[int]  # per layer: its saved bytes
    caps: Optional[List[Optional[int]]]  # per layer: the bytes its group may offload (None: all)
    schedule: Optional[Schedule]  # the engine's points (None: the resident window)
    forward_ms: List[float]  # per layer: its forward
    saved_ms: List[Optional[List[List[float]]]]  # per layer: [share of its bytes saved, ms into its forward] (saved_by)
    backward_ms: List[float]  # per layer: its backward (capped)
    tail_ms: float  # from the last layer's end to backward's start (head, loss)
    # The last tensor saved after the layers before the step's peak: [its count, ms after the
    # last layer's end]; copies run until it and the memory goes there (None: no such tensor).
    before_peak: Optional[list]
    head_backward_ms: float  # from backward's start to the last layer's backward
    d2h_gbps: float  # the device-to-host rate planned with
    h2d_gbps: float  # the host-to-device rate planned with
    predicted_exposed_ms: float  # of the step, waiting for copies
    predicted_step_ms: float
    measured_hold_ms: float  # the measured step's stream held at its start
    budget_bytes: Optional[int]  # memory_budget_bytes (None: no budget)
    measured_peak_bytes: int  # the measured step's peak
    tuning: Tuning  # the check against timed steps without a budget
    # The schedule's own mask while a probe checks it (None: not probed).
    model_mask: Optional[List[bool]] = None
    # Made again after the first probe (Prober._rescheduled; None: not made again): the rate
    # the probe's copies ran at, how late they were at the release points, the rate planned at.
    d2h_gbps_under_compute: Optional[float] = None
    copies_late: Optional[float] = None
    d2h_gbps_replanned: Optional[float] = None
    budget: Optional[BudgetChoice] = None  # the budget plan in use (None: no budget)
    recomputed: Optional[List[str]] = None  # the names of the layers the budget plan recomputes
    check: Optional[BudgetCheck] = None  # the budget plan's check against its timed steps

    def to_dict(self) -> dict:
        """The plan as `handle.plan` gives it: a new dict each call (its lists copied), so a
        dict kept from one step says what the plan was then."""
        out = {name: _copied(getattr(self, name)) for name in _COMMON}
        out["tuning"] = self.tuning.to_dict()
        out.update({name: _copied(getattr(self, name)) for name in _REPLAN if getattr(self, name) is not None})
        if self.budget is not None:
            out.update({name: _copied(getattr(self.budget, name)) for name in BudgetChoice.OWN})
            out["check"] = self.check.to_dict()
            out["recomputed"] = list(self.recomputed)
        return out


# The plan's keys in the dict: every plan's, then those of a schedule made again (present once set).
_REPLAN = ("model_mask", "d2h_gbps_under_compute", "copies_late", "d2h_gbps_replanned")
_COMMON = tuple(f.name for f in dataclasses.fields(Plan)
                if f.name not in _REPLAN + ("tuning", "budget", "recomputed", "check"))


def _copied(value):
    return list(value) if isinstance(value, list) else value
