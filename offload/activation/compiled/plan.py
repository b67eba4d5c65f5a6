"""Which layers a compiled graph offloads and which the compiler recomputes: pure functions of
what the partitioned graph saves per layer.

A compiled step runs no Python per layer, so auto mode cannot measure it as it measures an
eager step (copy times against layer times). Its plan comes from the graph instead:
- modes 'async' and 'sync': every layer not kept (keep_first/keep_last) is offloaded;
- 'auto' without a budget: the earliest layers whose copies hide under compute
  (`hidden_plan`), on a model of the compiled step as the rewrite places its ops
  (`step_estimate`: copies out in order, release points, fetches one group ahead) fed by each
  layer's estimated compute and the measured bus (costs.py);
- 'auto' with `memory_budget_bytes`: as few layers as meet the budget, earliest first (the
  eager budget plan's order: an early layer's copy has the most compute to hide under);
  where offloading every layer that may go is not enough, layers are recomputed, earliest
  first, by the compiler's own rematerialization (Note [compiled recompute] in partitioner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from ..auto.schedule import COPY_MARGIN, EXPOSED_TOLERANCE, FETCH_MARGIN


@dataclass(frozen=True)
class SavedBytes:
    """What the partitioned forward saves for backward, in bytes: per layer (what the plan may
    offload) and the rest (graph inputs, tensors outside the layers, small tensors)."""

    per_layer: Sequence[int]
    other: int


@dataclass
class CompiledPlan:
    """Per layer: offloaded, recomputed; and the estimate the plan was made against."""

    offload: List[bool]
    recompute: List[bool]
    device_bytes: Optional[int] = None  # estimated activation bytes left on the device at backward's start
    budget: Optional[int] = None
    notes: List[str] = field(default_factory=list)
    # Per offloaded layer, the layer after whose end its group is let go (None: the forward's end);
    # None for the resident window's release points.
    release_after: Optional[Dict[int, Optional[int]]] = None
    # The layer whose backward's start issues the first group's copy back (None: backward's start).
    first_fetch_at: Optional[int] = None

    def to_dict(self) -> dict:
        return {"offload": list(self.offload), "recompute": list(self.recompute), "device_bytes": self.device_bytes,
                "budget": self.budget, "notes": list(self.notes)}


def static_plan(keep: Sequence[bool]) -> CompiledPlan:
    """Every layer not kept is offloaded, none recomputed."""
    return CompiledPlan([not k for k in keep], [False] * len(keep))


def _on_device(saved: SavedBytes, offload: Sequence[bool], recompute: Sequence[bool],
               resident_groups: int) -> List[bool]:
    """Per layer: its saved bytes are on the device when backward starts (kept, or offloaded but
    still inside the resident window: the last `resident_groups - 1` offloaded groups)."""
    offloaded = [i for i, (off, rec) in enumerate(zip(offload, recompute)) if off and not rec]
    window = set(offloaded[len(offloaded) - (resident_groups - 1):]) if resident_groups > 1 else set()
    return [not rec and (not off or i in window) for i, (off, rec) in enumerate(zip(offload, recompute))]


def left_on_device(saved: SavedBytes, offload: Sequence[bool], recompute: Sequence[bool], resident_groups: int) -> int:
    """Activation bytes on the device when backward starts: the rest, plus each layer's bytes
    that `_on_device` finds there."""
    on = _on_device(saved, offload, recompute, resident_groups)
    return saved.other + sum(n for n, here in zip(saved.per_layer, on) if here)


def budget_plan(saved: SavedBytes, keep: Sequence[bool], budget: int, base_bytes: int,
                resident_groups: int) -> CompiledPlan:
    """As few offloaded layers as bring `base_bytes` + the activations left on the device under
    `budget`, earliest first; then, if offloading is not enough, recomputed layers among those
    whose bytes are still on the device (kept, or in the window), earliest first."""
    count = len(saved.per_layer)
    offload, recompute = [False] * count, [False] * count
    plan = CompiledPlan(offload, recompute, budget=budget)

    def fits() -> bool:
        plan.device_bytes = left_on_device(saved, offload, recompute, resident_groups)
        return base_bytes + plan.device_bytes <= budget

    if fits():
        return plan
    for i in range(count):
        if not keep[i] and saved.per_layer[i] > 0:
            offload[i] = True
            if fits():
                return plan
    while True:
        on = _on_device(saved, offload, recompute, resident_groups)
        candidates = [i for i in range(count) if on[i] and saved.per_layer[i] > 0]
        if not candidates:
            break
        recompute[candidates[0]], offload[candidates[0]] = True, False
        if fits():
            plan.notes.append("recomputes layers: offloading every layer that may go does not meet the budget")
            return plan
    plan.notes.append(f"cannot meet the budget: {base_bytes + plan.device_bytes} bytes estimated with the layers "
                      "left on the device recomputed")
    return plan


@dataclass(frozen=True)
class StepCosts:
    """What `step_estimate` models a compiled step from: per layer its saved bytes and its compute
    seconds in forward and backward, the compute outside the layers (the head and loss: after the
    layers in forward, before them in backward), and the bus each way in bytes per second."""

    nbytes: Sequence[int]
    forward: Sequence[float]
    backward: Sequence[float]
    forward_rest: float
    backward_rest: float
    d2h_bps: float
    h2d_bps: float


@dataclass(frozen=True)
class StepEstimate:
    """`step_estimate`'s answer: seconds the compute stream waits for copies, seconds of the step,
    and per offloaded layer the layer after whose end its group is let go (None: the forward's end)."""

    exposed: float
    step: float
    release_after: Dict[int, Optional[int]]
    first_fetch_at: Optional[int] = None  # the layer whose backward's start issues the first copy back


def step_estimate(offload: Sequence[bool], costs: StepCosts) -> StepEstimate:
    """The compiled step under `offload`, as the rewrite places auto mode's ops (rewrite.py, with
    `release_after`). A group's copy out starts when its layer ends, after the copies before it.
    It is let go at the end of the first layer that ends after its copy is done; the rest at the
    forward's end, where the compute stream waits for them. Backward needs group j where layer
    j + 1's backward starts (the last layer's own group: where its own starts); the first group
    backward needs is fetched as late as its copy still ends in time (the start of the latest
    layer's backward that leaves it enough, so that it is not on the device through the
    backward's start, its peak), or as backward starts where none does; each next one as the one
    before it arrives. Copies are taken slower than measured alone, by the auto schedule's
    margins. (Async's resident window, Note [window tail] in rewrite.py, is not modelled: no plan
    is made from it.)"""
    n = len(offload)
    d2h = costs.d2h_bps / (1 + COPY_MARGIN)
    h2d = costs.h2d_bps / (1 + FETCH_MARGIN)
    t = exposed = d2h_free = 0.0
    copying = []  # (layer, when its copy out is done) of the groups not let go yet, in forward order
    release_after: Dict[int, Optional[int]] = {}

    def wait(until: float) -> None:
        nonlocal t, exposed
        if until > t:
            exposed += until - t
            t = until

    for i in range(n):
        t += costs.forward[i]
        if offload[i]:
            d2h_free = max(t, d2h_free) + costs.nbytes[i] / d2h
            copying.append((i, d2h_free))
        while copying and copying[0][1] <= t:  # done by this layer's end: let go here
            release_after[copying.pop(0)[0]] = i
    t += costs.forward_rest
    if copying:
        wait(copying[-1][1])  # the copies end in order: the last one done means all are
        release_after.update((layer, None) for layer, _ in copying)
    needed_at = {i: min(i + 1, n - 1) for i in range(n) if offload[i]}
    order = sorted(needed_at, key=lambda i: (-needed_at[i], -i))
    first_fetch_at = _first_fetch_at(order[0], needed_at, costs, h2d) if order else None
    ready, h2d_free = {}, t
    if order and first_fetch_at is None:  # fetched at backward's start, before the head's backward
        ready[order[0]] = h2d_free = t + costs.nbytes[order[0]] / h2d
    t += costs.backward_rest
    k = 0
    for layer in reversed(range(n)):
        if layer == first_fetch_at:
            ready[order[0]] = h2d_free = t + costs.nbytes[order[0]] / h2d
        while k < len(order) and needed_at[order[k]] == layer:
            wait(ready[order[k]])
            if k + 1 < len(order):
                nxt = order[k + 1]
                ready[nxt] = h2d_free = max(t, h2d_free) + costs.nbytes[nxt] / h2d
            k += 1
        t += costs.backward[layer]
    return StepEstimate(exposed, t, release_after, first_fetch_at)


def _first_fetch_at(first: int, needed_at: Dict[int, int], costs: StepCosts, h2d: float) -> Optional[int]:
    """The latest layer after the one that needs group `first` whose backward, with those between
    them, lasts as long as the group's copy back; None where only backward's start leaves enough."""
    need = costs.nbytes[first] / h2d
    room = 0.0
    for layer in range(needed_at[first] + 1, len(costs.backward)):
        room += costs.backward[layer]
        if room >= need:
            return layer
    return None


def hidden_plan(eligible: Sequence[bool], costs: StepCosts) -> CompiledPlan:
    """Auto mode without a budget: the most eligible layers, earliest first (an early layer's copy has
    the most compute to hide under), whose copies `step_estimate` finds hidden (the compute stream
    waits at most EXPOSED_TOLERANCE of the step for them), each let go where its copy is done."""
    count = len(eligible)
    order = [i for i in range(count) if eligible[i] and costs.nbytes[i] > 0]
    best, estimate = [False] * count, step_estimate([False] * count, costs)
    for k in range(1, len(order) + 1):
        offload = [False] * count
        for i in order[:k]:
            offload[i] = True
        candidate = step_estimate(offload, costs)
        if candidate.exposed <= EXPOSED_TOLERANCE * candidate.step:
            best, estimate = offload, candidate
    plan = CompiledPlan(best, [False] * count, release_after=dict(estimate.release_after),
                        first_fetch_at=estimate.first_fetch_at)
    plan.notes.append(f"estimated: {sum(best)} of {len(order)} layers hide their copies under compute "
                      f"(step {estimate.step * 1e3:.1f} ms, copies exposed {estimate.exposed * 1e3:.2f} ms)")
    return plan
