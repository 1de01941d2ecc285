"""The planner-in-the-job's decisions without processes: the real `Planner`, event log, fleet,
rollout instances and train ranks over a fake pool, cluster and executor. Which plans run, which
are refused (a training layout change or a hybrid move the job cannot carry out), and how the
planner is reconciled to what runs after a refusal or a failed action; the planner's inputs built
from traces and an HF config."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from types import SimpleNamespace

import pytest

from libra.config import load_config
from libra.control.config import ControlConfig
from libra.control.events import EventBus
from libra.control.types import AgentState
from libra.job.cluster import Placement
from libra.job.fleet import Fleet, WorkerKind
from libra.job.instances import RolloutInstances
from libra.job.planning import JobPlanning, RankHybridControl, StepTimes, unsupported
from libra.job.problem import cluster_spec, model_arch, planned_rollout_sizes, planning_problem
from libra.job.rescoring import JobRescorer
from libra.job.train_ranks import TrainRankGroup
from libra.planner import Planner, RequestRecord
from libra.planner.actions import ActionResult, ExecutionReport, Outcome, RunningWorker
from libra.planner.device_map import DeviceMap
from libra.planner.diff import JoinHybridReplica, ReleaseHybridReplica, StopRolloutInstance
from libra.planner.plan import BucketPlan, Plan, RolloutInstance
from libra.planner.service import publish_plan_events
from libra.scheduler.baselines import LeastLoadRouter, RoundRobinRouter
from libra.scheduler.config import BucketConfig
from libra.trace import TrajectoryTrace, TurnTrace
from libra.training.elastic import ElasticConfig, HybridJoin, HybridPool
from tests.control.helpers import cpu_agent
from tests.job.fake_cluster import FakeCluster

ROLLOUT = WorkerKind.ROLLOUT_INSTANCE

TINY_LLAMA = {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 1024,
    "head_dim": 32,
    "dtype": "float32",
}


class Recorder:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def event(self, kind: str, message: str, **extra) -> None:
        self.events.append({"kind": kind, "message": message, **extra})

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events]


class FakePool:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.buckets = (BucketConfig("short", 1, 256), BucketConfig("long", 2, 4096))
        self.router = SimpleNamespace()  # no instance_loads: pressure 0
        self.waiting = 0  # no trajectory waits for an instance
        self.repriced = 0

    def reprice(self) -> None:
        self.repriced += 1

    def live_ids(self) -> list[int]:
        return list(self.ids)

    def get(self, instance_id: int):
        return SimpleNamespace(client=SimpleNamespace(address=f"127.0.0.1:{9000 + instance_id}"))


class FakeExecutor:
    """Records the actions it is given; runs what `outcome` says."""

    def __init__(self) -> None:
        self.instances: dict[str, RunningWorker] = {}
        self.executed: list[tuple[int, list]] = []
        self.fail = False

    def adopt_instance(self, plan_id, worker_id, tp, devices, address) -> None:
        self.instances[plan_id] = RunningWorker(worker_id, tuple(devices), tp, address)

    def running_instances(self):
        return dict(self.instances)

    def running_hybrids(self):
        return {}

    def forget_instance(self, instance_id):
        return self.instances.pop(instance_id, None)

    def execute(self, actions, plan_version=0) -> ExecutionReport:
        self.executed.append((plan_version, list(actions)))
        results = []
        for index, action in enumerate(actions):
            if self.fail:
                results.append(ActionResult(index, action, Outcome.FAILED, detail="RuntimeError: boom"))
                break
            if isinstance(action, StopRolloutInstance):
                del self.instances[action.instance_id]
            results.append(ActionResult(index, action, Outcome.OK))
        return ExecutionReport(plan_version, tuple(results), 0.5)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return tmp_path


def _planning(model_dir, tmp_path, rescore: bool = False) -> tuple[JobPlanning, Recorder]:
    """A JobPlanning over a 3-slot CPU cluster: the train rank on device 0, TP-1 instances 0 and 1
    (workers rollout-0, rollout-1) on devices 1 and 2 (`rescore`: its planner re-scores on the
    groups it records, `libra.job.rescoring`). Call inside a running loop."""
    config = load_config(
        "configs/tiny_cpu.py",
        [
            "job.prompts_per_step=2",
            "job.group_size=4",
            "backend.num_devices=3",
            "job.rollout_tp_sizes=1,1",
        ],
    )
    problem = planning_problem(config, model_dir)
    bus = EventBus()
    rescorer = JobRescorer(config, problem, lambda: planner.calibrated_factors()) if rescore else None
    planner = Planner(problem, on_event=publish_plan_events(bus), rescorer=rescorer)
    cluster = FakeCluster(tmp_path, agents=[cpu_agent("agent-0", range(3))])  # the test may lose it
    cluster.controller.events, cluster.controller.address = bus, "127.0.0.1:1"
    cluster.planner = planner
    cluster.device_map = lambda: DeviceMap.from_cluster_state(cluster.controller.cluster.snapshot())
    fleet = Fleet(cluster, start_timeout_s=1.0)
    for instance_id in (0, 1):
        name, ready = f"rollout-{instance_id}", tmp_path / f"rollout-{instance_id}.addr"
        placement = Placement("agent-0", (instance_id + 1,))
        fleet.start(name, ROLLOUT, placement, ["serve", str(ready)], ready, instance_id=instance_id)
    recorder = Recorder()
    instances = RolloutInstances(config, cluster, fleet, None, recorder, model_dir, FakePool([0, 1]))
    instances.start_s = [42.0, 30.0]
    train_ranks = TrainRankGroup(config, fleet, model_dir, hosts_hybrid_lane=False)
    planning = JobPlanning(config, cluster, fleet, instances, train_ranks, problem, recorder, rescorer)
    planning.executor = FakeExecutor()
    planning.adopt_launch_layout()
    planning.history.extend(RequestRecord(200, 150, 3, 0.1) for _ in range(16))
    return planning, recorder


def _shrunk(plan: Plan, device: int) -> Plan:
    instances = tuple(i for i in plan.instances if device not in i.devices)
    return Plan(
        plan.num_devices,
        plan.training,
        instances,
        (BucketPlan(1, len(instances), 256, 0, 0.0),),
        0.0,
        0.0,
    )


async def _settle(planning: JobPlanning, step: int) -> None:
    """Lets a started execution and the planner's observation finish, then passes the next step
    boundary (which carries out what the planner adopted, or hands it this step)."""
    if planning._execution is not None:
        await asyncio.wait([planning._execution])
    await planning.settled()
    await planning.after_step(StepTimes(step, wait_s=0.1, train_s=1.0, num_dropped_stale=0))


def test_launch_prices_a_plan_at_its_measured_instance_start(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        assert planning.planner.policy.reconfiguration_cost_s == 42.0  # above the prior of 15 s
        assert "planner_prior" in recorder.kinds()

    asyncio.run(scenario())


def test_launch_layout_becomes_the_current_plan(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        plan = planning.planner.current
        assert [(i.instance_id, i.devices) for i in plan.instances] == [
            ("rollout-tp1-d1", (1,)),
            ("rollout-tp1-d2", (2,)),
        ]
        assert (plan.training.first_device, plan.training.config.dp) == (0, 1)
        assert planning.executed_version == planning.planner.version == 1
        assert recorder.kinds() == ["planner_prior", "plan_applied"]  # plan_applied: the controller
        assert planning.rollout.pool_id("rollout-tp1-d2") == 1

    asyncio.run(scenario())


def test_external_plan_is_executed_at_the_next_step_and_recorded(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        adoption = planning.planner.propose(_shrunk(planning.planner.current, 2), "external")
        await _settle(planning, 1)
        await _settle(planning, 2)
        # Each step that fed the planner a history also priced the router's buckets again.
        assert planning.history and planning.instances.pool.repriced >= 1
        assert planning.executor.executed == [
            (adoption.version, [StopRolloutInstance("rollout-tp1-d2", (2,), False)])
        ]
        executed = [e for e in recorder.events if e["kind"] == "plan_executed"]
        assert [(e["plan_version"], e["ok"]) for e in executed] == [(adoption.version, True)]
        assert planning.executed_plan.instances == adoption.plan.instances
        assert "plan_executing" in recorder.kinds()

    asyncio.run(scenario())


def test_no_plan_runs_and_no_step_is_observed_while_an_instance_restarts(model_dir, tmp_path):
    """The watchdog restarting a dead instance: the layout is short of it, so the planner neither
    learns from those steps nor has a plan carried out (it would stop or drain an instance that
    is not there); both resume once the instance is back."""

    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        planning.instances.restarts_in_progress = 1
        adoption = planning.planner.propose(_shrunk(planning.planner.current, 2), "external")
        for step in range(1, 12):
            await _settle(planning, step)
        assert planning.executor.executed == []
        assert planning.planner.version == adoption.version  # no trigger was fed
        planning.instances.restarts_in_progress = 0
        await _settle(planning, 12)
        await _settle(planning, 13)
        assert [version for version, _ in planning.executor.executed] == [adoption.version]

    asyncio.run(scenario())


def test_plan_needing_a_hybrid_join_is_refused_and_the_planner_reconciled(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        launch = planning.planner.current
        # Training grows onto device 1 (DP 2): an elastic join the job cannot do yet.
        grown = Plan(
            3,
            type(launch.training)(type(launch.training.config)(1, 1, 2, 1), 0),
            (RolloutInstance("rollout-tp1-d2", 1, (2,), 2),),
            (BucketPlan(1, 1, 256, 0, 0.0),),
            0.0,
            0.0,
        )
        planning.planner.propose(grown, "external")
        await planning.after_step(StepTimes(1, 0.1, 1.0, 0))
        assert planning.executor.executed == []
        assert "plan_refused" in recorder.kinds()
        current = planning.planner.current
        assert current.instances == launch.instances and current.training.config.dp == 1
        assert planning.executed_version == planning.planner.version

    asyncio.run(scenario())


def test_each_core_rank_hosts_the_lane_of_one_hybrid_replica():
    """A core of D ranks (TP = PP = 1) hosts D lanes: hybrid replica D + r goes to core rank r, and
    a plan with more hybrids than core ranks is refused before anything runs. (The channels are
    never used: nothing listens at these addresses.)"""
    control = RankHybridControl(["127.0.0.1:1", "127.0.0.1:2"], 1, "token", ControlConfig())
    try:
        assert [control.hosts(replica) for replica in range(6)] == [False, False, True, True, False, False]
        assert unsupported([JoinHybridReplica(2, (2,)), JoinHybridReplica(3, (3,))], control) == []
        assert unsupported([JoinHybridReplica(4, (4,)), StopRolloutInstance("r", (4,), False)], control) == [
            JoinHybridReplica(4, (4,))
        ]
        assert unsupported([ReleaseHybridReplica(2, (2,))], None) == [ReleaseHybridReplica(2, (2,))]
        with pytest.raises(RuntimeError, match="a core of 2 DP replicas takes replicas 2 to 3"):
            control.request_join(4)
    finally:
        control.close()
    with pytest.raises(ValueError, match="3 core ranks do not form replicas of TP = 2"):
        RankHybridControl(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], 2, "token", ControlConfig())


class FakeLaneStub:
    """Fake of a core rank's TrainRank stub for the hybrid RPCs, over a real `HybridPool` (the
    lane's generation and state bookkeeping); `refuse` makes RequestJoin and RequestRelease fail
    like a rank whose RPC errs."""

    def __init__(self, address: str, refuse: bool = False):
        self.address, self.refuse = address, refuse
        self.pool = HybridPool(ElasticConfig())
        self.calls: list[tuple] = []

    def RequestJoin(self, request, timeout):
        self.calls.append(("join", request.replica))
        if self.refuse:
            raise RuntimeError(f"{self.address} refused")
        generation = self.pool.request_join(request.replica, 0.0)
        return SimpleNamespace(generation=generation, lane_address=self.address)

    def CancelJoin(self, request, timeout):
        self.calls.append(("cancel", request.replica, request.generation))
        self.pool.cancel(request.replica, request.generation, 0.0, request.reason)

    def RequestRelease(self, request, timeout):
        self.calls.append(("release", request.replica))
        if self.refuse:
            raise RuntimeError(f"{self.address} refused")

    def GetHybridState(self, request, timeout):
        self.calls.append(("state",))
        return SimpleNamespace(replica=-1)


def test_a_tensor_parallel_core_replica_joins_on_all_its_lanes():
    """A core of TP 2 x DP 2: hybrid replica 2 + r pairs with core replica r, whose ranks 2r and
    2r + 1 each host a lane; requests go to both, in TP order, with one agreed generation."""
    control = RankHybridControl([f"127.0.0.1:{i + 1}" for i in range(4)], 2, "token", ControlConfig())
    stubs = [FakeLaneStub(f"lane-{i}", refuse=i == 3) for i in range(4)]
    control._stubs = stubs  # the fakes stand in for the gRPC stubs (nothing listens at the addresses)
    try:
        assert [control.hosts(replica) for replica in range(5)] == [False, False, True, True, False]
        # Lane 0 saw a join that lane 1 missed (its RPC failed): lane 1 catches up by cancelled joins.
        stubs[0].pool.request_join(2, 0.0)
        stubs[0].pool.cancel(2, 1, 0.0)
        assert control.request_join(2) == HybridJoin(2, ("lane-0", "lane-1"))
        assert stubs[1].calls == [("join", 2), ("cancel", 2, 1), ("join", 2)]
        assert stubs[2].calls == stubs[3].calls == []
        control.request_release(2)
        assert stubs[0].calls[-1] == stubs[1].calls[-1] == ("release", 2)
        # One lane's failed RPC does not keep the request from the others (the first error is raised).
        stubs[0].refuse = True
        with pytest.raises(RuntimeError, match="lane-0 refused"):
            control.request_release(2)
        assert stubs[1].calls[-1] == ("release", 2) and len(stubs[1].calls) == 5
        # Replica 3's second lane refuses: the first lane's join is rolled back.
        with pytest.raises(RuntimeError, match="lane-3 refused"):
            control.request_join(3)
        assert stubs[2].calls == [("join", 3), ("cancel", 3, 1)]
        # States come from TP rank 0 of each asked replica's core replica only.
        control.states([2, 3])
        assert [stub.calls.count(("state",)) for stub in stubs] == [1, 0, 1, 0]
    finally:
        control.close()


def test_failed_action_reconciles_the_planner_with_what_runs(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        planning.executor.fail = True
        launch = planning.planner.current
        planning.planner.propose(_shrunk(launch, 2), "external")
        await _settle(planning, 1)
        await _settle(planning, 2)
        failed = [e for e in recorder.events if e["kind"] == "plan_executed"]
        assert failed and failed[0]["ok"] is False
        # The instance could not be stopped: the planner's plan has it again.
        assert planning.planner.current.instances == launch.instances
        assert planning.executed_version == planning.planner.version

    asyncio.run(scenario())


def test_triggered_search_runs_on_the_measured_history(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        for step in range(1, 12):
            await _settle(planning, step)
        decisions = [e for e in recorder.events if e["kind"] in ("plan_applied", "plan_rejected")]
        # The periodic trigger fired after warm-up and the planner decided (either way) on it.
        assert len(decisions) >= 2, recorder.events

    asyncio.run(scenario())


def test_replans_are_re_scored_on_the_groups_the_job_recorded(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path, rescore=True)
        policy = planning.planner.policy
        planning.planner.set_policy(dataclasses.replace(policy, reconfiguration_cost_s=0.0))
        for step in range(1, 12):
            planning.record(
                [TrajectoryTrace(f"g{step}-{j}", "p", f"g{step}", 200, (TurnTrace(300),)) for j in range(4)]
            )
            await _settle(planning, step)
        # The job's groups reached the rescorer, and the re-plan was chosen by its scores.
        assert [g[0].group_id for g in planning.rescorer.groups][-1] == "g11"
        (rescoring, *_) = planning.planner.rescorings
        assert len(rescoring.scored) >= 2
        applied = [e["message"] for e in recorder.events if e["kind"] == "plan_applied"]
        assert any("re-scored: " + rescoring.describe() in message for message in applied), applied

    asyncio.run(scenario())


def test_instance_lost_with_its_agent_is_replanned_without_it(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        launch = planning.planner.current
        cluster = planning.cluster
        cluster.agents[0] = dataclasses.replace(cluster.agents[0], state=AgentState.LOST)
        planning.on_instance_gone(1)  # the watchdog: pool instance 1 (device 2) died with its agent
        await planning.after_step(StepTimes(1, 0.1, 1.0, 0))
        assert "plan_replanned" in recorder.kinds()
        assert [i.devices for i in planning.planner.current.instances] == [(1,)]
        assert "rollout-tp1-d2" not in planning.executor.running_instances()
        # A plan that puts an instance back on the lost agent's device is refused.
        recorder.events.clear()
        await planning.settled()
        planning.planner.propose(launch, "external")
        await planning.after_step(StepTimes(2, 0.1, 1.0, 0))
        refused = [e["message"] for e in recorder.events if e["kind"] == "plan_refused"]
        assert refused and "node agent is lost" in refused[0]
        assert planning.executor.executed == []
        assert [i.devices for i in planning.planner.current.instances] == [(1,)]

    asyncio.run(scenario())


def test_planner_inputs(model_dir):
    arch = model_arch(model_dir, "float32")
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.bytes_per_param) == (4, 2, 32, 4)
    profile = SimpleNamespace()
    assert (cluster_spec(3, 1, profile).num_nodes, cluster_spec(3, 1, profile).devices_per_node) == (3, 1)
    assert (cluster_spec(4, 2, profile).num_nodes, cluster_spec(4, 2, profile).devices_per_node) == (2, 4)
    assert (cluster_spec(6, 1, profile).num_nodes, cluster_spec(6, 1, profile).devices_per_node) == (3, 2)
    trace = TrajectoryTrace(
        "t",
        "p",
        "g",
        prompt_tokens=40,
        turns=(TurnTrace(30, tool="calc", payload_tokens=5, tool_latency_s=0.25), TurnTrace(20)),
    )
    assert RequestRecord.from_trace(trace) == RequestRecord(45, 50, 2, 0.25)


@pytest.mark.parametrize("router_type", [LeastLoadRouter, RoundRobinRouter])
def test_baseline_routers_report_instance_loads_for_a_drain(router_type):
    router = router_type()
    router.add_instance(0, 0)
    router.add_instance(1, 0)
    for i in range(3):
        router.admit(f"t{i}", "p")
    router.set_instance_ready(1, False)
    loads = {load.instance_id: (load.active, load.ready) for load in router.instance_loads()}
    assert sum(active for active, _ in loads.values()) == 3
    assert loads[1][1] is False and loads[0][1] is True


def test_rollout_load_counts_what_engines_decode_and_what_queues_behind_them(model_dir, tmp_path):
    """The job's side of `StepObservation.measure`: the router's trajectories on each live
    instance, decoding up to the engine's `max_num_seqs` (64 in the tiny config), the rest queued."""

    async def scenario():
        planning, _ = _planning(model_dir, tmp_path)
        loads = [SimpleNamespace(instance_id=0, active=70), SimpleNamespace(instance_id=1, active=10)]
        planning.instances.pool.router = SimpleNamespace(instance_loads=lambda: loads)
        assert planning._rollout_load() == (64 + 10, 6, 2 * 64)
        planning.instances.pool.ids = [1]  # instance 0 lost: its trajectories count no more
        assert planning._rollout_load() == (10, 0, 64)

    asyncio.run(scenario())


def test_the_planner_lays_out_the_launch_when_no_tp_sizes_are_given(model_dir):
    """`job.rollout_tp_sizes` empty: the planner's search on the devices training leaves, among the
    buckets' TP sizes. On the default four slots its model picks three TP-1 instances over TP-2 +
    TP-1; with only a TP-2 bucket it must use TP-2, leaving a slot idle rather than break the
    buckets."""
    config = load_config("configs/tiny_cpu.py", ["job.rollout_tp_sizes="])
    assert config.job.rollout_tp_sizes == ()
    sizes, plan = planned_rollout_sizes(config, planning_problem(config, model_dir))
    assert sizes == (1, 1, 1) and plan.training.devices == (0,)
    only_tp2 = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, buckets=(BucketConfig("tp2", 2, 4096),))
    )
    sizes, plan = planned_rollout_sizes(only_tp2, planning_problem(only_tp2, model_dir))
    assert sizes == (2,) and len(plan.idle_devices) == 1
    four_ranks = load_config("configs/tiny_cpu.py", ["job.rollout_tp_sizes=", "training.data_parallel=4"])
    with pytest.raises(ValueError, match=r"0 devices left after training's 4.*set job.rollout_tp_sizes"):
        planned_rollout_sizes(four_ranks, planning_problem(four_ranks, model_dir))


def test_a_resumed_runs_planner_starts_from_the_groups_recorded_before(model_dir, tmp_path):
    async def scenario():
        planning, _ = _planning(model_dir, tmp_path, rescore=True)
        planning.history.clear()
        recorded = [
            TrajectoryTrace(f"g{g}-{j}", f"p{g}", f"g{g}", 100 + g, (TurnTrace(50 + j),))
            for g in range(3)
            for j in range(4)
        ]
        assert planning.restore_history(recorded) == 12
        # The history in the recorded order, the rescorer's groups whole, the planner told now.
        assert list(planning.history) == [RequestRecord.from_trace(t) for t in recorded]
        assert [[t.trajectory_id for t in group] for group in planning.rescorer.groups] == [
            [f"g{g}-{j}" for j in range(4)] for g in range(3)
        ]
        assert planning.planner.history == tuple(planning.history)
        assert planning.instances.pool.repriced == 1

    asyncio.run(scenario())


def test_the_planner_observes_on_a_thread_while_the_steps_go_on(model_dir, tmp_path):
    async def scenario():
        planning, recorder = _planning(model_dir, tmp_path)
        release, observed = threading.Event(), []

        def slow_observe(obs):  # a long search or re-scoring
            observed.append(obs.step)
            assert release.wait(10)
            if obs.step == 3:
                raise RuntimeError("boom")

        planning.planner.observe = slow_observe
        # Neither boundary waits for the planner; the second step ends while it still decides.
        await asyncio.wait_for(planning.after_step(StepTimes(1, 0.1, 1.0, 0)), 5)
        await asyncio.wait_for(planning.after_step(StepTimes(2, 0.1, 1.0, 0)), 5)
        release.set()
        await _settle(planning, 3)
        await planning.settled()
        assert observed == [1, 3]
        failed = [e["message"] for e in recorder.events if e["kind"] == "plan_failed"]
        assert failed == ["step 3: the planner failed: RuntimeError: boom"]

    asyncio.run(scenario())
