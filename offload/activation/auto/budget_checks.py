"""Auto mode with a memory budget: the plan put into the shape's `Plan`, a budget it cannot meet
reported, and the plan checked against its own timed steps.

`BudgetChecker` is a part of `AutoPlanner` (planner.py): the planner hands it each new budget
plan and calls it ahead of each training forward of the shape. budget_plan.py's `BudgetRun`
judges the timed steps (Note [budget check], Note [measured rival]); the checker times them and
acts on the verdict.
"""

from __future__ import annotations

import warnings
from typing import Optional

from ...core import _device
from .memory import fresh_segments
from .plan import BudgetCheck, Plan
from .schedule import planned_bytes
from .shared import Shared, copy_rate


class BudgetChecker:
    """Checks a shape's budget plan against timed steps and acts on the verdict (budget_plan.py).

    Built by `AutoPlanner` with the planner's `Shared` record (the handle, the engine, the
    clock, the ranks, the plans it updates) and the budget; the plans under check, the step
    their timing starts at and the warning once given are its own. The planner hands it each
    new budget plan (`start`) and calls `check` ahead of each training forward of a planned shape.
    """

    def __init__(self, shared: Shared, budget: Optional[int]):
        self.shared = shared
        self.budget = budget
        self.runs: dict = {}  # key -> BudgetRun while a budget plan is checked against its steps
        self.last_start = None  # (mark, key) of the last training forward of a budget plan being checked
        self.warned = False  # a budget the plan cannot meet is warned about once per handle

    def start(self, key, plan: Plan, run, stacklevel: int) -> str:
        """Check `run`, shape `key`'s new budget plan, and put it into `plan`;
        the note for the printed plan where it misses the budget (warned about with `stacklevel`
        counted from this call)."""
        self._use(plan, run)
        self.runs[key] = run
        return self._missed(plan, stacklevel + 1)

    def checking(self, key) -> bool:
        """Whether shape `key`'s budget plan is still being checked."""
        return key in self.runs

    def forget_step_start(self) -> None:
        """Steps ran outside the plan (measured): a check times from one forward to the next."""
        self.last_start = None

    def check(self, key) -> None:
        """Time the step that just ended if it ran this shape's budget plan under check; once
        enough are, compare with the prediction and plan again on a miss, or time an offloading
        plan's rival without offload and keep the faster (budget_plan.py)."""
        run = self.runs.get(key)
        if run is None:
            self.last_start = None
            return
        engine, clock = self.shared.engine, self.shared.clock
        mark = clock.mark()
        last, self.last_start = self.last_start, None
        if last is not None and last[1] == key and run.step_ended(
                clock.seconds(last[0], mark) * 1e3, _device.max_memory_allocated(engine.device), engine.counters):
            if self._judge(key, run):
                return
        if engine.on_accel:
            _device.reset_peak_memory_stats(engine.device)
        self.last_start = (mark, key)

    def _judge(self, key, run) -> bool:
        """Enough steps of `run` are timed: act on the verdict; True once the plan settles."""
        plan = self.shared.plans[key]
        measured = self.shared.ranks.agree(key, "budget plan's steps",
                                           {"samples": run.samples, "peaks": run.peaks,
                                            "rate": copy_rate(self.shared.engine, run.copies)},
                                           largest=("samples", "peaks"), smallest=("rate",))
        run.samples, run.peaks = measured["samples"], measured["peaks"]
        verdict = run.verdict(measured["rate"])
        _measured(plan.check, verdict)
        plan.check.replans = verdict["replans"]
        peak_mib = (verdict["measured_peak_bytes"] or 0) / 2**20
        took = (f"offload.activation auto: inputs {plan.input_shapes}: the plan's steps took "
                f"{verdict['measured_step_ms']:.2f} ms, peak {peak_mib:.1f} MiB")
        if verdict["replan"]:
            run.make()
        if verdict["replan"] or verdict["rival"] or verdict["switched"]:
            self._use(plan, run)  # the check's history keeps the plan just timed
        if verdict["replan"] or verdict["rival"]:
            # The warning points at the planner's before_forward (through check and the planner's _run_plan).
            missed = self._missed(plan, 5) if verdict["replan"] else ""
            if self.shared.verbose:
                what = "planned again" if verdict["replan"] else "timing against it the fastest plan without offload"
                print(f"{took}; {what}: offload {len(plan.offload)}, recompute {len(plan.recomputed)}, "
                      f"predicted {plan.predicted_step_ms:.2f} ms, "
                      f"{plan.budget.predicted_peak_bytes / 2**20:.1f} MiB" + missed, flush=True)
            return False
        if "kept" in verdict:
            _measured(plan.check, verdict["kept"])
        plan.check.settled, plan.check.rival = True, run.rival
        if self.shared.verbose and plan.check.rival is not None:
            won = plan.check.rival["won"]
            print(f"{took}; kept the plan {'that recomputes instead' if won else 'that offloads layers'}: "
                  f"offload {len(plan.offload)}, recompute {len(plan.recomputed)}", flush=True)
        del self.runs[key]
        fresh_segments(self.shared.engine)
        return True

    def _use(self, plan: Plan, run) -> None:
        """Put `run`'s current plan into `plan`; its check starts anew, the plan timed before
        (if any) kept in the check's history."""
        layers = self.shared.handle.layers
        choice = run.fields(layers)
        before = plan.check
        plan.budget = choice
        plan.mask, plan.schedule = choice.mask, choice.schedule
        plan.predicted_step_ms, plan.predicted_exposed_ms = choice.predicted_step_ms, choice.predicted_exposed_ms
        plan.check = BudgetCheck(replans=run.replans, rival=run.rival, predicted_step_ms=choice.predicted_step_ms,
                                 predicted_peak_bytes=choice.predicted_peak_bytes)
        if before is not None:
            plan.check.history = (before.history or []) + [before.timed()]
        plan.offload = [name for name, m in zip(layers, choice.mask) if m]
        plan.recomputed = [name for name, on in zip(layers, choice.recompute) if on]
        plan.offloaded_bytes = planned_bytes(plan.layer_bytes, choice.mask, None)
        plan.tuning.model_layers = sum(choice.mask)

    def _missed(self, plan: Plan, stacklevel: int) -> str:
        """Warn, once per handle, when the budget cannot be met; the note for the printed plan."""
        if plan.budget.budget_met:
            return ""
        least = plan.budget.least_peak_bytes
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"offload.enable_activation_offload: mode='auto' cannot meet memory_budget_bytes={self.budget} "
                f"for inputs {plan.input_shapes}: the least peak device memory any plan reaches is predicted at "
                f"{least} bytes ({len(plan.offload)} layers offloaded, {len(plan.recomputed)} recomputed; "
                "keep_first/keep_last keep the others, and what is not a saved activation stays); that plan runs. "
                "Raise the budget or lower keep_first/keep_last",
                stacklevel=stacklevel,
            )
        return (f"; does NOT meet memory_budget_bytes={self.budget} (least predicted peak {least / 2**20:.1f} MiB, "
                f"{len(plan.offload)} of {len(plan.mask)} layers offloaded)")


def _measured(check: BudgetCheck, measured: dict) -> None:
    """Put a verdict's measured step and peak (budget_plan.py's `BudgetRun.verdict`) into `check`."""
    check.measured_step_ms = measured["measured_step_ms"]
    check.measured_peak_bytes = measured["measured_peak_bytes"]
