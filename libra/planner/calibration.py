"""Calibration: fit the efficiency factors to measured times, and report the error on held-out
measurements.

Every prediction is `TimeBreakdown.seconds(factors)`, linear in (1/compute, 1/memory,
1/communication, overhead_s) plus a fixed latency floor that is subtracted from the measurement,
so fitting is linear least squares on the breakdowns' feature rows.
Rows are weighted by 1/measured so the fit minimises relative error (a 2 s step and a 20 ms step
count alike). Coefficients must not be negative: a negative one is pinned to zero (that component
costs nothing: efficiency inf) and the rest refitted, a small active-set method. Factors named
in `fixed` keep their prior values and
their contribution moves to the right-hand side -- use it when the measurements cannot separate
a component (e.g. no communication at TP = 1).
"""

from __future__ import annotations

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
    """The factors that minimise the relative squared error over `measurements`."""
    unknown = [n for n in fixed if n not in FACTOR_NAMES]
    if unknown:
        raise ValueError(f"fixed names unknown factors {unknown}; known: {list(FACTOR_NAMES)}")
    if not measurements:
        raise ValueError("calibration needs at least one measurement")
    features = np.stack([m.breakdown.features() for m in measurements])
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
