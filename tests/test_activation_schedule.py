"""Auto mode's plan as pure functions: schedule, simulate, choose, span ends."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import offload
from offload.core import _device
from _activation_helpers import one_thread  # noqa: F401 (fixtures: one_thread, pool)

# These tests run models on the CPU, whose activations are host memory already:
# where an accelerator exists the engine rightly leaves them alone, and
# test_activation_cuda.py covers the GPU.
pytestmark = pytest.mark.skipif(
    _device.accelerator_type() is not None,
    reason="CPU engine tests; with an accelerator present, test_activation_cuda.py covers the engine",
)


def test_activation_planner_hides_copies():
    """The timeline model: with a slow bus only every other layer fits under compute."""
    from offload.activation.auto.schedule import choose, simulate

    n = 8
    nbytes, fwd, bwd = [100.0] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    exposed_all, _ = simulate(eligible, nbytes, fwd, bwd, 50.0, 50.0, 2)
    assert exposed_all > 0
    mask, exposed, step = choose(eligible, nbytes, fwd, bwd, 50.0, 50.0, 2)
    assert exposed <= 0.01 * step and 0 < sum(mask) < n - 1
    mask_fast, exposed_fast, _ = choose(eligible, nbytes, fwd, bwd, 1e6, 1e6, 2)
    assert mask_fast == eligible and exposed_fast == 0
    # A budget that lets two layers stay: the rest is offloaded even though copies show.
    mask_budget, exposed_budget, _ = choose(eligible, nbytes, fwd, bwd, 50.0, 50.0, 2, allowance=200.0)
    assert sum(mask_budget) == n - 1 - 2 and exposed_budget > 0


def test_activation_schedule_fills_the_bus_before_the_last_layer_ends():
    """Auto mode's schedule: earliest layers first, the last one that fits in part, the first
    copied in parts while it runs; each copy planned complete (with its margin) before its
    release point and before the last layer ends; each group fetched back as soon as backward
    has let go of the bytes it brings back, or at the latest layer start that leaves time for
    its copy where that is earlier."""
    from offload.activation.auto.schedule import (COPY_MARGIN, FETCH_MARGIN, SPLIT_PARTS, TAIL_POINT, StepInputs,
                                                  schedule)

    n = 8
    nbytes, fwd, bwd = [100] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    plan, order, exposed = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0))
    per = (1 + COPY_MARGIN) / 50.0  # 0.021 s a byte: 2.1 s a layer
    # Layer 0 opens on an idle stream: copied in 4 parts of 25 bytes as it saves them (each
    # at a quarter of its second), from 0.25 s to 2.35; then layers 1 and 2 (2.35-4.45,
    # 4.45-6.55), and from 6.55 what fits by 8, the last layer's end (the deadline, not
    # backward's start at 10): 69 bytes, split where the copy passes the last layer's open
    # (7 s: 21 bytes).
    assert SPLIT_PARTS == 4 and plan.split_at == {0: [25, 50, 75], 3: [21]}
    assert order == [0, 1, 2, 3] and exposed == 0
    assert plan.caps == [None] * 3 + [int((8 - 6.55) / per)] + [None] * 4
    # Layer opens are 0..7: each part goes at the first open after its copy (layer 0's parts
    # end at 0.775, 1.3, 1.825 and 2.35 s); layer 3's first part as the last layer opens,
    # the rest when it ends (point 8).
    assert plan.release_at == {0: [1, 2, 2, 3], 1: 5, 2: 7, 3: [7, 8]}
    # Backward: layer 7 starts at 1, then every 2 s; layer i is needed at 15 - 2 i. A layer's
    # copy back takes 1 s (with FETCH_MARGIN 1.3 s): one layer ahead would do, but each group
    # comes back as soon as backward has let go of as many bytes as the groups back and still
    # needed hold (Note [memory-neutral fetch]): layer 3's 69 bytes once layer 7's 100 are
    # gone (layer 6's start), layer 2's once 200 are (169 held), then 269 of 300, 369 of 400.
    assert FETCH_MARGIN == 0.3
    assert plan.fetch_at == {6: [3], 5: [2], 4: [1], 3: [0]} and plan.fetch_at_start == []
    # A slower way back (2.6 s a layer with its margin, 2 s of backward each): no layer start
    # queues more than its layer's backward carries, 76 bytes (Note [fetch in pieces]), so the
    # groups come in pieces; each begins where backward has let go of its bytes (layer 3's 69
    # at layer 6, layer 2's at 5: 169 of 200 held, ...), and its rest follows at the next start.
    slow_back, _, exposed = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 50.0))
    assert slow_back.fetch_at == {6: [3], 5: [2], 4: [2, 1], 3: [1, 0], 2: [0]} and exposed == 0
    assert slow_back.fetch_share == {(5, 2): 0.76, (4, 1): 0.52, (3, 0): 0.28}
    assert slow_back.shares_at(4) == {1: 0.52} and slow_back.shares_at(6) == {}
    # Slower still (13 s a layer): the backward of layers 1-6, before the last, carries 15 bytes
    # each, 90 in all, so only 90 bytes are offloaded (Note [backward's room]): layer 0's first
    # three quarters and 15 bytes more, its parts let go as before, fetched in six pieces from
    # layer 6's start, where backward has let go of layer 7's bytes; nothing waits for them.
    slowest, slowest_order, exposed = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 10.0))
    assert slowest_order == [0] and slowest.caps[0] == 90 and exposed == 0
    assert slowest.split_at == {0: [25, 50, 75]} and slowest.release_at == {0: [1, 2, 2, 3]}
    assert slowest.fetch_at == {j: [0] for j in range(1, 7)} and slowest.fetch_at_start == []
    assert slowest.fetch_share[(6, 0)] == pytest.approx(1 / 6)
    # Layers kept on the device that save little: backward lets go of too few bytes before
    # the offloaded layers' own backward, so each group comes at its latest start, one layer ahead.
    small_kept = [100] * 4 + [10] * 4
    jit = schedule([True] * 4 + [False] * 4, StepInputs(small_kept, fwd, bwd, 2.0, 1.0, 50.0, 100.0))[0]
    assert jit.fetch_at == {4: [3], 3: [2], 2: [1], 1: [0]}
    # A slow bus: not even one layer fits before the last one ends, and a part of one does
    # (from 0.25 s: 7.75 s / 1.05 at 5 bytes/s = 36 bytes), copied in parts that end at 5.5,
    # 6.97 (the 32 bytes copied by the last layer's open) and 7.81 s.
    slow, slow_order, _ = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 5.0, 50.0))
    assert slow_order == [0] and slow.caps[0] == 36
    assert slow.split_at == {0: [25, 32]} and slow.release_at == {0: [6, 7, 8]}
    # The last tensor saved before the step's peak comes 1 s after the last layer ends (the
    # 3rd saved after it, in the head): copies may run until 9 s. Layer 3 is copied whole,
    # its bytes copied after the last layer's end (69-100) let go at that save (point 8.5),
    # and 16 bytes of layer 4 from 8.65 s (0.35 s / 0.021).
    tail, tail_order, exposed = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0, (3, 1.0)))
    assert tail_order == [0, 1, 2, 3, 4] and tail.caps[3] is None and tail.caps[4] == 16 and exposed == 0
    assert tail.split_at[3] == [21, 69] and tail.release_at[3] == [7, 8, 8 + TAIL_POINT]
    assert tail.release_at[4] == 8 + TAIL_POINT and tail.tail_save == 3
    # At the last layer's end: no copy is let go there, no point is kept.
    assert schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0, (3, 0.0)))[0] == plan
    # A copy stream still busy when a layer ends: that layer is not split.
    assert 1 not in plan.split_at and 2 not in plan.split_at
    # Nothing eligible, or a bus too slow for an eighth of a layer: nothing offloaded.
    assert schedule([False] * n, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 50.0))[1] == []
    assert schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 0.5, 50.0))[1] == []


def test_activation_schedule_closes_parts_when_the_layer_saved_their_bytes():
    """A layer's parts close when it has saved their bytes, by the measured marks: a layer that
    saves half its bytes 0.6 s into its second and the rest at 0.9 s starts its copy later
    than an even spread says, and its parts are let go later."""
    from offload.activation.auto.schedule import COPY_MARGIN, StepInputs, saved_by, schedule

    assert saved_by(None, 2.0, 0.25) == 0.5  # no marks: evenly over the layer's time
    marks = [(0.5, 0.6), (1.0, 0.9)]
    # The first mark with the share saved (the bytes between marks may all come at the later).
    assert saved_by(marks, 1.0, 0.25) == 0.6 and saved_by(marks, 1.0, 0.75) == 0.9
    assert saved_by([(0.5, 0.6)], 1.0, 0.75) == 1.0  # past the last mark: at the layer's end
    assert saved_by([(1.0, 1.5)], 1.0, 1.0) == 1.0  # never after the layer's end
    n = 8
    nbytes, fwd, bwd = [100] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    even, _, _ = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0))
    late, _, _ = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0, None,
                                               [marks] + [None] * (n - 1)))
    assert COPY_MARGIN == 0.05 and even.release_at[0] == [1, 2, 2, 3]
    # 0.525 s a part: from 0.6 s (the first two quarters), 1.125 and 1.65; the third quarter
    # from 1.65 (saved at 0.9), 2.175; the last from 2.175, 2.7.
    assert late.split_at[0] == [25, 50, 75] and late.release_at[0] == [2, 2, 3, 3]
    # The stream is free 0.35 s later for the layers after it: what fits by the end shrinks.
    assert late.caps[3] == int((8 - 2.7 - 2 * 2.1) / ((1 + COPY_MARGIN) / 50.0)) < even.caps[3]


def test_activation_schedule_counts_bytes_at_span_ends():
    """A group closes a part, or stops at its cap, only between two of its spans: with layers
    whose spans end at 30, 60 and 100 bytes, the first layer's parts close at span ends (its
    quarters' ends rounded up: 30, 60, and the rest), the layer that fits in part is capped at
    the last span end that fits (60 of the 69 bytes the bus could take), so the plan's bytes
    are what the engine will copy, and a part to be let go as the last layer opens ends at the
    last span end its copy passes by then."""
    from offload.activation.auto.schedule import (StepInputs, schedule, span_end_at_or_above,
                                                  span_end_at_or_below)

    assert span_end_at_or_below([30, 60, 100], 69) == 60 and span_end_at_or_below([30, 60, 100], 29) == 0
    assert span_end_at_or_above([30, 60, 100], 31) == 60 and span_end_at_or_above([30, 60, 100], 101) == 100
    assert span_end_at_or_below(None, 69) == 69 and span_end_at_or_above(None, 31) == 31
    n = 8
    nbytes, fwd, bwd = [100] * n, [1.0] * n, [2.0] * n
    eligible = [True] * (n - 1) + [False]
    plan, order, _ = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 50.0, 100.0,
                                                 spans=[[30, 60, 100]] * n))
    # 0.63 s a span of 30: layer 0's first part from 0.3 s (its 30 bytes saved), 0.93; then
    # 1.56 and 2.4 s; layers 1 and 2 to 6.6 s; layer 3 from 6.6 s: 66 bytes fit by 8 s, 60 go.
    assert order == [0, 1, 2, 3] and plan.caps == [None] * 3 + [60] + [None] * 4
    assert plan.split_at == {0: [30, 60]} and plan.release_at[0] == [1, 2, 3]
    # By the last layer's open (7 s) its copy has taken 19 bytes, less than its first span: no
    # part goes there (rounded up, a part's copy would end after the point it is let go at).
    assert plan.release_at[3] == 8
    # At 55 bytes/s layer 3 fits whole, its copy from 6.03 s: by 7 s it has taken 51 bytes,
    # so its first span (30) goes as the last layer opens, the rest at the end (7.94 s).
    faster, order, _ = schedule(eligible, StepInputs(nbytes, fwd, bwd, 2.0, 1.0, 55.0, 100.0,
                                                 spans=[[30, 60, 100]] * n))
    assert order == [0, 1, 2, 3] and faster.caps[3] is None
    assert faster.split_at[3] == [30] and faster.release_at[3] == [7, 8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.floats(0.1, 4.0), st.floats(0.1, 8.0)), min_size=2, max_size=12),
       st.integers(0, 3), st.floats(5.0, 500.0), st.floats(5.0, 500.0))
def test_activation_schedule_fetches_in_backward_order_within_memory_or_in_time(layers, kept, d2h, h2d):
    """Whatever the layers: the bus copies the groups back in the order backward needs them,
    each whole before its need and after the last layer's backward; no layer start queues more
    than its layer's backward carries (Note [fetch in pieces]); and a group begins where
    backward has let go of the bytes it and the groups back before it still need (Note
    [memory-neutral fetch]), or else no more is queued than the later layer starts could not
    carry in time."""
    from offload.activation.auto.schedule import FETCH_MARGIN, StepInputs, _freed_before, schedule

    nbytes, fwd, bwd = ([layer[k] for layer in layers] for k in range(3))
    n = len(layers)
    eligible = [i < n - 1 - kept for i in range(n)]
    plan, order, _ = schedule(eligible, StepInputs(nbytes, fwd, bwd, 0.5, 0.5, d2h, h2d))
    sizes = {i: nbytes[i] if plan.caps[i] is None else plan.caps[i] for i in order}
    freed = _freed_before(nbytes, sizes)
    room = [int(b * h2d / (1 + FETCH_MARGIN)) for b in bwd]
    end, at = {}, 0
    for i in sorted(order, reverse=True):  # the order backward needs them
        at = end[i] = at + sizes[i]

    def due(j):  # what must be queued by layer start j for every group to come whole before its need
        return max([0] + [end[h] - sum(room[h + 1:j]) for h in order if h < j])

    points = [n + 1] + list(range(n - 1, 0, -1))  # the order backward reaches them
    assert set(plan.fetch_at) <= set(points)
    share = dict.fromkeys(order, 0.0)
    issued = 0.0
    for j in points:
        before = issued
        held = [g for g in order if share[g] > 0 and g <= j]  # groups after j were let go
        listed = plan.fetch_at_start if j == n + 1 else plan.fetch_at.get(j, [])
        beyond = False
        for i in listed:
            assert i < j and share[i] < 1.0  # before its need, and never queued twice
            assert all(share[g] == 1.0 for g in order if g > i)  # those needed before it: whole
            begins = share[i] == 0.0
            new = plan.fetch_share.get((j, i), 1.0)
            assert share[i] < new <= 1.0
            issued += (new - share[i]) * sizes[i]
            share[i] = new
            if begins and j < n:
                held.append(i)
                beyond = beyond or sum(sizes[g] for g in held) > freed[j]
        if j < n:
            assert issued - before <= room[j] + 1e-6 * issued
            if beyond:  # a group begun beyond the bytes let go: only what is due
                assert issued == pytest.approx(due(j))
    assert all(share[i] == 1.0 for i in order)
    # Nothing comes back as backward starts or in the last layer's backward, near the step's
    # peak (Note [backward's room]); a trimmed layer's parts end below its cap, one point each.
    assert not plan.fetch_at_start and n - 1 not in plan.fetch_at
    for i in order:
        ends = plan.split_at.get(i, [])
        points = plan.release_at[i] if isinstance(plan.release_at[i], list) else [plan.release_at[i]]
        assert len(points) == len(ends) + 1 and all(e < sizes[i] for e in ends)
