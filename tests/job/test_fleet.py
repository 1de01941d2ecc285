"""`libra.job.fleet`: one record per worker under one name for its life, typed start and stop
(the launch's and the plan executor's), and a watchdog that hands each unasked end to its kind's
handler exactly once. A fake cluster stands in for the controller and
its agents (what the controller would report is set by the test); the real processes are the
job tests' (`test_default_run`, `test_agent_loss`, `test_training_lost`)."""

from __future__ import annotations

import asyncio

import pytest

from libra.control import WorkerRole, WorkerSpec, WorkerState
from libra.job.cluster import Placement
from libra.job.fleet import Fleet, FleetWorker, WorkerKind, WorkerPhase
from tests.job.fake_cluster import FakeCluster

ROLLOUT = WorkerKind.ROLLOUT_INSTANCE


def _start(fleet: Fleet, cluster: FakeCluster, name: str, kind: WorkerKind, agent: str, **fields):
    ready = cluster.ready_dir / f"{name}.addr"
    return fleet.start(
        name, kind, Placement(agent, (0,)), ["python", "-c", "pass", str(ready)], ready, **fields
    )


def test_each_unasked_end_is_handed_to_its_roles_handler_once(tmp_path):
    cluster = FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    handled: list[tuple[str, WorkerKind, bool, str]] = []

    async def handler(record: FleetWorker) -> None:
        handled.append((record.name, record.kind, record.agent_lost, record.lost_reason))

    fleet.on_loss(WorkerKind.ROLLOUT_INSTANCE, handler)
    fleet.on_loss(WorkerKind.TRAIN_RANK, handler)

    async def scenario():
        rollout = _start(fleet, cluster, "rollout-0", ROLLOUT, "agent-0", tp_size=2, instance_id=0)
        _start(fleet, cluster, "rollout-1", ROLLOUT, "agent-0", instance_id=1)
        _start(fleet, cluster, "train-0", WorkerKind.TRAIN_RANK, "agent-1")
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
        ("rollout-0", ROLLOUT, False, "EXITED with code -9"),
        ("train-0", WorkerKind.TRAIN_RANK, True, "its agent agent-1 is lost"),
    ]
    assert rollout.phase == WorkerPhase.LOST
    assert fleet.get("rollout-1").phase == WorkerPhase.ENDED


def test_a_stop_that_is_not_planned_is_handled_as_a_loss(tmp_path):
    """An instance that cannot load the current weights is stopped so that its handler restarts it."""
    cluster = FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    handled: list[str] = []

    async def handler(record: FleetWorker) -> None:
        handled.append(record.name)

    fleet.on_loss(ROLLOUT, handler)

    async def scenario():
        _start(fleet, cluster, "rollout-0", ROLLOUT, "agent-0", instance_id=0)
        watch = asyncio.create_task(fleet.watch())
        fleet.stop("rollout-0", planned=False)
        await asyncio.sleep(0.8)
        await fleet.close(timeout_s=5.0)
        await watch

    asyncio.run(scenario())
    assert handled == ["rollout-0"]


def test_a_worker_that_never_serves_is_stopped_forgotten_and_named(tmp_path):
    cluster = FakeCluster(tmp_path)
    cluster.silent.add("rollout-0")
    fleet = Fleet(cluster, start_timeout_s=0.5)
    with pytest.raises(RuntimeError, match="worker rollout-0 did not serve within 0.5 s"):
        _start(fleet, cluster, "rollout-0", ROLLOUT, "agent-0", instance_id=0)
    assert cluster.stopped == ["rollout-0"] and fleet.instance(0) is None


def test_close_lets_a_restart_in_progress_finish_then_stops_every_worker(tmp_path):
    cluster = FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    restarted: list[str] = []

    async def restart(record: FleetWorker) -> None:
        fleet.forget(record.name)
        await asyncio.sleep(0.5)  # the new instance starting
        await asyncio.to_thread(_start, fleet, cluster, "rollout-1", ROLLOUT, "agent-0", instance_id=1)
        restarted.append("rollout-1")

    fleet.on_loss(ROLLOUT, restart)

    async def scenario():
        _start(fleet, cluster, "rollout-0", ROLLOUT, "agent-0", instance_id=0)
        watch = asyncio.create_task(fleet.watch())
        cluster.end("rollout-0", WorkerState.EXITED, exit_code=1)
        while not fleet.handling:
            await asyncio.sleep(0.05)
        await fleet.close(timeout_s=5.0)
        await watch

    asyncio.run(scenario())
    assert restarted == ["rollout-1"]
    assert cluster.stopped == ["rollout-1"] and cluster.workers["rollout-1"].state == WorkerState.STOPPED


def test_a_lost_instance_runs_again_under_its_name_and_pool_id(tmp_path):
    """A restart is a new process (a new worker id) of the same record: nothing else is rebound,
    and a second loss of the restarted process is handled again."""
    cluster = FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    handled: list[tuple[str, str]] = []

    async def restart(record: FleetWorker) -> None:
        handled.append((record.name, record.worker_id))
        await asyncio.to_thread(fleet.relaunch, record)
        await asyncio.to_thread(fleet.wait_serving, record)

    fleet.on_loss(ROLLOUT, restart)

    async def scenario():
        record = _start(fleet, cluster, "rollout-0", ROLLOUT, "agent-0", tp_size=2, instance_id=0)
        watch = asyncio.create_task(fleet.watch())
        cluster.end("rollout-0", WorkerState.EXITED, exit_code=-9)
        while record.worker_id != "rollout-0.r1" or record.phase != WorkerPhase.SERVING:
            await asyncio.sleep(0.05)
        cluster.end("rollout-0.r1", WorkerState.EXITED, exit_code=1)
        while record.worker_id != "rollout-0.r2" or record.phase != WorkerPhase.SERVING:
            await asyncio.sleep(0.05)
        await fleet.close(timeout_s=5.0)
        await watch
        return record

    record = asyncio.run(scenario())
    assert handled == [("rollout-0", "rollout-0"), ("rollout-0", "rollout-0.r1")]
    assert (record.name, record.instance_id, record.tp_size, record.restarts) == ("rollout-0", 0, 2, 2)
    assert fleet.instance(0) is record
    assert cluster.stopped == ["rollout-0.r2"]  # close stopped the process running it now


def test_the_plan_executor_starts_and_stops_workers_through_the_fleet(tmp_path):
    """The executor's `ClusterApi` face: a started worker has a record at once (not watched until
    it serves), a stop by its name reaches whatever process runs it now, and a hybrid replica's
    record goes once its process ended (its lane, not the fleet, judges that end)."""
    cluster = FakeCluster(tmp_path)
    fleet = Fleet(cluster, start_timeout_s=5.0)
    handled: list[str] = []

    async def restart(record: FleetWorker) -> None:
        handled.append(record.worker_id)
        await asyncio.to_thread(fleet.relaunch, record)

    fleet.on_loss(ROLLOUT, restart)
    ready = tmp_path / "plan.addr"
    argv = ("python", "-c", "pass", str(ready))

    async def scenario():
        fleet.start_worker("agent-1", WorkerSpec("rollout-plan-1", WorkerRole.ROLLOUT, (2, 3), argv))
        hybrid = WorkerSpec(
            "hybrid-1-g1-2", WorkerRole.TRAIN, (1,), ("python", "-c", "pass", str(tmp_path / "h"))
        )
        fleet.start_worker("agent-1", hybrid)
        record = fleet.get("rollout-plan-1")
        assert (record.kind, record.phase, record.placement) == (
            ROLLOUT,
            WorkerPhase.STARTING,
            Placement("agent-1", (2, 3)),
        )
        assert fleet.get("hybrid-1-g1-2").kind is WorkerKind.HYBRID_REPLICA
        watch = asyncio.create_task(fleet.watch())
        fleet.serving(
            "rollout-plan-1", ready.read_text().strip(), tp_size=2, instance_id=5, plan_id="rollout-tp2-d6"
        )
        assert fleet.instance(5) is record and record.phase == WorkerPhase.SERVING
        cluster.end("rollout-plan-1", WorkerState.EXITED, exit_code=-9)  # lost: restarted
        cluster.end("hybrid-1-g1-2", WorkerState.EXITED, exit_code=0)  # released: left by itself
        while record.worker_id != "rollout-plan-1.r1":
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.6)
        assert fleet.of_kind(WorkerKind.HYBRID_REPLICA) == []
        status = fleet.stop_worker("rollout-plan-1", grace_s=1.0)  # a plan stops it, by its name
        await fleet.close(timeout_s=5.0)
        await watch
        return status

    status = asyncio.run(scenario())
    assert handled == ["rollout-plan-1"]
    assert status.spec.worker_id == "rollout-plan-1.r1" and status.state == WorkerState.STOPPED
    assert cluster.stopped == ["rollout-plan-1.r1"]
    with pytest.raises(KeyError):
        fleet.get("rollout-plan-1")
