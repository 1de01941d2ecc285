"""`libra.job.fleet`: one record per worker, typed start and stop, and a watchdog that hands each
unasked end to its role's handler exactly once. A fake cluster stands in for the controller and
its agents (what the controller would report is set by the test); the real processes are the
job tests' (`test_default_run`, `test_agent_loss`, `test_training_lost`)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from libra.control import WorkerRole, WorkerSpec, WorkerState
from libra.control.types import AgentState, ClusterState, WorkerStatus
from libra.job.cluster import Placement
from libra.job.fleet import Fleet, FleetWorker, WorkerPhase
from tests.control.helpers import cpu_agent


class _FakeCluster:
    """What the fleet reads and calls of `JobCluster`: the controller's snapshot, StartWorker and
    StopWorker. A started worker writes its ready file at once, unless `silent`."""

    token = "token"

    def __init__(self, tmp_path):
        self.agents = [cpu_agent("agent-0", range(4)), cpu_agent("agent-1", range(4))]
        self.workers: dict[str, WorkerStatus] = {}
        self.silent: set[str] = set()
        self.stopped: list[str] = []
        self.controller = SimpleNamespace(
            cluster=SimpleNamespace(
                snapshot=lambda: ClusterState(list(self.agents), list(self.workers.values()), 0)
            )
        )
        self.client = SimpleNamespace(start_worker=self._start_worker, stop_worker=self._stop_worker)
        self.ready_dir = tmp_path

    def _start_worker(self, agent_id: str, spec: WorkerSpec) -> None:
        self.workers[spec.worker_id] = WorkerStatus(
            spec, agent_id, WorkerState.RUNNING, pid=1000 + len(self.workers)
        )
        if spec.worker_id not in self.silent:
            (self.ready_dir / f"{spec.worker_id}.addr").write_text(f"127.0.0.1:{7000 + len(self.workers)}\n")

    def _stop_worker(self, worker_id: str, grace_s: float) -> None:
        self.stopped.append(worker_id)
        self.end(worker_id, WorkerState.STOPPED)

    def end(self, worker_id: str, state: WorkerState, exit_code: int = 0) -> None:
        self.workers[worker_id] = dataclasses.replace(
            self.workers[worker_id], state=state, exit_code=exit_code
        )

    def lose_agent(self, agent_id: str) -> None:
        self.agents = [
            dataclasses.replace(a, state=AgentState.LOST) if a.agent_id == agent_id else a
            for a in self.agents
        ]


def _start(fleet: Fleet, cluster: _FakeCluster, worker_id: str, role: WorkerRole, agent: str, **fields):
    ready = cluster.ready_dir / f"{worker_id}.addr"
    return fleet.start(worker_id, role, Placement(agent, (0,)), ["python", "-c", "pass"], ready, **fields)


def test_each_unasked_end_is_handed_to_its_roles_handler_once(tmp_path):
    cluster = _FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    handled: list[tuple[str, WorkerRole, bool, str]] = []

    async def handler(record: FleetWorker) -> None:
        handled.append((record.worker_id, record.role, record.agent_lost, record.lost_reason))

    fleet.on_loss(WorkerRole.ROLLOUT, handler)
    fleet.on_loss(WorkerRole.TRAIN, handler)

    async def scenario():
        rollout = _start(fleet, cluster, "rollout-0", WorkerRole.ROLLOUT, "agent-0", tp_size=2, instance_id=0)
        _start(fleet, cluster, "rollout-1", WorkerRole.ROLLOUT, "agent-0", instance_id=1)
        _start(fleet, cluster, "train-0", WorkerRole.TRAIN, "agent-1")
        assert (rollout.phase, rollout.address, rollout.tp_size) == (WorkerPhase.SERVING, "127.0.0.1:7001", 2)
        assert [r.instance_id for r in fleet.rollout_instances()] == [0, 1]
        watch = asyncio.create_task(fleet.watch())
        fleet.stop("rollout-1")  # asked for: no loss
        cluster.end("rollout-0", WorkerState.EXITED, exit_code=-9)
        await asyncio.sleep(1.2)  # two ticks: still handled once
        cluster.lose_agent("agent-1")
        await asyncio.sleep(1.2)
        await fleet.close(timeout_s=5.0)
        await watch
        return rollout

    rollout = asyncio.run(scenario())
    assert handled == [
        ("rollout-0", WorkerRole.ROLLOUT, False, "EXITED with code -9"),
        ("train-0", WorkerRole.TRAIN, True, "its agent agent-1 is lost"),
    ]
    assert rollout.phase == WorkerPhase.LOST
    assert fleet.get("rollout-1").phase == WorkerPhase.ENDED


def test_a_stop_that_is_not_planned_is_handled_as_a_loss(tmp_path):
    """An instance that cannot load the current weights is stopped so that its handler restarts it."""
    cluster = _FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    handled: list[str] = []

    async def handler(record: FleetWorker) -> None:
        handled.append(record.worker_id)

    fleet.on_loss(WorkerRole.ROLLOUT, handler)

    async def scenario():
        _start(fleet, cluster, "rollout-0", WorkerRole.ROLLOUT, "agent-0", instance_id=0)
        watch = asyncio.create_task(fleet.watch())
        fleet.stop("rollout-0", planned=False)
        await asyncio.sleep(0.8)
        await fleet.close(timeout_s=5.0)
        await watch

    asyncio.run(scenario())
    assert handled == ["rollout-0"]


def test_a_worker_that_never_serves_is_stopped_forgotten_and_named(tmp_path):
    cluster = _FakeCluster(tmp_path)
    cluster.silent.add("rollout-0")
    fleet = Fleet(cluster, start_timeout_s=0.5)
    with pytest.raises(RuntimeError, match="worker rollout-0 did not serve within 0.5 s"):
        _start(fleet, cluster, "rollout-0", WorkerRole.ROLLOUT, "agent-0", instance_id=0)
    assert cluster.stopped == ["rollout-0"] and fleet.instance(0) is None


def test_close_lets_a_restart_in_progress_finish_then_stops_every_worker(tmp_path):
    cluster = _FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    restarted: list[str] = []

    async def restart(record: FleetWorker) -> None:
        fleet.forget(record.worker_id)
        await asyncio.sleep(0.5)  # the new instance starting
        await asyncio.to_thread(
            _start, fleet, cluster, "rollout-1", WorkerRole.ROLLOUT, "agent-0", instance_id=1
        )
        restarted.append("rollout-1")

    fleet.on_loss(WorkerRole.ROLLOUT, restart)

    async def scenario():
        _start(fleet, cluster, "rollout-0", WorkerRole.ROLLOUT, "agent-0", instance_id=0)
        watch = asyncio.create_task(fleet.watch())
        cluster.end("rollout-0", WorkerState.EXITED, exit_code=1)
        while not fleet.handling:
            await asyncio.sleep(0.05)
        await fleet.close(timeout_s=5.0)
        await watch

    asyncio.run(scenario())
    assert restarted == ["rollout-1"]
    assert cluster.stopped == ["rollout-1"] and cluster.workers["rollout-1"].state == WorkerState.STOPPED
