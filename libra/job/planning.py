"""The global planner inside the job: its inputs from the job's own measurements, and its plans
carried out on the live cluster.

The job runs the `Planner` on its controller (`JobCluster.start`: the controller serves GetPlan /
ProposePlan / SetPlannerPolicy and publishes plan events); the job feeds it and executes what it
adopts:

    launch     the layout the job started (training on the first devices, rollout instances
               after them) becomes the planner's current plan, proposed like any external plan
    each step  the finished trajectories become the planner's request history; the step's
               measured train and rollout times, the routers' load and the stale drops are one
               `StepObservation` (the planner's triggers, warm-up, cooldown, hysteresis and apply
               rule decide whether it searches, re-scores and adopts); the planner observes it on
               a thread while training goes on, and steps that end meanwhile are not observed
    adopted    at the first step boundary after the planner's plan version moved past the one
               the job executed (its own adoption, or an external ProposePlan), the diff between
               the two is carried out by
               `ActionExecutor` on a thread while training keeps stepping; the next plan waits
               until that one is done. A plan that restarts training (a new TP, PP or core DP:
               `JobTrainingRestart`) runs at the step boundary instead, the loop waiting for it
    failed     the plan the cluster actually runs afterwards (the executor's instances, the
               pool's buckets) is proposed back, so the planner's current plan is the truth

Every plan event (adopted, proposed, rejected, vetoed, each executed action) is mirrored from the
controller's event log into the run's `events.jsonl`, where the report shows them.

Training grows and shrinks through the elastic hybrid pool: when the core has PP = 1 each of its
ranks hosts a lane of the pool (hybrid replica D + r pairs with core DP replica r, so up to D
hybrids, each of the core's TP = T), a plan's JoinHybridReplica starts a hybrid replica through
the node agent on the T devices rollout gave up (one worker, T processes; RequestJoin /
RequestRelease RPCs to the T ranks of its core replica), and the job follows each running
replica's lane state each step (`hybrid_*` events); a replica that rolled back (a process died, a
timeout) is retired and the planner reconciled, while the core keeps training.

Node loss: an instance whose node agent was lost is not restarted; the plan loses it, the planner
is reconciled, and plans that would start a worker on a lost agent's devices are refused.

What the job cannot carry out is refused before anything runs, and the planner reconciled to the
running layout: hybrid moves when the core has PP > 1, or more hybrids than core DP replicas.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from libra.control.types import EventKind
from libra.job.recorder import JobEvent
from libra.job.training_restart import JobTrainingRestart
from libra.planner.actions import ActionExecutor, ExecutionReport, describe_action
from libra.planner.config import (
    RequestRecord,
)
from libra.planner.controls import LaunchSpec
from libra.planner.diff import (
    Action,
    JoinHybridReplica,
    ReleaseHybridReplica,
    RestartTraining,
    StartRolloutInstance,
    diff_plans,
)
from libra.planner.plan import BucketPlan, Plan, RolloutInstance, TrainingPlacement
from libra.planner.training_cost import TrainingConfig
from libra.planner.triggers import StepObservation
from libra.rollout.plan_control import PoolRolloutControl
from libra.trace import TrajectoryTrace
from libra.training.elastic import HybridJoin, ReplicaState
from libra.training.hybrid import paired_core_rank
from libra.training.hybrid_worker import HybridReplicaSpec

if TYPE_CHECKING:
    from libra.config import LibraConfig
    from libra.job.cluster import JobCluster
    from libra.job.fleet import Fleet
    from libra.job.instances import RolloutInstances
    from libra.job.recorder import RunRecorder
    from libra.job.rescoring import JobRescorer
    from libra.job.train_ranks import TrainRankGroup
    from libra.planner.config import PlanningProblem

logger = logging.getLogger(__name__)
T = TypeVar("T")

PLAN_EVENT_KINDS = {
    EventKind.PLAN_APPLIED: JobEvent.PLAN_APPLIED,
    EventKind.PLAN_PROPOSED: JobEvent.PLAN_PROPOSED,
    EventKind.PLAN_REJECTED: JobEvent.PLAN_REJECTED,
    EventKind.PLAN_VETOED: JobEvent.PLAN_VETOED,
    EventKind.PLAN_EXECUTED: JobEvent.PLAN_ACTION,
}
"""Controller event kind -> the run's event kind."""
HYBRID_STATE_EVENTS = {
    ReplicaState.REQUESTED: JobEvent.HYBRID_REQUESTED,
    ReplicaState.FETCHING_STATE: JobEvent.HYBRID_FETCHING_STATE,
    ReplicaState.ZERO_SYNC: JobEvent.HYBRID_ZERO_SYNC,
    ReplicaState.ACTIVATING: JobEvent.HYBRID_ACTIVATING,
    ReplicaState.ACTIVE: JobEvent.HYBRID_ACTIVE,
    ReplicaState.RELEASING: JobEvent.HYBRID_RELEASING,
    ReplicaState.RELEASED: JobEvent.HYBRID_RELEASED,
    ReplicaState.ROLLED_BACK: JobEvent.HYBRID_ROLLED_BACK,
}
"""A hybrid replica's protocol state -> the run's event kind when its lane enters it."""


@dataclass(frozen=True)
class StepTimes:
    """One step as the loop measured it."""

    step: int
    wait_s: float
    """The loop waited this long for the step's batch (rollout was behind)."""
    train_s: float
    """Training and weight publication."""
    num_dropped_stale: int


# -- the seams the executor drives -------------------------------------------------------------


class JobLauncher:
    """`WorkerLauncher`: rollout instances as the job starts its own (same command line), hybrid
    replicas in the running training's config."""

    def __init__(self, cluster: JobCluster, instances: RolloutInstances, train_ranks: TrainRankGroup):
        self.cluster, self.instances, self.train_ranks = cluster, instances, train_ranks
        self._count = 0

    def rollout_instance(self, action: StartRolloutInstance) -> LaunchSpec:
        agent_id, _ = self.cluster.device_map().locate(action.devices)
        self._count += 1
        address_file = self.instances.run_dir / f"plan-{action.instance_id}-{self._count}.addr"
        argv = self.instances.argv(action.tp, self.cluster.agent_host(agent_id), address_file)
        return LaunchSpec(tuple(argv), self._env(), os.getcwd(), str(address_file))

    def hybrid_replica(self, action: JoinHybridReplica, join: HybridJoin) -> LaunchSpec:
        """A hybrid DP replica (`libra.training.hybrid_worker`) following its core replica's lanes."""
        ranks = self.train_ranks
        self._count += 1
        ready_file = ranks.run_dir / f"hybrid-{action.replica}-g{join.generation}-{self._count}.ready"
        spec = HybridReplicaSpec(
            hf_model=str(ranks.model_dir),
            lanes=tuple(join.lane_addresses),
            replica=action.replica,
            generation=join.generation,
            training=ranks.training,
            backend=ranks.config.backend,
            ready_file=str(ready_file),
        )
        return LaunchSpec(tuple(spec.to_argv()), self._env(), os.getcwd(), str(ready_file))

    def _env(self) -> dict[str, str]:
        return {"LIBRA_TOKEN": self.cluster.token, "PYTHONWARNINGS": "ignore"}


class NoHybridLane:
    """`HybridControl` of a core whose ranks host no hybrid lane (PP > 1): plans that move hybrid
    replicas are refused before execution, so reaching any method is a bug."""

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("the core training layout hosts no hybrid lane (its ranks are PP > 1)")

    request_join = cancel_join = request_release = _refuse


class RankHybridControl:
    """`HybridControl` over the core train ranks' RPCs (RequestJoin, CancelJoin, RequestRelease):
    hybrid replica D + r pairs with core DP replica r, whose T TP ranks (Megatron ranks r*T ..
    r*T + T - 1 at PP 1) each host a lane, and every request goes to all T of them; plus the
    lanes' states for the job to follow."""

    def __init__(self, addresses: list[str], tensor_parallel: int, token: str, control):
        from libra.control.auth import open_channel
        from libra.v1 import training_pb2, training_pb2_grpc

        if tensor_parallel < 1 or len(addresses) % tensor_parallel:
            raise ValueError(f"{len(addresses)} core ranks do not form replicas of TP = {tensor_parallel}")
        self._pb = training_pb2
        self._tp = tensor_parallel
        self._channels = [open_channel(address, token, control) for address in addresses]
        self._stubs = [training_pb2_grpc.TrainRankStub(channel) for channel in self._channels]

    @property
    def core_replicas(self) -> int:
        return len(self._stubs) // self._tp

    def hosts(self, replica: int) -> bool:
        return paired_core_rank(replica, self.core_replicas) is not None

    def _lanes(self, replica: int) -> list:
        """The stubs of the core replica's TP ranks, in TP order."""
        core, n = paired_core_rank(replica, self.core_replicas), self.core_replicas
        if core is None:
            raise RuntimeError(
                f"no core replica pairs with hybrid replica {replica}: a core of {n} DP replicas takes "
                f"replicas {n} to {2 * n - 1}"
            )
        return self._stubs[core * self._tp : (core + 1) * self._tp]

    def request_join(self, replica: int) -> HybridJoin:
        """Opens the join on every lane of the core replica. The lanes of one replica must agree on
        the generation; one that missed an earlier request (its RPC failed) is brought up to the
        others' by cancelled joins. A lane that refuses rolls back the ones that accepted."""
        accepted: list[tuple[object, int, str]] = []
        try:
            for stub in self._lanes(replica):
                reply = self._request(stub, replica)
                accepted.append((stub, reply.generation, reply.lane_address))
            newest = max(generation for _, generation, _ in accepted)
            for i, (stub, generation, address) in enumerate(accepted):
                while generation < newest:
                    self._cancel(stub, replica, generation, "catching up with the replica's other lanes")
                    generation = self._request(stub, replica).generation
                    accepted[i] = (stub, generation, address)
        except Exception:
            why = "another lane of the core replica refused the join"
            _on_every_lane(
                accepted,
                lambda lane: self._cancel(lane[0], replica, lane[1], why),
                f"roll back the partial join of hybrid replica {replica}",
            )
            raise
        return HybridJoin(newest, tuple(address for _, _, address in accepted))

    def _request(self, stub, replica: int):
        return stub.RequestJoin(self._pb.RequestJoinRequest(replica=replica), timeout=600)

    def _cancel(self, stub, replica: int, generation: int, reason: str) -> None:
        request = self._pb.CancelJoinRequest(replica=replica, generation=generation, reason=reason)
        stub.CancelJoin(request, timeout=600)

    def cancel_join(self, replica: int, generation: int, reason: str) -> None:
        _on_every_lane(
            self._lanes(replica),
            lambda stub: self._cancel(stub, replica, generation, reason),
            f"cancel the join of hybrid replica {replica}",
            reraise=True,
        )

    def request_release(self, replica: int) -> None:
        request = self._pb.RequestReleaseRequest(replica=replica)
        _on_every_lane(
            self._lanes(replica),
            lambda stub: stub.RequestRelease(request, timeout=600),
            f"release hybrid replica {replica}",
            reraise=True,
        )

    def states(self, replicas) -> list:
        """The HybridStateReply (replica, generation, state name, counters) of each of `replicas`:
        its core replica's TP rank 0 lane speaks for all (the lanes of a replica agree)."""
        request = self._pb.GetHybridStateRequest()
        return [self._lanes(replica)[0].GetHybridState(request, timeout=60) for replica in replicas]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def _on_every_lane(lanes: Sequence[T], send: Callable[[T], object], what: str, reraise: bool = False) -> None:
    """`send` to every lane even when some fail: the lanes of a replica move only once all of them
    have the request, so one failed RPC must not keep the others from getting theirs. The first
    failure is raised afterwards when `reraise`, else logged."""
    errors = []
    for lane in lanes:
        try:
            send(lane)
        except Exception as e:  # noqa: BLE001 - collected, raised or logged below
            errors.append(e)
    if errors and reraise:
        raise errors[0]
    for error in errors:
        logger.warning("could not %s on every lane: %s", what, error)


def unsupported(actions: list[Action], hybrids: RankHybridControl | None) -> list[Action]:
    """The actions the job cannot carry out: hybrid moves that no core rank's lane takes."""
    return [
        a
        for a in actions
        if isinstance(a, JoinHybridReplica | ReleaseHybridReplica)
        and (hybrids is None or not hybrids.hosts(a.replica))
    ]


# -- the planner in the loop -------------------------------------------------------------------


class JobPlanning:
    """Feeds the controller's planner at step boundaries and executes its plans (see the module
    docstring). Lives on the job's event loop; the executor runs on a thread."""

    def __init__(
        self,
        config: LibraConfig,
        cluster: JobCluster,
        fleet: Fleet,
        instances: RolloutInstances,
        train_ranks: TrainRankGroup,
        problem: PlanningProblem,
        recorder: RunRecorder,
        rescorer: JobRescorer | None = None,
    ):
        controller, planner = cluster.controller, cluster.planner
        if controller is None or planner is None:
            raise RuntimeError("the controller runs no planner: start the cluster with a planning problem")
        self.config, self.cluster, self.fleet = config, cluster, fleet
        self.instances, self.train_ranks, self.problem = instances, train_ranks, problem
        self.recorder = recorder
        self.planner = planner
        self.rescorer = rescorer
        """The planner's rescorer (`libra.job.rescoring`), fed each finished group; None: none."""
        self.events = controller.events
        self._event_sequence = 0
        self.history: collections.deque[RequestRecord] = collections.deque(
            maxlen=self.planner.policy.max_history
        )
        self.rejected_total = 0
        self.enabled = True
        self.executed_plan: Plan | None = None
        self.executed_version = 0
        self._execution: asyncio.Task[ExecutionReport] | None = None
        self._target: tuple[Plan, int] | None = None
        self._observation: asyncio.Task[object] | None = None
        """The planner observing a step on a thread (its search and re-scoring), if any."""
        self._observed_step = 0
        self._restarts_training = False
        self._train_first_device = 0
        """Where the core's ranks start (the job launches them on the first devices)."""
        self.launcher = JobLauncher(cluster, instances, train_ranks)
        self.rollout = PoolRolloutControl(
            instances.pool,
            asyncio.get_running_loop(),
            self._add_instance,
            remove_instance_coro=instances.forget,
        )
        self.hybrids: RankHybridControl | None = None
        self._pending_reconcile = ""
        """Why the planner must be reconciled at the next step boundary ("" : no need)."""
        self._lane_seen: dict[int, tuple[int, ReplicaState]] = {}
        """Hybrid replica -> (generation, state) of its lanes as last recorded."""
        # Every worker the executor starts or stops goes through the fleet (its `ClusterApi`).
        self.executor = ActionExecutor(
            fleet,
            self.rollout,
            JobTrainingRestart(train_ranks, instances, cluster),
            NoHybridLane(),
            self.launcher,
            config.planner.execution,
            events=self.events,
        )
        self._bind_lane()

    def _bind_lane(self) -> None:
        """The hybrid control of the core that runs now: its ranks' lanes when it hosts them."""
        if self.hybrids is not None:
            self.hybrids.close()
        ranks = self.train_ranks
        self._lane_seen = {}
        self.hybrids = (
            RankHybridControl(
                ranks.addresses, ranks.training.tensor_parallel, self.cluster.token, self.config.control
            )
            if ranks.hosts_hybrid_lane
            else None
        )
        self.executor.hybrid_control = self.hybrids or NoHybridLane()

    # -- launch ----------------------------------------------------------------------------------

    def adopt_launch_layout(self) -> None:
        """Registers the job's instances with the executor and the id map, and makes the running
        layout the planner's current plan. A layout the planner cannot describe (its device
        count or alignment) turns planning off for the run, with an event saying why."""
        devices = self.cluster.device_map()
        problem_devices = self.problem.cluster.num_devices
        if devices.num_devices != problem_devices:
            self._disable(
                f"the agents hold {devices.num_devices} devices, the planner was sized for {problem_devices}"
            )
            return
        for instance in self.fleet.rollout_instances():
            placement = instance.placement
            global_devices = devices.global_devices(placement.agent_id, placement.devices)
            instance.plan_id = plan_instance_id(instance.tp_size, global_devices)
            self.executor.adopt_instance(
                instance.plan_id, instance.name, instance.tp_size, global_devices, instance.address
            )
            self.rollout.bind(instance.plan_id, instance.instance_id)
        try:
            adoption = self.planner.propose(self.running_plan(), "the job's launch layout")
        except ValueError as e:
            self._disable(f"the launch layout is no plan the planner can hold: {e}")
            return
        self.executed_plan, self.executed_version = adoption.plan, adoption.version
        self._price_moves_by_the_launch()
        self._mirror_events()

    def _price_moves_by_the_launch(self) -> None:
        """Until a plan's reconfiguration is measured, the apply rule prices one at the policy's
        prior; an instance start measured at launch is a better one when it is longer (on a
        loaded CPU host it takes a minute, far above the prior meant for accelerators)."""
        policy, started = self.planner.policy, self.instances.start_s
        if started and max(started) > policy.reconfiguration_cost_s:
            measured = round(max(started), 1)
            self.planner.update_policy(reconfiguration_cost_s=measured)
            self.recorder.event(
                JobEvent.PLANNER_PRIOR,
                f"a plan's reconfiguration is priced at {measured} s until one is measured: "
                "the launch's slowest instance took that long to start",
            )

    def layout(self) -> str:
        """The plan in force, one line (the progress display)."""
        return f"v{self.executed_version}: {self.running_plan().layout()}"

    def running_plan(self) -> Plan:
        """The layout the cluster runs now: the launched training, the executor's instances, the
        pool's bucket thresholds for the TP sizes that have instances."""
        training = self.train_ranks.training
        hybrids = tuple(sorted(self.executor.running_hybrids()))
        placement = TrainingPlacement(
            TrainingConfig(
                training.tensor_parallel, training.pipeline_parallel, training.data_parallel + len(hybrids), 1
            ),
            first_device=self._train_first_device,
            hybrid_replicas=hybrids,
        )
        cluster = self.problem.cluster
        instances = tuple(
            RolloutInstance(plan_id, w.tp, w.devices, w.devices[0] // cluster.devices_per_node)
            for plan_id, w in sorted(self.executor.running_instances().items())
        )
        counts = collections.Counter(i.tp for i in instances)
        buckets = tuple(
            BucketPlan(b.tp_size, counts[b.tp_size], b.max_remaining_tokens, 0, 0.0)
            for b in sorted(self.instances.pool.buckets, key=lambda b: b.tp_size)
            if counts[b.tp_size]
        )
        return Plan(cluster.num_devices, placement, instances, buckets, 0.0, 0.0)

    # -- each step -------------------------------------------------------------------------------

    def record(self, traces) -> None:
        """The traces of a finished group join the history (and the groups the planner's
        rescorer replays)."""
        self.history.extend(RequestRecord.from_trace(trace) for trace in traces)
        if self.rescorer is not None:
            self.rescorer.record(traces)

    def restore_history(self, traces: Iterable[TrajectoryTrace]) -> int:
        """A resumed run's planner starts from what the stopped run had recorded up to its
        checkpoint (`trajectories.jsonl`, rewound to it), group by group in their order: its
        history and its rescorer's groups as they were, not the launch's seed request: the newest
        `max_history` trajectories (of `traces`, which may hold only those). Returns the number
        in the history."""
        groups: dict[str, list[TrajectoryTrace]] = {}
        for trace in collections.deque(traces, maxlen=self.history.maxlen):
            groups.setdefault(trace.group_id, []).append(trace)
        for group in groups.values():
            self.record(group)
        self._share_history()
        return len(self.history)

    def _share_history(self) -> None:
        """The planner plans from the history as it is now, and the router's bucket speeds are
        priced on it (the launch priced them on a seed request)."""
        if self.history:
            self.planner.update_history(tuple(self.history))
            self.instances.pool.reprice()

    async def after_step(self, times: StepTimes) -> None:
        """Called by the loop after each step: finishes a completed execution or observation,
        starts executing a plan adopted since the last boundary, else hands the planner this step
        (`_observe`: its search and re-scoring run on a thread while training goes on)."""
        if not self.enabled:
            return
        self.rejected_total += times.num_dropped_stale
        if self._execution is not None:
            if not self._execution.done():
                self._mirror_events()
                return  # one plan at a time; the planner observes again once it is carried out
            self._finish_execution()
        if self._observation is not None:
            if not self._observation.done():
                # The planner holds its lock while it searches: nothing here may wait for it.
                self._mirror_events()
                return
            self._finish_observation()
        if self._pending_reconcile:
            self.recorder.event(JobEvent.PLAN_REPLANNED, self._pending_reconcile)
            self._reconcile(self._pending_reconcile)
            self._pending_reconcile = ""
        await self._follow_lane()
        if self.instances.restarts_in_progress:
            # An instance is being restarted: rollout runs short of its layout, so these steps
            # measure no plan, and a plan now would act on an instance that is not there.
            self._mirror_events()
            return
        # A plan adopted since the last boundary (by the planner's last observation or an
        # external ProposePlan) runs first; the planner observes again once it is carried out.
        self._mirror_events()
        self._maybe_execute()
        if self._execution is not None:
            if self._restarts_training:
                # A training restart runs at this step boundary: the loop waits (no train step
                # may run on ranks being replaced); rollout keeps serving meanwhile.
                await asyncio.wait([self._execution])
                self._finish_execution()
            return
        self._observe(times)

    def _observe(self, times: StepTimes) -> None:
        """Feeds the planner the step on a thread; the next boundary picks up what it decided."""
        self._share_history()
        # Rollout ran during the whole step: its batch arrived `wait_s` after training (and
        # publication) of the previous one would have allowed. When the loop did not wait, that
        # is only a bound on rollout's time; the planner's calibration treats it as one.
        running, waiting, slots = self._rollout_load()
        obs = StepObservation.measure(
            times.step,
            times.train_s,
            times.wait_s + times.train_s,
            running=running,
            waiting=waiting,
            slots=slots,
            rejected_total=self.rejected_total,
            history_size=len(self.history),
        )
        self._observation = asyncio.create_task(asyncio.to_thread(self.planner.observe, obs))
        self._observed_step = times.step

    def _finish_observation(self) -> None:
        task, self._observation = self._observation, None
        try:
            task.result()
        except Exception as e:  # noqa: BLE001 - a failed search must not end the run
            self.recorder.event(
                JobEvent.PLAN_FAILED,
                f"step {self._observed_step}: the planner failed: {type(e).__name__}: {e}",
            )
        self._mirror_events()

    async def settled(self) -> None:
        """Waits for the planner's observation in flight, if any, and records what it decided
        (the next step boundary carries out a plan it adopted)."""
        if self._observation is not None:
            await asyncio.wait([self._observation])
            self._finish_observation()

    def _rollout_load(self) -> tuple[int, int, int]:
        """(running, waiting, slots) as `StepObservation.measure` counts them: an instance decodes
        up to its engine's `max_num_seqs` trajectories; the router's others on it queue there,
        and those no instance had room for wait unplaced (as the simulator counts them)."""
        per_instance = self.config.rollout.instance.max_num_seqs
        live = set(self.instances.pool.live_ids())
        loads = getattr(self.instances.pool.router, "instance_loads", None)
        placed = [load.active for load in loads() if load.instance_id in live] if loads is not None else []
        running = sum(min(n, per_instance) for n in placed)
        waiting = sum(max(0, n - per_instance) for n in placed) + self.instances.pool.waiting
        return running, waiting, len(live) * per_instance

    def _maybe_execute(self) -> None:
        plan, version = self.planner.current, self.planner.version
        if version == self.executed_version or plan is None:
            return
        _, actions = diff_plans(
            self.executed_plan,
            plan,
            cut_inflight=self.planner.policy.cut_inflight,
            pool=self.problem.config.hybrid_pool,
        )
        refused = unsupported(actions, self.hybrids)
        devices = self.cluster.device_map()
        dead = [a for a in actions if any(not devices.usable(d) for d in _devices_started(a))]
        if dead:
            self.recorder.event(
                JobEvent.PLAN_REFUSED,
                f"plan v{version} starts {describe_action(dead[0])} on a device whose node agent is lost",
                plan_version=version,
            )
            self._reconcile(f"the job refused plan v{version}")
            return
        if refused:
            self.recorder.event(
                JobEvent.PLAN_REFUSED,
                f"plan v{version} needs {describe_action(refused[0])}, which the job cannot do yet; "
                "keeping the running layout",
                plan_version=version,
            )
            self._reconcile(f"the job refused plan v{version}")
            return
        self.recorder.event(
            JobEvent.PLAN_EXECUTING,
            f"plan v{version}: {len(actions)} actions, predicted step {plan.predicted_step_s:.3f} s "
            f"(train {plan.predicted_train_s:.3f} s, rollout {plan.predicted_rollout_s:.3f} s)",
            plan_version=version,
            num_actions=len(actions),
        )
        self._target = (plan, version)
        self._restarts_training = any(isinstance(a, RestartTraining) for a in actions)
        self.executed_version = version  # claimed: a later version diffs against this one
        self._execution = asyncio.create_task(asyncio.to_thread(self.executor.execute, actions, version))

    def _finish_execution(self) -> None:
        task, (plan, version) = self._execution, self._target
        self._execution = self._target = None
        restarted, self._restarts_training = self._restarts_training, False
        if restarted:  # new train ranks (or the old layout again): a new lane
            self._bind_lane()
        try:
            report = task.result()
        except Exception as e:  # noqa: BLE001 - nothing ran (e.g. a device still held)
            self.recorder.event(
                JobEvent.PLAN_EXECUTED, f"plan v{version} not executed: {e}", plan_version=version, ok=False
            )
            self._reconcile(f"plan v{version} could not run")
            return
        self._mirror_events()
        live = len(self.instances.pool.live_ids())
        if report.ok:
            self.executed_plan = plan
            self._train_first_device = plan.training.first_device
            self.planner.record_reconfiguration(report.seconds, restart=restarted)
            self.recorder.event(
                JobEvent.PLAN_EXECUTED,
                f"plan v{version} applied in {report.seconds:.1f} s ({len(report.results)} actions)",
                plan_version=version,
                ok=True,
                seconds=round(report.seconds, 2),
                live_instances=live,
            )
            return
        failed = report.failed
        self.recorder.event(
            JobEvent.PLAN_EXECUTED,
            f"plan v{version} failed at {failed.describe()}",
            plan_version=version,
            ok=False,
            live_instances=live,
        )
        self._reconcile(f"plan v{version} failed at action {failed.index}")

    def _reconcile(self, why: str) -> None:
        """Makes the planner's current plan the layout that runs."""
        try:
            adoption = self.planner.propose(self.running_plan(), f"reconciled: {why}")
        except ValueError as e:
            self._disable(f"the running layout is no plan the planner can hold ({why}): {e}")
            return
        self.executed_plan, self.executed_version = adoption.plan, adoption.version
        self._mirror_events()

    async def _follow_lane(self) -> None:
        """Records each hybrid replica's protocol state as it changes; one that rolled back
        (its rank failed, timed out or was cancelled) is retired: its worker stopped, the
        planner's plan reconciled (its core rank kept training and filled its share in)."""
        if self.hybrids is None or not self.executor.running_hybrids():
            return
        try:
            lanes = await asyncio.to_thread(self.hybrids.states, sorted(self.executor.running_hybrids()))
        except Exception as e:  # noqa: BLE001 - a core rank busy or gone: look again next step
            logger.warning("hybrid lane state unavailable: %s", e)
            return
        for lane in lanes:
            await self._follow(lane)

    async def _follow(self, lane) -> None:
        # The reply names a `ReplicaState` (empty: the slot saw no join yet).
        state = ReplicaState[lane.state] if lane.state else None
        if state is not None and (lane.generation, state) != self._lane_seen.get(lane.replica):
            self._lane_seen[lane.replica] = (lane.generation, state)
            self.recorder.event(
                HYBRID_STATE_EVENTS[state],
                f"hybrid replica {lane.replica} (generation {lane.generation}) is {state.name}",
                replica=lane.replica,
                generation=lane.generation,
                accepted_payloads=lane.accepted_payloads,
                filled_in_shares=lane.filled_in_shares,
            )
        running = self.executor.running_hybrids().get(lane.replica)
        rolled_back = state is ReplicaState.ROLLED_BACK
        if rolled_back and running is not None and running.generation == lane.generation:
            detail = await asyncio.to_thread(self.executor.retire_hybrid, lane.replica)
            reason = lane.rollbacks[-1] if lane.rollbacks else "rolled back"
            self.recorder.event(
                JobEvent.HYBRID_RETIRED,
                f"hybrid replica {lane.replica} rolled back ({reason}); {detail}",
                replica=lane.replica,
                filled_in_shares=lane.filled_in_shares,
            )
            self._reconcile(f"hybrid replica {lane.replica} rolled back")

    def _disable(self, why: str) -> None:
        self.enabled = False
        self.recorder.event(JobEvent.PLANNER_OFF, why)

    def _mirror_events(self) -> None:
        """Copies the controller's new plan events into the run's events."""
        kinds = frozenset(PLAN_EVENT_KINDS)
        for event in self.events.watch(self._event_sequence, kinds, is_active=lambda: False):
            self._event_sequence = max(self._event_sequence, event.sequence)
            self.recorder.event(PLAN_EVENT_KINDS[event.kind], event.message, plan_version=event.plan_version)

    # -- instances the executor starts, and those lost outside a plan -----------------------------

    async def _add_instance(self, plan_id: str, worker_id: str, tp: int, address: str) -> int:
        return await self.instances.join(worker_id, plan_id, tp, address)

    def on_instance_gone(self, instance_id: int) -> None:
        """An instance was lost and not restarted (its node agent is lost, or it did not start
        again): the plan loses it (the planner is reconciled at the next step boundary)."""
        plan_id = self.rollout.unbind(instance_id)
        if plan_id is not None:
            self.executor.forget_instance(plan_id)
        self._pending_reconcile = f"rollout instance {plan_id or instance_id} lost and not restarted"

    async def close(self) -> None:
        """Waits for the planner's observation and a plan being carried out (bounded by the
        executor's timeouts), records them; a plan adopted now is not started."""
        await self.settled()
        if self._execution is not None:
            await asyncio.wait([self._execution])
            self._finish_execution()
        # Hybrid replicas end with the run (their lane, the core rank, stops next).
        for replica in sorted(self.executor.running_hybrids()):
            try:
                await asyncio.to_thread(self.executor.retire_hybrid, replica)
            except Exception as e:  # noqa: BLE001 - its agent may be gone; the run ends anyway
                logger.warning("hybrid replica %d not stopped: %s", replica, e)
        self._mirror_events()
        if self.hybrids is not None:
            self.hybrids.close()


def _devices_started(action: Action) -> tuple[int, ...]:
    return action.devices if isinstance(action, StartRolloutInstance | JoinHybridReplica) else ()


def plan_instance_id(tp: int, devices: tuple[int, ...]) -> str:
    """The planner's name of an instance (`libra.planner.plan.place_rollout`)."""
    return f"rollout-tp{tp}-d{devices[0]}"
