"""A measured step of auto mode: the engine's observer while a step of a new input shape is
measured (`StepMeasurer`), and what the plan reads from the shape's measured steps
(`MeasuredStep`: per-layer times, bytes and marks, and the step's memory).

`AutoPlanner` (planner.py) decides when a step is measured (`start`) and hands the engine this
part as its observer for that step (Note [engine interface] in ../engine.py); the measurer
records what the engine reports, and gives the planner its reading (`read`) to plan from.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from ...core import _device
from .memory import StretchPeaks
from .shared import Shared

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


def least_times(steps: list) -> dict:
    """Per layer (and around the layers) the least of several measured steps' times
    (`StepMeasurer.step_times`); a backward that one step did not time takes the others'."""
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


@dataclasses.dataclass
class MeasuredStep:
    """What a shape's measured steps give its plan. Per-layer lists have an entry a layer;
    times are seconds, each the least over the steps measured without offload (`least_times`)."""

    nbytes: list  # per layer: the bytes its group saved in the last measured step
    inputs: list  # per layer: the bytes of its tensor inputs (what a checkpoint of it saves)
    fwd: list  # per layer: its forward
    bwd: list  # per layer: its backward (None: never timed)
    tail: float  # from the last layer's end to backward's start: the head and the loss
    head_bwd: float  # from backward's start to the last layer's backward: theirs
    # Per layer: (share of its bytes saved, seconds into its forward) marks of the last step,
    # moved onto the least forward (`rescaled`); None where not marked.
    saved: list
    spans: list  # per layer: its group's span ends (Note [span ends] in schedule.py), or None
    # (m, seconds after the layers' end) of the last tensor saved after the layers before the
    # step's peak (`StepMeasurer.before_peak`, on the least tail); None: none, or not read.
    before_peak: Optional[tuple]
    peak: int  # the allocator's peak over the last measured step
    tail_bytes: int  # what the head and the loss hold on top of the layers as backward starts
    at_start: int  # what the step held as it started: parameters, optimizer state, ...
    stretch_peaks: dict  # `<kind>_peaks` -> per layer, the peak of that stretch (`StretchPeaks.per_layer`)
    held_s: float  # the hold the last measured step's stream was given (Note [measured at the device's pace])


class StepMeasurer:
    """The engine's observer while a step is measured; what the plan is read from.

    Built by `AutoPlanner` with the planner's `Shared` record (the handle, the engine, the
    clock); what it records of a step is its own.
    """

    def __init__(self, shared: Shared, by_stretch: bool):
        self.shared = shared
        self.records: dict = {}  # layer -> its marks, bytes and span ends in the measured step
        self.inputs: dict = {}  # layer -> bytes of its tensor inputs in the measured step (what a checkpoint saves)
        self.backward_mark = None  # when the measured step's backward started
        self.tail_marks: list = []  # (m, mark, peak bytes so far) of the tensors saved after the last layer
        self.waits: list = []  # (layer, in backward, begun, ended) of the compute stream's waits for copies
        self.reserved = 0  # the allocator's device memory as the current measured step started
        # The measured step's memory, stretch by stretch with a budget (Note [memory beside the
        # activations] in budget.py).
        self.memory = StretchPeaks(shared.engine.device, by_stretch=by_stretch)
        # When the host began a measured step's forward, the seconds it took to queue its layers,
        # and the hold the last measured step was given (Note [measured at the device's pace]).
        self.forward_host_start = None
        self.forward_host_s = None
        self.held_s = 0.0
        self.hold_pending = False  # the measured step's first layer has yet to open and hold
        self.earlier_times: list = []  # `step_times` of the shape's earlier steps measured without offload

    def new_shape(self) -> None:
        """The steps measured next are a new input shape's: no hold given yet, no times kept."""
        self.held_s = 0.0
        self.earlier_times = []

    def start(self, hold: bool) -> None:
        """A measured step's forward begins: its records start empty, and its peak from here;
        `hold`: the stream is held as its first layer opens (a step measured without offload)."""
        engine = self.shared.engine
        self.records = {}
        self.inputs = {}
        self.backward_mark = None
        self.tail_marks = []
        self.waits = []
        if engine.on_accel:
            _device.reset_peak_memory_stats(engine.device)
        self.reserved = _device.memory_reserved(engine.device)
        self.memory.start()
        self.hold_pending = hold  # held as the first layer opens
        self.forward_host_start = time.perf_counter()

    def not_measuring(self) -> None:
        """The next step is not measured: nothing is held."""
        self.hold_pending = False

    def step_ended(self) -> None:
        """The measured step ended (the next training forward begins): its last stretch ends."""
        self.memory.end(None)  # the first layer's backward, to the step's end

    def keep_times(self) -> None:
        """Keep the step just measured without offload's times for the plan (`read`)."""
        self.earlier_times.append(self.step_times())

    def _hold(self) -> None:
        """Hold the compute stream as a step measured without offload starts (Note [measured at
        the device's pace]): longer than the host took to queue the last measured forward."""
        queued = self.forward_host_s
        seconds = HOLD_CAP_S if queued is None else min(HOLD_CAP_S, HOLD_HOST_FACTOR * queued)
        self.held_s = seconds if _device.hold(self.shared.engine.device, seconds) else 0.0

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
        self.records.setdefault(group.layer, {})["open"] = self.shared.clock.mark()
        if self.backward_mark is None:
            self.memory.layer_opened(group.layer)

    def closed(self, group) -> None:
        if group.layer == len(self.shared.handle.layers) - 1 and self.backward_mark is None:
            self.memory.end(("tail", group.layer))  # the head and the loss, to backward's first unpack
            if self.forward_host_start is not None:
                # To the layers' end only: a model may wait for the device after them (a loss
                # read on the host), and that wait would count the hold itself.
                self.forward_host_s = time.perf_counter() - self.forward_host_start
        record = self.records.setdefault(group.layer, {})
        record["close"] = self.shared.clock.mark()
        record["bytes"] = group.nbytes
        record["capped"] = group.capped
        record["span_ends"] = group.auto.span_ends if group.auto is not None else None

    def saved_bytes(self, group) -> None:
        """The group's layer has saved the next PROFILE_POINTS-th share of its bytes."""
        self.records.setdefault(group.layer, {}).setdefault("profile", []).append(
            (group.capped, self.shared.clock.mark()))

    def unpacked(self, group) -> None:
        record = self.records.setdefault(group.layer, {})
        if "unpack" not in record:  # the layer's backward begins
            record["unpack"] = self.shared.clock.mark()
            self.memory.end(("backward", group.layer))

    def backward_started(self) -> None:
        self.backward_mark = self.shared.clock.mark()

    def wait_begins(self):
        """The compute stream is about to wait for a copy (the window's copy out, or a copy back
        before a layer's backward): a mark where the wait starts."""
        return self.shared.clock.mark()

    def wait_ended(self, layer, begun, backward: bool) -> None:
        """The wait that began at `begun` ended: after layer `layer` closed (forward) or as its
        backward started (Note [copy waits are not compute])."""
        self.waits.append((layer, backward, begun, self.shared.clock.mark()))

    def saved_after_layers(self, m: int) -> None:
        """The m-th tensor saved after the last layer: when, and the step's peak memory so far."""
        if m <= MAX_TAIL_SAVES:
            self.tail_marks.append((m, self.shared.clock.mark(), self.memory.so_far()))

    # ---- reading the measured steps
    def read(self, n: int, with_before_peak: bool) -> MeasuredStep:
        """What the plan is made from, read from the measured steps of `n` layers (the host
        waits for their events); the times kept of earlier steps are used up.
        `with_before_peak`: read `before_peak` (the schedule's; a budget plan has no use for it)."""
        records = [self.records.get(i, {}) for i in range(n)]
        nbytes = [record.get("bytes", 0) for record in records]
        last = self.step_times()
        times = least_times([last] + self.earlier_times)
        self.earlier_times = []
        fwd = times["fwd"]
        # The marks are the last step's: moved onto the least times, each at the same share of
        # its stretch (a mark past the layer's end would close a part after the layer does).
        saved = [rescaled(self.saved_marks(records[i]), fwd[i], last["fwd"][i]) for i in range(n)]
        spans = [record.get("span_ends") or None for record in records]
        before_peak = None
        if with_before_peak:
            before_peak = self.before_peak(self.records.get(n - 1, {}).get("close"), self.memory.step_peak)
            if before_peak is not None:
                before_peak = (before_peak[0], before_peak[1] * onto(times["tail"], last["tail"]))
        peak = self.memory.step_peak
        return MeasuredStep(
            nbytes=nbytes, inputs=[self.inputs.get(i, 0) for i in range(n)], fwd=fwd, bwd=times["bwd"],
            tail=times["tail"], head_bwd=times["head_bwd"], saved=saved, spans=spans, before_peak=before_peak,
            peak=peak, tail_bytes=max(0, peak - self.tail_marks[0][2]) if self.tail_marks else 0,
            at_start=self.memory.at_start, stretch_peaks=self.memory.per_layer(n), held_s=self.held_s)

    def saved_marks(self, record):
        """A layer's (share of its bytes saved, seconds into its forward) marks, or None."""
        marks, size = record.get("profile"), record.get("capped", 0)
        if not marks or size <= 0 or "open" not in record:
            return None
        clock = self.shared.clock
        return [(capped / size, max(0.0, clock.seconds(record["open"], mark))) for capped, mark in marks]

    def before_peak(self, last_close, peak: int):
        """(m, seconds after the last layer's end) of the last tensor saved after the last layer
        before the measured step reached its peak (memory let go there lowers the peak); None
        if the peak came before any (inside the layers)."""
        if last_close is None:
            return None
        before = [(m, mark) for m, mark, so_far in self.tail_marks if so_far < peak]
        if not before:
            return None
        m, mark = before[-1]
        return m, max(0.0, self.shared.clock.seconds(last_close, mark))

    def step_times(self) -> dict:
        """The measured step's times in seconds: per layer its forward (`fwd`) and backward
        (`bwd`, None where not timed), and around the layers the head and loss (`tail`: from
        the last layer's end to backward's start) and their backward (`head_bwd`: from there
        to the last layer's backward). Reads the step's events (the host waits for them)."""
        n = len(self.shared.handle.layers)
        clock = self.shared.clock
        fwd, bwd = [0.0] * n, [None] * n
        first_unpack = {}
        for i in range(n):
            record = self.records.get(i, {})
            if "open" in record and "close" in record:
                fwd[i] = clock.seconds(record["open"], record["close"])
            if "unpack" in record:
                first_unpack[i] = record["unpack"]
        for i in range(1, n):
            if i in first_unpack and i - 1 in first_unpack:
                bwd[i] = max(0.0, clock.seconds(first_unpack[i], first_unpack[i - 1]))
        last_close = self.records.get(n - 1, {}).get("close")
        tail = head_bwd = 0.0
        if last_close is not None and self.backward_mark is not None:
            tail = max(0.0, clock.seconds(last_close, self.backward_mark))
            if n - 1 in first_unpack:
                head_bwd = max(0.0, clock.seconds(self.backward_mark, first_unpack[n - 1]))
        # Note [copy waits are not compute]
        for layer, backward, begun, ended in self.waits:
            waited = max(0.0, clock.seconds(begun, ended))
            if backward and layer is not None and bwd[layer] is not None:
                bwd[layer] = max(0.0, bwd[layer] - waited)
            elif not backward and layer == n - 1:
                tail = max(0.0, tail - waited)
        return {"fwd": fwd, "bwd": bwd, "tail": tail, "head_bwd": head_bwd}
