"""Does the simulator predict a real run? Replay a run folder's own trajectories on a simulated
copy of its cluster, calibrated on that run's own measurements, and compare step times.

A run folder written by `libra run` holds what this needs:
- `trajectories.jsonl`: every trajectory in the trace format (`libra.trace`);
- `metrics.jsonl`: per training step its wall interval (`step_time_s`), the training and weight
  publication times, and the trajectories consumed;
- `occupancy.jsonl`: once a second, the live trajectories per bucket and the generated tokens/s;
- `events.jsonl`: the `started` event names the model folder and the worker counts.

Calibration (least squares, `libra.sim.calibration`): every occupancy sample is one decode
measurement (B = live trajectories per instance, step = B / per-instance tokens/s); every step is
one training measurement (its batch's lengths, train + publish seconds). The replay then runs the
job's loop in the simulator -- disaggregated, asynchronous with the run's staleness bound, the
run's rollout instances under C-MLFQ -- drawing the run's own groups in their order instead of a
synthetic workload. Predicted and measured step times are compared from step `skip_steps` on
(the first step also pays start-up).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from libra.model_spec import DTYPE_BYTES, ModelSpec
from libra.planner.calibration import fit_factors, holdout_errors
from libra.planner.config import ModelArch, PlannerConfig, RequestRecord, TrainingBatch
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.plan import place_rollout
from libra.planner.training_cost import TrainingConfig
from libra.scheduler.factory import RouterKind
from libra.sim.calibration import (
    Calibration,
    DecodeSample,
    TrainSample,
    decode_measurements,
    train_measurements,
)
from libra.sim.config import Mode, PolicySpec, Pool, SimConfig
from libra.sim.loop import AsyncRun
from libra.sim.metrics import SimResult
from libra.sim.pools import Layout
from libra.sim.workloads import ReplayedGroups, WorkloadConfig
from libra.trace import TrajectoryTrace, read_traces

REPLAY_POLICY = PolicySpec(
    "replay", Mode.DISAGGREGATED_ASYNC, Pool.PLANNED, RouterKind.CMLFQ, description="a real run, replayed"
)


@dataclass(frozen=True)
class RunRecord:
    """What a run folder says about the run."""

    traces: tuple[TrajectoryTrace, ...]
    steps: tuple[dict, ...]
    """metrics.jsonl rows, in step order."""
    occupancy: tuple[tuple[int, float], ...]
    """(live trajectories, generated tokens/s) per sample with tokens flowing."""
    model: ModelArch
    num_rollout_instances: int
    num_train_ranks: int
    finish_order: tuple[str, ...]
    """Trajectory ids in the order they finished (samples.jsonl), to split batches by step."""


def read_run(run_dir: str | Path) -> RunRecord:
    """Reads a run folder; ValueError naming the missing or malformed part."""
    run_dir = Path(run_dir)
    for name in ("trajectories.jsonl", "metrics.jsonl", "occupancy.jsonl", "events.jsonl"):
        if not (run_dir / name).is_file():
            raise ValueError(f"{run_dir} has no {name}: not a `libra run` folder")
    steps = tuple(sorted(_jsonl(run_dir / "metrics.jsonl"), key=lambda row: row["step"]))
    if len(steps) < 2:
        raise ValueError(f"{run_dir}/metrics.jsonl has {len(steps)} steps; the comparison needs 2 or more")
    # The string of `libra.job.recorder.JobEvent.STARTED`: the run folder is the contract (the job
    # sits above the simulator, which reads its files and imports none of it).
    started = next((e for e in _jsonl(run_dir / "events.jsonl") if e.get("kind") == "started"), None)
    if started is None or "model" not in started:
        raise ValueError(f"{run_dir}/events.jsonl has no `started` event naming the model")
    counts = [int(word) for word in started["message"].replace(",", " ").split() if word.isdigit()]
    if len(counts) < 2:
        raise ValueError(f"cannot read the worker counts from {started['message']!r}")
    spec = ModelSpec.from_hf_dir(started["model"])
    # A config.json that names no dtype is taken as the tiny models' float32.
    model = ModelArch.from_spec(spec, DTYPE_BYTES.get(spec.dtype or "float32", 2))
    occupancy = tuple(
        (sum(row["buckets"].values()), float(row["tokens_per_s"]))
        for row in _jsonl(run_dir / "occupancy.jsonl")
        if row.get("tokens_per_s", 0) > 0 and sum(row["buckets"].values()) > 0
    )
    samples = sorted(_jsonl(run_dir / "samples.jsonl"), key=lambda row: row.get("finished_s", 0.0))
    return RunRecord(
        traces=tuple(read_traces(run_dir / "trajectories.jsonl")),
        steps=steps,
        occupancy=occupancy,
        model=model,
        num_rollout_instances=counts[0],
        num_train_ranks=counts[1],
        finish_order=tuple(row["trajectory_id"] for row in samples),
    )


def _jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line.replace("NaN", "null")))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from error
    return rows


@dataclass(frozen=True)
class ValidationReport:
    measured_step_s: list[float]
    predicted_step_s: list[float]
    calibration: Calibration
    sim: SimResult
    notes: list[str] = field(default_factory=list)

    @property
    def measured_mean_s(self) -> float:
        return sum(self.measured_step_s) / len(self.measured_step_s)

    @property
    def predicted_mean_s(self) -> float:
        return sum(self.predicted_step_s) / len(self.predicted_step_s)

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured mean step time."""
        return (self.predicted_mean_s - self.measured_mean_s) / self.measured_mean_s


def sim_config_of_run(record: RunRecord, max_staleness: int) -> SimConfig:
    """The run's cluster as a simulation: one host whose devices are the run's CPU slots."""
    global_batch = int(record.steps[0]["num_trajectories"])
    groups = defaultdict(int)
    for trace in record.traces:
        groups[trace.group_id] += 1
    group_size = max(groups.values())
    # The cluster model wants a power-of-two node: a device over the run's slots stays idle.
    num_devices = 1 << (record.num_rollout_instances + record.num_train_ranks - 1).bit_length()
    return SimConfig(
        name="replay",
        profile="cpu",
        num_nodes=1,
        devices_per_node=num_devices,
        model=record.model,
        batch=TrainingBatch(
            global_batch=global_batch,
            group_size=group_size,
            micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
            max_staleness=max_staleness,
        ),
        workload=WorkloadConfig(group_size=group_size),
        planner=PlannerConfig(activation_workspace_bytes=0),
        num_steps=len(record.steps),
        fixed_node_pattern=(1,) * num_devices,
    )


def calibrate_from_run(record: RunRecord, config: SimConfig, training: TrainingConfig) -> Calibration:
    """Efficiency factors fitted to the run's own decode and training times."""
    by_id = {t.trajectory_id: t for t in record.traces}
    contexts = [t.prompt_tokens + (t.output_tokens + t.payload_tokens) / 2 for t in record.traces]
    mean_context = sum(contexts) / len(contexts)
    n = record.num_rollout_instances
    decode = [
        DecodeSample(
            1, max(1, round(live / n)), max(1.0, live / n) * mean_context, max(1.0, live / n) / (tps / n)
        )
        for live, tps in record.occupancy
    ]
    finished = [by_id[i] for i in record.finish_order if i in by_id] or list(record.traces)
    train, first = [], 0
    for row in record.steps:
        count = int(row["num_trajectories"])
        batch = finished[first : first + count] or finished[-count:]
        first += count
        seconds = float(row["train_time_s"]) + float(row.get("publish_time_s") or 0.0)
        train.append(TrainSample(training, tuple(t.total_tokens for t in batch), seconds))
    # One host has no links to measure: communication keeps its prior. A few dozen samples of
    # one decode shape cannot tell FLOPs from bytes, and a decode step's per-sequence cost on a
    # tiny model is framework work, not FLOPs: decode fits the byte term (it scales with the
    # batch's KV) and a per-step overhead, and compute keeps the prior that prices prefills.
    # Training fits FLOPs and a per-step overhead (a tiny model's weight traffic is negligible).
    rollout = fit_factors(
        decode_measurements(config.cluster, config.model, config.planner, decode),
        fixed=("compute", "communication"),
    )
    # Every step is its own hold-out group: leave-one-step-out says how well one fit prices the
    # steps it did not see.
    train_rows = [
        replace(row, group=f"step {i}")
        for i, row in enumerate(
            train_measurements(config.cluster, config.model, config.batch, config.planner, train)
        )
    ]
    fixed = ("memory", "communication")
    return Calibration(
        rollout=rollout,
        train=fit_factors(train_rows, fixed=fixed),
        rollout_errors=[],
        train_errors=holdout_errors(train_rows, fixed=fixed) if len(train_rows) > 1 else [],
    )


def validate_run(
    run_dir: str | Path, max_staleness: int = 1, skip_steps: int = 1, micro_batch: int = 16
) -> ValidationReport:
    """Calibrates on the run, replays it, and compares mean step times (steps after `skip_steps`)."""
    record = read_run(run_dir)
    if len(record.steps) <= skip_steps:
        raise ValueError(f"the run has {len(record.steps)} steps; skip_steps={skip_steps} leaves none")
    config = sim_config_of_run(record, max_staleness)
    training = TrainingConfig(1, 1, record.num_train_ranks, min(micro_batch, config.batch.global_batch))
    calibration = calibrate_from_run(record, config, training)
    config = _with_factors(config, calibration.train, calibration.rollout)
    n_train = record.num_train_ranks
    instances = place_rollout(
        n_train, config.num_devices, config.devices_per_node, [1] * record.num_rollout_instances
    )
    layout = Layout(training, tuple(range(n_train)), instances, (1, 2), (256, 4096))
    history = tuple(RequestRecord.from_trace(t) for t in record.traces)
    replay = ReplayedGroups.of_traces(record.traces)
    run = AsyncRun(config, REPLAY_POLICY, layout, _history(history, config.history_size), groups=replay)
    run.run()
    result = run.result(0.0)
    predicted = _intervals([s.ended_at for s in result.steps])
    measured = [float(row["step_time_s"]) for row in record.steps]
    return ValidationReport(
        measured_step_s=measured[skip_steps:],
        predicted_step_s=predicted[skip_steps:],
        calibration=calibration,
        sim=result,
        notes=[
            f"{len(record.traces)} trajectories in {len(replay.groups)} groups, "
            f"{record.num_rollout_instances} rollout instances, {n_train} train rank(s), "
            f"{len(record.occupancy)} decode and {len(record.steps)} training measurements"
        ],
    )


def _intervals(step_ends_s: list[float]) -> list[float]:
    """Step times as the job measures them: its trainer waits for a batch, trains and publishes,
    back to back, so a step's time runs from the previous step's end (the first from 0)."""
    return [b - a for a, b in zip([0.0, *step_ends_s], step_ends_s, strict=False)]


def _history(history: tuple[RequestRecord, ...], size: int) -> tuple[RequestRecord, ...]:
    return history[:size]


def _with_factors(config: SimConfig, train: EfficiencyFactors, rollout: EfficiencyFactors) -> SimConfig:
    return replace(config, train_factors=train, rollout_factors=rollout)
