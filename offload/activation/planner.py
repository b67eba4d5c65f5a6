"""Auto mode of activation offload: measure the first steps, then choose the layers to offload.

Measurement: the first step of a new input shape offloads every eligible layer (so a model
that only fits with offload still fits while it is measured); it gives the bandwidth the
copies achieve each way under compute, and its peak shows whether a step without offload
fits. If it does (and no budget is set), the next steps run with nothing offloaded (see
`_measured_enough`), else one more with everything offloaded; the last of them gives per
layer the bytes its group saves, its forward time (events at the group's open and close on
the compute stream) and its backward time (events at the first unpack of successive groups).

Plan without a budget (`schedule`): fill the device-to-host stream, in forward order,
with what it can copy out before backward starts (the last layer that fits is offloaded in
part: its first saved spans up to a byte cap). The engine runs it without the resident
window: each group's memory is let go at a planned point (a layer's start, the end of the
last layer, or backward's start) by a wait of the compute stream on its copy, planned to
be done by then; and each group is fetched back when backward reaches the latest layer
that leaves time for its copy (a hook on that layer's output gradient). A sparse plan then
frees its memory before the peak, which host polling could not: the host runs ahead of the
device and would see the copies done only later, and the window made adjacent layers stall.

Plan with a memory budget (`choose`): a small timeline model replays a step with the
resident window (the host waits for the oldest copy when it is full, the first group
needed from the host is fetched as backward starts, each other group when the one after it
starts unpacking). Starting from "offload every eligible layer", layers are taken back
onto the device one at a time, each time the one whose removal cuts the predicted exposed
time most, until no further layer fits in the budget.

Check against the step (no budget): the model misses what it does not see (the host
stalls of the resident window, launch-bound steps where the hooks' own cost shows, copies
slowing compute on a shared memory bus), so the plan is then run and timed. A plan is
"offload the first k layers of the schedule's order" (a prefix keeps every planned point
valid: dropping the last copies only ends the others sooner). A probe of a count k runs
its steps alternately with steps with nothing offloaded (run without hooks, exactly as
without offload), and compares the medians: on a shared machine the steps drift by a few
percent within minutes (on the H100 here, Llama at seq 8192: 79.6 ms in auto's baseline
probe, 81.1-81.3 ms a minute later), as much as the tolerance, so a baseline timed in a
probe of its own misjudged the counts probed before or after it. The model's k is probed
first; if it costs more than `STEP_TOLERANCE` of its baseline, k is bisected down to the
largest prefix that does not. A count the search settles on above zero is confirmed: probed once more,
and the plan backs off further if it misses the tolerance then (one good probe must not
settle a plan whose steps run slower, as a bench or a training loop then sees). Each probe
runs `PROBE_WARMUP_STEPS` unmeasured steps (new block sizes in the allocators) and
`PROBE_STEPS` timed ones of each side; the medians count, so a plan whose steps are
sometimes slow is judged by its usual step. After the first probe the rate its copies
achieved under its own compute is read; if it is below the rate the schedule assumed (less
`COPY_MARGIN`), the schedule is made again at it and the search starts over (once). So it
is if the probe missed the tolerance and its copies ended late at the release points
(`LATE_TOLERANCE`), at a rate lowered by how late they were.
A step is timed from one training forward to the next of the same input shape (events
on the compute stream), so the optimizer and data loading are in both sides alike. With
a memory budget, or when a step without offload might not fit on the device, the model's
plan is final.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Mapping
from typing import List, Optional

import torch

from ..core import _device
from ..core.copy import copy_to_device, copy_to_host

# Measuring steps of a new input shape: the first offloads every eligible layer (kernels and
# the pool warm up, the bus is measured under compute, and the peak shows whether a step
# without offload fits); the rest are measured, then the plan is made.
MEASURE_STEPS = 2
# Measured steps without offload at most: another follows a step in which the allocator took
# new device memory (its times include those allocations).
DRY_STEPS = 2
TOLERANCE = 0.01  # predicted exposed copy time allowed, as a fraction of the step (budget plans)
STEP_TOLERANCE = 0.03  # measured step-time overhead allowed over the no-offload step (the 3%)
# A probe alternates steps of the probed count and steps without offload: the first of
# each are not timed (new block sizes in the allocators), then PROBE_STEPS of each are.
PROBE_WARMUP_STEPS = 2
PROBE_STEPS = 3
# Timed probe steps whose end the device has not passed yet, at most: a probe step is read
# when the device is done with it (no host wait, so the host keeps running ahead as in any
# other step); only beyond this many does the host wait for the oldest.
PROBE_PENDING = 2
FIT_FRACTION = 0.9  # a step without offload is tried only if its predicted peak is below this share of memory
BACKWARD_CAP = 3.0  # a layer's measured backward time is taken as at most this times its forward
# A schedule plans each copy this much longer than the measured bandwidth says: a group's
# memory is let go by making the compute stream wait for its copy at a planned point, and a
# copy a little slower than measured must not turn that wait into a stall.
COPY_MARGIN = 0.05
# A first probe over the step-time tolerance whose copies ended late at the plan's release
# points (the compute stream waited there longer than this share of the copies' own time)
# makes the schedule again at a rate lowered by that share. The block stack on the H100
# waited 1.7-4.5 ms a step at its release points under a two-layer plan, its copies at the
# measured 55 GB/s: 2-3% of its step, and the 3% check then settled on one layer in some
# runs. The causes were bytes the plan did not count (its first layer, in parts, copied
# q's storage twice; a part's end fell inside a 268 MB span, which the engine copies whole
# in that part); with those counted the waits were gone. A plan made again keeps ~10%
# fewer bytes, so only a plan that misses its check is.
LATE_TOLERANCE = 0.02
# Copies back are planned this much longer: under backward's compute the host-to-device copy
# of a Llama layer ran at ~41 GB/s on the H100 against 53 GB/s measured (1.4 ms exposed per
# layer), and fetching one layer earlier costs memory only after backward's peak (its start).
FETCH_MARGIN = 0.3
# A layer offloaded in part offloads at least this share of its bytes (less frees too little
# for the hooks' work and the extra copy).
MIN_PART = 0.125
# A layer whose copy would start on an idle device-to-host stream is copied in this many
# parts, each as soon as the layer has saved its share of the bytes: waiting for the layer
# to end left the bus idle through the first offloaded layer's forward (an eighth of the
# block stack's forward, ~12% of what the bus can hide in it).
SPLIT_PARTS = 4
# The measured steps mark when each layer has saved every PROFILE_POINTS-th share of its bytes
# (of new spans): a layer's parts close when it has saved their bytes, which do not come evenly
# over its time (on the H100 the block stack's layers saved half their bytes by 41% of their
# time and all by 72%; Llama seq 8192's half only by 67%), so the schedule places a part's
# close by these marks. A multiple of SPLIT_PARTS: the quarters' ends are then marks of their own.
PROFILE_POINTS = 8
# Where the point of the last tensor saved before the step's peak, after the last layer (n),
# sits among the points: between the last layer's end (n) and backward's start (n + 1).
TAIL_POINT = 0.5
# Tensors saved after the last layer (head, loss) that the measuring step marks, at most.
MAX_TAIL_SAVES = 64


def max_tuning_steps(layers: int) -> int:
    """Steps auto mode takes at most to settle one input shape with `layers` eligible layers.

    The first measuring step and at most DRY_STEPS more; then probes of PROBE_WARMUP_STEPS
    + 2 x PROBE_STEPS steps each: the plan's, a bisection over the layers, the same again
    when the plan is made anew at the copies' rate, and the confirmation of the count it
    settles on (3 + 8 x (3 + 2 x log2 layers) with the defaults).
    """
    probe = PROBE_WARMUP_STEPS + 2 * PROBE_STEPS
    bisection = math.ceil(math.log2(max(layers, 1)))
    return 1 + DRY_STEPS + probe * (3 + 2 * bisection)


@dataclasses.dataclass
class Schedule:
    """How the engine runs auto mode's plan for one input shape (without a memory budget).

    Points of a step, in order: `j` < n when layer j opens, `n` when the last layer ends,
    `n + 0.5` (TAIL_POINT after n) when the `tail_save`-th tensor after the last layer is
    saved (the last one saved before the step's peak, in the head or the loss; None: no such
    point), `n + 1` when backward starts (its first unpack).
    - caps: per layer, the bytes of new storage spans its group may offload (the first ones
      saved; later tensors stay on the device), or None for all of them.
    - release_at: layer -> the point at which the compute stream waits, on the device, for
      its group's copy and its device tensors go back to the allocator in stream order (the
      copy is planned to be complete by then, so the wait costs nothing); a list for a layer
      copied in parts: a point per part. Without such a point a group's memory went back
      only when the host saw its copy done, and the host runs ahead of the device: a sparse
      plan freed nothing before backward.
    - fetch_at: layer j -> layers whose groups are copied back when backward reaches layer
      j (the gradient of its output is computed), so each arrives just before it is needed;
      fetch_at_start: those fetched as backward starts.
    - split_at: layer -> the layer's bytes of new spans, ascending, at which its group is
      closed (its copy starts) and the layer goes on in a new group (part): the copy runs
      while the layer still saves tensors, and each part is let go at its own point. The
      parts of a layer are fetched together.
    """

    n: int
    caps: List[Optional[int]]
    release_at: dict
    fetch_at: dict
    fetch_at_start: List[int]
    split_at: dict = dataclasses.field(default_factory=dict)
    tail_save: Optional[int] = None


def saved_by(marks, fwd: float, share: float) -> float:
    """Seconds into a layer of `fwd` seconds by which it has saved `share` of its bytes.

    `marks`: (share saved, seconds into the layer) ascending, each taken at the save that
    passed a share (see PROFILE_POINTS), so the bytes between two marks may all come with the
    later one: the first mark with at least `share` saved, else the layer's end. Without marks
    the bytes are spread evenly over the layer's time.
    """
    if marks is None:
        return fwd * share
    for saved, seconds in marks:
        if saved >= share:
            return min(seconds, fwd)
    return fwd


def span_end_at_or_below(bounds, nbytes: int) -> int:
    """The largest of a layer's span ends (`bounds`, ascending) not above `nbytes` (0 if none):
    what a cap of `nbytes` offloads. Without span ends, `nbytes`."""
    if not bounds:
        return nbytes
    return max((b for b in bounds if b <= nbytes), default=0)


def span_end_at_or_above(bounds, nbytes: int) -> int:
    """The first of a layer's span ends (`bounds`, ascending) at or above `nbytes` (the last if
    none): where a part ending at `nbytes` closes. Without span ends, `nbytes`."""
    if not bounds:
        return nbytes
    return next((b for b in bounds if b >= nbytes), bounds[-1])


def schedule(eligible: List[bool], nbytes, fwd, bwd, tail: float, head_bwd: float, d2h_bps: float,
             h2d_bps: float, before_peak=None, saved=None, spans=None):
    """Offload, in forward order, what the device-to-host stream can copy out before the last
    layer ends, and plan when each group's memory is let go and when it comes back.

    The timeline is the measured one: layer i runs fwd[i] after layer i-1, backward starts
    `tail` after the last layer ends (head, loss) and reaches the last layer `head_bwd` later;
    layer i's backward takes bwd[i]. A group's copy starts when it closes (or when the copy
    before it ends); a layer that opens with the stream idle is copied in `SPLIT_PARTS`
    parts, the first when the layer has run a part of its time. Every copy must end, with
    `COPY_MARGIN`, when the last layer does (point n): memory let go later, as backward
    starts, comes after the peak of a training step (the head's logits and the loss sit on
    top of every activation), so it would not lower it; a layer whose copy passes the last
    layer's open is split there too, the part copied by then let go as the last layer opens.
    `before_peak` (m, seconds): the m-th tensor saved after the last layer is the last one
    saved before the step's peak, that long after the last layer's end (a Llama at seq 8192
    peaks in its loss, on the fp32 logits: on an H200 the 12th tensor saved after the last
    layer, 3.2 ms after its end): copies may then run until it, the part copied by the last
    layer's end let go there (point n), the rest at that save (TAIL_POINT).
    `saved`: per layer, the marks of `saved_by` (None: its bytes spread evenly over its time);
    `spans`: per layer, its bytes of new spans after each one, ascending (None: any count).
    The last layer that fits is offloaded in part. Earliest layers first: their memory is
    freed for longest and backward needs them last, with the most time to bring them back.

    Returns (Schedule, order, predicted exposed seconds in backward): `order` lists the layers
    offloaded, in the order their copies run (a prefix of it is a smaller plan that keeps
    every point valid).
    """
    n = len(nbytes)
    opens, closes, t = [], [], 0.0
    for i in range(n):
        opens.append(t)
        t += fwd[i]
        closes.append(t)
    layers_end = deadline = t
    tail_save = None
    if before_peak is not None and before_peak[1] > 0:
        tail_save, seconds = before_peak
        deadline = t + seconds
    caps: List[Optional[int]] = [None] * n
    release_at, order, split_at = {}, [], {}
    free = 0.0
    per_byte = (1 + COPY_MARGIN) / d2h_bps
    saved = saved or [None] * n
    spans = spans or [None] * n
    for i in range(n):
        if not eligible[i] or nbytes[i] <= 0:
            continue
        # A layer's group closes a part, or stops at its cap, only between two spans: byte
        # counts are taken at the measured span ends (the block stack's layers end on a 268 MB
        # span, which a cap inside it leaves on the device whole).
        bounds = spans[i]
        size = bounds[-1] if bounds else nbytes[i]
        split = free < closes[i]  # else the copies before it keep the stream busy past its end
        first = span_end_at_or_above(bounds, size // SPLIT_PARTS)
        start = max(opens[i] + saved_by(saved[i], fwd[i], first / size) if split else closes[i], free)
        take = span_end_at_or_below(bounds, min(size, int((deadline - start) / per_byte)))
        if take < MIN_PART * size:
            continue
        # Parts, by the bytes of new spans where each ends: the layer's quarters while it
        # runs (split), and where the copy passes the last layer's open, so that what is
        # copied by then goes as the last layer starts: it adds its own activations after
        # that, and only a part as small as what it and the loss add can wait for point n.
        # A quarter closes at the first span end past it; a part that must be copied by a
        # point, at the last span end before what the bus copies by then (rounded up, the
        # block stack's part for the last layer's open took its layer's last 268 MB span too,
        # and that part's memory was held through the last layer: the step's peak).
        ends = {span_end_at_or_above(bounds, size * k // SPLIT_PARTS) for k in range(1, SPLIT_PARTS)} if split else set()
        ends.add(span_end_at_or_below(bounds, int((opens[-1] - start) / per_byte)))
        if tail_save is not None:
            ends.add(span_end_at_or_below(bounds, int((layers_end - start) / per_byte)))
        ends = sorted(b for b in ends if 0 < b < take) + [take]
        points, done, begun = [], free, 0
        for b in ends:
            # A part closes when the layer has saved its bytes, the last one when the layer
            # ends; its copy follows the one before it.
            closed = closes[i] if b == take else opens[i] + saved_by(saved[i], fwd[i], b / size)
            done = max(closed, done) + (b - begun) * per_byte
            begun = b
            later = [j for j in range(i + 1, n) if opens[j] >= done]
            points.append(later[0] if later else n if done <= layers_end else n + TAIL_POINT)
        if done > deadline:
            continue
        free = done
        caps[i] = None if take >= size else take
        order.append(i)
        if len(ends) > 1:
            split_at[i] = ends[:-1]
            release_at[i] = points
        else:
            release_at[i] = points[0]
    # Backward: layer j starts at begins[j]. The groups come back in the order backward needs
    # them, through one host-to-device stream: a copy must end before its layer starts and
    # before the next copy's latest start, so latest starts are found from the group needed
    # last, and each group is fetched at the latest layer start before its own (the least
    # memory held early). Each group at its own latest start, ignoring the copies queued
    # behind it, left those too late (10 ms exposed on the H100's block stack, two layers).
    begins, t = [0.0] * n, head_bwd
    for j in reversed(range(n)):
        begins[j] = t
        t += bwd[j]
    durations = {i: (nbytes[i] if caps[i] is None else caps[i]) / h2d_bps * (1 + FETCH_MARGIN) for i in order}
    latest, bound = {}, math.inf
    for i in order:  # forward order: the group needed last first
        bound = latest[i] = min(begins[i], bound) - durations[i]
    fetch_at: dict = {}
    fetch_at_start: List[int] = []
    exposed, h2d_free = 0.0, 0.0
    for i in reversed(order):
        triggers = [j for j in range(i + 1, n) if begins[j] <= latest[i]]
        if triggers:
            j = triggers[0]  # the latest such layer start
            fetch_at.setdefault(j, []).append(i)
            at = begins[j]
        else:
            fetch_at_start.append(i)
            at = 0.0
        end = max(at, h2d_free) + durations[i]
        h2d_free = end
        exposed += max(0.0, end - begins[i])
    # The point after the last layer is kept only if some part is let go there.
    points = [p for i in order for p in (release_at[i] if isinstance(release_at[i], list) else [release_at[i]])]
    tail_save = tail_save if any(p > n for p in points) else None
    return Schedule(n, caps, release_at, fetch_at, fetch_at_start, split_at, tail_save), order, exposed


def simulate(offload: List[bool], nbytes, fwd, bwd, d2h_bps: float, h2d_bps: float, window: int):
    """Predicted (exposed seconds, step seconds) of one step under a plan."""
    t = 0.0
    d2h_free = 0.0
    inflight = collections.deque()  # (end time, layer)
    exposed = 0.0
    n = len(offload)
    for i in range(n):
        t += fwd[i]
        if not offload[i]:
            continue
        end = max(t, d2h_free) + nbytes[i] / d2h_bps
        d2h_free = end
        inflight.append((end, i))
        while inflight and inflight[0][0] <= t:
            inflight.popleft()
        while len(inflight) > window - 1:
            end_oldest, _ = inflight.popleft()
            if end_oldest > t:
                exposed += end_oldest - t
                t = end_oldest
    resident = {i for _, i in inflight}  # still held at the end of forward: served from the device
    ready = {}
    h2d_free = t
    chosen = [i for i in range(n) if offload[i]]
    on_host = [i for i in chosen if i not in resident]
    if on_host and len(resident) < window:  # fetched as backward starts (_prefetch_at_backward_start)
        ready[on_host[-1]] = h2d_free = t + nbytes[on_host[-1]] / h2d_bps
    previous = {b: a for a, b in zip(chosen, chosen[1:])}
    for i in reversed(range(n)):
        if offload[i] and i not in resident:
            if i not in ready:
                ready[i] = max(t, h2d_free) + nbytes[i] / h2d_bps
                h2d_free = ready[i]
            if ready[i] > t:
                exposed += ready[i] - t
                t = ready[i]
        p = previous.get(i)
        if offload[i] and p is not None and p not in resident and p not in ready:
            ready[p] = max(t, h2d_free) + nbytes[p] / h2d_bps
            h2d_free = ready[p]
        t += bwd[i]
    return exposed, t


def _removals(mask, nbytes, fwd, bwd, d2h_bps, h2d_bps, window, allowance=None):
    """Greedy: yield (exposed, step) of `mask`, then take back onto the device the offloaded
    layer whose removal cuts the predicted exposed time most (ties: the smaller layer), and
    repeat; `mask` is updated in place. Stops when nothing more can be taken back."""
    kept = 0
    while True:
        exposed, step = simulate(mask, nbytes, fwd, bwd, d2h_bps, h2d_bps, window)
        yield exposed, step
        best = None
        for i, on in enumerate(mask):
            if not on or (allowance is not None and kept + nbytes[i] > allowance):
                continue
            mask[i] = False
            candidate = simulate(mask, nbytes, fwd, bwd, d2h_bps, h2d_bps, window)[0]
            mask[i] = True
            if best is None or (candidate, nbytes[i]) < (best[0], nbytes[best[1]]):
                best = (candidate, i)
        if best is None:
            return
        mask[best[1]] = False
        kept += nbytes[best[1]]


def choose(eligible: List[bool], nbytes, fwd, bwd, d2h_bps, h2d_bps, window, allowance: Optional[float] = None):
    """The offload mask: hide copies under compute, or keep at most `allowance` bytes on the device."""
    mask = list(eligible)
    exposed = step = 0.0
    for exposed, step in _removals(mask, nbytes, fwd, bwd, d2h_bps, h2d_bps, window, allowance):
        if exposed <= TOLERANCE * step:
            break
    return mask, exposed, step


class StepSearch:
    """How many layers of the schedule's order to offload, from measured step times.

    Each probe of a count times it against the step without offload, their steps taken in
    alternation (`record` gets both medians), so that a machine whose steps drift (clocks,
    other tenants) by more than the tolerance between two probes judges each count against
    a baseline of the same minutes. Probes the model's choice first; keeps it if it is within
    `tolerance` of its baseline, else bisects down to the largest count that is. A count
    above zero is confirmed once before it is final: it is probed again and must still be
    within tolerance (else the search goes on below it). `probe` is the count to run now,
    None once settled (`final`).
    """

    def __init__(self, model_k: int, tolerance: float = STEP_TOLERANCE):
        self.tolerance = tolerance
        self.step_ms: dict = {}  # layers offloaded -> its latest probe's median step (ms)
        self.baseline_ms: dict = {}  # layers offloaded -> the median step without offload in that probe
        self.lo, self.hi = 0, model_k  # largest count known within tolerance, smallest known over
        self.probe = model_k if model_k > 0 else None
        self.final = None if model_k > 0 else 0
        self.confirming = False  # the count probed now is being confirmed
        self.confirmed = False  # a confirmation ran (once per search: the steps are bounded)

    def within(self, k: int) -> bool:
        return self.step_ms[k] <= (1.0 + self.tolerance) * self.baseline_ms[k]

    def record(self, k: int, ms: float, baseline_ms: float) -> None:
        """The probe of `k` layers: its median step and the baseline's, timed in alternation."""
        if k != self.probe:
            raise RuntimeError(f"offload.activation auto: a step of {k} layers was recorded while probing "
                               f"{self.probe}")
        self.step_ms[k] = ms
        self.baseline_ms[k] = baseline_ms
        if self.confirming:
            self.confirming = False
            if self.within(k):
                self.probe, self.final = None, k
                return
            self.hi, self.lo = k, 0  # it did not hold: what is below it is unknown again
        elif self.within(k):
            self.lo = max(self.lo, k)
        else:
            self.hi = min(self.hi, k)
        if self.hi == self.lo or self.within(self.hi):  # the model's choice holds
            self._settle(self.hi)
        elif self.hi - self.lo <= 1:
            self._settle(self.lo)
        else:
            self.probe = (self.lo + self.hi) // 2

    def _settle(self, k: int) -> None:
        if k > 0 and not self.confirmed:
            self.confirmed = self.confirming = True
            self.probe = k
            return
        self.probe, self.final = None, k


class _Clock:
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


_KEY_DEPTH = 6  # containers nested deeper than this are not looked into


def _tensor_leaves(value, out: list, depth: int = 0) -> None:
    """Append the tensors in `value`: lists, tuples, mappings (dict, a Hugging Face
    BatchEncoding, which is a UserDict) and dataclasses, in order. torch's pytree walks
    registered containers only, and a UserDict or a user's dataclass is not one."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return
    if depth >= _KEY_DEPTH or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, Mapping):
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name, None) for field in dataclasses.fields(value)]
    else:
        return
    for item in items:
        _tensor_leaves(item, out, depth + 1)


def _shape_key(args, kwargs):
    """The shapes and dtypes of the tensors in a forward's inputs, nested ones included."""
    leaves: list = []
    _tensor_leaves(list(args) + [kwargs[k] for k in sorted(kwargs)], leaves)
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves)


def _planned_bytes(layer_bytes, mask, caps) -> int:
    """Bytes a plan offloads: each chosen layer's, or its cap where it is offloaded in part."""
    return sum(b if caps is None or caps[i] is None else min(b, caps[i])
               for i, (b, m) in enumerate(zip(layer_bytes, mask)) if m)


def _copies_late(copies) -> float:
    """How long the compute stream waited at the release points of a step, as a share of its
    device-to-host copies' time: the median over these steps' counters (0.0 where not timed).

    The median, as the probe's step times: on a shared machine a step's copies now and then
    ran at 38-46 GB/s instead of 55 (the H100's block stack), its release points waiting 8-12
    ms, and summed over the probe such a step made the plan again for a rate its usual steps
    do not see.
    """
    shares = [c["forward_wait_seconds"] / c["d2h_seconds"] for c in copies if c["d2h_seconds"] > 0]
    return statistics.median(shares) if shares else 0.0


def probe_bandwidth(device, nbytes: int = 64 << 20):
    """(d2h, h2d) bytes/s of one copy each way through the copy engine."""
    if not _device.is_accelerator(device):
        nbytes = 8 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    clock = _Clock(device)
    out = []
    for _ in range(2):  # the first round allocates the pool's blocks
        a = clock.mark()
        handle = copy_to_host([src])
        handle.synchronize()
        b = clock.mark()
        back = copy_to_device(handle, device)
        back.wait_stream()
        c = clock.mark()
        _device.synchronize(device)
        out = [nbytes / max(clock.seconds(a, b), 1e-9), nbytes / max(clock.seconds(b, c), 1e-9)]
    return out[0], out[1]


class _Probe:
    """A shape's plan being timed: the schedule's order, the search, and the steps seen of this probe."""

    __slots__ = ("order", "search", "serial", "steps", "samples", "pending", "replan", "d2h", "copies")

    def __init__(self, order, search, replan=None, d2h=None):
        self.order = order
        self.search = search
        # The schedule again at another device-to-host rate (bytes/s -> schedule()'s result),
        # the rate it assumed, and the copy counters of the first probe's offloading steps:
        # once that probe ends the schedule is made again if its copies ran slower.
        self.replan, self.d2h, self.copies = replan, d2h, []
        self.serial = 0  # bumped when the probed count changes, so a step of the last one is not timed
        self.steps = 0  # steps run of the current probe (the first PROBE_WARMUP_STEPS are not timed)
        self.samples = {True: [], False: []}  # timed steps (ms): of the probed count, and without offload
        self.pending: list = []  # (start, end, offloading) of timed steps the device may not have finished


class AutoPlanner:
    """The engine's observer while measuring; keeps one plan per input shape."""

    def __init__(self, handle, budget: Optional[int], verbose: bool):
        self.handle = handle
        self.engine = handle.engine
        self.budget = budget
        self.verbose = verbose
        self.clock = _Clock(self.engine.device)
        self.plans = {}
        self.key = None
        self.measuring = None  # (key, steps measured)
        # Measured steps run without offload (their layers' times are those of a step without
        # copies) when a step without offload fits on the device and there is no budget.
        self.dry = False
        self.bus = (None, None)  # (d2h, h2d) GB/s of the first measuring step's copies
        self.reserved = 0  # the allocator's device memory as the current measured step started
        self.records = {}
        self.backward_mark = None  # when the measured step's backward started
        self.tail_marks: list = []  # (m, mark, peak bytes so far) of the tensors saved after the last layer
        self.bandwidth = None
        self.tuning = {}  # key -> _Probe while its plan is being checked against measured steps
        # (mark, key, probe serial, whether it offloaded) of the last training forward of a planned shape
        self.last_start = None
        self.idle_key = None  # the shape of the last forward if its settled plan offloads nothing
        self.warned_budget = False  # a budget the plan cannot meet is warned about once per handle

    def current_plan(self):
        return self.plans.get(self.key)

    def before_forward(self, args, kwargs) -> bool:
        """Set the plan of this training forward's input shape; True when it runs without hooks.

        A shape whose settled plan offloads nothing costs a shape check per step and nothing
        else: its layers are unwrapped (no boundary, no clock, no hooks), until a shape that
        needs them comes.
        """
        key = _shape_key(args, kwargs)
        if key == self.idle_key and self.measuring is None:
            return True
        if self.measuring is not None and self.engine._backward_seen:
            measured_key, steps = self.measuring
            steps += 1
            if self._measured_enough(steps):
                self.plans[measured_key] = self._plan(measured_key)
                self.measuring = None
            else:
                self.measuring = (measured_key, steps)
        self.key = key
        handle = self.handle
        if key in self.plans:
            self._tune(key)
            handle._offload = list(self.plans[key]["mask"])
            self.engine.observer = None
            self.engine.schedule = self.plans[key].get("schedule")
            # Nothing offloaded: a settled plan, or a probe's step without offload (the baseline
            # the probed count is timed against is the step exactly as without offload).
            idle = not any(handle._offload)
            self.idle_key = key if idle and key not in self.tuning else None
            handle._set_layers_wrapped(not idle)
            return idle
        self.idle_key = None
        handle._set_layers_wrapped(True)
        self.last_start = None
        if self.measuring is None or self.measuring[0] != key:
            self.measuring = (key, 0)
            self.dry = False
        # Every eligible layer offloaded, in the window; or, once a step without offload is
        # known to fit, none (kept groups: each layer's bytes and times are still recorded).
        handle._offload = [False] * len(handle._keep) if self.dry else [not k for k in handle._keep]
        self.engine.observer = self
        self.engine.schedule = None
        self.records = {}
        self.backward_mark = None
        self.tail_marks = []
        if self.engine.on_accel:
            _device.reset_peak_memory_stats(self.engine.device)
        self.reserved = _device.memory_reserved(self.engine.device)
        return False

    def _measured_enough(self, steps: int) -> bool:
        """After measuring step `steps` of the current shape: whether to plan now.

        Layer times from a step with every layer offloaded are not those of a step without:
        on the H100 the block stack's layers ran 5.0 ms each with every layer offloaded
        (the window's stalls let the GPU's clocks rise) against 5.6 ms without, and a plan
        made from them ended its copies 10% of the forward early. So when a step without
        offload fits (and no budget is set: a budget may keep memory free for others), the
        measured steps after the first run without offload.
        """
        device = self.engine.device
        if steps == 1:
            stats = self.engine.stats()
            self.bus = (stats["d2h_gbps"], stats["h2d_gbps"])
            _, total = _device.mem_get_info(device)
            without_offload = stats["peak_device_bytes"] + stats["d2h_bytes"]  # at most
            self.dry = self.budget is None and (not total or without_offload <= FIT_FRACTION * total)
            return MEASURE_STEPS <= 1
        if self.dry:
            grew = _device.memory_reserved(device) > self.reserved
            return not grew or steps >= 1 + DRY_STEPS
        return steps >= MEASURE_STEPS

    # ---- checking the plan against measured steps
    def _tune(self, key) -> None:
        """Time the step that just ended if it ran this shape's current probe; move the search
        on; set the count the next step runs: the probed one and none, in alternation."""
        probe = self.tuning.get(key)
        if probe is None:
            self.last_start = None
            return
        mark = self.clock.mark()
        last, self.last_start = self.last_start, None
        if last is not None and last[1] == key and last[2] == probe.serial:
            probe.steps += 1
            ran = last[3]
            if ran and probe.replan is not None:
                # The step that just ended: its counters are the engine's until the next capture.
                probe.copies.append(self.engine._counters)
            if probe.steps > PROBE_WARMUP_STEPS and len(probe.samples[ran]) + sum(
                    p[2] == ran for p in probe.pending) < PROBE_STEPS:
                probe.pending.append((last[0], mark, ran))
        else:  # a new probe, or the shape changed in between: warm up again
            probe.steps = 0
            probe.pending = []
        # Read, oldest first, the timed steps the device has finished; wait only past PROBE_PENDING.
        clock = self.clock
        while probe.pending and (len(probe.pending) > PROBE_PENDING or clock.done(probe.pending[0][1])):
            start, end, ran = probe.pending.pop(0)
            probe.samples[ran].append(clock.seconds(start, end) * 1e3)
        search = probe.search
        k = search.probe
        if min(len(samples) for samples in probe.samples.values()) >= PROBE_STEPS:
            if not self._rescheduled(key, probe):
                search.record(k, statistics.median(probe.samples[True]), statistics.median(probe.samples[False]))
            search = probe.search
            probe.samples = {True: [], False: []}
            probe.serial += 1
            probe.steps = 0
        plan = self.plans[key]
        plan["tuning"]["step_ms"] = {str(n): ms for n, ms in sorted(search.step_ms.items())}
        plan["tuning"]["baseline_ms"] = {str(n): ms for n, ms in sorted(search.baseline_ms.items())}
        if search.probe is None:
            k = search.final
            self._apply(key, probe.order, k)
            del self.tuning[key]
            plan["tuning"]["settled"] = True
            if self.verbose:
                base = search.baseline_ms.get(k)
                mine = search.step_ms.get(k)
                print(
                    f"offload.activation auto: inputs {plan['input_shapes']} settled on {k} of "
                    f"{len(probe.order)} eligible layers ({plan['offloaded_bytes'] / 2**20:.1f} MiB offloaded)"
                    + (f", step {mine:.2f} ms vs {base:.2f} ms without offload, alternated" if base and mine else ""),
                    flush=True,
                )
            return
        # Even steps of a probe run the probed count, odd ones nothing (without hooks).
        offloading = probe.steps % 2 == 0
        self._apply(key, probe.order, search.probe if offloading else 0)
        self.last_start = (mark, key, probe.serial, offloading)

    def _rescheduled(self, key, probe) -> bool:
        """After the first probe: make the schedule again if its copies ran slower than it
        assumed (with its margin), or ended late at its release points, and start the search
        over on the new one.

        The rate measured while measuring came from copies that ran partly while compute
        stalled on the window; under a plan's full compute they ran slower (the block stack
        on an H200: 5 ms of waits at the release points in a 150 ms step). Copies at the
        planned rate may still end late where a layer saves its bytes later in its forward
        than the schedule's even spread (the block stack on the H100: 8-10% of the copies'
        time): if the probe missed the tolerance, the rate is then lowered by that share
        (`LATE_TOLERANCE`). Once per shape.
        """
        replan, probe.replan = probe.replan, None
        copies, probe.copies = probe.copies, []
        if replan is None:
            return False
        rate = self._copy_rate(copies)
        if rate is None:
            return False
        late = _copies_late(copies)
        # Late copies are worth a new schedule only where their waits cost the probe its
        # check: a plan that passes with them keeps its bytes (what the 3% is for).
        missed = statistics.median(probe.samples[True]) > (1 + probe.search.tolerance) * statistics.median(
            probe.samples[False])
        if rate >= probe.d2h / (1 + COPY_MARGIN) and not (missed and late > LATE_TOLERANCE):
            return False
        measured = rate
        if late > LATE_TOLERANCE:
            rate = min(rate, probe.d2h) / (1 + late)
        plan_schedule, order, exposed = replan(rate)
        plan = self.plans[key]
        plan.update(schedule=plan_schedule, caps=plan_schedule.caps, predicted_exposed_ms=exposed * 1e3,
                    d2h_gbps_under_compute=measured / 1e9, copies_late=late, d2h_gbps_replanned=rate / 1e9)
        plan["model_mask"] = [i in order for i in range(len(plan["mask"]))]
        plan["tuning"]["model_layers"] = len(order)
        probe.order = order
        probe.search = StepSearch(len(order), probe.search.tolerance)
        if self.verbose:
            print(f"offload.activation auto: inputs {plan['input_shapes']}: the copies ran at {measured / 1e9:.1f} GB/s "
                  f"under the plan's compute (planned {probe.d2h / 1e9:.1f}), the compute stream waiting for them "
                  f"{late:.1%} of their time at its release points; planned again at {rate / 1e9:.1f} GB/s: "
                  f"{_planned_bytes(plan['layer_bytes'], plan['model_mask'], plan['caps']) / 2**20:.1f} MiB",
                  flush=True)
        return True

    def _copy_rate(self, copies):
        """Bytes/s the device-to-host copies of a step achieved: the median over these steps'
        counters (None: not timed). The median, as in `_copies_late`."""
        self.engine._resolve_timing(block=True)  # the probe's samples are taken: waiting costs none
        rates = [c["d2h_bytes"] / c["d2h_seconds"] for c in copies if c["d2h_bytes"] > 0 and c["d2h_seconds"] > 0]
        return statistics.median(rates) if rates else None

    def _apply(self, key, order, k) -> None:
        plan = self.plans[key]
        chosen = set(order[:k])
        mask = [i in chosen for i in range(len(plan["mask"]))]
        plan["mask"] = mask
        plan["offload"] = [name for name, m in zip(self.handle.layers, mask) if m]
        plan["offloaded_bytes"] = _planned_bytes(plan["layer_bytes"], mask, plan.get("caps"))

    # ---- observer
    def opened(self, group) -> None:
        self.records.setdefault(group.layer, {})["open"] = self.clock.mark()

    def closed(self, group) -> None:
        record = self.records.setdefault(group.layer, {})
        record["close"] = self.clock.mark()
        record["bytes"] = group.nbytes
        record["capped"] = group.capped
        record["span_ends"] = group.span_ends

    def saved_bytes(self, group) -> None:
        """The group's layer has saved the next PROFILE_POINTS-th share of its bytes."""
        self.records.setdefault(group.layer, {}).setdefault("profile", []).append((group.capped, self.clock.mark()))

    def unpacked(self, group) -> None:
        record = self.records.setdefault(group.layer, {})
        record.setdefault("unpack", self.clock.mark())

    def backward_started(self) -> None:
        self.backward_mark = self.clock.mark()

    def saved_after_layers(self, m: int) -> None:
        """The m-th tensor saved after the last layer: when, and the step's peak memory so far."""
        if m <= MAX_TAIL_SAVES:
            self.tail_marks.append((m, self.clock.mark(), _device.max_memory_allocated(self.engine.device)))

    # ---- planning
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

    def _plan(self, key) -> dict:
        handle = self.handle
        n = len(handle.layers)
        nbytes, fwd, bwd = [0] * n, [0.0] * n, [None] * n
        first_unpack = {}
        for i in range(n):
            record = self.records.get(i, {})
            nbytes[i] = record.get("bytes", 0)
            if "open" in record and "close" in record:
                fwd[i] = self.clock.seconds(record["open"], record["close"])
            if "unpack" in record:
                first_unpack[i] = record["unpack"]
        saved = [self._saved_marks(self.records.get(i, {})) for i in range(n)]
        spans = [self.records.get(i, {}).get("span_ends") or None for i in range(n)]
        for i in range(1, n):
            if i in first_unpack and i - 1 in first_unpack:
                bwd[i] = max(0.0, self.clock.seconds(first_unpack[i], first_unpack[i - 1]))
        # Around the layers: from the last one's end to backward's start (head, loss), and from
        # there to the last layer's backward (their backward).
        last_close = self.records.get(n - 1, {}).get("close")
        tail = head_bwd = 0.0
        if last_close is not None and self.backward_mark is not None:
            tail = max(0.0, self.clock.seconds(last_close, self.backward_mark))
            if n - 1 in first_unpack:
                head_bwd = max(0.0, self.clock.seconds(self.backward_mark, first_unpack[n - 1]))
        # While measuring, backward waits for copies that everything-offloaded could not hide,
        # and that wait lands between two groups' first unpacks: cap at 3x forward (a layer's
        # backward is about 2x its forward, 3x with recomputation) so the plan does not count
        # exposed copy time as compute to hide copies under.
        bwd = [min(b, BACKWARD_CAP * f) if b is not None and f > 0 else b for b, f in zip(bwd, fwd)]
        ratios = [b / f for b, f in zip(bwd, fwd) if b is not None and f > 0]
        ratio = sorted(ratios)[len(ratios) // 2] if ratios else 2.0
        bwd = [b if b is not None else ratio * f for b, f in zip(bwd, fwd)]
        stats = self.engine.stats()
        d2h_gbps, h2d_gbps = self.bus if self.dry else (stats["d2h_gbps"], stats["h2d_gbps"])
        d2h = d2h_gbps * 1e9 if d2h_gbps else None
        h2d = h2d_gbps * 1e9 if h2d_gbps else None
        if self.budget is None or d2h is None or h2d is None:
            if self.bandwidth is None:
                self.bandwidth = probe_bandwidth(self.engine.device)
            idle_d2h, idle_h2d = self.bandwidth
            if self.budget is None:
                # The schedule starts from the faster of the two: the first measuring step's
                # copies may be slowed by what else the step does first (an H100 read 49.8
                # GB/s there in one run, 54.5 in the next), and a rate too high is corrected
                # once the plan's own copies are timed (_rescheduled).
                d2h, h2d = max(d2h or 0, idle_d2h), max(h2d or 0, idle_h2d)
            else:  # the window's plans keep the rate measured under it where there is one
                d2h, h2d = d2h or idle_d2h, h2d or idle_h2d
        eligible = [not k for k in handle._keep]
        allowance = None
        peak = stats["peak_device_bytes"]
        if self.budget is not None:
            allowance = max(0, self.budget - peak)
        window = self.engine.resident_groups
        plan_schedule = caps = before_peak = None
        if self.budget is None:
            # Hide the copies: what the bus moves before backward starts, freed at planned points.
            before_peak = self._before_peak(last_close, peak)
            plan_schedule, order, exposed = schedule(eligible, nbytes, fwd, bwd, tail, head_bwd, d2h, h2d,
                                                     before_peak, saved, spans)
            caps = plan_schedule.caps
            mask = [i in order for i in range(n)]
            step = sum(fwd) + tail + head_bwd + sum(bwd) + exposed
        else:  # as few layers as meet the budget, in the resident window
            mask, exposed, step = choose(eligible, nbytes, fwd, bwd, d2h, h2d, window, allowance)
        eligible_bytes = sum(b for b, e in zip(nbytes, eligible) if e)
        offloaded = _planned_bytes(nbytes, mask, caps)
        plan = {
            "input_shapes": [list(shape) for shape, _ in key],
            "mask": mask,
            "offload": [name for name, m in zip(handle.layers, mask) if m],
            "offloaded_bytes": offloaded,
            "eligible_bytes": eligible_bytes,
            "hideable_bytes": min(eligible_bytes, int(sum(fwd) * d2h)),
            "layer_bytes": nbytes,
            "caps": caps,
            "schedule": plan_schedule,
            "forward_ms": [f * 1e3 for f in fwd],
            # Per layer: [share of its bytes saved, ms into its forward] (see saved_by), or None.
            "saved_ms": [None if m is None else [[share, t * 1e3] for share, t in m] for m in saved],
            "backward_ms": [b * 1e3 for b in bwd],
            "tail_ms": tail * 1e3,
            # The last tensor saved after the layers before the step's peak: (its count, ms after
            # the last layer's end); copies run until it and the memory goes there.
            "before_peak": None if before_peak is None else [before_peak[0], before_peak[1] * 1e3],
            "head_backward_ms": head_bwd * 1e3,
            "d2h_gbps": d2h / 1e9,
            "h2d_gbps": h2d / 1e9,
            "predicted_exposed_ms": exposed * 1e3,
            "predicted_step_ms": step * 1e3,
            "budget_bytes": self.budget,
            "measured_peak_bytes": peak,
            "tuning": {"settled": True, "tolerance": STEP_TOLERANCE, "step_ms": {}, "model_layers": sum(mask),
                       "checked": False},
        }
        _, total = _device.mem_get_info(self.engine.device)
        fits = self.dry or not total or peak + eligible_bytes <= FIT_FRACTION * total
        if self.budget is None and fits and any(mask):
            # Timed against the step without offload (see the module docstring); the plan in
            # use meanwhile is the probe's, and `mask` becomes the settled one.
            def replan(d2h_bps):
                return schedule(eligible, nbytes, fwd, bwd, tail, head_bwd, d2h_bps, h2d, before_peak, saved, spans)

            self.tuning[key] = _Probe(order, StepSearch(sum(mask)), replan, d2h)
            plan["tuning"].update(settled=False, checked=True)
            plan["model_mask"] = list(mask)
        if self.budget is not None and peak + (eligible_bytes - offloaded) > self.budget and any(
            e and not m for e, m in zip(eligible, mask)
        ):
            plan["budget_met"] = False
        elif self.budget is not None:
            plan["budget_met"] = peak + (eligible_bytes - offloaded) <= self.budget
        missed = ""
        if plan.get("budget_met") is False:
            predicted = peak + eligible_bytes - offloaded
            missed = (f"; does NOT meet memory_budget_bytes={self.budget} (predicted peak {predicted / 2**20:.1f} "
                      f"MiB, {sum(mask)} of {sum(eligible)} eligible layers offloaded)")
            if not self.warned_budget:
                self.warned_budget = True
                warnings.warn(
                    f"offload.enable_activation_offload: mode='auto' cannot meet memory_budget_bytes={self.budget} "
                    f"for inputs {plan['input_shapes']}: the predicted peak device memory is {predicted} bytes with "
                    f"{sum(mask)} of {sum(eligible)} eligible layers offloaded (keep_first/keep_last keep the "
                    f"others, and what is not a saved activation stays); raise the budget, lower keep_first/"
                    "keep_last, or combine with activation checkpointing",
                    stacklevel=2,
                )
        if self.verbose:
            print(
                f"offload.activation auto plan for inputs {plan['input_shapes']}: offload {len(plan['offload'])} "
                f"of {n} layers ({offloaded / 2**20:.1f} of {eligible_bytes / 2**20:.1f} MiB eligible), "
                f"predicted exposed copy time {plan['predicted_exposed_ms']:.2f} ms of a "
                f"{plan['predicted_step_ms']:.2f} ms step at {plan['d2h_gbps']:.1f}/{plan['h2d_gbps']:.1f} GB/s"
                + ("; timing it against a step without offload" if plan["tuning"]["checked"] else "")
                + missed,
                flush=True,
            )
        return plan
