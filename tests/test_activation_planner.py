"""Auto mode's budget planner (offload/activation/auto/budget.py) and its check against timed steps
(auto/budget_plan.py) as pure functions of hand-made measurements."""

import random

import pytest

import dataclasses

from offload.activation.auto.budget import (KEEP, OFFLOAD, RECOMPUTE, Bus, LayerCost, StepCosts, StepMemory,
                                            calibrate, fixed_bytes, plan, predict)
from offload.activation.auto.budget_plan import BudgetRun

# 8 layers of 100 bytes (10 of them inputs), forward 1 s, backward 2 s; the last layer kept
# (keep_last); the head and the loss hold 150 bytes as backward starts.
N, TAIL = 8, 150


def _costs(n=N, **kw):
    return [LayerCost(100, 10, 1.0, 2.0, eligible=i < n - 1, **kw) for i in range(n)]


FAST = Bus(125.0, 125.0, 2)  # a layer's copy (0.8 s) hides under the next layer's forward
SLOW = Bus(40.0, 40.0, 2)  # a layer's copy takes 2.5 layers' forward time
CRAWL = Bus(10.0, 10.0, 2)  # a layer's copy takes 10 layers' forward time, an input's one


def _first_k(kind, k, n=N):
    return [kind if i < k else KEEP for i in range(n)]


def _best_first_k(costs, bus, budget):
    """The fastest 'checkpoint the first k' and 'offload the first k' plans that fit."""
    out = []
    for kind in (RECOMPUTE, OFFLOAD):
        fits = [p for p in (predict(_first_k(kind, k), StepCosts(costs, bus, tail_bytes=TAIL))
                            for k in range(N))
                if p.peak_bytes <= budget]
        out.append(min(p.step_s for p in fits) if fits else float("inf"))
    return min(out)


def test_activation_planner_predicts_the_plain_and_checkpointed_steps():
    costs = _costs()
    plain = predict([KEEP] * N, StepCosts(costs, SLOW, tail_bytes=TAIL))
    assert plain.step_s == 24.0 and plain.peak_bytes == 800 + TAIL and plain.exposed_s == 0
    ckpt = predict(_first_k(RECOMPUTE, N - 1), StepCosts(costs, SLOW, tail_bytes=TAIL))
    assert ckpt.recompute_s == 7.0 and ckpt.step_s == 31.0 and ckpt.peak_bytes < plain.peak_bytes / 3
    # Fixed bytes: what the measured peak holds besides the activations, 0 without memory statistics.
    assert fixed_bytes(plain.peak_bytes + 1000, [KEEP] * N, costs, SLOW, TAIL) == 1000
    assert fixed_bytes(0, [KEEP] * N, costs, SLOW, TAIL) == 0


def test_activation_planner_keeps_everything_above_the_peak_without_offload():
    for bus in (FAST, SLOW):
        result = plan(_costs(), bus, 800 + TAIL, tail_bytes=TAIL)
        assert result.feasible and result.chosen.kinds == [KEEP] * N and result.chosen.step_s == 24.0


def test_activation_planner_offloads_only_while_the_bus_hides_it():
    costs = _costs()
    # Down to the kept last layer, the group still in the window as backward starts, the one
    # fetched then, and the head's bytes: the least that offloading alone reaches.
    for budget in (850, 650, 450):
        result = plan(costs, FAST, budget, tail_bytes=TAIL)
        kinds = result.chosen.kinds
        assert result.feasible and result.chosen.peak_bytes <= budget
        assert RECOMPUTE not in kinds and OFFLOAD in kinds and result.chosen.step_s == 24.0
        # As few layers as meet it, the earliest.
        k = kinds.count(OFFLOAD)
        assert kinds == _first_k(OFFLOAD, k)
        assert predict(_first_k(OFFLOAD, k - 1), StepCosts(costs, FAST, tail_bytes=TAIL)).peak_bytes > budget


def test_activation_planner_mixes_recompute_and_offload_for_a_tight_budget():
    costs = _costs()
    budget = 500
    result = plan(costs, SLOW, budget, tail_bytes=TAIL)
    kinds = result.chosen.kinds
    assert result.feasible and result.chosen.peak_bytes <= budget
    assert RECOMPUTE in kinds and OFFLOAD in kinds
    # Faster than checkpointing or offloading the first k layers at the same budget, by at least
    # half the recompute time of the layer it offloads instead of recomputing.
    assert result.chosen.step_s <= _best_first_k(costs, SLOW, budget) - 0.5
    # Never slower than either family, at every budget of the sweep.
    for budget in range(950, 240, -50):
        result = plan(costs, SLOW, budget, tail_bytes=TAIL)
        assert result.chosen.step_s <= _best_first_k(costs, SLOW, budget) + 1e-9


def test_activation_planner_recomputes_a_layer_it_may_not_offload():
    """The last layer (keep_last) is never offloaded, but may be recomputed with its inputs kept:
    at full checkpointing's peak the plan recomputes every layer, as full checkpointing does,
    where recomputing all but the last would hold that layer's activations above it."""
    costs = _costs()
    full = predict([RECOMPUTE] * N, StepCosts(costs, SLOW, tail_bytes=TAIL))
    all_but_last = predict(_first_k(RECOMPUTE, N - 1), StepCosts(costs, SLOW, tail_bytes=TAIL))
    assert full.peak_bytes < all_but_last.peak_bytes
    result = plan(costs, SLOW, full.peak_bytes, tail_bytes=TAIL)
    assert result.feasible and result.chosen.peak_bytes <= full.peak_bytes
    assert result.chosen.kinds[-1] == RECOMPUTE
    assert all(kind != OFFLOAD or cost.eligible for kind, cost in zip(result.chosen.kinds, costs))


def test_activation_planner_says_when_the_budget_cannot_be_met():
    costs = _costs()
    checkpointed = predict([RECOMPUTE] * N, StepCosts(costs, SLOW, tail_bytes=TAIL))
    result = plan(costs, SLOW, checkpointed.peak_bytes - 60, tail_bytes=TAIL)
    assert not result.feasible
    assert result.least_peak_bytes == result.chosen.peak_bytes <= checkpointed.peak_bytes
    assert result.least_peak_bytes > checkpointed.peak_bytes - 60
    # Fixed bytes above the budget: nothing fits, the least peak includes them.
    result = plan(costs, SLOW, 1000, fixed=1000, tail_bytes=TAIL)
    assert not result.feasible and result.least_peak_bytes >= 1000


def test_activation_planner_counts_user_checkpointed_layers_as_recompute():
    costs = [LayerCost(10, 10, 1.0, 3.0, eligible=i < N - 1, checkpointed=True, full_bytes=100) for i in range(N)]
    result = plan(costs, FAST, 10 ** 6, tail_bytes=TAIL)
    assert result.chosen.kinds == [RECOMPUTE] * N
    # Their measured backward includes the recomputation: nothing is added for it.
    assert result.chosen.recompute_s == 0 and result.chosen.step_s == N * 4.0


@pytest.mark.parametrize("budget", [950, 650, 450, 300])
def test_activation_planner_same_plan_under_measurement_noise(budget):
    """Times measured 1% apart from run to run give the same plan (Note [stable plans])."""
    rng = random.Random(0)
    first = None
    for _ in range(12):
        costs = [LayerCost(100, 10, 1.0 * (1 + rng.uniform(-0.01, 0.01)), 2.0 * (1 + rng.uniform(-0.01, 0.01)),
                           eligible=i < N - 1) for i in range(N)]
        kinds = plan(costs, FAST, budget, tail_bytes=TAIL).chosen.kinds
        first = first or kinds
        assert kinds == first


def test_activation_planner_names_the_fastest_plan_without_offload_beside_an_offloading_one():
    costs = _costs()
    result = plan(costs, SLOW, 650, tail_bytes=TAIL)
    assert OFFLOAD in result.chosen.kinds
    rival = result.without_offload
    assert rival is not None and OFFLOAD not in rival.kinds and rival.peak_bytes <= 650
    # The fastest of its kind: no "checkpoint the first k" that fits is faster.
    ckpt = [predict(_first_k(RECOMPUTE, k), StepCosts(costs, SLOW, tail_bytes=TAIL)) for k in range(N + 1)]
    assert rival.step_s <= min(p.step_s for p in ckpt if p.peak_bytes <= 650) + 1e-9
    # A plan without offload has no rival.
    assert plan(costs, SLOW, 800 + TAIL, tail_bytes=TAIL).without_offload is None


def _timed(run, ms, peak):
    """Feed `run` steps of `ms` and `peak` until it has enough to judge; its verdict."""
    while not run.step_ended(ms, peak, None):
        pass
    return run.verdict(None)


@pytest.mark.parametrize("case", ["rival_faster", "offload_faster", "offload_by_too_little", "rival_over_budget"])
def test_activation_budget_run_times_an_offloading_plan_against_its_rival(case):
    """Note [measured rival]: an offloading plan, once checked, is timed against the fastest plan
    without offload and kept only when measured faster by half the recomputation it avoids."""
    budget = 650
    run = BudgetRun(_costs(), SLOW, budget, measured_peak=0, tail_s=0.0, tail_bytes=TAIL)
    offloading = run.make().chosen
    assert OFFLOAD in offloading.kinds
    verdict = _timed(run, 30.0, budget)
    assert verdict["rival"] and not verdict["replan"]
    rival = run.result.chosen
    assert OFFLOAD not in rival.kinds and run.fields(["l"] * N).kinds == rival.kinds
    margin = 0.5 * (rival.recompute_s - offloading.recompute_s) * 1e3
    assert margin > 0
    rival_ms, rival_peak = {"rival_faster": (29.0, budget), "offload_faster": (30.0 + margin + 1, budget),
                            "offload_by_too_little": (30.0 + margin / 2, budget),
                            "rival_over_budget": (40.0, budget * 2)}[case]
    verdict = _timed(run, rival_ms, rival_peak)
    offload_kept = case in ("offload_faster", "rival_over_budget")
    assert not verdict["rival"] and not verdict["replan"] and verdict["switched"] == offload_kept
    assert run.result.chosen.kinds == (offloading.kinds if offload_kept else rival.kinds)
    assert verdict["kept"]["measured_step_ms"] == (30.0 if offload_kept else rival_ms)
    check = run.rival
    assert check["kinds"] == rival.kinds and check["won"] is not offload_kept
    assert check["measured_step_ms"] == rival_ms and check["margin_ms"] == pytest.approx(margin)


def test_activation_planner_keeps_recomputed_inputs_where_the_budget_has_room():
    """Note [recomputed inputs kept]: a plan's recomputed layers keep their inputs on the device
    while the budget fits, the latest first; at full checkpointing's own peak they go to the host."""
    costs = _costs()
    # A bus so slow that offloading a layer never pays: the plans recompute.
    copied = predict([RECOMPUTE] * N, StepCosts(costs, CRAWL, tail_bytes=TAIL))
    kept = predict([RECOMPUTE] * N, StepCosts(costs, CRAWL, tail_bytes=TAIL), inputs_kept=[True] * N)
    assert kept.peak_bytes > copied.peak_bytes and kept.step_s == copied.step_s
    # Room for every input: the plan is hand-written full checkpointing, nothing copied.
    result = plan(costs, CRAWL, kept.peak_bytes, tail_bytes=TAIL)
    assert result.chosen.kinds == [RECOMPUTE] * N and result.chosen.inputs_kept == [True] * (N - 1) + [False]
    run = BudgetRun(costs, CRAWL, kept.peak_bytes, measured_peak=0, tail_s=0.0, tail_bytes=TAIL)
    run.make()
    fields = run.fields(["l"] * N)
    assert fields.inputs_kept == [True] * N and fields.mask == [False] * N
    assert fields.recompute == [True] * N
    # No room: every input goes to the host.
    result = plan(costs, CRAWL, copied.peak_bytes, tail_bytes=TAIL)
    assert result.chosen.inputs_kept == [False] * N and result.chosen.peak_bytes <= copied.peak_bytes
    # Room for some: the latest recomputed layers keep theirs, and the plan still fits.
    for budget in (300, 400, 500):
        chosen = plan(costs, CRAWL, budget, tail_bytes=TAIL).chosen
        recomputed = [i for i, k in enumerate(chosen.kinds) if k == RECOMPUTE and costs[i].eligible]
        flags = [chosen.inputs_kept[i] for i in recomputed]
        assert chosen.peak_bytes <= budget and any(flags)
        assert flags == sorted(flags)  # a run of copied layers, then a run of kept ones


def _measured(kinds, truth, bus, at_start, tail):
    """The allocator's stretch peaks of a step that ran `kinds` on layers costing `truth`."""
    ran = predict(kinds, StepCosts(truth, bus, at_start, tail_bytes=tail), window=True)
    return StepMemory(ran.peak_bytes, at_start,
                      [at_start + b + c.forward_extra_bytes for b, c in zip(ran.forward_bytes, truth)],
                      at_start + ran.start_bytes + tail,
                      [at_start + b + c.backward_extra_bytes for b, c in zip(ran.backward_bytes, truth)])


def test_activation_planner_places_memory_beside_the_activations_where_it_was_measured():
    """Note [memory beside the activations]: the measuring step's stretch peaks give back each
    layer's forward and backward working memory and the head's, so every plan's predicted peak
    is the one its step reaches; one excess over the whole step would add a backward's working
    memory to the start of backward, and leave it out of a recomputed layer's backward."""
    # One layer's backward holds much more than the others' (a wide intermediate's gradient).
    truth = [LayerCost(100, 10, 1.0, 2.0, eligible=i < N - 1, forward_extra_bytes=20 + i,
                       backward_extra_bytes=400 if i == 3 else 50) for i in range(N)]
    measured_kinds = [OFFLOAD] * (N - 1) + [KEEP]
    memory = _measured(measured_kinds, truth, SLOW, 1000, TAIL)
    plain = [dataclasses.replace(c, forward_extra_bytes=0, backward_extra_bytes=0) for c in truth]
    costs, fixed, tail = calibrate(measured_kinds, plain, SLOW, memory)
    assert costs == truth and fixed == 1000 and tail == TAIL
    for kinds in ([KEEP] * N, [RECOMPUTE] * N, _first_k(RECOMPUTE, 3), measured_kinds):
        expected = predict(kinds, StepCosts(truth, SLOW, 1000, tail_bytes=TAIL)).peak_bytes
        assert predict(kinds, StepCosts(costs, SLOW, fixed, tail_bytes=tail)).peak_bytes == expected
    # The whole step's excess as fixed bytes instead: wrong both ways.
    whole = fixed_bytes(memory.step_peak, measured_kinds, plain, SLOW, TAIL)
    keep_all, full = ([KEEP] * N, [RECOMPUTE] * N)
    assert (predict(keep_all, StepCosts(plain, SLOW, whole, tail_bytes=TAIL)).peak_bytes
            > predict(keep_all, StepCosts(truth, SLOW, 1000, tail_bytes=TAIL)).peak_bytes)
    assert (predict(full, StepCosts(plain, SLOW, whole, tail_bytes=TAIL)).peak_bytes
            < predict(full, StepCosts(truth, SLOW, 1000, tail_bytes=TAIL)).peak_bytes)


def test_activation_planner_fills_in_stretches_not_measured():
    truth = [LayerCost(100, 10, 1.0, 2.0, eligible=i < N - 1, backward_extra_bytes=100 + i) for i in range(N)]
    kinds = [OFFLOAD] * (N - 1) + [KEEP]
    memory = _measured(kinds, truth, SLOW, 500, TAIL)
    plain = [dataclasses.replace(c, backward_extra_bytes=0) for c in truth]
    # A layer whose backward was not measured (it unpacked nothing) takes the largest measured.
    backward = list(memory.backward)
    backward[2] = 0
    costs, fixed, _ = calibrate(kinds, plain, SLOW, dataclasses.replace(memory, backward=backward))
    assert [c.backward_extra_bytes for c in costs] == [100, 101, N + 99] + [100 + i for i in range(3, N)]
    ran = predict(kinds, StepCosts(costs, SLOW, fixed, tail_bytes=TAIL), window=True)
    assert ran.peak_bytes >= memory.step_peak
    # No stretch measured (no memory statistics, or only the whole step's): the whole step's excess.
    costs, fixed, tail = calibrate(kinds, plain, SLOW, StepMemory(memory.step_peak), TAIL)
    assert costs == plain and tail == TAIL and fixed == fixed_bytes(memory.step_peak, kinds, plain, SLOW, TAIL)
    assert calibrate(kinds, plain, SLOW, StepMemory(0), TAIL) == (plain, 0, TAIL)
    # What no stretch explains (a peak after them all) is added to every plan.
    costs, fixed, _ = calibrate(kinds, plain, SLOW, dataclasses.replace(memory, step_peak=memory.step_peak + 77))
    ran = predict(kinds, StepCosts(costs, SLOW, fixed, tail_bytes=TAIL), window=True)
    assert ran.peak_bytes == memory.step_peak + 77


def test_activation_planner_replays_the_resident_window():
    """In the resident window (the measuring step) a copied group is let go only when a later
    group's copy starts with the window full, the last ones are served from the device in
    backward, and the first group needed from the host comes back as backward starts: with a
    window of two, offloading the first k layers lowers the peak as backward starts by k - 2
    layers, however fast the bus (Note [budget points])."""
    costs = _costs()
    keep_all = predict([KEEP] * N, StepCosts(costs, FAST, tail_bytes=TAIL))
    for k in range(1, N):
        offloaded = predict(_first_k(OFFLOAD, k), StepCosts(costs, FAST, tail_bytes=TAIL), window=True)
        assert offloaded.start_bytes == keep_all.start_bytes - 100 * max(0, k - 2)
        assert offloaded.exposed_s == 0 and offloaded.step_s == keep_all.step_s
    # In forward, the group in the window is on the device beside the next layer's.
    assert predict(_first_k(OFFLOAD, 1), StepCosts(costs, FAST), window=True).forward_bytes[1] == 200
    # A window of three holds one more.
    wide = Bus(FAST.d2h_bps, FAST.h2d_bps, 3)
    offloaded = predict(_first_k(OFFLOAD, 5), StepCosts(costs, wide), window=True)
    assert offloaded.start_bytes == keep_all.start_bytes - 200


def test_activation_planner_plans_points_that_free_what_is_offloaded():
    """Note [budget points]: at planned points each offloaded layer is let go once its copy is
    planned done and comes back when backward reaches the layer whose backward hides its copy,
    so what a plan offloads is off the device as backward starts."""
    costs = _costs()
    keep_all = predict([KEEP] * N, StepCosts(costs, FAST, tail_bytes=TAIL))
    for k in range(1, N):
        p = predict(_first_k(OFFLOAD, k), StepCosts(costs, FAST, tail_bytes=TAIL))
        assert p.start_bytes == keep_all.start_bytes - 100 * k and p.peak_bytes < keep_all.peak_bytes
        # A copy of 0.8 s (0.84 s planned) is let go as the layer after next opens.
        assert p.release_at == {i: i + 2 if i + 2 < N else N for i in range(k)}
        # A copy back of 0.8 s (1.04 s planned) hides under one layer's backward of 2 s.
        assert p.fetch_at == {i + 1: [i] for i in range(k)} and p.fetch_at_start == []
        assert p.exposed_s == 0 and p.step_s == keep_all.step_s
    # A copy that does not end with the forward: the compute stream waits for it at its end.
    late = predict(_first_k(OFFLOAD, N - 1), StepCosts(costs, SLOW, tail_bytes=TAIL))
    assert late.release_at[N - 2] == N and late.exposed_s > 0
