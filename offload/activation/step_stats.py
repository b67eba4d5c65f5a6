"""The activation engine's per-step counters and the device timings that feed them.

Copies are timed by the copy layer (a timer per group copy); the waits of the compute stream
by a pair of events around them. Timings are added to the counters of the step they belong
to once the device has passed them, without blocking the host at a step start.
"""

from __future__ import annotations

from ..core import _device

_SPARE_EVENTS = 128  # timing events kept for reuse, at most


def new_counters() -> dict:
    return {
        "d2h_bytes": 0, "h2d_bytes": 0, "d2h_seconds": 0.0, "h2d_seconds": 0.0,
        "forward_wait_seconds": 0.0, "backward_wait_seconds": 0.0,
        # A group is a layer's saved tensors, or a part of them (a layer copied in parts while
        # it runs): layers_offloaded counts each layer once.
        "layers_offloaded": 0, "groups_offloaded": 0, "groups_fetched": 0, "groups_prefetched": 0,
        "tensors_offloaded": 0, "tensors_kept": 0,
    }


class StepTimings:
    """Timings not yet added to their step's counters."""

    def __init__(self, device):
        self.device = device
        # (counters, kind, start, end) for waits timed with events, (counters, kind, timer, None)
        # for copies the copy layer timed (a copy's timer holds none of its buffers: a fetched
        # group's device block is not kept for it).
        self.pending: list = []
        # Timing events read and done with, recorded again by later timings: making an event
        # costs host time, and a step makes several per layer.
        self.spare: list = []

    def copy(self, counters: dict, kind: str, timer) -> None:
        """Add a copy's time (the copy layer's `copy_timer()`) to `counters[kind]` once it is known."""
        self.pending.append((counters, kind, timer, None))

    def start(self, stream):
        """An event recorded on `stream` where a timed wait starts."""
        start = self._event()
        start.record(stream)
        return start

    def end(self, counters: dict, kind: str, start, stream) -> None:
        """The timed wait that began at `start` ends here on `stream`; its time goes to `counters[kind]`."""
        end = self._event()
        end.record(stream)
        self.pending.append((counters, kind, start, end))

    def resolve(self, block: bool) -> None:
        """Add finished timings to their counters; with `block`, wait for all of them."""
        pending = []
        spare = self.spare
        for timed in self.pending:
            counters, kind, start, end = timed
            if end is None:  # a copy's timer
                if block:
                    start.synchronize()
                seconds = start.seconds()
                if seconds is None:
                    pending.append(timed)
                else:
                    counters[kind] += seconds
            elif block or end.query():
                if block:
                    end.synchronize()
                counters[kind] += start.elapsed_time(end) / 1e3
                if len(spare) < _SPARE_EVENTS:
                    spare += (start, end)  # both passed: free to record again
            else:
                pending.append(timed)
        self.pending = pending

    def _event(self):
        spare = self.spare
        return spare.pop() if spare else _device.new_event(self.device, timing=True)
