"""Which layers a compiled graph offloads and which the compiler recomputes: pure functions of
what the partitioned graph saves per layer.

A compiled step runs no Python per layer, so auto mode cannot measure it as it measures an
eager step (copy times against layer times). Its plan comes from the graph instead:
- modes 'async' and 'sync', and 'auto' without a budget: every layer not kept
  (keep_first/keep_last) is offloaded, as the eager modes start;
- 'auto' with `memory_budget_bytes`: as few layers as meet the budget, earliest first (the
  eager budget plan's order: an early layer's copy has the most compute to hide under);
  where offloading every layer that may go is not enough, layers are recomputed, earliest
  first, by the compiler's own rematerialization (Note [compiled recompute] in partitioner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence


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
