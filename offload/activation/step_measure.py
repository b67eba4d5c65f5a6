"""The measured steps of auto mode: the planner as the engine's observer while a step of a new
input shape is measured, and the per-layer times, bytes and marks read from that step.

`StepMeasure` is a base class of `AutoPlanner` (planner.py), split out by concern: it records
what the engine reports (Note [engine interface] in engine.py) into the planner's state
(`records`, `inputs`, `backward_mark`, `tail_marks`, `waits`, `memory`, the hold's fields) and
reads the step's times from it (`_step_times`); planner.py decides when a step is measured and
makes the plan from what it read.
"""

from __future__ import annotations

import time

from ..core import _device

# Note [measured at the device's pace]: a layer's time is read from events on the compute
# stream, which time the device's work only while the host has queued it ahead. A measuring
# step often starts with the host caught up (the step before it waited for its copies, or
# planning synchronized), and a forward whose layers the host launches barely faster than the
# device runs them (a Hugging Face layer of a few milliseconds, the hooks' own work on top)
# then runs at the host's pace: the measured layers came out up to twice their device time,
# and a schedule made from them planned copies that the real forward could not hide. So in a
# step measured without offload the stream is held (`_device.hold`) for longer than the host
# took to queue the last measured forward: the host queues the forward (and part of backward)
# during the hold, and the events then time the device's work. The hold is queued as the first
# layer opens, not as the forward starts: a model may wait for the device before its layers
# (Hugging Face's mask creation reads the attention mask, or the position ids, on the host),
# and that wait would outlast a hold queued before it, leaving the host caught up as the first
# layer starts, which then measured its host's pace. Steps that offload in the window are not
# held: their host waits for copies mid-step, which no hold outlasts.

# Note [copy waits are not compute]: a step measured with its layers offloaded in the window
# (a budget's measuring, the first step of a shape) makes the compute stream wait for copies:
# for the oldest copy out as a layer closes, and for a layer's copy back as its backward
# starts. A layer's backward is timed from its first unpack to the next layer's, so its wait
# for the copy back lands in it wherever the bus takes longer to bring a layer back than its
# backward takes to run; the last layer's wait as it closes lands in the time from the layers'
# end to backward's start. Either is the bus's time, not compute, and a plan priced from it
# predicts its steps slower than they run (by the whole exposed copy time of the measured
# step). So the engine brackets each such wait with marks of the planner's clock, and the
# measured times are taken less the waits inside them. (The window's waits between two
# layers lie outside every timed stretch.)

# Tensors saved after the last layer (head, loss) that the measuring step marks, at most.
MAX_TAIL_SAVES = 64
# A measured step's stream is held this many times the host's time to queue the last
# measured forward, at most HOLD_CAP_S (a step measured for the first time is held HOLD_CAP_S):
# Note [measured at the device's pace].
HOLD_HOST_FACTOR = 1.5
HOLD_CAP_S = 0.25


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


def least_times(steps: list) -> dict:
    """Per layer (and around the layers) the least of several measured steps' times
    (`StepMeasure._step_times`); a backward that one step did not time takes the others'."""
    first = steps[0]
    least = {"tail": min(t["tail"] for t in steps), "head_bwd": min(t["head_bwd"] for t in steps)}
    least["fwd"] = [min(t["fwd"][i] for t in steps) for i in range(len(first["fwd"]))]
    least["bwd"] = []
    for i in range(len(first["bwd"])):
        timed = [t["bwd"][i] for t in steps if t["bwd"][i] is not None]
        least["bwd"].append(min(timed) if timed else None)
    return least


def onto(least: float, measured: float) -> float:
    """The factor that moves a time within a stretch that lasted `measured` seconds onto the
    same share of a stretch of `least` seconds (1 where that one is not shorter)."""
    return least / measured if 0 < least < measured else 1.0


def rescaled(marks, least: float, measured: float):
    """(share, seconds) marks taken in a stretch that lasted `measured` seconds, moved onto a
    stretch of `least` seconds (`onto`); None stays None."""
    if marks is None:
        return None
    factor = onto(least, measured)
    return [(share, seconds * factor) for share, seconds in marks]


class StepMeasure:
    """The measuring side of the planner (see `AutoPlanner`)."""

    def _start_measured_step(self) -> None:
        """A measured step's forward begins: its records start empty, and its peak from here."""
        self.records = {}
        self.inputs = {}
        self.backward_mark = None
        self.tail_marks = []
        self.waits = []
        if self.engine.on_accel:
            _device.reset_peak_memory_stats(self.engine.device)
        self.reserved = _device.memory_reserved(self.engine.device)
        self.memory.start()
        self.hold_pending = self.measure_without_offload  # held as the first layer opens
        self.forward_host_start = time.perf_counter()

    def _hold(self) -> None:
        """Hold the compute stream as a step measured without offload starts (Note [measured at
        the device's pace]): longer than the host took to queue the last measured forward."""
        queued = self.forward_host_s
        seconds = HOLD_CAP_S if queued is None else min(HOLD_CAP_S, HOLD_HOST_FACTOR * queued)
        self.held_s = seconds if _device.hold(self.engine.device, seconds) else 0.0

    # ---- observer
    def layer_inputs(self, index: int, nbytes: int) -> None:
        """The handle: layer `index` of the measured step took `nbytes` of tensor inputs."""
        self.inputs[index] = nbytes

    def opened(self, group) -> None:
        if self.hold_pending:  # the step's first layer (Note [measured at the device's pace])
            self.hold_pending = False
            begun = time.perf_counter()
            self._hold()
            self.forward_host_start += time.perf_counter() - begun  # the forward's queueing time leaves it out
        self.records.setdefault(group.layer, {})["open"] = self.clock.mark()
        if self.backward_mark is None:
            self.memory.layer_opened(group.layer)

    def closed(self, group) -> None:
        if group.layer == len(self.handle.layers) - 1 and self.backward_mark is None:
            self.memory.end(("tail", group.layer))  # the head and the loss, to backward's first unpack
            if self.forward_host_start is not None:
                # To the layers' end only: a model may wait for the device after them (a loss
                # read on the host), and that wait would count the hold itself.
                self.forward_host_s = time.perf_counter() - self.forward_host_start
        record = self.records.setdefault(group.layer, {})
        record["close"] = self.clock.mark()
        record["bytes"] = group.nbytes
        record["capped"] = group.capped
        record["span_ends"] = group.auto.span_ends if group.auto is not None else None

    def saved_bytes(self, group) -> None:
        """The group's layer has saved the next PROFILE_POINTS-th share of its bytes."""
        self.records.setdefault(group.layer, {}).setdefault("profile", []).append((group.capped, self.clock.mark()))

    def unpacked(self, group) -> None:
        record = self.records.setdefault(group.layer, {})
        if "unpack" not in record:  # the layer's backward begins
            record["unpack"] = self.clock.mark()
            self.memory.end(("backward", group.layer))

    def backward_started(self) -> None:
        self.backward_mark = self.clock.mark()

    def wait_begins(self):
        """The compute stream is about to wait for a copy (the window's copy out, or a copy back
        before a layer's backward): a mark where the wait starts."""
        return self.clock.mark()

    def wait_ended(self, layer, begun, backward: bool) -> None:
        """The wait that began at `begun` ended: after layer `layer` closed (forward) or as its
        backward started (Note [copy waits are not compute])."""
        self.waits.append((layer, backward, begun, self.clock.mark()))

    def saved_after_layers(self, m: int) -> None:
        """The m-th tensor saved after the last layer: when, and the step's peak memory so far."""
        if m <= MAX_TAIL_SAVES:
            self.tail_marks.append((m, self.clock.mark(), self.memory.so_far()))

    # ---- reading the measured step
    def _saved_marks(self, record):
        """A layer's (share of its bytes saved, seconds into its forward) marks, or None."""
        marks, size = record.get("profile"), record.get("capped", 0)
        if not marks or size <= 0 or "open" not in record:
            return None
        return [(capped / size, max(0.0, self.clock.seconds(record["open"], mark))) for capped, mark in marks]

    def _before_peak(self, last_close, peak: int):
        """(m, seconds after the last layer's end) of the last tensor saved after the last layer
        before the measured step reached its peak (memory let go there lowers the peak); None
        if the peak came before any (inside the layers)."""
        if last_close is None:
            return None
        before = [(m, mark) for m, mark, so_far in self.tail_marks if so_far < peak]
        if not before:
            return None
        m, mark = before[-1]
        return m, max(0.0, self.clock.seconds(last_close, mark))

    def _step_times(self) -> dict:
        """The measured step's times in seconds: per layer its forward (`fwd`) and backward
        (`bwd`, None where not timed), and around the layers the head and loss (`tail`: from
        the last layer's end to backward's start) and their backward (`head_bwd`: from there
        to the last layer's backward). Reads the step's events (the host waits for them)."""
        n = len(self.handle.layers)
        fwd, bwd = [0.0] * n, [None] * n
        first_unpack = {}
        for i in range(n):
            record = self.records.get(i, {})
            if "open" in record and "close" in record:
                fwd[i] = self.clock.seconds(record["open"], record["close"])
            if "unpack" in record:
                first_unpack[i] = record["unpack"]
        for i in range(1, n):
            if i in first_unpack and i - 1 in first_unpack:
                bwd[i] = max(0.0, self.clock.seconds(first_unpack[i], first_unpack[i - 1]))
        last_close = self.records.get(n - 1, {}).get("close")
        tail = head_bwd = 0.0
        if last_close is not None and self.backward_mark is not None:
            tail = max(0.0, self.clock.seconds(last_close, self.backward_mark))
            if n - 1 in first_unpack:
                head_bwd = max(0.0, self.clock.seconds(self.backward_mark, first_unpack[n - 1]))
        # Note [copy waits are not compute]
        for layer, backward, begun, ended in self.waits:
            waited = max(0.0, self.clock.seconds(begun, ended))
            if backward and layer is not None and bwd[layer] is not None:
                bwd[layer] = max(0.0, bwd[layer] - waited)
            elif not backward and layer == n - 1:
                tail = max(0.0, tail - waited)
        return {"fwd": fwd, "bwd": bwd, "tail": tail, "head_bwd": head_bwd}

