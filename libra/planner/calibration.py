"""Calibration: fit the efficiency factors to measured times, and report the error on held-out
measurements.

Every prediction is `TimeBreakdown.seconds(factors)`, linear in (1/compute, 1/memory,
1/communication, overhead_s) plus a fixed latency floor that is subtracted from the measurement,
once each overlapped compute/memory pair's binding side is known, so fitting is linear least
squares on the breakdowns' feature rows, once for each way the pairs can split (`fit_factors`).
Rows are weighted by 1/measured so the fit minimises relative error (a 2 s step and a 20 ms step
count alike). Coefficients must not be negative: a negative one is pinned to zero (that component
costs nothing: efficiency inf) and the rest refitted, a small active-set method. Factors named
in `fixed` keep their prior values and
their contribution moves to the right-hand side -- use it when the measurements cannot separate
a component (e.g. no communication at TP = 1).

`StepCalibration` is the online half: while a plan runs, the planner compares each stage's
measured step time with the model's prediction for that plan and scales the stage's factors by
the ratio (`scaled_factors`), so that candidates and the running plan are priced by one
calibrated model and their difference is in measured seconds.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from libra.planner.cost_model import EfficiencyFactors, TimeBreakdown

FACTOR_NAMES = ("compute", "memory", "communication", "overhead_s")
DEFAULT_PRIOR = EfficiencyFactors()


@dataclass(frozen=True)
class Measurement:
    breakdown: TimeBreakdown
    """What the cost model says the measured operation consists of."""
    measured_s: float
    label: str = ""
    group: str = ""
    """Repetitions of one configuration share a group; hold-out leaves whole groups out."""

    def __post_init__(self) -> None:
        if self.measured_s <= 0:
            raise ValueError(f"measurement {self.label!r}: measured_s must be > 0, got {self.measured_s}")


@dataclass(frozen=True)
class HeldOutError:
    label: str
    predicted_s: float
    measured_s: float

    @property
    def relative_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def _to_coefficients(f: EfficiencyFactors) -> np.ndarray:
    return np.array([1 / f.compute, 1 / f.memory, 1 / f.communication, f.overhead_s])


def fit_factors(
    measurements: list[Measurement],
    prior: EfficiencyFactors = DEFAULT_PRIOR,
    fixed: tuple[str, ...] = (),
) -> EfficiencyFactors:
    """The factors that minimise the relative squared error over `measurements`.

    Which side of an overlapped pair (c, m) (`TimeBreakdown.overlapped`) binds depends on the
    factors being fitted: compute when c / m >= compute / memory. So the sides are those of one
    threshold on c / m, and the fit tries each: below every pair's ratio, between each two, above
    all -- a linear fit each, tens of small fits for tens of measurements -- and keeps the one
    whose factors predict the measurements best, among the splits that put at least
    `MIN_SIDE_MEASUREMENTS` on a side whose efficiency they alone would set (of all, if none
    does). A factor no measurement shows (the compute efficiency when every pair is on its
    memory side) keeps its prior, raised where needed to the least value that leaves those pairs
    on that side."""
    unknown = [n for n in fixed if n not in FACTOR_NAMES]
    if unknown:
        raise ValueError(f"fixed names unknown factors {unknown}; known: {list(FACTOR_NAMES)}")
    if not measurements:
        raise ValueError("calibration needs at least one measurement")
    pairs = [pair for m in measurements for pair in m.breakdown.overlapped]
    ratios = sorted({c / m for c, m in pairs if c > 0 and m > 0})
    # A threshold between each two ratios (not at one, where rounding could flip that pair).
    thresholds = [ratios[0] / 2] if ratios else []
    thresholds += [math.sqrt(a * b) for a, b in itertools.pairwise(ratios)] + [math.inf]
    fits = []  # (set by too few, error, factors) of each split
    for ratio in thresholds:
        # Factors whose compute / memory is `ratio` put exactly the pairs at or above it on their
        # compute side.
        sides = EfficiencyFactors(compute=ratio, memory=1.0)
        features = np.stack([m.breakdown.features(sides) for m in measurements])
        factors = _kept_on_their_sides(
            _fit_linear(features, measurements, prior, fixed), features, pairs, ratio, fixed
        )
        too_few = not _each_side_set_by_enough(measurements, features, ratio, fixed)
        fits.append((too_few, _relative_error(factors, measurements), factors))
    # The best admissible split; with none (a handful of measurements), the best of all.
    return min(fits, key=lambda fit: fit[:2])[2]


MIN_SIDE_MEASUREMENTS = 2
"""Measurements a split must put on a side before that side's efficiency may be fitted from them
alone."""


def _each_side_set_by_enough(
    measurements: list[Measurement], features: np.ndarray, ratio: float, fixed: tuple[str, ...]
) -> bool:
    """Whether the split at `ratio` lets no efficiency be set by fewer than
    `MIN_SIDE_MEASUREMENTS` measurements: one noisy step put alone on its side would fit that
    side's efficiency exactly (a review's trials: memory 4.5x off)."""
    for column, name in ((0, "compute"), (1, "memory")):
        plain = [m.breakdown.compute_s if column == 0 else m.breakdown.memory_s for m in measurements]
        if name in fixed or any(plain) or not features[:, column].any():
            continue  # fixed, seen outside the pairs, or not fitted at all
        on_side = sum(
            1
            for m in measurements
            if any(_on_compute_side(c, mem, ratio) == (column == 0) for c, mem in m.breakdown.overlapped)
        )
        if on_side < MIN_SIDE_MEASUREMENTS:
            return False
    return True


def _kept_on_their_sides(
    factors: EfficiencyFactors,
    features: np.ndarray,
    pairs: list[tuple[float, float]],
    ratio: float,
    fixed: tuple[str, ...],
) -> EfficiencyFactors:
    """`factors` with an unobserved compute (memory) efficiency raised so that every overlapped
    pair the fit counted on its memory (compute) side -- c / m below (at or above) `ratio` --
    stays there."""
    if "compute" not in fixed and not features[:, 0].any():
        needed = max(
            (c * factors.memory / m for c, m in pairs if m > 0 and not _on_compute_side(c, m, ratio)),
            default=0.0,
        )
        factors = dataclasses.replace(factors, compute=max(factors.compute, needed * (1 + 1e-9)))
    if "memory" not in fixed and not features[:, 1].any():
        needed = max(
            (m * factors.compute / c for c, m in pairs if c > 0 and _on_compute_side(c, m, ratio)),
            default=0.0,
        )
        factors = dataclasses.replace(factors, memory=max(factors.memory, needed * (1 + 1e-9)))
    return factors


def _on_compute_side(compute_s: float, memory_s: float, ratio: float) -> bool:
    """Whether the split at `ratio` counts an overlapped pair on its compute side: as
    `TimeBreakdown.features` does under factors whose compute / memory is `ratio`."""
    return compute_s / ratio >= memory_s


def _relative_error(factors: EfficiencyFactors, measurements: list[Measurement]) -> float:
    return sum(((m.breakdown.seconds(factors) - m.measured_s) / m.measured_s) ** 2 for m in measurements)


def _fit_linear(
    features: np.ndarray, measurements: list[Measurement], prior: EfficiencyFactors, fixed: tuple[str, ...]
) -> EfficiencyFactors:
    measured = np.array([m.measured_s for m in measurements])
    weights = 1.0 / measured
    # The collectives' latency floor is a measured constant, not a share of a peak: it is what
    # the factors must NOT explain.
    measured = measured - np.array([m.breakdown.latency_s for m in measurements])
    coefficients = _to_coefficients(prior)
    free = [i for i, name in enumerate(FACTOR_NAMES) if name not in fixed and features[:, i].any()]
    while free:
        pinned = [i for i in range(len(FACTOR_NAMES)) if i not in free]
        rhs = measured - features[:, pinned] @ coefficients[pinned]
        solution, *_ = np.linalg.lstsq(features[:, free] * weights[:, None], rhs * weights, rcond=None)
        if (solution >= 0).all():
            coefficients[free] = solution
            break
        for i, value in zip(free, solution, strict=True):
            if value < 0:
                coefficients[i] = 0.0
        free = [i for i, value in zip(free, solution, strict=True) if value >= 0]

    def efficiency(c: float) -> float:
        return float("inf") if c == 0 else float(1 / c)

    return EfficiencyFactors(
        compute=efficiency(coefficients[0]),
        memory=efficiency(coefficients[1]),
        communication=efficiency(coefficients[2]),
        overhead_s=float(coefficients[3]),
    )


def holdout_errors(
    measurements: list[Measurement],
    prior: EfficiencyFactors = DEFAULT_PRIOR,
    fixed: tuple[str, ...] = (),
) -> list[HeldOutError]:
    """Leave-one-group-out: fit on every other configuration, predict the held-out one."""
    groups = sorted({m.group or m.label for m in measurements})
    errors = []
    for group in groups:
        train = [m for m in measurements if (m.group or m.label) != group]
        if not train:
            raise ValueError("hold-out needs measurements of at least two configurations")
        factors = fit_factors(train, prior, fixed)
        for m in measurements:
            if (m.group or m.label) == group:
                errors.append(HeldOutError(m.label, m.breakdown.seconds(factors), m.measured_s))
    return errors


# -- online: per-stage scales of the running plan -------------------------------------------------


def scaled_factors(factors: EfficiencyFactors, scale: float) -> EfficiencyFactors:
    """Factors whose predictions are `scale` times those of `factors` (the collectives' latency
    floor, a measured constant, stays as it is)."""
    if not scale > 0 or math.isinf(scale):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return EfficiencyFactors(
        compute=factors.compute / scale,
        memory=factors.memory / scale,
        communication=factors.communication / scale,
        overhead_s=factors.overhead_s * scale,
    )


@dataclass(frozen=True)
class StageScales:
    """Measured over predicted step time, per stage."""

    train: float = 1.0
    rollout: float = 1.0


ROLLOUT_BOUND_MARGIN = 0.05
"""A step whose rollout time exceeds its train time by less than this share did not wait for
rollout in any way a step time can show: its rollout time is only an upper bound."""


PriceAt = Callable[[StageScales], tuple[float, float]]
"""The running plan's (train, rollout) step time predicted with the factors scaled per stage."""

MIN_SCALE, MAX_SCALE = 1e-3, 1e3
MIN_SCALABLE_SHARE = 0.5
SECANT_STEPS, SECANT_TOLERANCE = 8, 0.005


class StepCalibration:
    """Per-stage scales from the steps the running plan took.

    A training step is measured directly. Rollout is measured only as the time it took to deliver
    a step's batch, and when training was the slower stage that is the train time, not rollout's:
    a bound. So the rollout scale is fitted to the median of the steps where rollout bound the
    step when most of them did; otherwise it may only shrink to what the bound allows, starting
    from the train scale (no evidence that the model errs differently on the two stages).
    Scales outlive a plan change (they describe the model's error, not the plan); the steps do
    not (they were measured under the old plan).

    A scale is not simply measured / predicted: part of a prediction no factor scales (the
    collectives' latency floor, the time trajectories spend in tools), and a bucket's makespan
    switches between bounds, so each stage's prediction is piecewise linear in its scale. The
    scale is the root of predicted(s) = measured, found by a few secant steps.

    One scale per stage assumes the model errs alike on every layout. Where it does not, the
    scales fitted under successive plans differ, and `spread` says by how much: a candidate
    must beat the running plan by more than that to count as faster (else the planner would
    move back and forth between layouts, each looking better under the other's scale)."""

    def __init__(self, window: int = 8, min_steps: int = 3):
        if window < 1 or not 1 <= min_steps <= window:
            raise ValueError(f"calibration needs window >= min_steps >= 1, got {window}, {min_steps}")
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)
        self._min_steps = min_steps
        self.scales = StageScales()
        self._rollout_measured = False
        self._plan_fit: tuple[float | None, float | None] | None = None
        """The (train, rollout) scales fitted under the running plan; None where a stage was not."""
        self._past_fits: deque[tuple[float | None, float | None]] = deque(maxlen=window)

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def record(self, train_s: float, rollout_s: float) -> None:
        if train_s > 0 and rollout_s > 0:
            self._steps.append((train_s, rollout_s))

    def restart(self) -> None:
        """A new plan runs: the steps so far measured the old one."""
        self._steps.clear()
        if self._plan_fit is not None:
            self._past_fits.append(self._plan_fit)
        self._plan_fit = None

    @property
    def spread(self) -> float:
        """How far the scales fitted under the recent plans lie apart (max / min - 1, the larger
        of the two stages; a stage counts only where it was fitted, not carried over); 0 until
        a stage was fitted under two plans."""
        fits = [*self._past_fits, *([self._plan_fit] if self._plan_fit else [])]
        spreads = [0.0]
        for stage in (0, 1):
            values = [f[stage] for f in fits if f[stage] is not None]
            if len(values) >= 2:
                spreads.append(max(values) / min(values) - 1)
        return max(spreads)

    def update(self, price_at: PriceAt) -> StageScales:
        """The scales after fitting the running plan's predictions (`price_at`) to the recorded
        steps (unchanged while too few steps were recorded under the running plan)."""
        if len(self._steps) < self._min_steps:
            return self.scales
        bound = [r for t, r in self._steps if r > t * (1 + ROLLOUT_BOUND_MARGIN)]
        measured = 2 * len(bound) > len(self._steps)
        targets = (
            statistics.median(t for t, _ in self._steps),
            statistics.median(bound if measured else [r for _, r in self._steps]),
        )
        (train, rollout), (train_fitted, rollout_fitted) = _fit(
            price_at, targets, (self.scales.train, self.scales.rollout)
        )
        if measured and rollout_fitted:
            self._rollout_measured = True
        elif not measured:  # `rollout` is the largest scale the bound allows
            rollout = min(self.scales.rollout if self._rollout_measured else train, rollout)
        self.scales = StageScales(train, rollout)
        self._plan_fit = (train if train_fitted else None, rollout if measured and rollout_fitted else None)
        return self.scales


def _fit(
    price_at: PriceAt, targets: tuple[float, float], fallback: tuple[float, float]
) -> tuple[tuple[float, float], tuple[bool, bool]]:
    """Per stage, the scale whose prediction meets the target (secant steps from scale 1). A
    stage keeps its fallback when the model cannot price it (0 or inf), when no scale meets the
    target (the parts no factor scales alone exceed the measurement: in an asynchronous loop a
    step can take less than the slowest trajectory plus its tool time), or when at the solution
    less than `MIN_SCALABLE_SHARE` of the prediction scales (a fixed part, the slowest
    trajectory's latency say, bounds it): then the measurement says little about the factors,
    and a scale fitted to it would call that stage nearly free or very slow. Returns the scales
    and which stages were fitted."""
    x0, y0 = (1.0, 1.0), price_at(StageScales(1.0, 1.0))
    priceable = [0 < y < math.inf for y in y0]
    x1 = tuple(
        _clamp(t / y) if ok else f for t, y, ok, f in zip(targets, y0, priceable, fallback, strict=True)
    )
    met = [False, False]
    for _ in range(SECANT_STEPS):
        y1 = price_at(StageScales(*x1))
        met = [
            ok and abs(y - t) <= SECANT_TOLERANCE * t for y, t, ok in zip(y1, targets, priceable, strict=True)
        ]
        if all(m or not ok for m, ok in zip(met, priceable, strict=True)):
            break
        step = []
        for a, fa, b, fb, t, done in zip(x0, y0, x1, y1, targets, met, strict=True):
            slope = (fb - fa) / (b - a) if b != a else 0.0
            if done or not math.isfinite(fb):
                step.append(b)
            elif slope > 0:
                step.append(_clamp(b + (t - fb) / slope))
            else:
                step.append(_clamp(b * t / fb))
        x0, y0, x1 = x1, y1, tuple(step)
    if any(met):  # how much of each prediction its scale moves: y(x) - y(x/2) is half of it
        half = price_at(StageScales(*(x / 2 for x in x1)))
        met = [m and 2 * (y - h) >= MIN_SCALABLE_SHARE * y for m, y, h in zip(met, y1, half, strict=True)]
    scales = tuple(x if m else f for x, m, f in zip(x1, met, fallback, strict=True))
    return scales, tuple(met)


def _clamp(scale: float) -> float:
    return min(MAX_SCALE, max(MIN_SCALE, scale))
