"""offload.core.timing's device spans against fake events on a CPU: a span read waits for both of its events."""

from offload.core import _device
from offload.core.timing import Span


class _Event:
    """A timing event complete only once synchronized, as one behind queued work is."""

    def __init__(self):
        self.done, self.at = False, None

    def record(self, stream):
        self.at = len(stream)
        stream.append(self)

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def elapsed_time(self, other):
        if not (self.done and other.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return float(other.at - self.at)


def test_span_across_streams_waits_for_its_start(monkeypatch):
    """A span started on one stream and stopped on another (as a copy is timed on a stream that
    waits only for it) may see its end complete first: reading it waits for both events, and a
    read that must not block says not yet until both are done."""
    compute, marker, events = [], [], []

    def new_event(device=None, timing=False):
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(_device, "is_accelerator", lambda device: True)
    monkeypatch.setattr(_device, "normalize_device", lambda device: device)
    monkeypatch.setattr(_device, "new_event", new_event)
    monkeypatch.setattr(_device, "current_stream", lambda device=None: compute)
    span = Span("cuda:0")
    span.stop(marker)
    span.end_event.done = True  # the end's stream ran ahead of the start's
    assert span.ms(wait=False) is None
    start, end = events  # the span's events, its start's first
    assert end is span.end_event
    assert span.ms() == 0.0 and start.done
    assert span.ms(wait=False) == 0.0
