"""The experiment trackers a run's scalars go to, besides `metrics.jsonl`: TensorBoard (the
default, under `<run_dir>/tensorboard`), Weights & Biases and MLflow, chosen by `job.trackers`.

Every tracker gets the same scalars: each step's `StepMetrics` as `job/<field>` at the step, each
held-out evaluation as `eval/<when>_<field>` at its version. A value that was not measured (NaN,
e.g. the logprob gap of a step whose batch had no current tokens) is left out everywhere.

A resumed run continues its tracker runs: the W&B run id and the MLflow run id are kept in
`<run_dir>/trackers.json`. TensorBoard drops the scalars from the resumed step on (its purge
step); W&B keeps its first value of a step logged twice, MLflow both.

W&B and MLflow are optional (Libra's `trackers` extra): naming one that is not installed is an
error at start, naming the package. `WANDB_MODE=offline` keeps W&B local; MLflow logs to
`job.mlflow_tracking_uri`, by default a file store in the run folder.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

IDS_FILE = "trackers.json"


class TrackerKind(enum.StrEnum):
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"


class Tracker(Protocol):
    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def measured(scalars: Mapping[str, float]) -> dict[str, float]:
    """The scalars a tracker logs: numbers, NaN (not measured) left out."""
    return {k: float(v) for k, v in scalars.items() if not math.isnan(float(v))}


class TensorBoardTracker:
    def __init__(self, run_dir: Path, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, run_id: str | None, config: dict):
        wandb = self._wandb = _require("wandb", TrackerKind.WANDB)
        self._run = wandb.init(
            project=project,
            name=run_dir.name,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
        )
        self.run_id = self._run.id

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()
        # W&B's service process would outlive the run until the interpreter exits.
        self._wandb.teardown()


class MlflowTracker:
    def __init__(self, run_dir: Path, tracking_uri: str, experiment: str, run_id: str | None, config: dict):
        if not tracking_uri:
            # A run folder holds its own records: MLflow 3 keeps its file store only on request.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            tracking_uri = (run_dir / "mlruns").resolve().as_uri()
        _require("mlflow", TrackerKind.MLFLOW)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=tracking_uri)
        if run_id is None:
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
            run_id = self._client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in config.items()]
            self._client.log_batch(run_id, params=params)
        self.run_id = run_id
        self.tracking_uri = tracking_uri

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(name, value, now, step) for name, value in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def open_trackers(
    kinds: tuple[str, ...],
    run_dir: Path,
    project: str,
    mlflow_tracking_uri: str = "",
    purge_step: int | None = None,
    config: dict | None = None,
) -> list[Tracker]:
    """The trackers of `kinds` for the run in `run_dir`, continuing the runs `trackers.json`
    names (a resumed run). `config`: the run's flattened config, recorded by W&B and MLflow."""
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    config = config or {}
    trackers: list[Tracker] = []
    for kind in map(TrackerKind, kinds):
        match kind:
            case TrackerKind.TENSORBOARD:
                trackers.append(TensorBoardTracker(run_dir, purge_step))
            case TrackerKind.WANDB:
                tracker = WandbTracker(run_dir, project, ids.get(kind), config)
                ids[kind] = tracker.run_id
                trackers.append(tracker)
            case TrackerKind.MLFLOW:
                tracker = MlflowTracker(run_dir, mlflow_tracking_uri, project, ids.get(kind), config)
                ids[kind] = tracker.run_id
                trackers.append(tracker)
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return trackers


_PACKAGES = {TrackerKind.WANDB: "wandb", TrackerKind.MLFLOW: "mlflow-skinny"}


def flat_config(config) -> dict[str, str]:
    """A config dataclass as `section.field` -> value (what W&B and MLflow record of the run)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = value if isinstance(value, int | float | bool | str) else str(value)

    walk("", dataclasses.asdict(config))
    return flat


def _require(module: str, kind: TrackerKind):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(
            f"job.trackers names {kind.value!r}, but {module} is not installed: pip install "
            f"'libra-rl[trackers]' (or {_PACKAGES[kind]}), or drop {kind.value!r} from job.trackers"
        ) from e
