"""Auto mode with a memory budget: the plan put into the handle's dict, a budget it cannot meet
reported, and the plan checked against its own timed steps.

`BudgetChecks` is a base class of `AutoPlanner` (planner.py), split out by concern: the two
share the planner's state (`handle`, `engine`, `budget`, `plans`, `budget_runs`, `clock`,
`ranks`, `verbose`, `warned_budget`, `budget_start`, `_copy_rate`, `_fresh_segments`).
budget_run.py judges the timed steps (Note [budget check], Note [measured rival]); this side
times them and acts on the verdict.
"""

from __future__ import annotations

import warnings

from ..core import _device
from .schedule import planned_bytes


class BudgetChecks:
    """The budget plan's side of the planner (see `AutoPlanner`)."""

    def _use_budget_plan(self, key, plan, run) -> None:
        """Put `run`'s current plan into `plan` (the handle's dict)."""
        fields = run.fields(self.handle.layers)
        check = plan.get("check")
        plan.update(fields)
        if check is not None:
            fields["check"]["history"] = check.get("history", []) + [
                {k: check[k] for k in ("measured_step_ms", "measured_peak_bytes", "predicted_step_ms",
                                       "predicted_peak_bytes") if k in check}]
        plan["check"]["predicted_step_ms"] = plan["predicted_step_ms"]
        plan["check"]["predicted_peak_bytes"] = plan["predicted_peak_bytes"]
        mask = plan["mask"]
        plan["offload"] = [name for name, m in zip(self.handle.layers, mask) if m]
        plan["recomputed"] = [name for name, on in zip(self.handle.layers, plan["recompute"]) if on]
        plan["offloaded_bytes"] = planned_bytes(plan["layer_bytes"], mask, None)
        plan["tuning"]["model_layers"] = sum(mask)

    def _budget_missed(self, plan) -> str:
        """Warn, once per handle, when the budget cannot be met; the note for the printed plan."""
        if plan["budget_met"]:
            return ""
        least = plan["least_peak_bytes"]
        if not self.warned_budget:
            self.warned_budget = True
            warnings.warn(
                f"offload.enable_activation_offload: mode='auto' cannot meet memory_budget_bytes={self.budget} "
                f"for inputs {plan['input_shapes']}: the least peak device memory any plan reaches is predicted at "
                f"{least} bytes ({len(plan['offload'])} layers offloaded, {len(plan['recomputed'])} recomputed; "
                "keep_first/keep_last keep the others, and what is not a saved activation stays); that plan runs. "
                "Raise the budget or lower keep_first/keep_last",
                stacklevel=3,
            )
        return (f"; does NOT meet memory_budget_bytes={self.budget} (least predicted peak {least / 2**20:.1f} MiB, "
                f"{len(plan['offload'])} of {len(plan['mask'])} layers offloaded)")

    def _check_budget(self, key) -> None:
        """Time the step that just ended if it ran this shape's budget plan under check; once
        enough are, compare with the prediction and plan again on a miss, or time an offloading
        plan's rival without offload and keep the faster (budget_run.py)."""
        run = self.budget_runs.get(key)
        if run is None:
            self.budget_start = None
            return
        device = self.engine.device
        mark = self.clock.mark()
        last, self.budget_start = self.budget_start, None
        if last is not None and last[1] == key and run.step_ended(
                self.clock.seconds(last[0], mark) * 1e3, _device.max_memory_allocated(device), self.engine.counters):
            plan = self.plans[key]
            measured = self.ranks.agree(key, "budget plan's steps", {"samples": run.samples, "peaks": run.peaks,
                                                                     "rate": self._copy_rate(run.copies)},
                                        largest=("samples", "peaks"), smallest=("rate",))
            run.samples, run.peaks = measured["samples"], measured["peaks"]
            verdict = run.verdict(measured["rate"])
            plan["check"].update(measured_step_ms=verdict["measured_step_ms"],
                                 measured_peak_bytes=verdict["measured_peak_bytes"], replans=verdict["replans"])
            peak_mib = (verdict["measured_peak_bytes"] or 0) / 2**20
            took = (f"offload.activation auto: inputs {plan['input_shapes']}: the plan's steps took "
                    f"{verdict['measured_step_ms']:.2f} ms, peak {peak_mib:.1f} MiB")
            if verdict["replan"]:
                run.make()
            if verdict["replan"] or verdict["rival"] or verdict["switched"]:
                self._use_budget_plan(key, plan, run)  # the check's history keeps the plan just timed
            if verdict["replan"] or verdict["rival"]:
                missed = self._budget_missed(plan) if verdict["replan"] else ""
                if self.verbose:
                    what = ("planned again" if verdict["replan"]
                            else "timing against it the fastest plan without offload")
                    print(f"{took}; {what}: offload {len(plan['offload'])}, recompute {len(plan['recomputed'])}, "
                          f"predicted {plan['predicted_step_ms']:.2f} ms, "
                          f"{plan['predicted_peak_bytes'] / 2**20:.1f} MiB" + missed, flush=True)
            else:
                plan["check"].update(verdict.get("kept", {}), settled=True, rival=run.rival)
                if self.verbose and plan["check"]["rival"] is not None:
                    won = plan["check"]["rival"]["won"]
                    print(f"{took}; kept the plan {'that recomputes instead' if won else 'that offloads layers'}: "
                          f"offload {len(plan['offload'])}, recompute {len(plan['recomputed'])}", flush=True)
                del self.budget_runs[key]
                self._fresh_segments()
                return
        if self.engine.on_accel:
            _device.reset_peak_memory_stats(device)
        self.budget_start = (mark, key)
