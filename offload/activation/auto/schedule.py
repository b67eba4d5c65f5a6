"""Auto mode's plan as pure functions of measured layer times and bytes.

`schedule` plans, without a memory budget, which layers' saved tensors the device-to-host
stream copies out before backward starts and at which points each group is let go and
fetched back (see Note [planned release points]); `simulate` and `choose` plan for a memory
budget on a model of the resident window; `StepSearch` (search.py) chooses how many
layers of the schedule's order to keep from measured step times. Nothing here touches a device.

Note [planned release points]: a group's device memory goes back to the allocator when the
compute stream waits, on the device, for the group's copy at a planned point (a layer's
start, the end of the last layer, or backward's start), the copy being planned complete by
then. Host polling could not free memory before the step's peak: the host runs ahead of
the device and sees copies done only later, and the resident window made adjacent layers
stall.

Note [span ends]: a layer's group closes a part, or stops at its byte cap, only between two
new storage spans, and a span is copied whole in the part that saves it; the schedule
therefore counts bytes at the measured span ends, so that what it plans is what the engine
copies.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import List, NamedTuple, Optional, Sequence

# The engine runs what is planned here, so the points and parts it counts in are its own.
from ..forward import SPLIT_PARTS, TAIL_POINT

# Predicted exposed copy time allowed in a budget plan, as a fraction of the predicted step.
EXPOSED_TOLERANCE = 0.01
# A schedule plans each copy this much longer than the measured bandwidth says: a group's
# memory is let go by making the compute stream wait for its copy at a planned point, and a
# copy a little slower than measured must not turn that wait into a stall.
COPY_MARGIN = 0.05
# Copies back are planned this much longer: under backward's compute the host-to-device
# copies run slower than measured alone, and fetching a layer earlier costs memory only
# after backward's peak (its start).
FETCH_MARGIN = 0.3
# A layer offloaded in part offloads at least this share of its bytes (less frees too little
# for the hooks' work and the extra copy).
MIN_PART = 0.125


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
      copied in parts: a point per part (Note [planned release points]).
    - fetch_at: layer j -> layers whose groups are copied back when backward reaches layer
      j (the gradient of its output is computed), so each arrives before it is needed;
      fetch_at_start: those fetched as backward starts. A layer listed at several points is
      fetched in pieces: fetch_share: (point, layer) -> the share of its bytes fetched by that
      point (n + 1: backward's start), for each point but its last (Note [fetch in pieces]).
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
    fetch_share: dict = dataclasses.field(default_factory=dict)

    def shares_at(self, point: int) -> dict:
        """Layer -> the share of its bytes fetched by `point` (a layer, or n + 1 for backward's
        start), for the layers fetched there in part (Note [fetch in pieces])."""
        return {i: share for (at, i), share in self.fetch_share.items() if at == point}


def saved_by(marks, fwd: float, share: float) -> float:
    """Seconds into a layer of `fwd` seconds by which it has saved `share` of its bytes.

    `marks`: (share saved, seconds into the layer) ascending, each taken at the save that
    passed a share (see forward.py's PROFILE_POINTS), so the bytes between two marks may all
    come with the later one: the first mark with at least `share` saved, else the layer's end.
    Without marks the bytes are spread evenly over the layer's time.
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


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A measured step, what `schedule` plans from (seconds, bytes, bytes/s; lists one entry a layer)."""

    nbytes: Sequence[int]  # per layer: the bytes its group saves
    fwd: Sequence[float]  # per layer: its forward's time
    bwd: Sequence[float]  # per layer: its backward's time
    tail: float  # from the last layer's end to backward's start (the head, the loss)
    head_bwd: float  # from backward's start to the last layer's backward
    d2h_bps: float  # device-to-host copy rate
    h2d_bps: float  # host-to-device copy rate
    # (m, seconds): the m-th tensor saved after the last layer is the last one saved before the
    # step's peak, that long after the last layer's end (None: none).
    before_peak: Optional[tuple] = None
    saved: Optional[list] = None  # per layer: the marks of `saved_by` (None: bytes spread evenly over its time)
    spans: Optional[list] = None  # per layer: its bytes of new spans after each one, ascending (None: any count)


def schedule(eligible: List[bool], step: StepInputs):
    """Offload, in forward order, what the device-to-host stream can copy out before the last
    layer ends, and plan when each group's memory is let go and when it comes back.

    The timeline is the measured one (`step`): layer i runs fwd[i] after layer i-1, backward
    starts `tail` after the last layer ends (head, loss) and reaches the last layer `head_bwd`
    later; layer i's backward takes bwd[i]. A group's copy starts when it closes (or when the copy
    before it ends); a layer that opens with the stream idle is copied in `SPLIT_PARTS`
    parts, the first when the layer has run a part of its time. Every copy must end, with
    `COPY_MARGIN`, when the last layer does (point n): memory let go later, as backward
    starts, comes after the peak of a training step (the head's logits and the loss sit on
    top of every activation), so it would not lower it; a layer whose copy passes the last
    layer's open is split there too, the part copied by then let go as the last layer opens.
    `before_peak` (m, seconds): the m-th tensor saved after the last layer is the last one
    saved before the step's peak, that long after the last layer's end (a model whose peak is
    in its loss): copies may then run until it, the part copied by the last layer's end let
    go there (point n), the rest at that save (TAIL_POINT).
    `saved`: per layer, the marks of `saved_by` (None: its bytes spread evenly over its time);
    `spans`: per layer, its bytes of new spans after each one, ascending (None: any count).
    The last layer that fits is offloaded in part. Earliest layers first: their memory is
    freed for longest and backward needs them last, with the most time to bring them back.

    Returns (Schedule, order, predicted exposed seconds in backward): `order` lists the layers
    offloaded, in the order their copies run (a prefix of it is a smaller plan that keeps
    every point valid).
    """
    nbytes = step.nbytes
    n = len(nbytes)
    line = _timeline(step)
    caps: List[Optional[int]] = [None] * n
    release_at, order, split_at = {}, [], {}
    free = 0.0
    for i in range(n):
        if not eligible[i] or nbytes[i] <= 0:
            continue
        placed = _place(i, step, line, free)
        if placed is None:
            continue
        free = placed.done
        caps[i] = None if placed.take >= placed.size else placed.take
        order.append(i)
        if len(placed.ends) > 1:
            split_at[i] = placed.ends[:-1]
            release_at[i] = placed.points
        else:
            release_at[i] = placed.points[0]
    _within_backward_room(order, caps, release_at, split_at, nbytes, step.bwd, step.h2d_bps, line.spans)
    fetch_at, fetch_at_start, fetch_share, exposed = fetch_plan(order, sizes_of(nbytes, caps, order), nbytes,
                                                                step.bwd, step.head_bwd, step.h2d_bps)
    # The point after the last layer is kept only if some part is let go there.
    points = [p for i in order for p in (release_at[i] if isinstance(release_at[i], list) else [release_at[i]])]
    tail_save = line.tail_save if any(p > n for p in points) else None
    return Schedule(n, caps, release_at, fetch_at, fetch_at_start, split_at, tail_save, fetch_share), order, exposed


@dataclasses.dataclass
class _Timeline:
    """`schedule`'s forward: when each layer opens and closes, and by when copies must end."""

    opens: List[float]  # per layer: seconds into the step it opens at
    closes: List[float]  # per layer: seconds into the step it ends at
    layers_end: float  # the last layer's end
    deadline: float  # copies end by then: the last layer's end, or the save before the peak
    tail_save: Optional[int]  # the count of that save after the last layer (None: none)
    per_byte: float  # seconds a byte's copy is planned to take (COPY_MARGIN included)
    saved: list  # per layer: the marks of `saved_by`, or None
    spans: list  # per layer: its span ends, or None


def _timeline(step: StepInputs) -> _Timeline:
    n = len(step.nbytes)
    opens, closes, t = [], [], 0.0
    for i in range(n):
        opens.append(t)
        t += step.fwd[i]
        closes.append(t)
    deadline = t
    tail_save = None
    if step.before_peak is not None and step.before_peak[1] > 0:
        tail_save, seconds = step.before_peak
        deadline = t + seconds
    return _Timeline(opens, closes, t, deadline, tail_save, (1 + COPY_MARGIN) / step.d2h_bps,
                     step.saved or [None] * n, step.spans or [None] * n)


class _Placed(NamedTuple):
    """A layer's copy as `schedule` places it."""

    take: int  # bytes copied (at a span end)
    size: int  # the layer's bytes (its last span end)
    ends: List[int]  # the bytes at which each part ends, ascending, the last `take`
    points: list  # per part: the point it is let go at
    done: float  # when its last part's copy ends


def _place(i: int, step: StepInputs, line: _Timeline, free: float) -> Optional[_Placed]:
    """Layer i's copy, its copy stream free from `free` on; None where too little of it fits."""
    # Byte counts are taken at the measured span ends (Note [span ends]).
    bounds, fwd, opens, per_byte = line.spans[i], step.fwd, line.opens, line.per_byte
    size = bounds[-1] if bounds else step.nbytes[i]
    split = free < line.closes[i]  # else the copies before it keep the stream busy past its end
    first = span_end_at_or_above(bounds, size // SPLIT_PARTS)
    start = max(opens[i] + saved_by(line.saved[i], fwd[i], first / size) if split else line.closes[i], free)
    take = span_end_at_or_below(bounds, min(size, int((line.deadline - start) / per_byte)))
    if take < MIN_PART * size:
        return None
    # Parts, by the bytes of new spans where each ends: the layer's quarters while it
    # runs (split), and where the copy passes the last layer's open, so that what is
    # copied by then goes as the last layer starts: it adds its own activations after
    # that, and only a part as small as what it and the loss add can wait for point n.
    # A quarter closes at the first span end past it; a part that must be copied by a
    # point, at the last span end before what the bus copies by then (rounded up, a part
    # due at the last layer's open could hold a large span through the step's peak).
    ends = {span_end_at_or_above(bounds, size * k // SPLIT_PARTS) for k in range(1, SPLIT_PARTS)} if split else set()
    ends.add(span_end_at_or_below(bounds, int((opens[-1] - start) / per_byte)))
    if line.tail_save is not None:
        ends.add(span_end_at_or_below(bounds, int((line.layers_end - start) / per_byte)))
    ends = sorted(b for b in ends if 0 < b < take) + [take]
    n = len(opens)
    points, done, begun = [], free, 0
    for b in ends:
        # A part closes when the layer has saved its bytes, the last one when the layer
        # ends; its copy follows the one before it.
        closed = line.closes[i] if b == take else opens[i] + saved_by(line.saved[i], fwd[i], b / size)
        done = max(closed, done) + (b - begun) * per_byte
        begun = b
        later = [j for j in range(i + 1, n) if opens[j] >= done]
        points.append(later[0] if later else n if done <= line.layers_end else n + TAIL_POINT)
    if done > line.deadline:
        return None
    return _Placed(take, size, ends, points, done)


# Note [memory-neutral fetch]: a group fetched back at the latest layer start that leaves time
# for its copy holds the least memory, but leaves the chain of copies back no slack: the fetch
# starts when the compute stream reaches its trigger, so a stall of the compute stream delays
# every copy after it. Under data parallelism and FSDP such stalls are common (a copy back late
# on one rank makes every rank wait at its next collective) and they compound: the wait delays
# the next triggers, whose copies then come late in turn. Fetching earlier costs no memory at
# the step's peak as long as backward has already let go of as many bytes as the fetched groups
# still needed hold (the step's memory stays below what it held as backward started, its peak):
# so a group's first piece (Note [fetch in pieces]) goes at the earliest layer start where that
# holds and the bus has room, or where its need makes it due, if that is earlier.


def _freed_before(nbytes, sizes: dict) -> List[int]:
    """Per layer j, the saved bytes on the device that backward has let go of when layer j's
    backward starts: those of the layers after it, less what their groups offloaded (`sizes`)."""
    freed, acc = [0] * len(nbytes), 0
    for j in reversed(range(len(nbytes))):
        freed[j] = acc
        acc += max(0, nbytes[j] - sizes.get(j, 0))
    return freed


# Note [backward's room]: a group lowers the step's peak only if it comes back after it, and the
# peak lies at or soon after backward's start: the head's and the loss's gradients on top of every
# activation, or the last layer's backward. A group's device block is allocated at its first
# piece (Note [fetch in pieces]), so a plan whose groups the backward of the layers before the
# last cannot carry would bring one back as backward starts or in the last layer's backward, and
# lower the peak by less than it offloads, by nothing for a plan of one group. So the schedule
# offloads no more than those layers' backward carries (what the bus moves in it, less
# FETCH_MARGIN), trimming the layers copied last: in a model of a few layers with large
# activations that is less than forward could hide, and each byte offloaded then lowers the peak.


def _within_backward_room(order, caps, release_at, split_at, nbytes, bwd, h2d_bps, spans) -> None:
    """Trim the plan (in place) to what the backward of the layers before the last carries back
    (Note [backward's room]): the layers copied last are capped at a span end, or dropped where
    less than MIN_PART of them would stay."""
    n, room = len(nbytes), _rooms(bwd, h2d_bps)
    while order:
        sizes = sizes_of(nbytes, caps, order)
        over = _latest_slots(order, sizes, room, n - 1)[1]
        if over <= 0:
            return
        i = order[-1]
        bounds = spans[i] if spans is not None else None
        size = bounds[-1] if bounds else nbytes[i]
        keep = span_end_at_or_below(bounds, sizes[i] - over)
        if keep < MIN_PART * size:
            order.pop()
            caps[i] = None
            release_at.pop(i)
            split_at.pop(i, None)
            continue
        # The part that now ends the layer is let go where the part it ends in was.
        ends = [e for e in split_at.get(i, []) if e < keep]
        points = release_at[i] if isinstance(release_at[i], list) else [release_at[i]]
        caps[i] = keep
        release_at[i] = points[:len(ends) + 1] if ends else points[0]
        if ends:
            split_at[i] = ends
        else:
            split_at.pop(i, None)


def sizes_of(nbytes, caps, order) -> dict:
    """Per offloaded layer, the bytes its groups copy back: all of its own, or its cap."""
    return {i: nbytes[i] if caps[i] is None else caps[i] for i in order}


# Note [fetch in pieces]: copies back run on the device's host-to-device copy engine, which
# serves them in the order they reach it, whatever stream queued them. Another library's small
# host-to-device copy on the compute stream at a layer's start (FSDP2 copies its unsharded
# parameters' sizes in at each unit's backward) waits behind every copy back queued before it,
# and the compute stream with it. So each layer start queues no more than the bus moves in that
# layer's backward (less FETCH_MARGIN): a group whose copy is longer comes back in pieces over
# the backward of several layers, into one device block allocated at its first piece. Pieces go
# as late as the groups' needs allow, or earlier where backward has let go of the bytes a group
# brings back (Note [memory-neutral fetch]); what the layers' backward cannot carry goes as
# backward starts.


def _rooms(bwd, h2d_bps: float) -> dict:
    """Per layer j > 0, the bytes the bus moves back in its backward (less FETCH_MARGIN): what
    a piece queued as it starts may hold (Note [fetch in pieces])."""
    return {j: int(bwd[j] * h2d_bps / (1 + FETCH_MARGIN)) for j in range(1, len(bwd))}


def _latest_slots(order, sizes: dict, room: dict, top: int):
    """The latest layer starts below `top` each byte can be queued at: the group needed last
    (order's first) into the last layer start before its need, each filled to its room.
    Returns (layer start -> bytes, the bytes left over, due at `top` or earlier)."""
    latest = dict.fromkeys(range(1, top), 0)
    left, s = dict(room), 1
    for i in order:  # needed last first
        rest, s = sizes[i], max(s, i + 1)
        while rest > 0 and s < top:
            take = min(rest, left[s])
            latest[s] += take
            left[s] -= take
            rest -= take
            if rest > 0:
                s += 1
        if rest > 0:
            return latest, rest + sum(sizes[g] for g in order[order.index(i) + 1:])
    return latest, 0


def fetch_plan(order, sizes: dict, nbytes, bwd, head_bwd: float, h2d_bps: float):
    """Which layer starts fetch which groups back, and how much of each (Note [fetch in pieces]).

    `order`: the offloaded layers, forward order; `sizes`: the bytes each copies back; layer j's
    backward starts `head_bwd` plus the backward of the layers after it into backward and takes
    bwd[j]. Slot j (a layer start, or n: backward's start) may queue what the bus moves in the
    time to the next layer start; a piece queued at slot j ends by layer j - 1's start, so group
    i's pieces go at slots above i.

    Returns (fetch_at, fetch_at_start, fetch_share, predicted exposed seconds): fetch_at maps a
    layer to the layers whose groups it fetches (in the order backward needs them), and
    fetch_share maps (layer, or n + 1 for backward's start; layer fetched) to the share of its
    bytes fetched by then where that is less than all of them.
    """
    n = len(nbytes)
    begins, t = [0.0] * n, head_bwd
    for j in reversed(range(n)):
        begins[j] = t
        t += bwd[j]
    slots = [n] + list(range(n - 1, 0, -1))  # in the order backward reaches them
    per_second = h2d_bps / (1 + FETCH_MARGIN)
    room = _rooms(bwd, h2d_bps)
    room[n] = int(head_bwd * per_second)
    latest, left_over = _latest_slots(order, sizes, room, n)
    latest[n] = left_over  # what the layers' backward cannot carry goes as backward starts
    total = sum(sizes[i] for i in order)
    need = list(reversed(order))  # the order backward needs the groups in, and the bus copies them
    ends, at = {}, 0
    for i in need:
        at = ends[i] = at + sizes[i]
    freed = _freed_before(nbytes, sizes)
    fetch_at: dict = {}
    fetch_at_start: List[int] = []
    fetch_share: dict = {}
    issued, started, done_at, free = 0, [], {}, 0.0
    for j in slots:
        due = total - sum(latest[k] for k in slots if k < j)  # bytes that must be queued by now
        limit, held = issued, [g for g in started if g <= j]  # groups after j were let go
        for i in need:  # a group already begun goes on; a new one within the bytes let go (not at n)
            if ends[i] <= issued:
                continue
            if i not in started:
                if j == n or sizes[i] + sum(sizes[g] for g in held) > freed[j]:
                    break
                held.append(i)
            limit = ends[i]
        upto = max(due, min(issued + room[j], limit))
        if upto <= issued:
            continue
        at = 0.0 if j == n else begins[j]
        for i in need:
            lo = ends[i] - sizes[i]
            if lo >= upto or ends[i] <= issued:
                continue
            (fetch_at_start if j == n else fetch_at.setdefault(j, [])).append(i)
            if i not in started:
                started.append(i)
            got = min(upto, ends[i]) - max(issued, lo)
            free = done_at[i] = max(at, free) + got / per_second
            if upto < ends[i]:
                fetch_share[(n + 1 if j == n else j, i)] = (upto - lo) / sizes[i]
        issued = upto
    exposed = sum(max(0.0, done_at[i] - begins[i]) for i in order)
    return fetch_at, fetch_at_start, fetch_share, exposed


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
        if exposed <= EXPOSED_TOLERANCE * step:
            break
    return mask, exposed, step


def planned_bytes(layer_bytes, mask, caps) -> int:
    """Bytes a plan offloads: each chosen layer's, or its cap where it is offloaded in part."""
    return sum(b if caps is None or caps[i] is None else min(b, caps[i])
               for i, (b, m) in enumerate(zip(layer_bytes, mask)) if m)
