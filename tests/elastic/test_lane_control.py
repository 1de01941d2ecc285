"""The core lane's side of plan execution without processes: `LaneControl` (the executor's
`HybridControl`) over a `CoreLane` whose engine is a stand-in (nothing here trains)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from libra.planner.controls import HybridControl
from libra.training.elastic import HybridJoin, ReplicaState
from libra.training.hybrid import CoreLane, LaneControl


class StandInEngine:
    """What CoreLane touches outside a join: the rank layout, `peer`, `version`, `train_step`."""

    def __init__(self):
        self.info = SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, dp_rank=0)
        self.peer = None
        self.version = 0
        self.steps: list[int] = []

    def train_step(self, batch):
        self.steps.append(len(batch))
        return SimpleNamespace(loss=0.0)


@pytest.fixture
def control():
    lane = CoreLane(StandInEngine(), token="lane-control-test-token")
    yield LaneControl(lane)
    lane.listener.close()


def test_join_answers_generation_and_lane_addresses(control):
    assert isinstance(control, HybridControl)
    join = control.request_join(1)
    assert join == HybridJoin(1, (control.lane.address,))
    assert control.lane.state() is ReplicaState.REQUESTED
    state, _ = control.run_step(0, [])  # no hybrid connected: the core steps on
    assert state is ReplicaState.REQUESTED and control.lane.engine.steps == [0]


def test_a_lane_takes_only_its_ranks_replica(control):
    """Core DP rank r of D pairs with hybrid replica D + r: here rank 0 of 1, replica 1."""
    with pytest.raises(ValueError, match="pairs with hybrid replica 1, not 2"):
        control.request_join(2)
    assert control.lane.state() is None


def test_cancel_rolls_back_only_the_current_generation(control):
    join = control.request_join(1)
    control.cancel_join(1, join.generation + 1, "an older executor's cancel")
    assert control.lane.state() is ReplicaState.REQUESTED
    control.cancel_join(1, join.generation, "worker did not start: INVALID_ARGUMENT")
    assert control.lane.state() is ReplicaState.ROLLED_BACK
    assert control.lane.counters.rollbacks == ["worker did not start: INVALID_ARGUMENT"]
    control.cancel_join(1, join.generation, "again")  # already ended: nothing happens
    assert len(control.lane.counters.rollbacks) == 1
    assert control.request_join(1).generation == join.generation + 1  # the slot is free again


def test_requests_wait_for_the_step_boundary(control):
    """A join requested from another thread lands between two steps, never inside one."""
    inside = threading.Event()
    release = threading.Event()
    engine = control.lane.engine

    def slow_step(batch):
        inside.set()
        release.wait(5)
        return SimpleNamespace(loss=0.0)

    engine.train_step = slow_step
    stepping = threading.Thread(target=control.run_step, args=(0, []))
    stepping.start()
    inside.wait(5)
    joined: list[HybridJoin] = []
    joiner = threading.Thread(target=lambda: joined.append(control.request_join(1)))
    joiner.start()
    joiner.join(0.2)
    assert joined == [] and control.lane.state() is None  # still inside the step
    release.set()
    stepping.join(5)
    joiner.join(5)
    assert joined and control.lane.state() is ReplicaState.REQUESTED
