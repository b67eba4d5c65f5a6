"""Auto mode across the ranks of a process group: what a plan is made from, and the timed steps
it is judged by, made the same on every rank.

Note [ranks agree]: under FSDP or DDP a step ends when the slowest rank's collectives do, so a
copy one rank does not hide stalls every rank at the next collective. Planned per rank, from
each rank's own measurements, the ranks would settle on different plans (their layer times and
bus rates differ by a few percent, and so do the probes' verdicts near the tolerance); a rank
then pays for the layers its peers offload, and probes whose offloading steps fall in different
steps on different ranks time each other's costs. Every decision auto mode makes is a pure
function of its measurements (schedule.py, budget.py, search.py), so agreeing on the
measurements agrees on the decisions: at each point where the planner decides, the ranks
exchange what they measured and combine it alike: bytes and peaks the largest, times and bus
rates the smallest (a plan whose copies hide under the shortest compute at the slowest bus
hides on every rank), step times the slowest rank's (the step a collective makes every rank
wait for), and what has no order (where in a layer its bytes are saved) rank 0's.

The exchange is collective, so every rank of the group must reach each decision point: the
ranks run the same input shapes in the same order, as FSDP's do. A rank that arrives with
another shape, or at another point, makes every rank raise, naming both.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist


class Ranks:
    """The ranks auto mode plans with: one alone (`group` None), or a process group's."""

    def __init__(self, group=None):
        self.group = group
        self.many = group is not None and dist.get_world_size(group) > 1
        self.first = not self.many or dist.get_rank(group) == 0  # the rank that reports the agreed plan

    def agree(self, key, point: str, values: dict, largest: Sequence[str] = (), smallest: Sequence[str] = ()) -> dict:
        """`values` (name -> a number, None, or a list or tuple of them) as every rank combines
        them: the names in `largest` and `smallest` element by element (None where no rank has
        a value), every other name rank 0's. One rank alone: `values` as they are."""
        if not self.many:
            return dict(values)
        mine = (repr(key), point, values)
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        if any(other[:2] != mine[:2] for other in everyone):
            seen = "; ".join(f"rank {r}: {other[1]} for inputs {other[0]}" for r, other in enumerate(everyone))
            raise RuntimeError(
                "offload.activation auto (process_group): the ranks reached different points of the plan "
                f"({seen}). With a process_group every rank must run the same input shapes in the same "
                "order; run auto mode without process_group where they differ")
        per_rank = [other[2] for other in everyone]
        out = dict(per_rank[0])
        for names, pick in ((largest, max), (smallest, min)):
            for name in names:
                out[name] = _each(pick, [r[name] for r in per_rank], name)
        return out


def _each(pick, values: list, name: str):
    """`pick` over the ranks' `values` of one name, element by element through lists and tuples."""
    first = values[0]
    if isinstance(first, (list, tuple)):
        if any(not isinstance(v, (list, tuple)) or len(v) != len(first) for v in values):
            raise RuntimeError(f"offload.activation auto (process_group): the ranks measured {name} of different "
                               f"lengths ({[len(v) if isinstance(v, (list, tuple)) else v for v in values]}); "
                               "every rank must run the same model")
        return type(first)(_each(pick, [v[i] for v in values], name) for i in range(len(first)))
    present = [v for v in values if v is not None]
    return pick(present) if present else None


def largest_flag(ranks: Ranks, key, point: str, flag: bool) -> bool:
    """True if any rank's `flag` is."""
    return bool(ranks.agree(key, point, {"flag": int(flag)}, largest=("flag",))["flag"])


def smallest_value(ranks: Ranks, key, point: str, value: Optional[float]) -> Optional[float]:
    """The smallest of the ranks' `value`s (None where none has one)."""
    return ranks.agree(key, point, {"value": value}, smallest=("value",))["value"]
