"""How many layers of auto mode's schedule to offload, from timed steps: the verdict on one
probed count and the search over counts, as pure functions of step times.

Note [verdicts under noise]: a probe's verdict compares the median of its offloading steps
with the median of the steps without offload alternated with them. Single medians of a few
steps straddle STEP_OVERHEAD_TOLERANCE wherever a count's true overhead lies near it, so two
runs on one shape would settle on different counts. So a verdict has three outcomes, with a
band around the tolerance sized by the probe's own noise (the spread of its steps without
offload, which nothing of the plan touches): *within* (the overhead is below the tolerance by
more than the band), *over* (above it by more than the band), *unsure* (inside the band). An
unsure probe takes more steps (the band narrows as the square root of their number), and one
still unsure after PROBE_ROUNDS rounds is decided by the model: the count is kept if the
schedule made at the bus rate measured under the probes' compute still offloads it. The
rate is a median of copy timings, far steadier than a step-time difference, and a rate within
the schedule's margin of the planned one counts as the planned one (the same band idea), so
the settled count is a function of measurements that repeat from run to run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Optional, Sequence

# Measured step-time overhead a plan may add over the step without offload.
STEP_OVERHEAD_TOLERANCE = 0.03
# Rounds of timed steps a probe takes at most while its verdict is unsure (Note [verdicts under noise]).
PROBE_ROUNDS = 4
# Paired steps a verdict needs at least: the median of fewer is moved by two slow steps of a
# shared machine (a collection, another tenant) landing on one side, by far more than the band.
MIN_PAIRS = 6
# The band is this many standard errors of the measured overhead wide on either side: a
# clear verdict is then wrong about once in a thousand probes, so a search of a few probes
# settles alike from run to run, and what the band leaves undecided the model decides ...
BAND_SIGMAS = 3.0
# ... but at least BAND_FLOOR (steps timed to the microsecond on a quiet machine still differ
# by launch jitter) and at most BAND_CAP: an overhead that far past the tolerance is rejected
# however noisy the machine.
BAND_FLOOR = 0.0025
BAND_CAP = 0.10
# The spread is read from at least this many steps without offload (below it the band is
# BAND_CAP): the median absolute deviation of three steps is the smaller of two deviations,
# near zero by chance, and a band drawn from it calls noise a clear verdict. The steps of the
# search's earlier probes count too (the machine's noise outlives one probe), the latest
# SPREAD_WINDOW of them.
MIN_SPREAD_STEPS = 6
SPREAD_WINDOW = 24
# Paired ratios of a probe from which their own spread is read (see `noise_band`).
PAIRS_FOR_SPREAD = 3
# Normal-consistent scale of the median absolute deviation, and the standard error of a
# median of n normal samples in units of sigma / sqrt(n).
MAD_SIGMA = 1.4826
MEDIAN_SE = math.sqrt(math.pi / 2)

WITHIN, OVER, UNSURE = "within", "over", "unsure"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One probe's judgement. `overhead`: the median of the paired ratios (an offloading step
    over the step without offload next to it) less one; `band`: the half-width around the
    tolerance inside which the verdict is UNSURE."""

    kind: str
    overhead: float
    band: float
    steps: int


def deviations(baseline_ms: Sequence[float]) -> list:
    """Each step's absolute deviation from the steps' median, as a share of the median."""
    centre = statistics.median(baseline_ms) if baseline_ms else 0.0
    return [abs(b - centre) / centre for b in baseline_ms] if centre > 0 else []


def noise_band(spread: Sequence[float], pairs: int, ratio_spread: Sequence[float] = ()) -> float:
    """Half-width of the unsure band for an overhead measured from `pairs` paired steps, from
    the relative deviations of steps without offload (`spread`, see `deviations`) and of the
    paired ratios themselves (`ratio_spread`), whichever says more noise.

    A spread is its median (robust to the odd slow step a shared machine gives), scaled to a
    normal sigma; a paired ratio carries the noise of two steps, and its median over `pairs`
    pairs has MEDIAN_SE x sqrt(2 / pairs) of one step's sigma. The ratios' own spread counts
    where the offloading steps vary more than the others (copies contending now and then), and
    a spread read from a few steps comes out low more often than high: the larger of the two
    is the safer band.
    """
    if pairs < MIN_PAIRS:
        return math.inf
    if len(spread) < MIN_SPREAD_STEPS:
        return BAND_CAP
    sigma = MAD_SIGMA * statistics.median(spread)
    if len(ratio_spread) >= PAIRS_FOR_SPREAD:
        sigma = max(sigma, MAD_SIGMA * statistics.median(ratio_spread) / math.sqrt(2.0))
    se = MEDIAN_SE * sigma * math.sqrt(2.0 / pairs)
    return min(BAND_CAP, max(BAND_FLOOR, BAND_SIGMAS * se))


def step_verdict(step_ms: Sequence[float], baseline_ms: Sequence[float],
                 tolerance: float = STEP_OVERHEAD_TOLERANCE, earlier: Sequence[float] = ()) -> Verdict:
    """The verdict on a probed count from its timed steps and the steps without offload taken
    in alternation with them (index i of each list: neighbours in time); `earlier`: relative
    deviations of steps without offload in earlier probes (see MIN_SPREAD_STEPS)."""
    if not step_ms or not baseline_ms:
        raise ValueError("offload.activation auto: a verdict needs timed steps of both sides, got "
                         f"{len(step_ms)} offloading and {len(baseline_ms)} without offload")
    pairs = min(len(step_ms), len(baseline_ms))
    # Paired ratios: a drift of the machine over the probe lands on both steps of a pair alike.
    ratios = [s / b for s, b in zip(step_ms, baseline_ms) if b > 0]
    overhead = statistics.median(ratios) - 1.0 if ratios else math.inf
    room = max(0, SPREAD_WINDOW - len(baseline_ms))  # this probe's steps first, then the latest earlier ones
    band = noise_band((list(earlier)[-room:] if room else []) + deviations(baseline_ms), pairs, deviations(ratios))
    if overhead <= tolerance - band:
        kind = WITHIN
    elif overhead > tolerance + band:
        kind = OVER
    else:
        kind = UNSURE
    return Verdict(kind, overhead, band, pairs)


class StepSearch:
    """How many layers of the schedule's order to offload, from measured step times.

    Each probe of a count times it against the step without offload, their steps taken in
    alternation, so that a machine whose steps drift (clocks, other tenants) by more than the
    tolerance between two probes judges each count against a baseline of the same minutes.
    Probes the model's choice first; keeps it if it is within `tolerance` of its baseline,
    else bisects down to the largest count that is. A count above zero is confirmed once
    before it is final: it is probed again and must still be within tolerance (else the
    search goes on below it). `probe` is the count to run now, None once settled (`final`).

    `record` judges a probe by its two medians alone; `judge` by its timed steps, with the
    unsure band and the model's word (Note [verdicts under noise]).
    """

    def __init__(self, model_k: int, tolerance: float = STEP_OVERHEAD_TOLERANCE):
        self.tolerance = tolerance
        self.model_k = model_k
        self.step_ms: dict = {}  # layers offloaded -> its latest probe's median step (ms)
        self.baseline_ms: dict = {}  # layers offloaded -> the median step without offload in that probe
        self.ok: dict = {}  # layers offloaded -> its latest probe's verdict: within tolerance
        self.verdicts: list = []  # per judged probe: layers, overhead, band, verdict, what decided it
        self.spread: list = []  # relative deviations of the judged probes' steps without offload
        self.lo, self.hi = 0, model_k  # largest count known within tolerance, smallest known over
        self.probe = model_k if model_k > 0 else None
        self.final = None if model_k > 0 else 0
        self.confirming = False  # the count probed now is being confirmed
        self.confirmed = False  # a confirmation ran (once per search: the steps are bounded)

    def within(self, k: int) -> bool:
        return self.ok[k]

    def record(self, k: int, ms: float, baseline_ms: float) -> None:
        """The probe of `k` layers: its median step and the baseline's, timed in alternation."""
        self._decide(k, ms, baseline_ms, ms <= (1.0 + self.tolerance) * baseline_ms)

    def judge(self, k: int, step_ms: Sequence[float], baseline_ms: Sequence[float], last_round: bool,
              model_count: Optional[Callable[[], Optional[int]]] = None) -> Optional[bool]:
        """The probe of `k` layers from its timed steps (alternated with `baseline_ms`): True or
        False once decided (the search moves on), None while unsure and not `last_round` (the
        probe takes more steps). An unsure last round keeps `k` if the model's count covers it:
        `model_count()`, the count the model offloads at the bus rate measured under compute
        (asked only then), or this search's own model count where it (or it) is None.
        """
        self._check(k)
        verdict = step_verdict(step_ms, baseline_ms, self.tolerance, self.spread)
        if verdict.kind == UNSURE and not last_round:
            return None
        self.spread = (self.spread + deviations(baseline_ms))[-SPREAD_WINDOW:]
        within = verdict.kind == WITHIN
        if verdict.kind == UNSURE:
            model = model_count() if model_count is not None else None
            within = k <= (self.model_k if model is None else model)
        self.verdicts.append({"layers": k, "overhead": verdict.overhead, "band": verdict.band,
                              "steps": verdict.steps, "verdict": verdict.kind,
                              "by": "model" if verdict.kind == UNSURE else "steps", "kept": within})
        self._decide(k, statistics.median(step_ms), statistics.median(baseline_ms), within)
        return within

    def _check(self, k: int) -> None:
        if k != self.probe:
            raise RuntimeError(f"offload.activation auto: a step of {k} layers was recorded while probing "
                               f"{self.probe}")

    def _decide(self, k: int, ms: float, baseline_ms: float, within: bool) -> None:
        self._check(k)
        self.step_ms[k] = ms
        self.baseline_ms[k] = baseline_ms
        self.ok[k] = within
        if self.confirming:
            self.confirming = False
            if within:
                self.probe, self.final = None, k
                return
            self.hi, self.lo = k, 0  # it did not hold: what is below it is unknown again
        elif within:
            self.lo = max(self.lo, k)
        else:
            self.hi = min(self.hi, k)
        if self.hi == self.lo or self.ok[self.hi]:  # the model's choice holds
            self._accept(self.hi)
        elif self.hi - self.lo <= 1:
            self._accept(self.lo)
        else:
            self.probe = (self.lo + self.hi) // 2

    def _accept(self, k: int) -> None:
        """End the search at `k`, after one more probe of it if it is above zero (the confirmation)."""
        if k > 0 and not self.confirmed:
            self.confirmed = self.confirming = True
            self.probe = k
            return
        self.probe, self.final = None, k
