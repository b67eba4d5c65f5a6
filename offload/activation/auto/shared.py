"""What the parts of auto mode's planner share: the record of their common state (`Shared`),
the clock their timed stretches and steps are marked with (`Clock`), and the copies' rate read
from timed steps' counters (`copy_rate`).

`AutoPlanner` (planner.py) builds one `Shared` and hands it to each part it is built from: the
step measurer (measure.py), the prober (probes.py) and the budget checker (budget_checks.py).
State only one part uses lives in that part.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from ...core import _device
from .ranks import Ranks


class Clock:
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


@dataclasses.dataclass
class Shared:
    """The state every part of the planner reads; one record, so what one part sets the others see."""

    # The handle (Note [handle interface] in ../api.py): its layers' names, `keep`, and the
    # setters of the per-layer masks the plans choose.
    handle: Any
    # The handle's engine (Note [engine interface] in ../engine.py): the device, the plan in
    # use, the observer, the counters of the step that just ended.
    engine: Any
    # The ranks whose measurements every decision combines (Note [ranks agree] in ranks.py).
    ranks: Ranks
    # Where every timed stretch and step is marked and read: the measured step's layers, a
    # probe's steps, a budget plan's steps.
    clock: Clock
    # Print each plan and each verdict on it (the first rank only: the ranks' plans are the same).
    verbose: bool
    # Input shape key -> its `Plan` (plan.py; `handle.plan` gives its `to_dict()`): the planner
    # makes it, the prober and the budget checker update its fields as their timed steps decide.
    plans: dict = dataclasses.field(default_factory=dict)


def copy_rate(engine, copies):
    """Bytes/s the device-to-host copies of a step achieved: the median over these steps'
    counters (None: not timed). The median, as in `probes.copies_late`."""
    engine.resolve_timing(block=True)  # the steps' samples are taken: waiting costs none
    rates = [c["d2h_bytes"] / c["d2h_seconds"] for c in copies if c["d2h_bytes"] > 0 and c["d2h_seconds"] > 0]
    return statistics.median(rates) if rates else None
