"""Auto mode of activation offload: measure the first steps, then choose the layers to offload.

Measurement: for `MEASURE_STEPS` steps of a new input shape every eligible layer is
offloaded (so a model that only fits with offload still fits while it is measured) and
the planner records per layer the bytes its group copied, its forward time (events at the
group's open and close on the compute stream) and its backward time (events at the first
unpack of successive groups), plus the bandwidth the copies achieved each way.

Plan: a small timeline model replays a step: layer i's copy starts when its group closes
and the D2H stream is free, the resident window makes the host wait for the oldest copy,
in backward each group's H2D copy is issued when the group after it starts unpacking
(prefetch) and compute waits for it. Starting from "offload every eligible layer", layers
are taken back onto the device one at a time, each time the one whose removal cuts the
predicted exposed time most, until the exposed time is within `TOLERANCE` of the step
(or, with a memory budget, until no further layer fits in the budget).
"""

from __future__ import annotations

import collections
import time
from typing import List, Optional

import torch

from . import _device
from ._copy import copy_to_device, copy_to_host

MEASURE_STEPS = 2  # the first step warms up kernels and the pool; the last one is used
TOLERANCE = 0.01  # predicted exposed copy time allowed, as a fraction of the step
BACKWARD_CAP = 3.0  # a layer's measured backward time is taken as at most this times its forward


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


def choose(eligible: List[bool], nbytes, fwd, bwd, d2h_bps, h2d_bps, window, allowance: Optional[float] = None):
    """The offload mask: hide copies under compute, or keep at most `allowance` bytes on the device."""
    mask = list(eligible)
    kept = 0
    while True:
        exposed, step = simulate(mask, nbytes, fwd, bwd, d2h_bps, h2d_bps, window)
        if exposed <= TOLERANCE * step:
            return mask, exposed, step
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
            return mask, exposed, step
        mask[best[1]] = False
        kept += nbytes[best[1]]


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

    def seconds(self, a, b) -> float:
        if not self.accel:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def _shape_key(args, kwargs):
    key = []
    for value in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), str(value.dtype)))
    return tuple(key)


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
        handle.wait()
        b = clock.mark()
        back = copy_to_device(handle, device)
        back.wait_stream()
        c = clock.mark()
        _device.synchronize(device)
        out = [nbytes / max(clock.seconds(a, b), 1e-9), nbytes / max(clock.seconds(b, c), 1e-9)]
    return out[0], out[1]


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
        self.records = {}
        self.bandwidth = None

    def current_plan(self):
        return self.plans.get(self.key)

    def before_forward(self, args, kwargs) -> None:
        key = _shape_key(args, kwargs)
        if self.measuring is not None and self.engine._backward_seen:
            measured_key, steps = self.measuring
            steps += 1
            if steps >= MEASURE_STEPS:
                self.plans[measured_key] = self._plan(measured_key)
                self.measuring = None
            else:
                self.measuring = (measured_key, steps)
        self.key = key
        handle = self.handle
        if key in self.plans:
            handle._offload = list(self.plans[key]["mask"])
            self.engine.observer = None
            return
        if self.measuring is None or self.measuring[0] != key:
            self.measuring = (key, 0)
        handle._offload = [not k for k in handle._keep]
        self.engine.observer = self
        self.records = {}
        if self.engine.on_accel:
            _device.reset_peak_memory_stats(self.engine.device)

    # ---- observer
    def opened(self, group) -> None:
        self.records.setdefault(group.layer, {})["open"] = self.clock.mark()

    def closed(self, group) -> None:
        record = self.records.setdefault(group.layer, {})
        record["close"] = self.clock.mark()
        record["bytes"] = group.nbytes

    def unpacked(self, group) -> None:
        record = self.records.setdefault(group.layer, {})
        record.setdefault("unpack", self.clock.mark())

    # ---- planning
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
        for i in range(1, n):
            if i in first_unpack and i - 1 in first_unpack:
                bwd[i] = max(0.0, self.clock.seconds(first_unpack[i], first_unpack[i - 1]))
        # While measuring, backward waits for copies that everything-offloaded could not hide,
        # and that wait lands between two groups' first unpacks: cap at 3x forward (a layer's
        # backward is about 2x its forward, 3x with recomputation) so the plan does not count
        # exposed copy time as compute to hide copies under.
        bwd = [min(b, BACKWARD_CAP * f) if b is not None and f > 0 else b for b, f in zip(bwd, fwd)]
        ratios = [b / f for b, f in zip(bwd, fwd) if b is not None and f > 0]
        ratio = sorted(ratios)[len(ratios) // 2] if ratios else 2.0
        bwd = [b if b is not None else ratio * f for b, f in zip(bwd, fwd)]
        stats = self.engine.stats()
        d2h = stats["d2h_gbps"] * 1e9 if stats["d2h_gbps"] else None
        h2d = stats["h2d_gbps"] * 1e9 if stats["h2d_gbps"] else None
        if d2h is None or h2d is None:
            if self.bandwidth is None:
                self.bandwidth = probe_bandwidth(self.engine.device)
            d2h, h2d = d2h or self.bandwidth[0], h2d or self.bandwidth[1]
        eligible = [not k for k in handle._keep]
        allowance = None
        peak = stats["peak_device_bytes"]
        if self.budget is not None:
            allowance = max(0, self.budget - peak)
        mask, exposed, step = choose(eligible, nbytes, fwd, bwd, d2h, h2d, self.engine.resident_groups, allowance)
        eligible_bytes = sum(b for b, e in zip(nbytes, eligible) if e)
        offloaded = sum(b for b, m in zip(nbytes, mask) if m)
        plan = {
            "input_shapes": [list(shape) for shape, _ in key],
            "mask": mask,
            "offload": [name for name, m in zip(handle.layers, mask) if m],
            "offloaded_bytes": offloaded,
            "eligible_bytes": eligible_bytes,
            "hideable_bytes": min(eligible_bytes, int(sum(fwd) * d2h)),
            "layer_bytes": nbytes,
            "forward_ms": [f * 1e3 for f in fwd],
            "backward_ms": [b * 1e3 for b in bwd],
            "d2h_gbps": d2h / 1e9,
            "h2d_gbps": h2d / 1e9,
            "predicted_exposed_ms": exposed * 1e3,
            "predicted_step_ms": step * 1e3,
            "budget_bytes": self.budget,
            "measured_peak_bytes": peak,
        }
        if self.budget is not None and peak + (eligible_bytes - offloaded) > self.budget and any(
            e and not m for e, m in zip(eligible, mask)
        ):
            plan["budget_met"] = False
        elif self.budget is not None:
            plan["budget_met"] = peak + (eligible_bytes - offloaded) <= self.budget
        if self.verbose:
            print(
                f"offload.activation auto plan for inputs {plan['input_shapes']}: offload {len(plan['offload'])} "
                f"of {n} layers ({offloaded / 2**20:.1f} of {eligible_bytes / 2**20:.1f} MiB eligible), "
                f"predicted exposed copy time {plan['predicted_exposed_ms']:.2f} ms of a "
                f"{plan['predicted_step_ms']:.2f} ms step at {plan['d2h_gbps']:.1f}/{plan['h2d_gbps']:.1f} GB/s",
                flush=True,
            )
        return plan
