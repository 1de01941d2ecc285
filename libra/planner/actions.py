"""Executes a plan diff: the ordered actions of `libra.planner.diff` carried out on node agents
through the controller's cluster API, with the rollout and training sides behind the small
protocols of `libra.planner.controls`.

What each action does:

- StopRolloutInstance: drain (stop routing to it, wait for its in-flight trajectories, at most
  `drain_timeout_s`; the ones left at the deadline are cut) or cut (abort now; they resume on
  another instance from their kept tokens); then StopWorker; then the pool forgets it.
- StartRolloutInstance: StartWorker on the agent holding its devices, wait until it serves (its
  ready file), then the pool adds it (current weights, its TP bucket).
- JoinHybridReplica: the core opens a join (generation, lane address); StartWorker runs the
  hybrid replica on the devices rollout just gave up. The join protocol itself runs on the core's
  lane at step boundaries, so the executor does not wait for it.
- ReleaseHybridReplica: the core releases the replica at its next step boundary, and its worker
  exits by itself; StopWorker only if it has not within `release_timeout_s`.
- RestartTraining: checkpoint -> stop (hybrid workers too) -> start the new layout -> load.
- SetBucketThresholds: handed to the rollout side.

Order and failure. Before anything runs, the action list is checked against the devices that
running workers hold: every start must land on devices that are free or freed by an earlier action
(`check_device_order`). Actions then run one at a time; each outcome is an event (PLAN_EXECUTED,
with the plan's version) and a line of the returned report. The first failure stops the rest
(they are reported as skipped). A failed action leaves what it touched as it was: an instance
whose worker could not be stopped is restored to routing and stays registered; a started worker
that never became ready is stopped; a hybrid whose worker could not start has its join cancelled.
The instances and hybrid replicas that run afterwards are in `running_instances()` and
`running_hybrids()` — what the planner's current plan should be reconciled with after a failure.
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from libra.control.events import EventBus
from libra.control.types import ClusterState, EventKind, WorkerRole, WorkerSpec, WorkerStatus
from libra.planner.controls import HybridControl, LaunchSpec, RolloutControl, TrainingControl, WorkerLauncher
from libra.planner.device_map import DeviceMap
from libra.planner.diff import (
    Action,
    JoinHybridReplica,
    ReleaseHybridReplica,
    RestartTraining,
    SetBucketThresholds,
    StartRolloutInstance,
    StopRolloutInstance,
)
from libra.planner.execution_config import ExecutorConfig

logger = logging.getLogger(__name__)


class ClusterApi(Protocol):
    """The controller's cluster API (`libra.control.ClusterClient` is one)."""

    def cluster_state(self) -> ClusterState: ...

    def start_worker(self, agent_id: str, spec: WorkerSpec) -> WorkerStatus: ...

    def stop_worker(self, worker_id: str, grace_s: float = 0.0) -> WorkerStatus: ...


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class ActionResult:
    index: int
    action: Action
    outcome: Outcome
    seconds: float = 0.0
    detail: str = ""

    def describe(self) -> str:
        return f"{self.index}: {describe_action(self.action)}: {self.outcome.value} {self.detail}".rstrip()


@dataclass(frozen=True)
class ExecutionReport:
    plan_version: int
    results: tuple[ActionResult, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.outcome is Outcome.OK for r in self.results)

    @property
    def failed(self) -> ActionResult | None:
        return next((r for r in self.results if r.outcome is Outcome.FAILED), None)


@dataclass(frozen=True)
class RunningWorker:
    """A worker the executor started (or adopted) for the plan."""

    worker_id: str
    devices: tuple[int, ...]
    """Global (plan) device numbers."""
    tp: int = 0
    address: str = ""
    generation: int = 0
    """Hybrid replicas: the join's generation."""


def describe_action(action: Action) -> str:
    match action:
        case StopRolloutInstance():
            how = "cut" if action.cut_inflight else "drain"
            return f"stop rollout {action.instance_id} ({how}) on {list(action.devices)}"
        case StartRolloutInstance():
            return f"start rollout {action.instance_id} TP-{action.tp} on {list(action.devices)}"
        case JoinHybridReplica():
            return f"join hybrid replica {action.replica} on {list(action.devices)}"
        case ReleaseHybridReplica():
            return f"release hybrid replica {action.replica} from {list(action.devices)}"
        case RestartTraining():
            return (
                f"restart training TP={action.tp} PP={action.pp} DP={action.dp} on {list(action.new_devices)}"
            )
        case SetBucketThresholds():
            return "set bucket thresholds " + ", ".join(f"TP-{k}<={n}" for k, n in action.thresholds)
    raise TypeError(f"not a plan action: {action!r}")


def check_device_order(actions: Sequence[Action], busy: set[int]) -> None:
    """ValueError naming the first action that would start on a device still held — by a running
    worker (`busy`) not stopped by an earlier action, or by an earlier start."""
    held = set(busy)
    for index, action in enumerate(actions):
        match action:
            case StopRolloutInstance() | ReleaseHybridReplica():
                held -= set(action.devices)
            case RestartTraining():
                held -= set(action.old_devices)
                taken = sorted(held & set(action.new_devices))
                if taken:
                    raise ValueError(
                        f"action {index} ({describe_action(action)}): devices {taken} are still held"
                    )
                held |= set(action.new_devices)
            case StartRolloutInstance() | JoinHybridReplica():
                taken = sorted(held & set(action.devices))
                if taken:
                    raise ValueError(
                        f"action {index} ({describe_action(action)}): devices {taken} are still held; "
                        "stops must come before the starts that use their devices"
                    )
                held |= set(action.devices)


class ActionExecutor:
    """Carries plan diffs out, one plan at a time (concurrent `execute` calls wait their turn),
    and keeps track of the rollout instances and hybrid replicas it runs. Blocking: an asyncio job
    calls it through `asyncio.to_thread`."""

    def __init__(
        self,
        cluster: ClusterApi,
        rollout: RolloutControl,
        training: TrainingControl,
        hybrids: HybridControl,
        launcher: WorkerLauncher,
        config: ExecutorConfig | None = None,
        events: EventBus | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cluster = cluster
        self.rollout = rollout
        self.training = training
        self.hybrid_control = hybrids
        self.launcher = launcher
        self.config = config or ExecutorConfig()
        self.events = events
        self.clock = clock
        self._instances: dict[str, RunningWorker] = {}
        self._hybrids: dict[int, RunningWorker] = {}
        self._numbers = itertools.count(1)
        self._devices = DeviceMap(())
        self._lock = threading.Lock()
        self._known_worker_ids: set[str] = set()

    # -- what runs -------------------------------------------------------------------------------

    def adopt_instance(
        self, instance_id: str, worker_id: str, tp: int, devices: tuple[int, ...], address: str
    ) -> None:
        """Registers an instance started outside the executor (the job's initial ones), so a later
        plan can stop it."""
        self._instances[instance_id] = RunningWorker(worker_id, tuple(devices), tp, address)

    def forget_instance(self, instance_id: str) -> RunningWorker | None:
        """Drops an instance whose worker is gone outside any plan (its node agent was lost), so
        that no later plan tries to stop it; returns what was known of it."""
        with self._lock:
            return self._instances.pop(instance_id, None)

    def running_instances(self) -> dict[str, RunningWorker]:
        return dict(self._instances)

    def running_hybrids(self) -> dict[int, RunningWorker]:
        return dict(self._hybrids)

    # -- execution -------------------------------------------------------------------------------

    def execute(self, actions: Sequence[Action], plan_version: int = 0) -> ExecutionReport:
        """Runs `actions` in order (see the module docstring); ValueError, with nothing done, when
        their order would start a worker on a held device or a device does not exist."""
        with self._lock:
            return self._execute(actions, plan_version)

    def _execute(self, actions: Sequence[Action], plan_version: int) -> ExecutionReport:
        state = self.cluster.cluster_state()
        self._known_worker_ids = {w.spec.worker_id for w in state.workers}
        self._devices = DeviceMap.from_cluster_state(state)
        check_device_order(actions, self._busy_devices(state))
        for action in actions:
            for devices in _devices_started(action):
                self._devices.locate(devices)
        start = self.clock()
        results: list[ActionResult] = []
        failed = False
        # The pool holds the instances the plan starts as loading from now on, so that what
        # the instances it stops carried waits for them (`RolloutControl.expect`).
        starting = tuple(a.tp for a in actions if isinstance(a, StartRolloutInstance))
        if starting:
            self._expect(starting)
        try:
            for index, action in enumerate(actions):
                if failed:
                    results.append(ActionResult(index, action, Outcome.SKIPPED))
                    continue
                began = self.clock()
                try:
                    detail = self._run(action)
                    result = ActionResult(index, action, Outcome.OK, self.clock() - began, detail)
                except Exception as e:  # noqa: BLE001 - any failure stops the plan and is reported
                    failed = True
                    result = ActionResult(
                        index, action, Outcome.FAILED, self.clock() - began, _describe_error(e)
                    )
                results.append(result)
                self._publish(plan_version, result.describe())
        finally:
            if starting:  # those that did not start are given up: nothing waits for them
                self._expect(())
        report = ExecutionReport(plan_version, tuple(results), self.clock() - start)
        self._publish(plan_version, _summary(report))
        return report

    def _expect(self, tp_sizes: tuple[int, ...]) -> None:
        """`RolloutControl.expect`, which only steers placement: its failure (the pool's loop
        not answering) is logged and fails no plan; the next plan's expectation replaces it."""
        try:
            self.rollout.expect(tp_sizes)
        except Exception:  # noqa: BLE001 - any failure here is reported and the plan goes on
            logger.warning("could not tell the rollout pool of the instances %s", tp_sizes, exc_info=True)

    def _run(self, action: Action) -> str:
        match action:
            case StopRolloutInstance():
                return self._stop_instance(action)
            case StartRolloutInstance():
                return self._start_instance(action)
            case JoinHybridReplica():
                return self._join(action)
            case ReleaseHybridReplica():
                return self._release(action)
            case RestartTraining():
                return self._restart(action)
            case SetBucketThresholds():
                self.rollout.set_bucket_thresholds(action.thresholds)
                return ""
        raise TypeError(f"not a plan action: {action!r}")

    # -- rollout instances -----------------------------------------------------------------------

    def _stop_instance(self, action: StopRolloutInstance) -> str:
        instance = self._instances.get(action.instance_id)
        if instance is None:
            raise LookupError(
                f"no running instance {action.instance_id!r} (known: {sorted(self._instances)})"
            )
        if action.cut_inflight:
            detail = f"cut {self.rollout.cut(action.instance_id)}"
        else:
            left = self.rollout.drain(action.instance_id, self.config.drain_timeout_s)
            detail = (
                "drained" if left == 0 else f"drain timed out: cut {self.rollout.cut(action.instance_id)}"
            )
        try:
            status = self.cluster.stop_worker(instance.worker_id, grace_s=self.config.stop_grace_s)
            if not status.state.ended:
                raise RuntimeError(
                    f"worker {instance.worker_id} is still {status.state.name} after StopWorker"
                )
        except Exception:
            # It still runs: keep it registered and routed to (the cluster stays as it was).
            self.rollout.restore(action.instance_id)
            raise
        del self._instances[action.instance_id]
        self.rollout.remove_instance(action.instance_id)
        return f"{detail}; worker {instance.worker_id} {status.state.name.lower()}"

    def _start_instance(self, action: StartRolloutInstance) -> str:
        spec = self.launcher.rollout_instance(action)
        worker_id = self._start_worker(
            f"rollout-{action.instance_id}", WorkerRole.ROLLOUT, action.devices, spec
        )
        try:
            address = self._wait_ready(worker_id, spec.ready_file)
            self.rollout.add_instance(action.instance_id, worker_id, action.tp, address)
        except Exception:
            self._stop_quietly(worker_id)
            raise
        self._instances[action.instance_id] = RunningWorker(worker_id, action.devices, action.tp, address)
        return f"worker {worker_id} serves at {address}" if address else f"worker {worker_id} runs"

    # -- hybrid replicas -------------------------------------------------------------------------

    def _join(self, action: JoinHybridReplica) -> str:
        if action.replica in self._hybrids:
            raise ValueError(
                f"hybrid replica {action.replica} already runs ({self._hybrids[action.replica].worker_id})"
            )
        join = self.hybrid_control.request_join(action.replica)
        try:
            if len(join.lane_addresses) != len(action.devices):
                raise ValueError(
                    f"hybrid replica {action.replica} was planned on {len(action.devices)} device(s), but "
                    f"its core replica has TP = {len(join.lane_addresses)}: a hybrid runs one rank per "
                    "core TP rank"
                )
            spec = self.launcher.hybrid_replica(action, join)
            worker_id = self._start_worker(
                f"hybrid-{action.replica}-g{join.generation}", WorkerRole.TRAIN, action.devices, spec
            )
        except Exception as e:
            self.hybrid_control.cancel_join(action.replica, join.generation, f"worker did not start: {e}")
            raise
        try:
            self._wait_ready(worker_id, spec.ready_file)
        except Exception as e:
            self._stop_quietly(worker_id)
            self.hybrid_control.cancel_join(action.replica, join.generation, f"worker not ready: {e}")
            raise
        self._hybrids[action.replica] = RunningWorker(worker_id, action.devices, generation=join.generation)
        return f"worker {worker_id}, generation {join.generation}, lanes {', '.join(join.lane_addresses)}"

    def _release(self, action: ReleaseHybridReplica) -> str:
        hybrid = self._hybrids.get(action.replica)
        if hybrid is None:
            raise LookupError(
                f"no hybrid replica {action.replica} was started (known: {sorted(self._hybrids)})"
            )
        self.hybrid_control.request_release(action.replica)
        deadline = self.clock() + self.config.release_timeout_s
        status = self._worker_status(hybrid.worker_id)
        while not status.state.ended and self.clock() < deadline:
            time.sleep(self.config.poll_interval_s)
            status = self._worker_status(hybrid.worker_id)
        if status.state.ended:
            detail = f"worker {hybrid.worker_id} exited by itself ({status.exit_code})"
        else:
            status = self.cluster.stop_worker(hybrid.worker_id, grace_s=self.config.stop_grace_s)
            detail = f"worker {hybrid.worker_id} stopped after {self.config.release_timeout_s} s"
        del self._hybrids[action.replica]
        return detail

    def retire_hybrid(self, replica: int) -> str:
        """Stops the worker of a hybrid replica that left outside a plan (its lane rolled it back:
        failure, timeout, cancellation) and forgets it, so its devices are free for the next plan.
        The caller (the job, watching the lane) says when; the planner's current plan should then
        lose the replica too."""
        with self._lock:
            hybrid = self._hybrids.pop(replica, None)
            if hybrid is None:
                raise LookupError(f"no hybrid replica {replica} runs (known: {sorted(self._hybrids)})")
            status = self.cluster.stop_worker(hybrid.worker_id, grace_s=self.config.stop_grace_s)
            return f"worker {hybrid.worker_id} {status.state.name.lower()} (exit {status.exit_code})"

    # -- training --------------------------------------------------------------------------------

    def _restart(self, action: RestartTraining) -> str:
        steps = []
        checkpoint = ""
        if action.old_devices:
            checkpoint = self.training.checkpoint()
            steps.append(f"checkpoint {checkpoint}")
            # Hybrid replicas belong to the old layout; their lanes die with the core ranks.
            for replica, hybrid in sorted(self._hybrids.items()):
                self._stop_quietly(hybrid.worker_id)
                del self._hybrids[replica]
                steps.append(f"stopped hybrid {replica}")
            self.training.stop_training()
            steps.append("stopped")
        self.training.start_training(action)
        steps.append("started")
        if checkpoint:
            self.training.load_checkpoint(checkpoint)
            steps.append("loaded")
        return ", ".join(steps)

    # -- workers ---------------------------------------------------------------------------------

    def _start_worker(self, name: str, role: WorkerRole, devices: tuple[int, ...], spec: LaunchSpec) -> str:
        agent_id, local = self._devices.locate(devices)
        if spec.ready_file:
            Path(spec.ready_file).unlink(missing_ok=True)  # a previous run's file is not readiness
        # Worker ids are never reused (the controller keeps an ended worker ended), not even those
        # of an earlier executor on the same controller.
        worker_id = f"{name}-{next(self._numbers)}"
        while worker_id in self._known_worker_ids:
            worker_id = f"{name}-{next(self._numbers)}"
        self._known_worker_ids.add(worker_id)
        self.cluster.start_worker(
            agent_id, WorkerSpec(worker_id, role, local, spec.argv, dict(spec.env), spec.cwd)
        )
        return worker_id

    def _wait_ready(self, worker_id: str, ready_file: str) -> str:
        """The worker's ready file's content once it exists; RuntimeError when the worker ended
        first, TimeoutError after `start_timeout_s`."""
        deadline = self.clock() + self.config.start_timeout_s
        while True:
            if not ready_file:
                status = self._worker_status(worker_id)
                if status.state.ended:
                    raise RuntimeError(f"worker {worker_id} ended at once (exit {status.exit_code})")
                return ""
            path = Path(ready_file)
            if path.is_file():
                return path.read_text().strip()
            status = self._worker_status(worker_id)
            if status.state.ended:
                raise RuntimeError(
                    f"worker {worker_id} ended ({status.state.name}, exit {status.exit_code}) before it was "
                    f"ready; log: {status.log_path}"
                )
            if self.clock() > deadline:
                raise TimeoutError(
                    f"worker {worker_id} wrote no {ready_file} within {self.config.start_timeout_s} s"
                )
            time.sleep(self.config.poll_interval_s)

    def _worker_status(self, worker_id: str) -> WorkerStatus:
        for worker in self.cluster.cluster_state().workers:
            if worker.spec.worker_id == worker_id:
                return worker
        raise LookupError(f"the controller does not know worker {worker_id!r}")

    def _stop_quietly(self, worker_id: str) -> None:
        try:
            self.cluster.stop_worker(worker_id, grace_s=self.config.stop_grace_s)
        except Exception:  # noqa: BLE001 - already gone, or its agent is; nothing more to stop
            pass

    def _busy_devices(self, state: ClusterState) -> set[int]:
        return {
            d
            for w in state.workers
            if not w.state.ended
            for d in self._devices.global_devices(w.agent_id, w.spec.devices)
        }

    def _publish(self, plan_version: int, message: str) -> None:
        if self.events is not None:
            self.events.publish(EventKind.PLAN_EXECUTED, plan_version=plan_version, message=message)


def _describe_error(error: Exception) -> str:
    """One line; a gRPC error (from the cluster API) as its status code and details."""
    code, details = getattr(error, "code", None), getattr(error, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return f"{type(error).__name__}: {error}"


def _devices_started(action: Action) -> list[tuple[int, ...]]:
    if isinstance(action, StartRolloutInstance | JoinHybridReplica):
        return [action.devices]
    return []


def _summary(report: ExecutionReport) -> str:
    counts = {o.value: sum(r.outcome is o for r in report.results) for o in Outcome}
    failed = report.failed
    head = (
        f"plan v{report.plan_version} applied"
        if failed is None
        else f"plan v{report.plan_version} failed at action {failed.index}"
    )
    return f"{head} in {report.seconds:.2f} s: " + json.dumps(counts)
