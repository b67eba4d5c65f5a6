"""The per-save records `AsyncStager.metrics()` returns, and when their copy times are read."""

from __future__ import annotations

from collections import deque
from typing import List

# The metrics of this many recent saves are kept.
METRICS_KEPT = 256
# Saves whose spent copy handles are kept, at most, until a result() lets them go.
SPENT_KEPT = 4


class SaveLog:
    """Records of recent saves. A record's copy time is read from its copies' handles once
    they are complete; until then the record holds the handles (and so host buffers).

    Once read, the handles become `spent`: a later `StagingFuture.result()` lets them go
    (DCP's upload thread, or the caller's own wait) rather than `stage()`, where freeing
    the handles of thousands of copies would cost the caller's time. Bounded by SPENT_KEPT
    for callers that never ask for a result.
    """

    def __init__(self):
        self.records: deque = deque(maxlen=METRICS_KEPT)
        self._untimed: deque = deque()  # records whose copy time is not read yet, oldest first
        self.spent: list = []

    def add(self, record: dict) -> None:
        self.records.append(record)
        if record["_timing"]:
            self._untimed.append(record)

    def read_timings(self, final: bool = False) -> None:
        """Read the copy times of finished saves, oldest first; `final`: drop the rest."""
        while self._untimed:
            record = self._untimed[0]
            timing = record["_timing"]
            resolve_timing(record)
            if record["_timing"] is not None and not final:
                break
            record["_timing"] = None
            if timing:
                self.spent.append(timing)
            self._untimed.popleft()
        if final or len(self.spent) > SPENT_KEPT:
            self.spent.clear()

    def public(self) -> List[dict]:
        out = []
        for record in self.records:
            resolve_timing(record)
            out.append({k: v for k, v in record.items() if not k.startswith("_")})
        return out


def resolve_timing(record: dict) -> None:
    """Fill `copy_ms` and `gbps` of `record` once its timed copies are complete (never waits)."""
    timing = record.get("_timing")
    if timing:
        # Per device, its copies run one after another on its copy stream: their sum.
        per_device = []
        for handles in timing.values():
            try:
                seconds = [handle.copy_seconds() for handle in handles]
            except Exception:  # noqa: BLE001 - a failed copy: its save's future raises the error
                record["_timing"] = None
                return
            if None in seconds:
                return  # not complete yet (copy_seconds never waits)
            per_device.append(sum(seconds))
        record["copy_ms"] = max(per_device) * 1e3
        record["_timing"] = None
    if record["copy_ms"] is not None and record["gbps"] is None and record["copy_ms"] > 0:
        record["gbps"] = record["bytes"] / (record["copy_ms"] * 1e-3) / 1e9
