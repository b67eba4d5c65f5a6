"""Auto mode's plan for a memory budget, as pure functions of per-layer measurements.

Each layer is kept (its saved tensors stay on the device), offloaded (its saved tensors go to
the host and come back ahead of its backward, at planned points) or recomputed (its
forward runs under a non-reentrant checkpoint: only its inputs are saved, and they are
offloaded like any other group; backward runs its forward again). `predict` replays one step
of a plan on a timeline of the layers' measured times and the bus's rates and gives its step
time and its peak; `plan` picks, among the plans that fit the budget, the one of least
predicted step time, or says the budget cannot be met and what least peak can. Nothing here
touches a device.

Note [budget plan search]: three choices per layer make 3^n plans; the search evaluates the
families a person would write by hand, "offload the first a eligible layers and recompute the
next b" and "recompute the first b and offload the next a" for every a and b (so "checkpoint
the first k layers" and "offload the first k layers" are among them and the plan is never
predicted slower than either at the same budget), then improves the best of them one layer
at a time while a change lowers the predicted step and still fits. Offloading earliest layers
first is what the bus favours: their memory is freed longest and backward needs them last,
with the most time to bring them back.

Note [recomputed inputs kept]: the model takes a recomputed layer's input copy as free when
the bus hides it, but each copied group also costs hooks, events and a fetch that the layer's
recomputation must wait for in backward, none of which it sees, and what such a copy saves is
one layer's inputs. So once a plan is chosen, its recomputed layers keep their inputs on the
device while the predicted peak still fits, the latest layers first: their copies come back
earliest in backward, with the least compute to hide behind. A plan then differs from
hand-written checkpointing only where the budget needs it to.

Note [memory beside the activations]: the allocator's peak is more than the groups' saved
bytes: a layer's forward holds its working tensors, the head's backward its logits' gradient, a
layer's backward the gradients it computes (of its inputs, its intermediates and, where the
optimizer frees them between steps, its parameters). These are measured in the measuring step,
stretch by stretch (each layer's forward, the head and loss with their backward, each layer's
backward), as the allocator's peak there less the activations the replay of that step's plan
holds there and less what the step held as it started (parameters, optimizer state): a layer's
`forward_extra_bytes` and `backward_extra_bytes`, and the tail's bytes. Every plan's replay adds
them at the same stretch, so a plan whose peak falls in a recomputed layer's backward is not
predicted below the one whose peak falls as backward starts for want of the backward's own
working memory, nor the other way round. One fixed excess over the whole step would count
whichever stretch held the measured peak at every other.

Note [budget points]: a budget plan runs at points planned from its replay, as auto mode's
schedule without a budget does (Note [planned release points] in schedule.py): each copied
group is let go as the first layer opens after its copy is planned complete, the compute
stream waiting for it there, and comes back when backward reaches the latest layer whose
backward hides the copy. In the resident window the host lets a group go only when the
window is full (it seldom sees a copy complete, running ahead of the device), the last groups
of a forward stay on the device through backward's start, and the first group needed from the
host comes back as backward starts, however much backward of kept layers lies before it: with
a window of two, offloading k layers lowers the peak as backward starts by only k - 2.

Note [stable plans]: measured times move by a few percent from run to run; two plans whose
predicted steps differ by less than that would otherwise be chosen at random. Among the plans
that fit and are predicted within `TIE_TOLERANCE` of the fastest, the simplest is chosen:
fewest layers recomputed, then fewest offloaded, then the earliest layers. A budget above the
step's peak without offload therefore keeps every layer, and small changes of the measured
times keep the same plan.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import List, Optional, Sequence

from .schedule import COPY_MARGIN, FETCH_MARGIN

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"
# Plans predicted within this share of the fastest one are taken as equally fast (Note [stable plans]).
TIE_TOLERANCE = 0.005
# Rounds of one-layer changes after the families, at most (each round changes one layer).
MAX_ROUNDS_PER_LAYER = 2
# Strides of the offloaded layers the search tries (Note [budget plan search]): 1 is a run of
# layers; copies queue on one stream, so where a copy is longer than a layer's forward, spacing
# the offloaded layers leaves each one more compute to hide under.
OFFLOAD_STRIDES = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What a layer costs, measured in a step that runs it without checkpointing.

    saved_bytes: bytes its group saves for backward; input_bytes: what a checkpoint of it
    saves instead (its tensor inputs); forward_s, backward_s: its times (backward_s includes
    the recomputation where the user checkpoints it already); eligible: it may be offloaded
    (keep_first / keep_last layers may not, but may be recomputed); checkpointed: the user checkpoints it
    already, so it is recomputed whatever the plan and `full_bytes` (what its recomputation
    saves, when known) stands for its saved bytes during its backward.
    """

    saved_bytes: int
    input_bytes: int
    forward_s: float
    backward_s: float
    eligible: bool = True
    checkpointed: bool = False
    full_bytes: Optional[int] = None
    # Bytes its forward and its backward hold besides the saved groups (Note [memory beside the activations]).
    forward_extra_bytes: int = 0
    backward_extra_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Bus:
    """Copy rates under compute (bytes/s) and the resident window (groups on the device at once)."""

    d2h_bps: float
    h2d_bps: float
    window: int = 2


@dataclasses.dataclass
class Prediction:
    """A plan (one kind a layer) and its predicted step: seconds, peak bytes (fixed bytes
    included), the part of the step spent waiting for copies, and the recomputation's share."""

    kinds: List[str]
    step_s: float
    peak_bytes: int
    exposed_s: float
    recompute_s: float
    # Per layer: a recomputed layer whose inputs stay on the device (Note [recomputed inputs kept]).
    inputs_kept: List[bool] = dataclasses.field(default_factory=list)
    # The saved groups' bytes on the device (no fixed or extra bytes): during each layer's
    # forward, as backward starts, and during each layer's backward.
    forward_bytes: List[int] = dataclasses.field(default_factory=list)
    start_bytes: int = 0
    backward_bytes: List[int] = dataclasses.field(default_factory=list)
    # At planned points (Note [budget points]): layer -> the point its group is let go at (a
    # layer's open, n: the last layer's end), layer -> the layers fetched when backward reaches
    # it, and the layers fetched as backward starts.
    release_at: dict = dataclasses.field(default_factory=dict)
    fetch_at: dict = dataclasses.field(default_factory=dict)
    fetch_at_start: List[int] = dataclasses.field(default_factory=list)

    def fits(self, budget: Optional[int]) -> bool:
        return budget is None or self.peak_bytes <= budget


@dataclasses.dataclass
class BudgetPlan:
    """`plan`'s answer: the chosen prediction, whether it meets the budget, the least peak any
    plan reaches (what the budget must be at least), and, where the chosen plan offloads, the
    fastest plan that fits without offloading (its measured rival, Note [measured rival] in
    budget_plan.py)."""

    chosen: Prediction
    feasible: bool
    least_peak_bytes: int
    candidates: int
    without_offload: Optional[Prediction] = None


def allowed(cost: LayerCost) -> Sequence[str]:
    """The kinds a layer may take: a layer the user checkpoints is recomputed in any plan; one
    that may not be offloaded (keep_first, keep_last) may still be recomputed, its inputs kept on
    the device (`_copied`): full checkpointing recomputes the last layer too, and a plan that
    could not would hold that layer's activations above checkpointing's peak."""
    if cost.checkpointed:
        return (RECOMPUTE,)
    if not cost.eligible:
        return (KEEP, RECOMPUTE)
    return (KEEP, OFFLOAD, RECOMPUTE)


def _held(kind: str, cost: LayerCost) -> int:
    """Bytes the layer's group holds on the device after its forward, unless copied out."""
    return cost.input_bytes if kind == RECOMPUTE else cost.saved_bytes


def _copied(kind: str, cost: LayerCost) -> int:
    return _held(kind, cost) if cost.eligible and kind != KEEP else 0


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """A step as the budget model replays it: what each layer costs, the bus, and what the step
    holds and takes besides the layers."""

    costs: Sequence[LayerCost]  # per layer
    bus: Bus
    fixed_bytes: int = 0  # held throughout the step: parameters, gradients, optimizer state
    tail_s: float = 0.0  # from the last layer's end to the last layer's backward (head, loss)
    tail_bytes: int = 0  # what the head and the loss hold on top of the layers as backward starts


def predict(kinds: Sequence[str], step: StepCosts, inputs_kept: Sequence[bool] = (),
            window: bool = False) -> Prediction:
    """Replay one step of the plan `kinds` (one per layer) at its planned points (Note [budget
    points]), or with `window` as the engine's resident window runs it (the measuring step), on `step`'s
    costs, bus and fixed and tail figures; a
    recomputed layer flagged in `inputs_kept` holds its inputs on the device instead of copying them.

    Forward: layer i runs `forward_s` after layer i-1; a copied group's copy starts when its
    layer ends (or when the copy before it ends) and takes its bytes over `d2h_bps`. At planned
    points a group is let go as the first layer opens after its copy is planned complete
    (`COPY_MARGIN` longer), at the latest as the last layer ends, where the compute stream
    waits for copies still running. In the window a group is let go when a later group's copy
    starts with `window` groups in it, the compute stream waiting for its copy if not complete
    (the host, running ahead of the device, seldom sees a copy complete sooner), and the groups
    still in it as backward starts are served from the device. Memory during layer i: the
    groups kept on the device, those not let go, and what layer i saves (its inputs only when
    recomputed).

    Backward: at planned points each group is fetched when backward reaches the latest layer
    whose backward, with those after it, hides its copy (`FETCH_MARGIN` longer), or as backward
    starts; in the window the first group needed from the host is fetched as backward starts
    and each other one when the group after it starts its backward. What is fetched as backward
    starts (at the model output's gradient) is on the device during the head's backward: the
    head and the loss hold `tail_bytes` on top of it, `tail_s` from the last layer's end to the
    last layer's backward. A layer's backward waits for its group, takes `backward_s` (plus
    `forward_s` when recomputed by the plan) and holds, while it runs, what it saved (again,
    when recomputed) besides the groups held and fetched. Each layer's forward and backward
    add its extra bytes (Note [memory beside the activations]). Peak: the largest of those
    sums, plus `fixed_bytes` (what the step holds throughout: parameters, gradients,
    optimizer state).
    """
    replay = _Replay.start(kinds, step, inputs_kept, window)
    _replay_forward(replay)
    _forward_ends(replay)
    _fetch_points(replay)
    start_bytes = _replay_backward(replay)
    r, n = replay, len(step.costs)
    return Prediction(list(kinds), r.t, int(r.peak + step.fixed_bytes), r.exposed, r.recompute,
                      [r.kept[i] and kinds[i] == RECOMPUTE for i in range(n)], r.forward_bytes, start_bytes,
                      r.backward_bytes, r.release_at, r.fetch_at, r.fetch_at_start)


@dataclasses.dataclass
class _Replay:
    """`predict`'s replay of one step as it goes: the clock, the memory, the groups' state."""

    kinds: Sequence[str]
    step: StepCosts
    window: bool  # as the resident window runs it, else at planned points
    held: List[int]  # per layer: bytes its group holds on the device after its forward, unless copied out
    copied: List[int]  # per layer: bytes its group copies out (0: none)
    recomputed: List[bool]  # per layer: recomputed by the plan (not the user's checkpoint)
    kept: List[bool]  # per layer: inputs_kept
    forward_bytes: List[int]  # per layer: the groups' bytes on the device during its forward
    backward_bytes: List[int]  # per layer: the same during its backward
    t: float = 0.0  # seconds into the step
    exposed: float = 0.0  # seconds waiting for copies
    recompute: float = 0.0  # seconds recomputing
    peak: int = 0  # the most bytes seen so far (fixed bytes not included)
    on_device: int = 0  # bytes of groups not copied out (kept, recomputed with their inputs kept)
    memory: int = 0  # bytes of groups on the device in backward
    d2h_free: float = 0.0  # when the device-to-host stream is free
    h2d_free: float = 0.0  # when the host-to-device stream is free
    # (copy end, planned end, layer) of groups not let go
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    release_at: dict = dataclasses.field(default_factory=dict)
    resident: set = dataclasses.field(default_factory=set)  # in the window as backward starts: served from the device
    fetch_at: dict = dataclasses.field(default_factory=dict)
    fetch_at_start: List[int] = dataclasses.field(default_factory=list)
    ready: dict = dataclasses.field(default_factory=dict)  # layer -> when its group is back

    @classmethod
    def start(cls, kinds, step: StepCosts, inputs_kept, window: bool) -> "_Replay":
        costs = step.costs
        n = len(costs)
        kept = list(inputs_kept) or [False] * n
        return cls(kinds, step, window, held=[_held(k, c) for k, c in zip(kinds, costs)],
                   copied=[0 if kept[i] and k == RECOMPUTE else _copied(k, c)
                           for i, (k, c) in enumerate(zip(kinds, costs))],
                   recomputed=[k == RECOMPUTE and not c.checkpointed for k, c in zip(kinds, costs)],
                   kept=kept, forward_bytes=[0] * n, backward_bytes=[0] * n)

    def fetch(self, groups, now) -> None:
        """Copy `groups` back from `now` on (those not fetched yet), one after the other."""
        for g in groups:
            if g not in self.ready:
                self.ready[g] = self.h2d_free = max(now, self.h2d_free) + self.copied[g] / self.step.bus.h2d_bps
                self.memory += self.copied[g]


def _replay_forward(r: _Replay) -> None:
    """The layers' forwards: each group's copy out, and where it is let go (`predict`)."""
    bus, copied, pending = r.step.bus, r.copied, r.pending
    for i, (kind, cost) in enumerate(zip(r.kinds, r.step.costs)):
        while not r.window and pending and pending[0][1] <= r.t:  # point i: layer i opens
            r.release_at[pending.popleft()[2]] = i
        during = cost.input_bytes if kind == RECOMPUTE else cost.saved_bytes
        r.forward_bytes[i] = r.on_device + sum(copied[j] for *_, j in pending) + during
        r.peak = max(r.peak, r.forward_bytes[i] + cost.forward_extra_bytes)
        r.t += cost.forward_s
        if not copied[i]:
            r.on_device += r.held[i]
            continue
        start = max(r.t, r.d2h_free)
        r.d2h_free = start + copied[i] / bus.d2h_bps
        pending.append((r.d2h_free, start + copied[i] / bus.d2h_bps * (1 + COPY_MARGIN), i))
        while r.window and len(pending) > bus.window - 1:
            end_oldest = pending.popleft()[0]
            if end_oldest > r.t:
                r.exposed += end_oldest - r.t
                r.t = end_oldest


def _forward_ends(r: _Replay) -> None:
    """The last layer ends: the groups still in the window stay (`window`), or every copy is
    waited for at point n; what the device holds as backward starts."""
    n = len(r.step.costs)
    if r.window:
        r.resident = {j for *_, j in r.pending}
    else:
        for end, _, j in r.pending:  # point n: the last layer ends
            r.release_at[j] = n
            if end > r.t:
                r.exposed += end - r.t
                r.t = end
    r.memory = r.on_device + sum(r.copied[j] for j in r.resident)


def _fetch_points(r: _Replay) -> None:
    """Where backward fetches each group on the host back: in the window, each as the group after
    it starts its backward; at planned points, the latest layer whose backward hides its copy."""
    costs, n = r.step.costs, len(r.step.costs)
    chosen = [i for i in range(n) if r.copied[i] and i not in r.resident]
    if r.window:
        previous = {b: a for a, b in zip(chosen, chosen[1:])}
        if chosen and len(r.resident) < r.step.bus.window:
            r.fetch_at_start.append(chosen[-1])
        for later, earlier in previous.items():
            r.fetch_at.setdefault(later, []).append(earlier)
        return
    # When each layer's backward starts, copies back waiting for none.
    starts, s = [0.0] * n, r.t + r.step.tail_s
    for j in reversed(range(n)):
        starts[j] = s
        s += costs[j].backward_s + (costs[j].forward_s if r.recomputed[j] else 0.0)
    for g in reversed(chosen):
        need = r.copied[g] / r.step.bus.h2d_bps * (1 + FETCH_MARGIN)
        at = next((j for j in range(g + 1, n) if starts[g] - starts[j] >= need), None)
        (r.fetch_at_start if at is None else r.fetch_at.setdefault(at, [])).append(g)


def _replay_backward(r: _Replay) -> int:
    """The head's backward and the layers': each waits for its group; the bytes on the device as
    backward starts (`predict`)."""
    step = r.step
    r.h2d_free = r.t + step.tail_s
    r.fetch(r.fetch_at_start, r.t + step.tail_s)
    start_bytes = r.memory
    r.peak = max(r.peak, r.memory + step.tail_bytes)
    r.t += step.tail_s
    for i in reversed(range(len(step.costs))):
        kind, cost = r.kinds[i], step.costs[i]
        if not r.window:  # at the gradient of layer i's output
            r.fetch(r.fetch_at.get(i, ()), r.t)
        if r.copied[i] and i not in r.resident:
            r.fetch([i], r.t)
            if r.ready[i] > r.t:
                r.exposed += r.ready[i] - r.t
                r.t = r.ready[i]
        if r.window:  # at layer i's first unpack
            r.fetch(r.fetch_at.get(i, ()), r.t)
        extra = 0
        if kind == RECOMPUTE:
            extra = cost.full_bytes if cost.checkpointed and cost.full_bytes is not None else cost.saved_bytes
        r.backward_bytes[i] = r.memory + extra
        r.peak = max(r.peak, r.backward_bytes[i] + cost.backward_extra_bytes)
        r.t += cost.backward_s
        if r.recomputed[i]:
            r.t += cost.forward_s
            r.recompute += cost.forward_s
        r.memory -= r.held[i]
    return start_bytes


def fixed_bytes(measured_peak: int, kinds: Sequence[str], costs: Sequence[LayerCost], bus: Bus,
                tail_bytes: int = 0) -> int:
    """What a step holds besides the layers' saved activations: the measured step's peak less
    the activation peak `predict` gives for the plan it ran in the resident window (0 where the
    device keeps no memory statistics)."""
    if measured_peak <= 0:
        return 0
    ran = predict(kinds, StepCosts(costs, bus, tail_bytes=tail_bytes), window=True)
    return max(0, measured_peak - ran.peak_bytes)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The allocator's peaks in the measuring step, stretch by stretch (bytes; 0: not measured).

    step_peak: the whole step's; at_start: what it held as it started; forward: per layer, from
    its start to the next layer's (the first layer's from the step's start); tail: from the last
    layer's end to backward's first unpack of it (the head, the loss and their backward);
    backward: per layer, from its first unpack to the next layer's in backward (the first
    layer's to the step's end, the optimizer's step included).
    """

    step_peak: int
    at_start: int = 0
    forward: Sequence[int] = ()
    tail: int = 0
    backward: Sequence[int] = ()


def calibrate(kinds: Sequence[str], costs: Sequence[LayerCost], bus: Bus, memory: StepMemory,
              tail_bytes: int = 0):
    """(costs with their extra bytes, fixed bytes, tail bytes) from the measuring step that ran
    `kinds` in the resident window (Note [memory beside the activations]).

    A stretch's extra is its measured peak less the groups the replay holds there and less
    `at_start` (never below 0); a stretch not measured takes the largest measured of its kind.
    Where no stretch is measured, every layer's extras are 0 and the fixed bytes are the whole
    step's excess (`fixed_bytes`), `tail_bytes` as given. The fixed bytes then cover what the
    stretches do not, so the replay of `kinds` peaks where the step did.
    """
    n = len(costs)
    costs = [dataclasses.replace(c, forward_extra_bytes=0, backward_extra_bytes=0) for c in costs]
    ran = predict(kinds, StepCosts(costs, bus), window=True)

    def extras(peaks, held):
        peaks = list(peaks) + [0] * (n - len(peaks))
        measured = [max(0, p - h - memory.at_start) if p > 0 else None for p, h in zip(peaks, held)]
        known = [e for e in measured if e is not None]
        return [e if e is not None else max(known, default=0) for e in measured], bool(known)

    forward, seen_forward = extras(memory.forward, ran.forward_bytes)
    backward, seen_backward = extras(memory.backward, ran.backward_bytes)
    if not (seen_forward or seen_backward or memory.tail > 0):
        return costs, fixed_bytes(memory.step_peak, kinds, costs, bus, tail_bytes), tail_bytes
    if memory.tail > 0:
        tail_bytes = max(0, memory.tail - ran.start_bytes - memory.at_start)
    costs = [dataclasses.replace(c, forward_extra_bytes=f, backward_extra_bytes=b)
             for c, f, b in zip(costs, forward, backward)]
    fixed = memory.at_start
    ran = predict(kinds, StepCosts(costs, bus, fixed, tail_bytes=tail_bytes), window=True)
    fixed += max(0, memory.step_peak - ran.peak_bytes)
    return costs, fixed, tail_bytes


def _families(costs: Sequence[LayerCost]):
    """Plans of the hand-written kind: offload eligible layers (a run of them, or every s-th one,
    which leaves each copy more layers' compute to hide under) and recompute the earliest of the
    others, either after or before the offloaded ones (Note [budget plan search])."""
    base = [allowed(c)[0] for c in costs]
    free = [i for i, c in enumerate(costs) if len(allowed(c)) > 1]
    offloadable = [i for i in free if OFFLOAD in allowed(costs[i])]
    m = len(free)

    def make(offloaded, recomputed):
        kinds = list(base)
        for i in offloaded:
            kinds[i] = OFFLOAD
        for i in recomputed:
            kinds[i] = RECOMPUTE
        return kinds

    for stride in OFFLOAD_STRIDES:
        for b in range(m + 1):
            # Recompute the first b, offload every stride-th of the rest that may be offloaded.
            rest = [i for i in free[b:] if i in offloadable][::stride]
            for a in range(len(rest) + 1):
                yield make(rest[:a], free[:b])
        for a in range(1, len(offloadable[::stride]) + 1):
            # Offload every stride-th from the first, recompute the earliest b of the others.
            offloaded = offloadable[::stride][:a]
            others = [i for i in free if i not in offloaded]
            for b in range(1, len(others) + 1):
                yield make(offloaded, others[:b])


def _simplicity(p: Prediction):
    """Order among equally fast plans (Note [stable plans])."""
    return (p.kinds.count(RECOMPUTE), p.kinds.count(OFFLOAD),
            [(k != KEEP, k == RECOMPUTE) for k in reversed(p.kinds)])


def _pick(predictions, budget):
    fitting = [p for p in predictions if p.fits(budget)]
    if not fitting:
        return None
    fastest = min(p.step_s for p in fitting)
    return min((p for p in fitting if p.step_s <= fastest * (1 + TIE_TOLERANCE)), key=_simplicity)


def plan(costs: Sequence[LayerCost], bus: Bus, budget: Optional[int], fixed: int = 0,
         tail_s: float = 0.0, tail_bytes: int = 0) -> BudgetPlan:
    """The plan of least predicted step time whose predicted peak fits `budget` (bytes, the
    whole device memory of the step, `fixed` included), or, if none does, the plan of least
    predicted peak with `feasible` False (Note [budget plan search], Note [stable plans])."""
    seen = {}
    step = StepCosts(costs, bus, fixed, tail_s, tail_bytes)

    def evaluate(kinds):
        key = tuple(kinds)
        if key not in seen:
            seen[key] = predict(kinds, step)
        return seen[key]

    predictions = [evaluate(kinds) for kinds in _families(costs)]
    least = min(predictions, key=lambda p: (p.peak_bytes, p.step_s))
    best = _pick(predictions, budget)
    free = [i for i, c in enumerate(costs) if len(allowed(c)) > 1]
    # One layer at a time: the fastest plan that fits, or while none does the least peak.
    current = best if best is not None else least
    for _ in range(MAX_ROUNDS_PER_LAYER * max(1, len(free))):
        moves = []
        for i in free:
            for kind in allowed(costs[i]):
                if kind != current.kinds[i]:
                    kinds = list(current.kinds)
                    kinds[i] = kind
                    moves.append(evaluate(kinds))
        if best is not None:
            better = _pick([p for p in moves if p.step_s < current.step_s * (1 - 1e-9)], budget)
        else:
            lower = [p for p in moves if p.peak_bytes < current.peak_bytes]
            better = min(lower, key=lambda p: (p.peak_bytes, p.step_s)) if lower else None
            if better is not None and better.fits(budget):
                best = better
        if better is None:
            break
        current = better
    least = min(seen.values(), key=lambda p: (p.peak_bytes, p.step_s))
    if best is None:
        return BudgetPlan(least, False, least.peak_bytes, len(seen))
    chosen = _pick(list(seen.values()), budget)
    rival = None
    if OFFLOAD in chosen.kinds:
        # The families hold "recompute the first b" for every b, so a plan without offload is
        # among those evaluated whenever one fits.
        rival = _pick([p for p in seen.values() if OFFLOAD not in p.kinds], budget)

    return BudgetPlan(_keep_inputs(chosen, step, budget), True, least.peak_bytes, len(seen),
                      rival and _keep_inputs(rival, step, budget))


def _keep_inputs(p: Prediction, step: StepCosts, budget: Optional[int]) -> Prediction:
    """`p` with the inputs of recomputed layers kept on the device where that still fits `budget`
    and is no slower, the latest recomputed layers' first (Note [recomputed inputs kept])."""
    costs = step.costs
    kept = [False] * len(costs)
    for i in reversed(range(len(costs))):
        if p.kinds[i] == RECOMPUTE and _copied(RECOMPUTE, costs[i]):
            kept[i] = True
            trial = predict(p.kinds, step, kept)
            if trial.fits(budget) and trial.step_s <= p.step_s * (1 + 1e-9):
                p = trial
            else:
                kept[i] = False
    return p
