"""`JobTrainingRestart` against fake train ranks and instances (no processes): the happy path
hands the new layout to the job's ranks and loads the checkpoint; when the new layout's ranks do
not come up, the old layout is started again from the same checkpoint before the failure is
reported."""

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


class FakeTrainRanks:
    """`TrainRankGroup` without processes; `start` fails while `broken`."""

    def __init__(self, tmp_path, broken: bool):
        self.run_dir = tmp_path
        self.training = TrainingConfig()
        self.placements = [Placement("agent-0", (0,))]
        self.names = ["train-0"]
        self.stopped: list[str] = []
        self.started: list[tuple[int, list[Placement]]] = []
        self.saved_version = 7  # what a checkpoint written now holds
        self.broken = broken
        self.client = self._client()

    def _client(self):
        return SimpleNamespace(
            save_checkpoint=lambda directory: self.saved_version,
            load_checkpoint=lambda directory: self.saved_version,
        )

    def layout(self):
        return self.training, list(self.placements)

    def stop(self):
        self.stopped.extend(self.names)

    def start(self, placements, training):
        self.training, self.placements = training, list(placements)
        self.started.append((training.tensor_parallel, list(placements)))
        self.names = [f"train-g{len(self.started) + 1}-{r}" for r in range(len(placements))]
        if self.broken and training.tensor_parallel == 2:
            raise RuntimeError("rank 1 did not serve")
        self.client = self._client()


class FakeInstances:
    """`RolloutInstances` as a restart sees it: the job's version and republication."""

    def __init__(self):
        self.publication = SimpleNamespace(current_version=7)
        self.republished = 0

    def republish(self, trainer):
        self.republished += 1


def _cluster():
    agent = cpu_agent("agent-0", range(4))
    return SimpleNamespace(device_map=lambda: DeviceMap.from_cluster_state(ClusterState([agent], [], 0)))


LAYOUT = RestartTraining((0,), (0, 1), tp=2, pp=1, dp=1, micro_batch=1)


def _restart(ranks, instances) -> JobTrainingRestart:
    restart = JobTrainingRestart(ranks, instances, _cluster())
    restart.checkpoint()
    restart.stop_training()
    return restart


def test_restart_starts_the_new_layout_and_loads_the_checkpoint(tmp_path):
    ranks, instances = FakeTrainRanks(tmp_path, broken=False), FakeInstances()
    restart = _restart(ranks, instances)
    restart.start_training(LAYOUT)
    restart.load_checkpoint(str(tmp_path / "restarts" / "restart-1"))
    assert ranks.stopped == ["train-0"]
    assert ranks.started == [(2, [Placement("agent-0", (0,)), Placement("agent-0", (1,))])]
    assert ranks.training.tensor_parallel == 2 and ranks.training.world_size == 2
    assert instances.republished == 1


def test_a_new_layout_that_fails_to_start_gives_way_to_the_old_one(tmp_path):
    ranks, instances = FakeTrainRanks(tmp_path, broken=True), FakeInstances()
    restart = _restart(ranks, instances)
    with pytest.raises(RuntimeError, match="training resumed in the old layout"):
        restart.start_training(LAYOUT)
    # The half-started new ranks were stopped, the old layout started again and loaded.
    assert ranks.stopped == ["train-0", "train-g2-0", "train-g2-1"]
    assert [tp for tp, _ in ranks.started] == [2, 1]
    assert ranks.started[1][1] == [Placement("agent-0", (0,))]
    assert ranks.training == dataclasses.replace(TrainingConfig())
    assert instances.republished == 1


def test_loaded_version_must_be_the_jobs(tmp_path):
    ranks, instances = FakeTrainRanks(tmp_path, broken=False), FakeInstances()
    restart = _restart(ranks, instances)
    restart.start_training(LAYOUT)
    instances.publication.current_version = 8
    with pytest.raises(RuntimeError, match="loaded version 7, the job is at 8"):
        restart.load_checkpoint("somewhere")
