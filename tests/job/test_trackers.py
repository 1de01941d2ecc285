"""`libra.job.trackers`: TensorBoard, Weights & Biases (offline) and MLflow (a local file store)
get the same scalars from the run's recorder, read back from what each wrote; a resumed run
continues the same W&B and MLflow runs; a tracker that is not installed or not known is refused
with a message naming it."""

from __future__ import annotations

import math
import struct
import sys

import pytest

from libra.job.config import TRACKERS, JobConfig
from libra.job.recorder import HeldOutEvaluation, RunRecorder, StepMetrics
from libra.job.trackers import TrackerKind, open_trackers

KINDS = ("tensorboard", "wandb", "mlflow")


def _step(step: int, gap: float) -> StepMetrics:
    values = dict.fromkeys(StepMetrics.__dataclass_fields__, 0.0)
    values.update(step=step, time_s=10.0 * step, mean_reward=0.1 * step, loss=1.0 / step)
    values.update(num_trajectories=64, logprob_abs_diff=gap)
    return StepMetrics(**values)


def _same(points: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, and values equal up to TensorBoard's float32."""
    assert [step for step, _ in points] == [step for step, _ in expected]
    assert [value for _, value in points] == pytest.approx([value for _, value in expected], rel=1e-6)


def _tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _mlflow(tracker) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.tracking_uri)
    keys = client.get_run(tracker.run_id).data.metrics
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, key)) for key in keys
    }


def _wandb(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The history rows of the W&B offline run file (LevelDB log records of `Record` protos)."""
    import json

    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    payloads, chunk, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a record header is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        chunk += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL, LAST
            payloads.append(chunk)
            chunk = b""
    history: dict[str, list[tuple[int, float]]] = {}
    for payload in payloads:
        record = wandb_internal_pb2.Record.FromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
        }
        step = items.pop("_step")
        for key, value in items.items():
            if not key.startswith("_"):
                history.setdefault(key, []).append((step, value))
    return history


def test_every_tracker_gets_the_same_scalars_and_a_resume_continues_its_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = open_trackers(KINDS, tmp_path, "libra-test", config={"job.num_steps": 2})
    recorder = RunRecorder(tmp_path, trackers)
    recorder.evaluation(HeldOutEvaluation("before", 0, 8, 2, 0.25, 0.5), [])
    recorder.step(_step(1, gap=float("nan")))  # not measured: left out everywhere
    recorder.step(_step(2, gap=2e-6))
    recorder.close()

    tensorboard, mlflow, wandb = _tensorboard(tmp_path), _mlflow(trackers[2]), _wandb(tmp_path)
    _same(tensorboard["job/mean_reward"], [(1, 0.1), (2, 0.2)])
    _same(tensorboard["job/logprob_abs_diff"], [(2, 2e-6)])
    _same(tensorboard["eval/before_mean_reward"], [(0, 0.25)])
    # Every step field but `step`; the evaluation's but `when`, `version` and its unmeasured (NaN) gap.
    assert (
        len(tensorboard)
        == len(StepMetrics.__dataclass_fields__) - 1 + len(HeldOutEvaluation.__dataclass_fields__) - 4
    )
    for other in (mlflow, wandb):
        assert sorted(other) == sorted(tensorboard)
        for tag, points in tensorboard.items():
            _same(other[tag], points)
    assert not any(math.isnan(v) for points in wandb.values() for _, v in points)

    # A resumed run logs into the same W&B and MLflow runs (`trackers.json`).
    resumed = open_trackers(KINDS, tmp_path, "libra-test", purge_step=3)
    assert [t.run_id for t in resumed[1:]] == [t.run_id for t in trackers[1:]]
    recorder = RunRecorder(tmp_path, resumed)
    recorder.step(_step(3, gap=1e-6))
    recorder.close()
    assert [s for s, _ in _mlflow(resumed[2])["job/loss"]] == [1, 2, 3]
    assert [s for s, _ in _tensorboard(tmp_path)["job/loss"]] == [1, 2, 3]


def test_a_tracker_that_is_not_installed_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(RuntimeError, match=r"job.trackers names 'wandb', but wandb is not installed"):
        open_trackers(("wandb",), tmp_path, "libra-test")


@pytest.mark.parametrize("trackers", [("tensorboard", "neptune"), ("wandb", "wandb"), "wandb"])
def test_bad_tracker_lists_are_refused_naming_the_field(trackers):
    assert TRACKERS == tuple(TrackerKind)  # the config's list is the trackers' kinds
    with pytest.raises(ValueError, match="job.trackers must name each of"):
        JobConfig(trackers=trackers)
