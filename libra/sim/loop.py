"""The simulated RL loop of one policy: draw groups, route, gate, train, publish, maybe re-plan.

`simulate(config, policy)` builds the policy's starting layout (`pools`), a real router (C-MLFQ or
a baseline) over simulated instances (`engine`), and runs `num_steps` training steps:

- Colocated synchronous: every device rolls out the step's groups; when the last trajectory is
  done, the devices switch to training (a stage switch each way), train, and the next step
  starts on the new version. Tail batching launches more prompts than it keeps, ends the round
  when enough groups are complete, aborts the rest and runs their prompts later in dedicated
  long rounds.
- Disaggregated asynchronous: the real `StalenessGate` admits new groups while rollout is at most
  `max_staleness` versions ahead; the trainer takes the first `global_batch` fresh finished
  trajectories, trains (training cost model on that batch's lengths), publishes the weights, and
  the next turns run on the new version. With re-planning, the real `Planner` observes each step
  and adopts plans by its own apply rule (a policy without the elastic pool tells it that the
  pool pairs nothing, so every training change is priced as the restart it is); the loop then
  moves devices between the stages.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from libra.planner.config import RequestRecord, TriggerPolicy
from libra.planner.diff import RestartTraining
from libra.planner.planner import Planner, PlanRescorer
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_speeds import with_speeds
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel
from libra.planner.triggers import StepObservation
from libra.scheduler.config import BucketConfig, bucket_of, fair_queue_length
from libra.scheduler.factory import make_router
from libra.sim.config import Mode, PolicySpec, SimConfig
from libra.sim.engine import LiveTrajectory, RolloutCluster
from libra.sim.metrics import DeviceLedger, SimResult, StepRecord, tail_share
from libra.sim.pools import (
    Layout,
    bucket_configs,
    build_layout,
    plan_buckets,
    planning_problem,
    trajectories_in_flight,
)
from libra.sim.workloads import GroupSource, WorkloadGenerator
from libra.trace import TrajectoryTrace

PREFLIGHT_GROUP_OFFSET = 10_000_000
"""Preflight groups are drawn from indices no run uses."""


def preflight_history(config: SimConfig) -> tuple[RequestRecord, ...]:
    """A sample of the workload at step 0, as the original's startup preflight seeds the planner."""
    generator = WorkloadGenerator(config.workload)
    groups = math.ceil(config.history_size / config.workload.group_size)
    traces = [t for i in range(groups) for t in generator.group(PREFLIGHT_GROUP_OFFSET + i, 0.0)]
    return tuple(RequestRecord.from_trace(t) for t in traces[: config.history_size])


@dataclass(frozen=True)
class WorkloadWindow:
    """Which groups a run draws: from index `first_group`, at the drift of its own progress
    (step / num_steps), or held at `held_progress` (a short run that prices plans on the
    workload as it is at one moment of a longer one)."""

    first_group: int = 0
    held_progress: float | None = None

    def progress(self, step: int, num_steps: int) -> float:
        return step / num_steps if self.held_progress is None else self.held_progress


RescorerFactory = Callable[[Callable[[], tuple[RequestRecord, ...]], Callable[[], float]], PlanRescorer]
"""Builds a run's plan rescorer from how to read the run's history and workload progress now."""


class PolicyRun:
    """One policy's run; `run()` returns its `SimResult`."""

    def __init__(
        self,
        config: SimConfig,
        policy: PolicySpec,
        layout: Layout,
        history: tuple[RequestRecord, ...],
        workload: WorkloadWindow = WorkloadWindow(),
        rescorer: RescorerFactory | None = None,
        groups: GroupSource | None = None,
    ):
        self.config = config
        self.workload = workload
        self.make_rescorer = rescorer
        self.policy = policy
        self.layout = layout
        self.history = deque(history, maxlen=config.history_size)
        self.generator = groups if groups is not None else WorkloadGenerator(config.workload)
        self.batch = config.batch
        self.staleness_bound = (
            0
            if policy.mode is Mode.COLOCATED_SYNC
            else (config.batch.max_staleness if policy.max_staleness is None else policy.max_staleness)
        )
        # A policy that names its own staleness (one-step off-policy, on-policy) keeps exactly it,
        # and drops what finishes past it, as its peers run it.
        takes_config = policy.mode is not Mode.COLOCATED_SYNC and policy.max_staleness is None
        self.tail = config.tail_staleness if takes_config else 0
        self.staleness_mode = config.staleness_mode if takes_config else "drop"
        self.ledger = DeviceLedger(config.num_devices)
        rollout_cost = RolloutCostModel(config.cluster, config.model, config.planner, config.rollout_factors)
        self.train_cost = TrainingCostModel(
            config.cluster,
            config.model,
            replace(config.batch, max_staleness=self.staleness_bound),
            config.planner,
            config.train_factors,
        )
        # A cap the config leaves 0 is derived for the launch pool, and again by the cluster
        # whenever a plan changes the pool, as the job's pool does.
        in_flight = trajectories_in_flight(config, policy)
        derived_cap = not config.cmlfq.max_queue_length
        total_weight = sum(rollout_cost.router_weight(i.tp) for i in layout.instances)
        cap = fair_queue_length(in_flight, total_weight) if derived_cap else config.cmlfq.max_queue_length
        cmlfq_config = layout.cmlfq_config(config.cmlfq, cap)
        self.rollout_cost = rollout_cost
        cmlfq_config = replace(cmlfq_config, buckets=self._priced(cmlfq_config.buckets))
        router = make_router(policy.router, cmlfq_config)
        self.cluster = RolloutCluster(
            router,
            cmlfq_config,
            rollout_cost,
            config.planner.max_decode_batch,
            config.costs.migration,
            config.costs.kv_move_bandwidth_bytes_per_s,
            config.token_budget,
            trajectories_in_flight=in_flight if derived_cap else 0,
        )
        self.cluster.on_finish = self._on_finish
        self.instance_of_name: dict[str, int] = {}
        self.training: TrainingConfig = layout.training
        self.train_devices = layout.train_devices
        self.next_group = workload.first_group
        self.step = 0
        self.steps: list[StepRecord] = []
        self.staleness: list[int] = []
        self.consumed_tokens = 0
        self.train_busy_s = 0.0
        self.started = 0
        self.finished = 0
        self.aborted = 0
        self.dropped = 0
        self.plans_applied = 0
        self.plans_rejected = 0
        self.search_s: list[float] = []
        self.notes: list[str] = []
        self.planner: Planner | None = None
        self.current_plan = layout.plan
        self.bucket_tps, self.thresholds = layout.bucket_tps, layout.thresholds
        self.bucket_updates = 0
        self.bucket_moves = 0
        w = config.model.weight_bytes
        self.publish_s = (
            0.0
            if policy.mode is Mode.COLOCATED_SYNC
            else w / config.cluster.profile.inter_node_bandwidth_bytes_per_s
        )

    # Shared pieces.

    def _place_instances(self, instances, ready_at: float) -> None:
        for inst in instances:
            sim = self.cluster.add_instance(
                inst.instance_id, inst.tp, bucket_of(self.bucket_tps, inst.tp), inst.devices, ready_at
            )
            self.instance_of_name[inst.instance_id] = sim.instance_id

    def _draw_group(self) -> list[TrajectoryTrace]:
        traces = self.generator.group(
            self.next_group, self.workload.progress(self.step, self.config.num_steps)
        )
        self.next_group += 1
        return traces

    def _train_s(self, batch: list[LiveTrajectory], cfg: TrainingConfig) -> float:
        lengths = [t.trace.total_tokens for t in batch]
        mean = sum(lengths) / len(lengths)
        seqs = SequenceStats(mean, sum(x * x for x in lengths) / len(lengths), max(lengths))
        return self.train_cost.step_s(cfg, seqs)

    def _consume(self, batch: list[LiveTrajectory], version: int) -> int:
        """Takes `batch` into a step at `version`; returns its trained (generated) tokens."""
        tokens = 0
        for traj in batch:
            self.staleness.append(version - (traj.oldest_version or 0))
            tokens += traj.generated
        self.consumed_tokens += tokens
        return tokens

    def _on_finish(self, traj: LiveTrajectory) -> None:
        self.finished += 1
        self.history.append(RequestRecord.from_trace(traj.trace))
        self.handle_finish(traj)

    def handle_finish(self, traj: LiveTrajectory) -> None:
        raise NotImplementedError

    def _busy_by_tp(self) -> dict[int, float]:
        busy: dict[int, float] = {}
        for inst in self.cluster.all_instances():
            busy[inst.tp] = busy.get(inst.tp, 0.0) + inst.busy_s * inst.tp
        return dict(sorted(busy.items()))

    def _tokens_by_tp(self) -> dict[int, float]:
        tokens: dict[int, float] = {}
        for inst in self.cluster.all_instances():
            tokens[inst.tp] = tokens.get(inst.tp, 0.0) + inst.decoded_tokens
        return dict(sorted(tokens.items()))

    def result(self, wall_s: float) -> SimResult:
        self.cluster.settle()
        now = self.cluster.now
        seconds = self.ledger.close(now)
        seconds["rollout_busy"] = sum(i.busy_s * i.tp for i in self.cluster.all_instances())
        seconds["train_busy"] = self.train_busy_s
        return SimResult(
            policy=self.policy.name,
            config_name=self.config.name,
            num_devices=self.config.num_devices,
            num_steps=self.step,
            makespan_s=now,
            trajectories=len(self.staleness),
            output_tokens=self.consumed_tokens,
            device_seconds=seconds,
            staleness=self.staleness,
            steps=self.steps,
            migrations=self.cluster.num_migrations,
            migration_s=self.cluster.migration_s,
            prefix_evictions=self.cluster.prefix_evictions,
            evicted_prefill_tokens=self.cluster.evicted_prefill_tokens,
            busy_by_tp=self._busy_by_tp(),
            tokens_by_tp=self._tokens_by_tp(),
            turns=self.cluster.num_turns,
            dropped=self.dropped,
            aborted=self.aborted,
            plans_applied=self.plans_applied,
            plans_rejected=self.plans_rejected,
            planner_search_s=self.search_s,
            wall_s=wall_s,
            started=self.started,
            finished=self.finished,
            notes=self.notes,
        )

    def _priced(self, buckets: tuple[BucketConfig, ...]) -> tuple[BucketConfig, ...]:
        """The buckets with their speeds on the workload as it is (`sim.cmlfq_price_moves`)."""
        if not self.config.cmlfq_price_moves:
            return buckets
        kv_transfer = self.config.costs.migration == "kv_move"
        return with_speeds(buckets, self.rollout_cost, tuple(self.history), kv_transfer)


class SyncRun(PolicyRun):
    """Colocated synchronous rounds (optionally with tail batching)."""

    def run(self) -> None:
        self._place_instances(self.layout.instances, 0.0)
        self.long_queue: deque[list[TrajectoryTrace]] = deque()
        self._begin_round()
        self.cluster.run_until(lambda: self.step >= self.config.num_steps)

    def _begin_round(self) -> None:
        now = self.cluster.now
        self.round_started = now
        self.ledger.set_role(range(self.config.num_devices), "rollout", now)
        groups_kept = self.batch.global_batch // self.batch.group_size
        long_round = self.policy.tail_batching and len(self.long_queue) >= groups_kept
        if long_round:
            groups = [self.long_queue.popleft() for _ in range(groups_kept)]
        else:
            launch = groups_kept
            if self.policy.tail_batching:
                launch = math.ceil(groups_kept * self.config.costs.tail_overprovision)
            groups = [self._draw_group() for _ in range(launch)]
        self.groups_needed = groups_kept
        self.round_live: dict[str, list[LiveTrajectory]] = {}
        self.round_traces = {g[0].group_id: g for g in groups}
        self.done_groups: list[str] = []
        self.remaining: dict[str, int] = {}
        for traces in groups:
            self.remaining[traces[0].group_id] = len(traces)
            self.round_live[traces[0].group_id] = [self.cluster.start(t, tag=self.step) for t in traces]
            self.started += len(traces)

    def handle_finish(self, traj: LiveTrajectory) -> None:
        group = traj.trace.group_id
        self.remaining[group] -= 1
        if self.remaining[group] == 0:
            self.done_groups.append(group)
            if len(self.done_groups) == self.groups_needed:
                self._end_round()

    def _end_round(self) -> None:
        now = self.cluster.now
        kept = set(self.done_groups)
        for group, trajs in self.round_live.items():
            if group in kept:
                continue
            for traj in trajs:
                if traj.finished_at is None:
                    self.cluster.abort(traj)
                    self.aborted += 1
            if self.policy.tail_batching:  # RollPacker: the unfinished prompt runs in a long round
                self.long_queue.append(self.round_traces[group])
        batch = [t for g in self.done_groups for t in self.round_live[g]]
        tokens = self._consume(batch, self.cluster.version)
        rollout_s = now - self.round_started
        train_s = self._train_s(batch, self.training)
        switch = self.config.costs.colocate_switch_s
        n = range(self.config.num_devices)
        self.ledger.set_role(n, "loading", now)
        self.cluster.schedule(now + switch, self.ledger.set_role, n, "train", now + switch)
        self.cluster.schedule(
            now + switch + train_s, self.ledger.set_role, n, "loading", now + switch + train_s
        )
        end = now + 2 * switch + train_s
        self.train_busy_s += train_s * self.config.num_devices
        self.steps.append(
            StepRecord(
                self.step,
                self.round_started,
                end,
                train_s,
                rollout_s,
                2 * switch,
                tail_share([t.started_at for t in batch], [t.finished_at for t in batch]),
                self.config.num_devices,
                tokens,
            )
        )
        self.cluster.schedule(end, self._next_round)

    def _next_round(self) -> None:
        self.step += 1
        self.cluster.publish(self.step)
        if self.step < self.config.num_steps:
            self._begin_round()


class AsyncRun(PolicyRun):
    """Disaggregated training and rollout with bounded staleness (and, optionally, re-planning)."""

    def run(self) -> None:
        from libra.training.staleness import StalenessGate

        self.gate = StalenessGate(self.staleness_bound, self.batch.global_batch, tail_staleness=self.tail)
        self.buffer: deque[LiveTrajectory] = deque()
        self.trainer_busy = False
        self.trainer_free_at = 0.0
        self.pending_training: tuple[float, TrainingConfig, tuple[int, ...]] | None = None
        self.stall_s = 0.0
        self.last_step_end = 0.0
        self.last_batch_ready = 0.0
        self._place_instances(self.layout.instances, 0.0)
        self.ledger.set_role(self.train_devices, "train", 0.0)
        for inst in self.layout.instances:
            self.ledger.set_role(inst.devices, "rollout", 0.0)
        if self.policy.replan:
            self._start_planner()
        self._start_groups()
        self.cluster.run_until(lambda: self.step >= self.config.num_steps)

    def _start_groups(self) -> None:
        g = self.batch.group_size
        while self.gate.capacity() >= g:
            self.gate.try_start(g)
            for trace in self._draw_group():
                self.cluster.start(trace, tag=self.gate.version)  # the version it was launched at
            self.started += g

    def handle_finish(self, traj: LiveTrajectory) -> None:
        self.buffer.append(traj)
        self._maybe_train()

    def _waits_for_tail(self) -> bool:
        """Trajectories still running were launched so long ago that the next step would leave
        them too stale: the step waits for them in `wait` mode, and in `budget` mode when dropping
        them would take the dropped share past the budget (as the job does)."""
        due = sum(1 for t in self.cluster.live.values() if self.gate.must_train(t.tag))
        return self.gate.waits_for_due(due, self.staleness_mode, self.config.drop_budget)

    def _take_fresh(self) -> list[LiveTrajectory] | None:
        """The first `global_batch` finished trajectories the gate admits at the trainer's
        version (those this step must train on first, unless in `drop` mode); stale ones are
        dropped (their slots return to rollout)."""
        if self.staleness_mode != "drop":
            due = [t for t in self.buffer if self.gate.must_train(t.tag)]
            self.buffer = deque(due + [t for t in self.buffer if not self.gate.must_train(t.tag)])
        while len(self.buffer) >= self.batch.global_batch:
            head = self.buffer[0]
            if self.gate.admit([head.oldest_version])[0]:
                break
            self.buffer.popleft()
            self.dropped += 1
        if len(self.buffer) < self.batch.global_batch:
            return None
        fresh = [self.buffer.popleft() for _ in range(self.batch.global_batch)]
        stale = [t for t in fresh[1:] if not self.gate.admit([t.oldest_version])[0]]
        if stale:  # put the fresh ones back in order and try again later
            self.dropped += len(stale)
            keep = [t for t in fresh if t not in stale]
            self.buffer.extendleft(reversed(keep))
            self._start_groups()
            return self._take_fresh()
        return fresh

    def _maybe_train(self) -> None:
        now = self.cluster.now
        self._start_groups()
        if (
            self.trainer_busy
            or len(self.buffer) < self.batch.global_batch
            or self.step >= self.config.num_steps
        ):
            return
        if now < self.trainer_free_at:
            self.cluster.schedule(self.trainer_free_at, self._maybe_train)
            return
        if self._waits_for_tail():
            return  # its finish calls back
        batch = self._take_fresh()
        self._start_groups()
        if batch is None:
            return
        if self.pending_training and now >= self.pending_training[0]:
            _, self.training, self.train_devices = self.pending_training
            self.pending_training = None
        tokens = self._consume(batch, self.gate.version)
        train_s = self._train_s(batch, self.training) + self.publish_s
        self.trainer_busy = True
        self.train_busy_s += train_s * self.training.num_devices
        wait = max(0.0, now - self.last_step_end)
        rollout_interval = now - self.last_batch_ready
        self.last_batch_ready = now
        self.steps.append(
            StepRecord(
                self.step,
                now,
                now + train_s,
                train_s,
                wait,
                self.stall_s,
                tail_share([t.started_at for t in batch], [t.finished_at for t in batch]),
                self.training.num_devices,
                tokens,
            )
        )
        self.stall_s = 0.0
        self.cluster.schedule(now + train_s, self._train_done, train_s, rollout_interval)

    def _train_done(self, train_s: float, rollout_s: float) -> None:
        self.trainer_busy = False
        self.last_step_end = self.cluster.now
        self.gate.on_train_step(self.batch.global_batch)
        self.step += 1
        self.cluster.publish(self.gate.version)
        # The history moved on: the router's speeds follow it, as the job's do.
        if self.config.cmlfq_price_moves:
            self.cluster.reprice(self._priced)
        if self.planner is not None and self.step < self.config.num_steps:
            self._observe(train_s, rollout_s)
        self._start_groups()
        self._maybe_train()

    # Re-planning.

    def _start_planner(self) -> None:
        costs = self.config.costs
        policy = replace(
            self.config.planner.policy,
            auto_apply=True,
            cut_inflight=True,
            reconfiguration_cost_s=costs.hybrid_join_s + costs.instance_start_s,
            restart_cost_s=costs.restart_training_s,
        )
        problem = self._planning_problem()
        problem = replace(problem, config=replace(problem.config, policy=policy))
        rescorer = None
        if self.make_rescorer is not None:
            rescorer = self.make_rescorer(
                lambda: tuple(self.history), lambda: self.workload.progress(self.step, self.config.num_steps)
            )
        self.planner = Planner(
            problem,
            self.config.train_factors,
            self.config.rollout_factors,
            on_event=self._on_planner_event,
            rescorer=rescorer,
        )
        # The planner starts from the layout already running (its initial plan).
        self.current_plan = self.planner.propose(self.current_plan, "the launch layout").plan

    def _planning_problem(self):
        """The re-plans' problem: with the elastic pool, training may grow by replicas that take
        unequal, group-granular shares (`SearchConfig.uneven_data_parallel`); without it a
        re-split restarts training into Megatron DP groups of equal shares."""
        history = tuple(self.history)
        return planning_problem(
            self.config, history, self.staleness_bound, elastic=self.policy.elastic, tail_staleness=self.tail
        )

    def _on_planner_event(self, event) -> None:
        if event.kind == "rejected":  # the trigger's reason and the planner's rule
            self.plans_rejected += 1
            self.notes.append(f"step {self.step}: re-plan rejected by the planner: {event.message}")

    def _observe(self, train_s: float, rollout_s: float) -> None:
        planner = self.planner
        planner.update_history(tuple(self.history))
        obs = StepObservation.measure(
            self.step,
            train_s,
            rollout_s,
            running=len(self.cluster.live),
            waiting=len(self.cluster.unplaced),
            slots=sum(1 for _ in self.cluster.instances) * self.config.planner.max_decode_batch,
            rejected_total=self.dropped,
            history_size=len(self.history),
        )
        started = time.perf_counter()
        adoption = planner.observe(obs)
        elapsed = time.perf_counter() - started
        if elapsed > 1e-4:  # a search ran (a trigger fired)
            self.search_s.append(elapsed)
        if adoption is None:
            return
        restart = any(isinstance(a, RestartTraining) for a in adoption.actions)
        costs = self.config.costs
        cost = costs.restart_training_s if restart else costs.hybrid_join_s + costs.instance_start_s
        planner.record_reconfiguration(cost, restart=restart)
        self.notes.append(f"step {self.step}: re-plan applied by the planner: {adoption.reason}")
        self._apply(adoption.plan, restart)

    def _apply(self, plan, restart: bool) -> None:
        now, costs = self.cluster.now, self.config.costs
        self.plans_applied += 1
        old_train = set(self.train_devices) | set(self.current_plan.training.devices)
        old_plan, self.current_plan = self.current_plan, plan
        old_keys = {(i.tp, i.devices): i for i in old_plan.instances}
        new_keys = {(i.tp, i.devices): i for i in plan.instances}
        # The plan's new instances join (loading) before the old ones leave, as the job's pool
        # expects them from the plan's start (`InstancePool.expect`): the cap counts them when
        # the leavers' trajectories are placed again, and what has no room waits for them. The
        # buckets change last, as in the job, so nobody is moved onto a leaver.
        started = [i for key, i in new_keys.items() if key not in old_keys]
        instance_ready = now + costs.instance_start_s
        self._place_instances(started, instance_ready)
        for key, inst in old_keys.items():
            if key not in new_keys:
                self.cluster.remove_instance(self.instance_of_name.pop(inst.instance_id))
        self._update_buckets(plan)
        new_train = plan.training.devices
        if restart:
            ready = now + costs.restart_training_s
            self.trainer_free_at = max(self.trainer_free_at, ready)
            self.stall_s += costs.restart_training_s
            self.pending_training = (ready, plan.training.config, new_train)
        else:
            ready = now + (costs.hybrid_join_s if len(new_train) > len(self.train_devices) else 0.0)
            if ready <= now:
                self.training, self.train_devices = plan.training.config, new_train
            else:
                self.pending_training = (ready, plan.training.config, new_train)
        # Device roles: what changes goes through `loading` until its new role is live.
        for d in range(self.config.num_devices):
            if d in new_train:
                if restart or d not in old_train:
                    self._reassign(d, "train", ready)
            elif any(d in i.devices for i in started):
                self._reassign(d, "rollout", instance_ready)
            elif not any(d in i.devices for i in plan.instances):
                self.ledger.set_role([d], "unassigned", now)
        self.notes.append(
            f"step {self.step}: applied plan ({'restart' if restart else 'elastic'}): "
            f"train {training_layout(plan.training.config, self.batch)}, {len(plan.instances)} instances"
        )

    def _update_buckets(self, plan) -> None:
        """When the plan's buckets (TP sizes or thresholds) differ from the router's, the router
        takes the new ones at run time; every instance is relabelled, those the plan added
        (loading) too (the ones it drops were removed already)."""
        tps, thresholds = plan_buckets(plan)
        if (tps, thresholds) == (self.bucket_tps, self.thresholds) or not tps:
            return
        self.bucket_tps, self.thresholds = tps, thresholds
        mapping = {i: bucket_of(tps, inst.tp) for i, inst in self.cluster.instances.items()}
        moved = self.cluster.update_buckets(self._priced(bucket_configs(tps, thresholds)), mapping)
        self.bucket_moves += moved
        self.bucket_updates += 1
        self.notes.append(
            f"step {self.step}: router buckets now TP {list(tps)} up to {list(thresholds)} remaining "
            f"tokens ({moved} live trajectories moved)"
        )

    def _reassign(self, device: int, role: str, at: float) -> None:
        now = self.cluster.now
        if at <= now:
            self.ledger.set_role([device], role, now)
            return
        self.ledger.set_role([device], "loading", now)
        self.cluster.schedule(at, self.ledger.set_role, [device], role, at)


def training_layout(cfg: TrainingConfig, batch) -> str:
    """E.g. `28 devices TP4 PP1 DP7 mb1 (groups 5 x4 + 4 x3)` (32 groups): the layout and its DP shares."""
    groups = batch.global_batch // batch.group_size
    low, extra = divmod(groups, cfg.dp)
    shares = f"{low} x{cfg.dp}" if not extra else f"{low + 1} x{extra} + {low} x{cfg.dp - extra}"
    return f"{cfg.num_devices} devices TP{cfg.tp} PP{cfg.pp} DP{cfg.dp} mb{cfg.micro_batch} (groups {shares})"


def simulate(
    config: SimConfig,
    policy: PolicySpec,
    layout: Layout,
    history: tuple[RequestRecord, ...],
    workload: WorkloadWindow = WorkloadWindow(),
    rescorer: RescorerFactory | None = None,
    groups: GroupSource | None = None,
) -> SimResult:
    """Runs one policy from its layout; deterministic for the config (and its seeds). `rescorer`:
    how its planner re-scores candidate plans (`libra.sim.rescoring`; None: by its model).
    `groups`: where it draws its groups (None: the config's synthetic workload)."""
    started = time.perf_counter()
    run_cls = SyncRun if policy.mode is Mode.COLOCATED_SYNC else AsyncRun
    run = run_cls(config, policy, layout, history, workload, rescorer, groups)
    run.run()
    return run.result(time.perf_counter() - started)


def run_policy(config: SimConfig, name: str, history=None, plan=None) -> SimResult:
    """Convenience: the preflight history, the initial plan and the layout, then `simulate`."""
    from libra.sim.config import POLICIES
    from libra.sim.pools import initial_plan

    policy = POLICIES[name]
    history = history or preflight_history(config)
    if plan is None and policy.mode is Mode.DISAGGREGATED_ASYNC and policy.pool.value != "fixed_pattern":
        plan = initial_plan(config, history, config.batch.max_staleness)
    return simulate(config, policy, build_layout(config, policy, history, plan), history)


__all__ = ["TriggerPolicy", "preflight_history", "run_policy", "simulate"]
