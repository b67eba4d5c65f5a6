"""Auto mode's step search (offload/activation/auto/search.py) as pure functions of step times:
the verdict on one probe, the bisection over counts, and the same count under timing noise."""

import random
import statistics

import pytest

from offload.activation.auto.probes import PROBE_STEPS
from offload.activation.auto.search import (BAND_CAP, BAND_FLOOR, BAND_SIGMAS, MAD_SIGMA, MEDIAN_SE, MIN_PAIRS,
                                            MIN_SPREAD_STEPS, OVER, PROBE_ROUNDS, STEP_OVERHEAD_TOLERANCE, UNSURE,
                                            WITHIN, StepSearch, deviations, noise_band, step_verdict)

TOL = STEP_OVERHEAD_TOLERANCE


def test_activation_step_search_bisects_to_the_largest_within_tolerance():
    def run(model_k, overhead_per_layer):
        search, probes = StepSearch(model_k, tolerance=0.03), []
        while search.probe is not None:
            probes.append(search.probe)
            search.record(search.probe, 100.0 * (1 + overhead_per_layer * search.probe), 100.0)
        return search.final, probes

    assert run(6, 0.001) == (6, [6, 6])  # the model's choice holds: checked, confirmed, kept
    assert run(6, 0.01) == (3, [6, 3, 4, 3])  # 3% allows 3 layers
    assert run(6, 0.5) == (0, [6, 3, 1])  # nothing hides: offload nothing
    assert run(0, 0.5) == (0, [])  # nothing to check
    with pytest.raises(RuntimeError, match="while probing"):
        StepSearch(4).record(2, 1.0, 1.0)

    # A count that looked fine once but runs 10% slower when timed again is not kept.
    search, probes, seen = StepSearch(2, tolerance=0.03), [], set()
    while search.probe is not None:
        k = search.probe
        probes.append(k)
        search.record(k, 100.0 if k not in seen else 110.0, 100.0)
        seen.add(k)
    assert (search.final, probes) == (1, [2, 2, 1])

    # Each count is judged against the baseline of its own probe, not an earlier one.
    search = StepSearch(2, tolerance=0.03)
    search.record(2, 108.0, 100.0)  # 8% over
    search.record(1, 110.0, 108.0)  # the machine slowed down: 1.9% over its own baseline
    search.record(1, 101.0, 100.0)  # confirmed
    assert search.final == 1 and search.baseline_ms == {2: 100.0, 1: 100.0}


def _baseline(spread, n=2 * PROBE_STEPS):
    """n steps without offload around 100 ms whose median absolute deviation is `spread` ms."""
    out = [100.0 + spread * (1 if i % 2 else -1) for i in range(n)]
    assert statistics.median(abs(b - statistics.median(out)) for b in out) == pytest.approx(spread)
    return out


def test_activation_step_verdict_band_edges():
    # The band: BAND_SIGMAS standard errors of a median of paired ratios, from the baseline's MAD.
    base = _baseline(1.0)  # 6 steps, sigma 1.48%: band 3 x 1.2533 x 1.48% x sqrt(2/6) = 3.22%
    band = BAND_SIGMAS * MEDIAN_SE * MAD_SIGMA * 0.01 * (2 / 6) ** 0.5
    assert noise_band(deviations(base), 6) == pytest.approx(band)
    eps = 1e-4
    for overhead, kind in ((TOL - band - eps, WITHIN), (TOL - band + eps, UNSURE), (TOL, UNSURE),
                           (TOL + band - eps, UNSURE), (TOL + band + eps, OVER)):
        verdict = step_verdict([b * (1 + overhead) for b in base], base)
        assert verdict.kind == kind, (overhead, verdict)
        assert verdict.overhead == pytest.approx(overhead) and verdict.band == pytest.approx(band)
    # More pairs narrow the band as the square root of their number.
    assert noise_band(deviations(_baseline(1.0, 18)), 18) == pytest.approx(band / 3 ** 0.5)
    # Fewer pairs than MIN_PAIRS: no verdict however far; fewer steps to read a spread from
    # than MIN_SPREAD_STEPS: the cap, until earlier probes' steps make up the number.
    few = base[:MIN_PAIRS - 1]
    assert step_verdict([2 * b for b in few], few).kind == UNSURE
    assert noise_band(deviations(few), MIN_PAIRS) == BAND_CAP
    assert noise_band(deviations(base[:MIN_SPREAD_STEPS - 1]) + deviations(base), MIN_PAIRS) < BAND_CAP
    # A quiet baseline: the floor; a wild one: the cap (far past the tolerance is over however noisy).
    quiet = [100.0] * 6
    assert noise_band(deviations(quiet), 6) == BAND_FLOOR
    for overhead, kind in ((TOL - BAND_FLOOR - eps, WITHIN), (TOL + BAND_FLOOR - eps, UNSURE),
                           (TOL + BAND_FLOOR + eps, OVER)):
        assert step_verdict([100.0 * (1 + overhead)] * 6, quiet).kind == kind
    wild = _baseline(40.0)
    assert noise_band(deviations(wild), 6) == BAND_CAP
    assert step_verdict([b * (1 + TOL + BAND_CAP + eps) for b in wild], wild).kind == OVER
    assert step_verdict([b * (1 + TOL + BAND_CAP - eps) for b in wild], wild).kind == UNSURE
    # Paired: a drift over the probe that moves both sides of each pair alike does not count.
    drifting = [100.0, 104.0, 108.0]
    assert step_verdict([b * 1.01 for b in drifting], drifting).overhead == pytest.approx(0.01)
    with pytest.raises(ValueError, match="needs timed steps"):
        step_verdict([], [1.0])


def test_activation_step_search_unsure_asks_for_more_then_the_model():
    base = _baseline(1.0)  # band 3.22%
    unsure = [b * (1 + TOL) for b in base]
    search = StepSearch(4)
    assert search.judge(4, unsure, base, last_round=False) is None  # more steps of the same probe
    assert search.probe == 4 and not search.verdicts
    # Still unsure in its last round: the model's count at the measured bus rate decides.
    assert search.judge(4, unsure, base, last_round=True, model_count=lambda: 2) is False
    assert search.probe == 2 and search.verdicts[-1]["by"] == "model"
    assert search.judge(2, unsure, base, last_round=True, model_count=lambda: 2) is True
    assert search.judge(3, unsure, base, last_round=True, model_count=lambda: 2) is False
    assert search.probe == 2 and search.confirming
    # Asked only when the steps leave it unsure; None: the search's own count.
    def never():
        raise AssertionError("the model is asked only for an unsure verdict")

    assert search.judge(2, [b * 0.99 for b in base], base, last_round=False, model_count=never) is True
    assert search.final == 2
    assert StepSearch(3).judge(3, unsure, base, last_round=True, model_count=lambda: None) is True


def _noisy_settle(true_overhead, model_k, seed, model_count=None, jitter=0.015, drift=0.001, outliers=0.03):
    """The planner's search over synthetic steps: each step without offload 100 ms, drifting by
    `drift` a step, jittered by `jitter` (a normal share) and now and then 30% slow (`outliers`);
    an offloading step of k layers (1 + true_overhead[k]) times that. Steps alternate, as the
    planner's probes run them. Returns (the settled count, the count the medians of each
    probe's first round alone give: `record`)."""
    rng = random.Random(seed)
    clock = [0]

    def step(overhead):
        clock[0] += 1
        slow = 1.3 if rng.random() < outliers else 1.0
        return 100.0 * (1 + drift * clock[0]) * (1 + overhead) * (1 + rng.gauss(0.0, jitter)) * slow

    def probe_rounds(k):
        on, off = [], []
        for _ in range(PROBE_ROUNDS):
            for _ in range(PROBE_STEPS):
                on.append(step(true_overhead[k]))
                off.append(step(0.0))
            yield on, off

    search, plain = StepSearch(model_k), StepSearch(model_k)
    while search.probe is not None:
        k = search.probe
        for rounds, (on, off) in enumerate(probe_rounds(k), 1):
            if search.judge(k, on, off, rounds == PROBE_ROUNDS, model_count) is not None:
                break
    while plain.probe is not None:
        k = plain.probe
        on, off = next(probe_rounds(k))
        plain.record(k, statistics.median(on), statistics.median(off))
    return search.final, plain.final


SEEDS = range(12)


@pytest.mark.parametrize("case", ["model right, near the tolerance", "model over, bus slower under compute",
                                  "nothing hides"])
def test_activation_step_search_same_count_under_noise(case):
    """Seeded jitter (1.5% a step, drift, 3% of steps 30% slow) around fixed true costs: the
    search settles on the same count for every seed. The medians of single probes compared
    with the tolerance alone (`record`) do not, where a count lies near it."""
    if case == "model right, near the tolerance":
        # Each layer costs 0.45%: the model's 6 layers 2.7%, inside the noise of the tolerance.
        true, model_k, model_count, expected = {k: 0.0045 * k for k in range(7)}, 6, None, 6
    elif case == "model over, bus slower under compute":
        # The measuring step's bus reading offered 6 layers; under the probes' compute the copies
        # run at a rate where 3.5 layers hide (the rate, a median of copy timings, jittered 1%):
        # 4 layers cost 3.4%, near the tolerance, 5 and 6 clearly more.
        true, model_k, expected = {0: 0.0, 1: 0.004, 2: 0.008, 3: 0.012, 4: 0.034, 5: 0.07, 6: 0.11}, 6, 3
        rate = random.Random(99)

        def model_count():
            return int(3.5 * (1 + rate.gauss(0.0, 0.01)))
    else:
        true, model_k, model_count, expected = {k: 0.1 * k for k in range(5)}, 4, None, 0
    settled, plain = zip(*(_noisy_settle(true, model_k, seed, model_count) for seed in SEEDS))
    assert set(settled) == {expected}, settled
    if case != "nothing hides":
        assert len(set(plain)) > 1, plain  # the noise is such that single medians disagree
