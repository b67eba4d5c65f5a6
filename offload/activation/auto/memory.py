"""Auto mode and the device's memory: a measured step's memory read stretch by stretch
(`StretchPeaks`), and the allocator's cached blocks given back as a shape's plan settles
(`fresh_segments`).

The stretches are each layer's forward (the first one's from the step's start), the head and
the loss with their backward (from the last layer's end to backward's first unpack of it), and
each layer's backward (from its first unpack to the next layer's; the first layer's to the
step's end). At each boundary the allocator's peak so far is that stretch's, and the peak starts
again from what is allocated then. The budget model adds each where it was measured (Note
[memory beside the activations] in budget.py); without a budget only the step's peak is kept,
and the allocator's peak is never reset.
"""

from __future__ import annotations

import gc

from ...core import _device
from ...core.copy import release_finished_copies

# Note [fresh segments]: the steps before a plan settles (measuring with every layer offloaded,
# probes, a budget plan's checks and its rival) leave the device allocator's cache cut into
# blocks sized for those plans, and the settled plan's own allocations then split and merge
# them every step: the same plan runs measurably slower than when started on a fresh cache. So
# the cached blocks are given back once, as a shape's plan settles (the next step's first
# allocations go to the driver again, as in any first step). Garbage is collected first, and
# the core lets go of the sources of the last copies (held until a later copy sees them done:
# a plan that offloads nothing makes none, and would hold a layer's activations for good):
# blocks still held would otherwise stay as segments of their own and cut up the new ones the
# same way.

KINDS = ("forward", "tail", "backward")


class StretchPeaks:
    """The peaks of one measured step. The planner calls `start` as the step starts (after the
    allocator's peak is reset), `end` at each boundary with the stretch that begins there
    (`(kind, layer)`; None: the step's end)."""

    def __init__(self, device, by_stretch: bool):
        self.device = device
        self.by_stretch = by_stretch
        self.step_peak = 0
        self.at_start = 0  # what the step held as it started: parameters, optimizer state, ...
        self.running = None  # the stretch running: (kind, layer)
        self.peaks: dict = {kind: {} for kind in KINDS}  # kind -> layer -> the allocator's peak there

    def start(self) -> None:
        self.at_start = _device.memory_allocated(self.device)
        self.step_peak = 0
        self.running = ("start", None)  # until the first layer opens, then part of its forward's
        self.peaks = {kind: {} for kind in KINDS}

    def layer_opened(self, layer: int) -> None:
        """A layer's forward begins (what ran before the first layer counts as its forward's)."""
        if self.running == ("start", None):
            self.running = ("forward", layer)
        else:
            self.end(("forward", layer))

    def end(self, following) -> None:
        """The allocator's peak since the running stretch began is that stretch's; `following` begins."""
        peak = _device.max_memory_allocated(self.device)
        self.step_peak = max(self.step_peak, peak)
        if not self.by_stretch:
            return
        ended, self.running = self.running, following
        if ended is not None and ended[1] is not None:
            peaks = self.peaks[ended[0]]
            peaks[ended[1]] = max(peaks.get(ended[1], 0), peak)
        _device.reset_peak_memory_stats(self.device)  # none off an accelerator

    def so_far(self) -> int:
        """The step's peak until now."""
        return max(self.step_peak, _device.max_memory_allocated(self.device))

    def per_layer(self, n: int) -> dict:
        """`<kind>_peaks`: per layer of `n`, the peak of its stretch of that kind (0: not measured)."""
        return {f"{kind}_peaks": [peaks.get(i, 0) for i in range(n)] for kind, peaks in self.peaks.items()}


def fresh_segments(engine) -> None:
    """A shape's plan settled: give the allocator's cached blocks back (Note [fresh segments])."""
    if engine.on_accel:
        gc.collect()
        _device.synchronize(engine.device)
        release_finished_copies()
    _device.empty_cache()
