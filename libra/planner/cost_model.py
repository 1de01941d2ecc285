"""What every cost model returns: times split into ideal components, and the efficiency factors
that turn them into predictions.

A prediction is

    time = compute_s / compute + memory_s / memory + communication_s / communication + overhead_s
           + latency_s + sum over overlapped pairs of max(c / compute, m / memory)

where `compute_s` is the time at the device's peak FLOP/s, `memory_s` at its peak memory
bandwidth and `communication_s` at its peak link bandwidth (one direction). An overlapped pair is
compute and memory traffic of the same kernels, which real engines run at once: a decode step's
matmuls read the weights and multiply them by the batch's activations, so they take the longer of
the two (the roofline), not their sum -- at batch 64 the sum would overstate a 14B model's step on
an A800 by ~1.6x. `latency_s` holds the
profile's measured floors (`HardwareProfile.allreduce_latency_s` per all-reduce, and an inference
engine's `engine_step_overhead_s` per step): not shares of a peak, so no efficiency scales them
and calibration moves them to the measured side (its `overhead_s` fits what is left). This is
what makes calibration a least-squares problem that is linear once each overlapped pair's bound
side is known (`libra.planner.calibration` tries each way the pairs can split).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EfficiencyFactors:
    """Achieved share of each peak (in (0, 1] on real hardware) and a fixed per-step overhead."""

    compute: float = 0.5
    memory: float = 0.85
    communication: float = 0.7
    overhead_s: float = 0.0
    """Framework time per step (kernel launches, Python, scheduling)."""

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "communication"):
            if getattr(self, name) <= 0:
                raise ValueError(f"efficiency {name} must be > 0, got {getattr(self, name)}")
        if self.overhead_s < 0:
            raise ValueError(f"efficiency overhead_s must be >= 0, got {self.overhead_s}")


@dataclass(frozen=True)
class TimeBreakdown:
    """Ideal (peak-rate) time components of one operation, in seconds."""

    compute_s: float = 0.0
    memory_s: float = 0.0
    communication_s: float = 0.0
    overhead_steps: float = 0.0
    """How many times the per-step overhead is paid."""
    latency_s: float = 0.0
    """Measured floors (collective latency, an engine's host time per step), in seconds as they
    are (not scaled by an efficiency)."""
    overlapped: tuple[tuple[float, float], ...] = ()
    """(compute_s, memory_s) of kernels that compute while they read: each pair takes the longer
    of its two times. Kept apart per operation, so that a sum of steps is the sum of their maxima."""

    def __add__(self, other: TimeBreakdown) -> TimeBreakdown:
        return TimeBreakdown(
            self.compute_s + other.compute_s,
            self.memory_s + other.memory_s,
            self.communication_s + other.communication_s,
            self.overhead_steps + other.overhead_steps,
            self.latency_s + other.latency_s,
            self.overlapped + other.overlapped,
        )

    def scaled(self, factor: float) -> TimeBreakdown:
        return TimeBreakdown(
            self.compute_s * factor,
            self.memory_s * factor,
            self.communication_s * factor,
            self.overhead_steps * factor,
            self.latency_s * factor,
            tuple((c * factor, m * factor) for c, m in self.overlapped),
        )

    def features(self, eff: EfficiencyFactors) -> np.ndarray:
        """The row of the calibration design matrix: coefficients of (1/compute, 1/memory,
        1/communication, overhead_s); `latency_s` is not one (it is subtracted from the measurement).
        Each overlapped pair counts on the side that binds under `eff` (the other is hidden)."""
        compute, memory = self.compute_s, self.memory_s
        for c, m in self.overlapped:
            if c / eff.compute >= m / eff.memory:
                compute += c
            else:
                memory += m
        return np.array([compute, memory, self.communication_s, self.overhead_steps])

    def seconds(self, eff: EfficiencyFactors) -> float:
        return (
            self.compute_s / eff.compute
            + self.memory_s / eff.memory
            + self.communication_s / eff.communication
            + self.overhead_steps * eff.overhead_s
            + self.latency_s
            + sum(max(c / eff.compute, m / eff.memory) for c, m in self.overlapped)
        )


def ring_allreduce_s(num_bytes: float, group: int, bandwidth: float) -> float:
    """Ideal ring all-reduce time: each member sends and receives 2 (g-1)/g of the buffer."""
    if group <= 1:
        return 0.0
    return 2.0 * (group - 1) / group * num_bytes / bandwidth


def allreduce_latency_s(group: int, latency_s: float) -> float:
    """Latency floor of one all-reduce over `group` members: none for a group of one. Small
    all-reduces run as one-shot kernels (every member reads its peers' buffers at once), so the
    floor does not grow with the group inside a node (see `libra.backends.profiles`)."""
    return latency_s if group > 1 else 0.0
