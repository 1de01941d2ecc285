"""Calibrating the simulator on the machine it will predict: measured decode steps and training
steps in, efficiency factors out (through `libra.planner.calibration`).

The CPU end-to-end job measures, per rollout decode iteration, the batch size and KV tokens it
ran with and how long it took, and per training step the batch's sequence lengths and the step
time. Each measurement is priced by the same cost model the simulator uses (so the fit is in the
simulator's own terms), the factors are fitted by least squares, and `prediction_errors` reports
how far the calibrated simulator is from held-out measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.planner.calibration import HeldOutError, Measurement, fit_factors, holdout_errors
from libra.planner.config import ClusterSpec, ModelArch, PlannerConfig, TrainingBatch
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel


@dataclass(frozen=True)
class DecodeSample:
    tp: int
    batch: int
    kv_tokens: float
    """KV tokens held by the whole batch."""
    measured_s: float


@dataclass(frozen=True)
class TrainSample:
    config: TrainingConfig
    sequence_lengths: tuple[int, ...]
    measured_s: float


def decode_measurements(
    cluster: ClusterSpec, model: ModelArch, planner: PlannerConfig, samples: list[DecodeSample]
) -> list[Measurement]:
    cost = RolloutCostModel(cluster, model, planner, EfficiencyFactors())
    return [
        Measurement(
            cost.decode_step(s.tp, s.batch, s.kv_tokens / max(s.batch, 1)),
            s.measured_s,
            label=f"decode tp{s.tp} b{s.batch}",
            group=f"tp{s.tp}-b{s.batch}",
        )
        for s in samples
    ]


def train_measurements(
    cluster: ClusterSpec,
    model: ModelArch,
    batch: TrainingBatch,
    planner: PlannerConfig,
    samples: list[TrainSample],
) -> list[Measurement]:
    cost = TrainingCostModel(cluster, model, batch, planner, EfficiencyFactors())
    rows = []
    for s in samples:
        if not s.sequence_lengths:
            raise ValueError("a training sample needs the batch's sequence lengths")
        n = len(s.sequence_lengths)
        seqs = SequenceStats(
            sum(s.sequence_lengths) / n, sum(x * x for x in s.sequence_lengths) / n, max(s.sequence_lengths)
        )
        rows.append(
            Measurement(
                cost.step(s.config, seqs), s.measured_s, label=f"train {s.config}", group=str(s.config)
            )
        )
    return rows


@dataclass(frozen=True)
class Calibration:
    rollout: EfficiencyFactors
    train: EfficiencyFactors
    rollout_errors: list[HeldOutError]
    train_errors: list[HeldOutError]


def calibrate(
    cluster: ClusterSpec,
    model: ModelArch,
    batch: TrainingBatch,
    planner: PlannerConfig,
    decode: list[DecodeSample],
    train: list[TrainSample],
    fixed: tuple[str, ...] = ("communication",),
) -> Calibration:
    """Fits the rollout and training factors; hold-out errors need two or more configurations
    per side (otherwise the list is empty). Communication is fixed by default: a single CPU
    machine has no links to measure."""
    decode_rows = decode_measurements(cluster, model, planner, decode)
    train_rows = train_measurements(cluster, model, batch, planner, train)
    return Calibration(
        rollout=fit_factors(decode_rows, fixed=fixed),
        train=fit_factors(train_rows, fixed=fixed),
        rollout_errors=holdout_errors(decode_rows, fixed=fixed)
        if len({m.group for m in decode_rows}) > 1
        else [],
        train_errors=holdout_errors(train_rows, fixed=fixed)
        if len({m.group for m in train_rows}) > 1
        else [],
    )
