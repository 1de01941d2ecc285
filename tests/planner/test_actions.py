"""The plan executor against a real controller and a real node agent (`libra agent` process with 4
CPU slots). Workers are `python -c` sleepers standing for rollout instances and hybrid replicas
(see `actions_fakes`); the rollout pool and the training side are recording fakes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control import ClusterClient, Controller, WorkerRole, WorkerSpec, WorkerState
from libra.control.config import ControlConfig
from libra.control.types import EventKind
from libra.planner.actions import ActionExecutor, ExecutorConfig, Outcome, check_device_order
from libra.planner.controls import HybridControl, RolloutControl, TrainingControl, WorkerLauncher
from libra.planner.diff import (
    JoinHybridReplica,
    ReleaseHybridReplica,
    RestartTraining,
    StartRolloutInstance,
    StopRolloutInstance,
    diff_plans,
)
from libra.planner.plan import BucketPlan, Plan, TrainingPlacement, place_rollout
from libra.planner.training_cost import TrainingConfig
from tests.control.helpers import HEARTBEAT_S, TOKEN, wait_for
from tests.planner.actions_fakes import SLEEPER, RecordingRollout, RecordingTraining, SleeperLauncher

NUM_DEVICES = 4
DRAIN_TIMEOUT_S = 7.5


def make_plan(dp: int, rollout: list[int], tp: int = 1) -> Plan:
    training = TrainingPlacement(TrainingConfig(tp, 1, dp, 1))
    instances = place_rollout(tp * dp, NUM_DEVICES, NUM_DEVICES, rollout)
    buckets = tuple(BucketPlan(k, rollout.count(k), 100 * k, 0, 0.0) for k in sorted(set(rollout)))
    return Plan(NUM_DEVICES, training, instances, buckets, 1.0, 1.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One controller and one node agent for the module (an agent takes seconds to start on a busy
    machine); each test gets a fresh executor and leaves no worker running."""
    root = tmp_path_factory.mktemp("actions")
    config = LibraConfig(
        run_dir=str(root / "run"),
        control=ControlConfig(port=0, token=TOKEN, heartbeat_interval_s=HEARTBEAT_S),
        backend=BackendConfig(name="cpu", num_devices=NUM_DEVICES),
    )
    controller = Controller(config).start()
    argv = [sys.executable, "-m", "libra.cli", "agent", "--controller", controller.address]
    argv += [f"run_dir={root / 'agent'}", f"backend.num_devices={NUM_DEVICES}"]
    agent = subprocess.Popen(argv, env={**os.environ, "LIBRA_TOKEN": TOKEN}, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: controller.cluster.snapshot().agents, timeout_s=120, what="agent registration")
        yield controller, config
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
        controller.stop()


@pytest.fixture
def setup(cluster, tmp_path):
    ctl, config = cluster
    rollout = RecordingRollout(
        inflight={"rollout-tp1-d2": 4, "rollout-tp1-d3": 2}, stuck={"rollout-tp1-d3": 2}
    )
    training = RecordingTraining(tmp_path)
    launcher = SleeperLauncher(tmp_path, training, missing_command=frozenset({3}))
    client = ClusterClient(ctl.address, TOKEN, config.control)
    executor = ActionExecutor(
        client,
        rollout,
        training,
        training,  # the recording fake plays both the restart and the hybrid side
        launcher,
        ExecutorConfig(
            drain_timeout_s=DRAIN_TIMEOUT_S, start_timeout_s=30, stop_grace_s=2, release_timeout_s=20
        ),
        events=ctl.events,
    )
    first_event = ctl.events.last_sequence
    yield executor, rollout, training, ctl, first_event
    for worker in ctl.cluster.snapshot().workers:
        if not worker.state.ended:
            client.stop_worker(worker.spec.worker_id, grace_s=1)
    client.close()


def running_devices(ctl) -> dict[str, tuple[int, ...]]:
    return {w.spec.worker_id: w.spec.devices for w in ctl.cluster.snapshot().workers if not w.state.ended}


def device_timeline(ctl, after: int) -> dict[int, list[tuple[str, str]]]:
    """Per device, the (event, worker id) sequence of worker starts and stops after event
    sequence `after`, in event order."""
    devices = {w.spec.worker_id: w.spec.devices for w in ctl.cluster.snapshot().workers}
    timeline: dict[int, list[tuple[str, str]]] = {}
    for event in ctl.events._history:
        if event.sequence > after and event.kind in (
            EventKind.WORKER_STARTED,
            EventKind.WORKER_STOPPED,
            EventKind.WORKER_EXITED,
        ):
            for d in devices[event.worker_id]:
                timeline.setdefault(d, []).append((event.kind.name, event.worker_id))
    return timeline


def test_replans_drain_cut_join_release_in_order(setup):
    executor, rollout, training, ctl, first_event = setup
    plan1 = make_plan(dp=1, rollout=[1, 1, 1])
    plan1, actions = diff_plans(None, plan1)
    report = executor.execute(actions, plan_version=1)
    assert report.ok, [r.describe() for r in report.results]
    assert training.calls == [("start_training", (0,))]  # first plan: nothing to checkpoint or stop
    assert sorted(rollout.registered) == ["rollout-tp1-d1", "rollout-tp1-d2", "rollout-tp1-d3"]
    assert rollout.registered["rollout-tp1-d2"] == (1, "127.0.0.1:7002")  # the address the worker wrote
    assert sorted(running_devices(ctl).values()) == [(1,), (2,), (3,)]

    # Training grows by a hybrid replica on device 1; rollout becomes one TP-2 instance on 2-3.
    # The instances on 2 and 3 stop first (the TP-2 needs their devices), the one on device 1
    # keeps serving until the TP-2 instance has started, the replica joins last.
    # Draining: d1 and d2 drain in time, d3 keeps 2 trajectories past the deadline (they are cut).
    rollout.calls.clear()
    plan2, actions = diff_plans(plan1, make_plan(dp=2, rollout=[2]), cut_inflight=False)
    assert [(type(a), a.devices) for a in actions[:5]] == [
        (StopRolloutInstance, (2,)),
        (StopRolloutInstance, (3,)),
        (StartRolloutInstance, (2, 3)),
        (StopRolloutInstance, (1,)),
        (JoinHybridReplica, (1,)),
    ]
    report = executor.execute(actions, plan_version=2)
    assert report.ok, [r.describe() for r in report.results]
    assert [c for c in rollout.calls if c[0] in ("drain", "cut", "remove")] == [
        ("drain", "rollout-tp1-d2", DRAIN_TIMEOUT_S),
        ("remove", "rollout-tp1-d2"),
        ("drain", "rollout-tp1-d3", DRAIN_TIMEOUT_S),
        ("cut", "rollout-tp1-d3"),
        ("remove", "rollout-tp1-d3"),
        ("drain", "rollout-tp1-d1", DRAIN_TIMEOUT_S),
        ("remove", "rollout-tp1-d1"),
    ]
    assert "drain timed out: cut 2" in report.results[1].detail
    # The pool held the TP-2 instance as loading from the plan's start, and let it go at its end.
    assert rollout.expected[-2:] == [(2,), ()]
    assert ("join", 1, 1) in training.calls
    assert sorted(running_devices(ctl).values()) == [(1,), (2, 3)]
    assert set(executor.running_hybrids()) == {1}

    # Back: the hybrid is released (its worker exits by itself), rollout returns, cut this time.
    rollout.calls.clear()
    plan3, actions = diff_plans(plan2, make_plan(dp=1, rollout=[1, 1, 1]), cut_inflight=True)
    assert isinstance(actions[0], ReleaseHybridReplica)
    report = executor.execute(actions, plan_version=3)
    assert report.ok, [r.describe() for r in report.results]
    assert "exited by itself (0)" in report.results[0].detail
    assert ("cut", "rollout-tp2-d2") in rollout.calls and not any(c[0] == "drain" for c in rollout.calls)
    assert executor.running_hybrids() == {}
    assert sorted(running_devices(ctl).values()) == [(1,), (2,), (3,)]

    # Grow again, then change training's TP: a restart (checkpoint, stop the hybrid and the ranks,
    # start the new layout, load) -- the rollout instance on 2-3 is kept.
    plan4, actions = diff_plans(plan3, make_plan(dp=2, rollout=[2]))
    assert executor.execute(actions, plan_version=4).ok
    training.calls.clear()
    _, actions = diff_plans(plan4, make_plan(dp=1, tp=2, rollout=[2]))
    assert [type(a) for a in actions] == [RestartTraining]
    report = executor.execute(actions, plan_version=5)
    assert report.ok, [r.describe() for r in report.results]
    assert training.calls == [
        ("checkpoint",),
        ("stop_training",),
        ("start_training", (0, 1)),
        ("load", "ckpt-1"),
    ]
    assert "stopped hybrid 1" in report.results[0].detail and executor.running_hybrids() == {}
    assert sorted(running_devices(ctl).values()) == [(2, 3)]

    # Every device was given up before a new worker took it: per device, starts and ends alternate.
    for device, timeline in device_timeline(ctl, first_event).items():
        kinds = [kind for kind, _ in timeline]
        assert kinds[0] == "WORKER_STARTED", (device, timeline)
        for a, b in zip(kinds, kinds[1:], strict=False):
            assert (a == "WORKER_STARTED") != (b == "WORKER_STARTED"), (device, timeline)
    # Each action's outcome, and each plan's summary, is a PLAN_EXECUTED event.
    applied = [
        e for e in ctl.events._history if e.kind == EventKind.PLAN_EXECUTED and e.sequence > first_event
    ]
    assert [e.plan_version for e in applied if "applied in" in e.message] == [1, 2, 3, 4, 5]
    assert any("drain timed out" in e.message and e.plan_version == 2 for e in applied)


def test_a_failed_start_stops_the_rest_and_keeps_running_instances(setup):
    executor, rollout, training, ctl, first_event = setup
    plan1, actions = diff_plans(None, make_plan(dp=1, rollout=[1, 1, 1]))
    assert executor.execute(actions).ok
    rollout.calls.clear()
    before = running_devices(ctl)

    # An instance whose worker dies before it serves, then more work that must not happen.
    actions = [
        StopRolloutInstance("rollout-tp1-d1", (1,), cut_inflight=True),
        StartRolloutInstance("broken-d1", 1, (1,)),
        StopRolloutInstance("rollout-tp1-d2", (2,), cut_inflight=True),
        StartRolloutInstance("rollout-tp1-d2b", 1, (2,)),
    ]
    report = executor.execute(actions, plan_version=7)
    assert [r.outcome for r in report.results] == [
        Outcome.OK,
        Outcome.FAILED,
        Outcome.SKIPPED,
        Outcome.SKIPPED,
    ]
    assert report.failed.index == 1 and "exit 3" in report.failed.detail
    # Nothing waits for the instances that did not start.
    assert rollout.expected[-2:] == [(1, 1), ()]
    # The instance on d2 was never touched: still running, registered and routed to.
    assert not any(c[1] == "rollout-tp1-d2" for c in rollout.calls)
    assert "rollout-tp1-d2" in rollout.routed and "rollout-tp1-d2" in executor.running_instances()
    assert running_devices(ctl) == {w: d for w, d in before.items() if d != (1,)}
    assert "broken-d1" not in rollout.registered
    summary = [e for e in ctl.events._history if e.kind == EventKind.PLAN_EXECUTED][-1]
    assert summary.plan_version == 7 and "failed at action 1" in summary.message

    # A hybrid replica whose command does not exist: StartWorker refuses, the join is cancelled.
    report = executor.execute([JoinHybridReplica(3, (1,))], plan_version=8)
    assert report.failed is not None and report.failed.detail.startswith("INVALID_ARGUMENT: spec.argv")
    assert training.calls[-1][:3] == ("cancel_join", 3, 1)
    assert executor.running_hybrids() == {}

    # Two devices for a replica whose core replica has one TP rank (one lane): refused before any
    # worker starts, the join cancelled.
    report = executor.execute([JoinHybridReplica(3, (0, 1))], plan_version=9)
    assert report.failed is not None and "core replica has TP = 1" in report.failed.detail
    assert training.calls[-1][:3] == ("cancel_join", 3, 2)
    assert executor.running_hybrids() == {}

    # A replica that joined and was then rolled back by its lane: the job retires its worker.
    assert executor.execute([JoinHybridReplica(2, (1,))]).ok
    worker = executor.running_hybrids()[2].worker_id
    assert executor.retire_hybrid(2).endswith("stopped (exit -15)")
    assert ctl.cluster.worker(worker).state == WorkerState.STOPPED and executor.running_hybrids() == {}


def test_a_worker_that_cannot_be_stopped_stays_registered(setup):
    executor, rollout, training, ctl, first_event = setup
    _, actions = diff_plans(None, make_plan(dp=1, rollout=[1, 1, 1]))
    assert executor.execute(actions).ok
    real_stop = executor.cluster.stop_worker

    def failing_stop(worker_id, grace_s=0.0):
        raise RuntimeError("agent at 127.0.0.1:1 failed StopWorker: UNAVAILABLE")

    executor.cluster.stop_worker = failing_stop
    try:
        report = executor.execute([StopRolloutInstance("rollout-tp1-d2", (2,), cut_inflight=False)])
    finally:
        executor.cluster.stop_worker = real_stop
    assert report.failed is not None and "UNAVAILABLE" in report.failed.detail
    assert rollout.calls[-2:] == [("drain", "rollout-tp1-d2", DRAIN_TIMEOUT_S), ("restore", "rollout-tp1-d2")]
    assert "rollout-tp1-d2" in rollout.registered and "rollout-tp1-d2" in rollout.routed
    worker = executor.running_instances()["rollout-tp1-d2"].worker_id
    assert ctl.cluster.worker(worker).state == WorkerState.RUNNING


def test_out_of_order_actions_are_refused_before_anything_runs(setup):
    executor, rollout, training, ctl, first_event = setup
    _, actions = diff_plans(None, make_plan(dp=1, rollout=[1, 1, 1]))
    assert executor.execute(actions).ok
    rollout.calls.clear()
    started = len(ctl.cluster.snapshot().workers)
    wrong = [
        StartRolloutInstance("rollout-tp2-d2", 2, (2, 3)),  # d2 and d3 are still held here ...
        StopRolloutInstance("rollout-tp1-d2", (2,), cut_inflight=True),  # ... and freed only here
        StopRolloutInstance("rollout-tp1-d3", (3,), cut_inflight=True),
    ]
    with pytest.raises(ValueError, match=r"action 0 .* devices \[2, 3\] are still held"):
        executor.execute(wrong)
    with pytest.raises(ValueError, match="devices \\[9\\] do not exist"):
        executor.execute([StartRolloutInstance("far", 1, (9,))])
    assert rollout.calls == [] and len(ctl.cluster.snapshot().workers) == started


def test_adopted_instances_are_stopped_like_started_ones(setup, tmp_path):
    """The job's initial instances are started outside the executor and adopted by it."""
    executor, rollout, training, ctl, first_event = setup
    assert isinstance(rollout, RolloutControl) and isinstance(training, HybridControl)
    assert isinstance(training, TrainingControl) and isinstance(executor.launcher, WorkerLauncher)
    ready = tmp_path / "external.addr"
    argv = (sys.executable, "-c", SLEEPER, str(ready), "127.0.0.1:7100")
    agent_id = ctl.cluster.snapshot().agents[0].agent_id
    executor.cluster.start_worker(agent_id, WorkerSpec("initial-0", WorkerRole.ROLLOUT, (0,), argv))
    executor.adopt_instance("initial-0", "initial-0", 1, (0,), "127.0.0.1:7100")
    rollout.add_instance("initial-0", "initial-0", 1, "127.0.0.1:7100")
    with pytest.raises(ValueError, match=r"devices \[0\] are still held"):
        executor.execute([StartRolloutInstance("other", 1, (0,))])
    report = executor.execute([StopRolloutInstance("initial-0", (0,), cut_inflight=True)])
    assert report.ok and ctl.cluster.worker("initial-0").state == WorkerState.STOPPED
    assert rollout.calls[-2:] == [("cut", "initial-0"), ("remove", "initial-0")]


def test_check_device_order_follows_frees_and_takes():
    check_device_order(
        [
            StopRolloutInstance("a", (2, 3), True),
            StartRolloutInstance("b", 1, (2,)),
            JoinHybridReplica(1, (3,)),
        ],
        busy={2, 3},
    )
    check_device_order([RestartTraining((0, 1), (0, 1, 2), 1, 1, 3, 1)], busy={0, 1})
    with pytest.raises(ValueError, match=r"action 1 .* \[2\]"):
        check_device_order([StartRolloutInstance("b", 1, (2,)), JoinHybridReplica(1, (2,))], busy=set())
    with pytest.raises(ValueError, match=r"action 0 .* \[2\]"):
        check_device_order([RestartTraining((0, 1), (0, 1, 2), 1, 1, 3, 1)], busy={0, 1, 2})


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="planner.execution.drain_timeout_s"):
        ExecutorConfig(drain_timeout_s=0)


def test_device_map_lays_agents_end_to_end():
    from libra.control.types import AgentState, ClusterState
    from libra.planner.device_map import DeviceMap
    from tests.control.helpers import cpu_agent

    agents = [cpu_agent("a", [1, 0]), cpu_agent("gone", [0], AgentState.LOST), cpu_agent("b", [0, 1])]
    state = ClusterState(agents, [], 0)
    devices = DeviceMap.from_cluster_state(state)
    # A lost agent keeps its place: b's devices keep the numbers they had while it lived.
    assert devices.num_devices == 5
    assert devices.locate((3, 4)) == ("b", (0, 1))
    assert devices.global_devices("b", (1,)) == (4,)
    assert devices.global_devices("gone", (0,)) == ()
    assert [devices.usable(d) for d in range(6)] == [True, True, False, True, True, False]
    with pytest.raises(ValueError, match="no longer alive"):
        devices.locate((2,))
    with pytest.raises(ValueError, match="span agents"):
        devices.locate((1, 3))
