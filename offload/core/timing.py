"""Timing shared by every capability: `Span` (one interval) and `PhaseTimer` (named phases).

See Note [device time]: work on an accelerator is timed with events, never by
synchronizing while it is queued; work on the host with the host's clock.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterable, List, Optional

from . import _device

# Note [device time]
# ~~~~~~~~~~~~~~~~~~
# A span of device work is measured by two timing events recorded on the stream
# that runs it, so the number is the device's time, not the host's time to
# enqueue the work. The events are read only when asked (`Span.ms`), after the
# end event has completed; nothing here synchronizes the device while work is
# being queued. Where there is no accelerator the work is synchronous and the
# host's clock (perf_counter) measures it.


class Span:
    """The time from construction to the last `stop()`: of the work queued on a stream of
    `device` (timing events, see Note [device time]) or, where `device` is None or not an
    accelerator, of the host's clock."""

    __slots__ = ("device", "on_accel", "_start", "_end")

    def __init__(self, device=None, stream=None):
        self.device = None if device is None else _device.normalize_device(device)
        self.on_accel = self.device is not None and _device.is_accelerator(self.device)
        self._start = self._mark(stream)
        self._end = None

    def _mark(self, stream):
        if not self.on_accel:
            return time.perf_counter()
        event = _device.new_event(self.device, timing=True)
        event.record(stream if stream is not None else _device.current_stream(self.device))
        return event

    def stop(self, stream=None) -> "Span":
        """Mark the end on `stream` (default: the current one); a later `stop()` moves it."""
        self._end = self._mark(stream)
        return self

    @property
    def end_event(self):
        """The end's timing event (accelerator spans), for a caller that also waits on it; else None."""
        return self._end if self.on_accel else None

    def ms(self, wait: bool = True) -> Optional[float]:
        """Milliseconds from start to end (0.0 if never stopped). `wait=False`: None while
        the device has not reached both, never blocking; else the host waits for them."""
        if self._end is None:
            return 0.0
        if not self.on_accel:
            return (self._end - self._start) * 1e3
        # Both events: a span started on one stream and stopped on another can see its end
        # complete before its start (the start's stream still has earlier work queued).
        if not wait and not (self._end.query() and self._start.query()):
            return None
        self._end.synchronize()
        self._start.synchronize()
        return self._start.elapsed_time(self._end)


class PhaseTimer:
    """Per-phase timing for multi-step transfers (weight sync): milliseconds per phase,
    summed over its repeats; a phase that never ran reports 0.0."""

    def __init__(self, device, phases: Iterable[str]):
        self.device = _device.normalize_device(device)
        self.phases = list(phases)
        self._repeats: Dict[str, List[Span]] = {p: [] for p in self.phases}
        self._overall: Dict[str, Span] = {}  # phase -> one span from its first mark to its last
        self._host_ms: Dict[str, float] = {p: 0.0 for p in self.phases}
        self._wall = Span()

    @contextlib.contextmanager
    def phase(self, name: str, stream=None):
        """Time the work queued (device) or done (host) inside the block; sums over repeats."""
        span = Span(self.device, stream)
        yield
        self._repeats[name].append(span.stop(stream))

    def add_host(self, name: str, seconds: float) -> None:
        self._host_ms[name] += seconds * 1e3

    def mark_span(self, name: str, stream=None) -> None:
        """Extend phase `name` as one span from its first mark to its last (overlapping work, e.g. a collective).

        Off the accelerator the work is done when marked (gloo returns from wait() once
        the collective completed), so the host's clock is the span's clock."""
        span = self._overall.get(name)
        if span is None:
            self._overall[name] = Span(self.device, stream)
        else:
            span.stop(stream)

    def result(self, **extra) -> dict:
        """Milliseconds per phase (`<phase>_ms`) and `total_ms` (host wall time until all work completed)."""
        out = {}
        for name in self.phases:
            ms = self._host_ms[name] + sum(span.ms() for span in self._repeats[name])
            overall = self._overall.get(name)
            if overall is not None:
                ms += overall.ms()
            out[f"{name}_ms"] = ms
        out["total_ms"] = self._wall.stop().ms()
        out.update(extra)
        return out
