"""Calibrating the simulator on the machine it will predict: measured decode steps and training
steps in, efficiency factors out (through `libra.planner.calibration`).

The CPU end-to-end job measures, per rollout decode iteration, the batch size and KV tokens it
ran with and how long it took, and per training step the batch's sequence lengths and the step
time. Each measurement is priced by the same cost model the simulator uses (so the fit is in the
simulator's own terms), the factors are fitted by least squares, and `prediction_errors` reports
how far the calibrated simulator is from held-out measurements.

On accelerators the measurements come from vLLM itself, run on the target nodes at each TP size:
`vllm bench latency` (`benchmarks/benchmark_latency.py` in older releases) with
`--output-json` writes the mean latency of `--batch-size` prompts of `--input-len` tokens each
generating `--output-len`; `LatencyRun.parse` reads such a file with the settings it was run
with, and `latency_measurements` prices the run as the cost model sees it (one prefill pass of the
batch, then output_len - 1 decode steps), so a sweep of TP x batch x context calibrates the same
factors (`libra simulate CONFIG --calibrate-vllm FILE:tp=..,batch=..,input=..,output=..`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from libra.planner.calibration import HeldOutError, Measurement, fit_factors, holdout_errors
from libra.planner.config import ClusterSpec, ModelArch, PlannerConfig, TrainingBatch
from libra.planner.cost_model import EfficiencyFactors, TimeBreakdown
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


@dataclass(frozen=True)
class LatencyRun:
    """One `vllm bench latency` run: `batch` prompts of `input_len` tokens, each generating
    `output_len`, on a TP-`tp` engine; `measured_s` its mean latency (the file's avg_latency)."""

    tp: int
    batch: int
    input_len: int
    output_len: int
    measured_s: float
    label: str = ""

    _SETTINGS = ("tp", "batch", "input", "output")

    @classmethod
    def parse(cls, spec: str) -> LatencyRun:
        """`FILE:tp=2,batch=8,input=1024,output=128`: the JSON file `--output-json` wrote and the
        settings the run used (the file does not record them)."""
        path, sep, settings = spec.rpartition(":")
        if not sep or not path:
            raise ValueError(f"--calibrate-vllm {spec!r}: expected FILE:tp=K,batch=B,input=I,output=O")
        values = {}
        for item in settings.split(","):
            key, eq, value = item.partition("=")
            if key.strip() not in cls._SETTINGS or not eq or not value.strip().isdigit() or int(value) < 1:
                raise ValueError(
                    f"--calibrate-vllm {spec!r}: {item!r} is not one of "
                    f"{', '.join(k + '=N' for k in cls._SETTINGS)} with N >= 1"
                )
            if key.strip() in values:
                raise ValueError(f"--calibrate-vllm {spec!r}: {key.strip()} is given twice")
            values[key.strip()] = int(value)
        missing = [k for k in cls._SETTINGS if k not in values]
        if missing:
            raise ValueError(f"--calibrate-vllm {spec!r}: missing {', '.join(missing)}")
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--calibrate-vllm: cannot read {path}: {e}") from e
        latency = data.get("avg_latency") if isinstance(data, dict) else None
        if not isinstance(latency, int | float) or latency <= 0:
            raise ValueError(
                f"--calibrate-vllm: {path} has no positive avg_latency (not a bench latency file?)"
            )
        return cls(
            values["tp"], values["batch"], values["input"], values["output"], float(latency), Path(path).name
        )


def latency_measurements(
    cluster: ClusterSpec, model: ModelArch, planner: PlannerConfig, runs: list[LatencyRun]
) -> list[Measurement]:
    """Each run as the cost model prices it: the batch's prompts prefilled in one pass, then
    output_len - 1 decode steps (the first token comes with the prefill) at a context growing
    from input_len, which the model's affine step sums exactly at the mean context."""
    cost = RolloutCostModel(cluster, model, planner, EfficiencyFactors())
    rows = []
    for r in runs:
        one = cost.prefill(r.tp, r.input_len)
        prefill = TimeBreakdown(
            compute_s=one.compute_s * r.batch,
            communication_s=one.communication_s * r.batch,
            overhead_steps=1.0,  # one engine step, like each decode step
            latency_s=one.latency_s,
        )
        steps = r.output_len - 1
        decode = cost.decode_step(r.tp, r.batch, r.input_len + r.output_len / 2).scaled(steps)
        rows.append(
            Measurement(
                prefill + decode,
                r.measured_s,
                label=r.label or f"vllm tp{r.tp} b{r.batch} in{r.input_len} out{r.output_len}",
                group=f"tp{r.tp}-b{r.batch}-in{r.input_len}-out{r.output_len}",
            )
        )
    return rows


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


def calibrate_rollout_by_vllm(
    cluster: ClusterSpec, model: ModelArch, planner: PlannerConfig, runs: list[LatencyRun]
) -> tuple[EfficiencyFactors, list[HeldOutError]]:
    """Rollout factors fitted to vLLM latency runs, and each run's error when it is held out.
    Communication is fitted only when a run has TP > 1. Refused, naming why: fewer distinct
    settings than factors to fit, a run faster than the profile's fixed floors alone, and a fit
    that cannot tell the factors apart (an efficiency of infinity)."""
    if not runs:
        raise ValueError("calibration needs at least one vLLM latency run")
    rows = latency_measurements(cluster, model, planner, runs)
    for row in rows:
        if row.measured_s <= row.breakdown.latency_s:
            raise ValueError(
                f"{row.label}: measured {row.measured_s:.4g} s, below the {row.breakdown.latency_s:.4g} s "
                f"the {cluster.profile.name} profile's fixed floors alone take (engine step overhead and "
                "all-reduce latency per step): check the run's settings, or lower the profile's floors"
            )
    settings = len({m.group for m in rows})
    fitted = 3 + any(r.tp > 1 for r in runs)  # compute, memory, overhead (+ communication)
    if settings < fitted:
        raise ValueError(
            f"fitting {fitted} rollout factors needs runs of at least {fitted} different settings "
            f"(batch sizes and contexts; TP sizes for communication), got {settings}"
        )
    factors = fit_factors(rows)
    degenerate = [n for n in ("compute", "memory", "communication") if not math.isfinite(getattr(factors, n))]
    if degenerate and (degenerate != ["communication"] or fitted == 4):
        raise ValueError(
            f"the runs do not separate the {', '.join(degenerate)} time from the rest (fitted efficiency "
            "infinite): add runs whose batch size or context differs more"
        )
    return factors, holdout_errors(rows)
