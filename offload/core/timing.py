"""Per-phase timing for multi-step transfers (weight sync, parameter offload).

A phase that ran on the device is timed with events on the stream it ran on, so
the number is the device's time, not the host's time to enqueue it; a phase on
the host is timed with perf_counter. A phase that never ran reports 0.0. Events
are read once, in `result()`, after the last one has completed: nothing here
synchronizes the device while work is being queued.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterable

from . import _device


class PhaseTimer:
    def __init__(self, device, phases: Iterable[str]):
        self.device = _device.normalize_device(device)
        self.on_accel = _device.is_accelerator(self.device)
        self.phases = list(phases)
        self._pairs: Dict[str, list] = {p: [] for p in self.phases}  # (start, end) events per phase
        self._spans: Dict[str, list] = {}  # phase -> [first start event, last end event]
        self._host: Dict[str, float] = {p: 0.0 for p in self.phases}
        self._t0 = time.perf_counter()

    def _event(self, stream=None):
        event = _device.new_event(self.device, timing=True)
        event.record(stream if stream is not None else _device.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def phase(self, name: str, stream=None):
        """Time the work queued (device) or done (host) inside the block; sums over repeats."""
        if not self.on_accel:
            start = time.perf_counter()
            yield
            self._host[name] += time.perf_counter() - start
            return
        start = self._event(stream)
        yield
        self._pairs[name].append((start, self._event(stream)))

    def add_host(self, name: str, seconds: float) -> None:
        self._host[name] += seconds

    def mark_span(self, name: str, stream=None) -> None:
        """Extend phase `name` as one span from its first mark to its last (overlapping work, e.g. a collective)."""
        span = self._spans.setdefault(name, [None, None])
        # Off the accelerator the work is done (gloo returns from wait() once the
        # collective completed), so the host's clock is the span's clock.
        event = self._event(stream) if self.on_accel else time.perf_counter()
        if span[0] is None:
            span[0] = event
        span[1] = event

    def result(self, **extra) -> dict:
        """Milliseconds per phase (`<phase>_ms`) and `total_ms` (host wall time until all work completed)."""
        out = {}
        for name in self.phases:
            ms = self._host[name] * 1e3
            for start, end in self._pairs[name]:
                end.synchronize()
                ms += start.elapsed_time(end)
            span = self._spans.get(name)
            if span is not None and span[0] is not span[1]:
                if self.on_accel:
                    span[1].synchronize()
                    ms += span[0].elapsed_time(span[1])
                else:
                    ms += (span[1] - span[0]) * 1e3
            out[f"{name}_ms"] = ms
        out["total_ms"] = (time.perf_counter() - self._t0) * 1e3
        out.update(extra)
        return out
