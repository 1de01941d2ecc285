"""`JobTrainingRestart` against a fake job (no processes): the happy path hands the new layout to
the job's ranks and loads the checkpoint; when the new layout's ranks do not come up, the old
layout is started again from the same checkpoint before the failure is reported."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from libra.control.types import ClusterState
from libra.job.cluster import Placement
from libra.job.training_restart import JobTrainingRestart
from libra.planner.device_map import DeviceMap
from libra.planner.diff import RestartTraining
from libra.training.config import TrainingConfig
from tests.control.helpers import cpu_agent


class FakeJob:
    """The parts of `JobWorkers` a restart touches; `start_train_ranks` fails while `broken`."""

    def __init__(self, tmp_path, broken: bool):
        agent = cpu_agent("agent-0", range(4))
        self.run_dir = tmp_path
        self.config = SimpleNamespace(training=TrainingConfig())
        self.stopped: list[str] = []
        self.cluster = SimpleNamespace(
            device_map=lambda: DeviceMap.from_cluster_state(ClusterState([agent], [], 0))
        )
        self.placements = [Placement("agent-0", (0,))]
        self.train_worker_ids = ["train-0"]
        self.started: list[tuple[int, list[Placement]]] = []
        self.current_version = 7
        self.republished = 0
        self.broken = broken
        self.trainer = self._trainer()

    def _trainer(self):
        saved = self.current_version  # what a checkpoint written now holds
        return SimpleNamespace(
            save_checkpoint=lambda directory: saved,
            load_checkpoint=lambda directory: saved,
            close=lambda: None,
        )

    def train_layout(self):
        return self.config.training, list(self.placements)

    def stop_train_ranks(self):
        self.stopped.extend(self.train_worker_ids)

    def start_train_ranks(self, placements, training):
        self.config.training, self.placements = training, list(placements)
        self.started.append((training.tensor_parallel, list(placements)))
        self.train_worker_ids = [f"train-g{len(self.started) + 1}-{r}" for r in range(len(placements))]
        if self.broken and training.tensor_parallel == 2:
            raise RuntimeError("rank 1 did not serve")
        self.trainer = self._trainer()

    def republish(self):
        self.republished += 1


LAYOUT = RestartTraining((0,), (0, 1), tp=2, pp=1, dp=1, micro_batch=1)


def _restart(job) -> JobTrainingRestart:
    restart = JobTrainingRestart(job)
    restart.checkpoint()
    restart.stop_training()
    return restart


def test_restart_starts_the_new_layout_and_loads_the_checkpoint(tmp_path):
    job = FakeJob(tmp_path, broken=False)
    restart = _restart(job)
    restart.start_training(LAYOUT)
    restart.load_checkpoint(str(tmp_path / "restarts" / "restart-1"))
    assert job.stopped == ["train-0"]
    assert job.started == [(2, [Placement("agent-0", (0,)), Placement("agent-0", (1,))])]
    assert job.config.training.tensor_parallel == 2 and job.config.training.world_size == 2
    assert job.republished == 1


def test_a_new_layout_that_fails_to_start_gives_way_to_the_old_one(tmp_path):
    job = FakeJob(tmp_path, broken=True)
    restart = _restart(job)
    with pytest.raises(RuntimeError, match="training resumed in the old layout"):
        restart.start_training(LAYOUT)
    # The half-started new ranks were stopped, the old layout started again and loaded.
    assert job.stopped == ["train-0", "train-g2-0", "train-g2-1"]
    assert [tp for tp, _ in job.started] == [2, 1]
    assert job.started[1][1] == [Placement("agent-0", (0,))]
    assert job.config.training == dataclasses.replace(TrainingConfig())
    assert job.republished == 1


def test_loaded_version_must_be_the_jobs(tmp_path):
    job = FakeJob(tmp_path, broken=False)
    restart = _restart(job)
    restart.start_training(LAYOUT)
    job.current_version = 8
    with pytest.raises(RuntimeError, match="loaded version 7, the job is at 8"):
        restart.load_checkpoint("somewhere")
