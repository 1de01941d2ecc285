"""The job's one owner of its workers.

Every worker the job runs — a rollout instance, a train rank or a hybrid replica; the launch's own
and those a plan starts — has one record here under one name for its whole life: its kind,
placement, command line, the controller's id of the process running it now, its address, pool id,
plan id and phase. Workers start and stop only through the fleet: the launch calls `launch` /
`wait_serving`, the plan executor the fleet's `ClusterApi` face (`start_worker` / `stop_worker`,
by the same names). One watchdog notices each serving worker that ends without being asked (it
exited, or its node agent was lost) exactly once, and hands it to the job's handler for its kind
(`RolloutInstances` restarts an instance under its name and pool id, `TrainRankGroup` reports the
train ranks lost). A hybrid replica's end is its lane's to judge (`JobPlanning` follows it); the
fleet only drops its record once its process ended.

    STARTING --(ready)--> SERVING --(stop asked)--> STOPPING --> ENDED
                             \\--(ended unasked, or its agent lost)--> LOST --(relaunch)--> STARTING
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from libra.control import WorkerRole, WorkerSpec, WorkerState
from libra.control.types import AgentState, ClusterState, WorkerStatus
from libra.job.cluster import JobCluster, Placement

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.5
_STOP_GRACE_S = 5.0


class WorkerKind(enum.Enum):
    ROLLOUT_INSTANCE = "rollout instance"
    TRAIN_RANK = "train rank"
    HYBRID_REPLICA = "hybrid replica"

    @property
    def role(self) -> WorkerRole:
        """The controller's role of the kind's processes."""
        return WorkerRole.ROLLOUT if self is WorkerKind.ROLLOUT_INSTANCE else WorkerRole.TRAIN


class WorkerPhase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    """The job asked it to stop: its end is no loss."""
    ENDED = "ended"
    LOST = "lost"
    """It ended without being asked, or its node agent was lost."""


@dataclass
class FleetWorker:
    name: str
    """The job's name for the worker, kept across restarts (the plan executor's and the logs')."""
    kind: WorkerKind
    placement: Placement
    argv: tuple[str, ...]
    """Its launch spec's command line (a restart runs it again)."""
    ready_file: Path | None = None
    """Written by the worker once it serves (its address or port); None: whoever started it waits
    (the plan executor)."""
    worker_id: str = ""
    """The controller's id of the process running it now (worker ids are never reused)."""
    tp_size: int = 1
    instance_id: int | None = None
    """The instance pool's id of a rollout instance (kept across restarts)."""
    plan_id: str = ""
    """The planner's name of a rollout instance, once a plan holds it."""
    address: str = ""
    phase: WorkerPhase = WorkerPhase.STARTING
    lost_reason: str = ""
    agent_lost: bool = False
    """It was lost with its node agent: nothing can be restarted on its devices."""
    restarts: int = 0


LossHandler = Callable[[FleetWorker], Awaitable[None]]


class Fleet:
    """The records of the job's workers on `cluster`, their start and stop, and the watchdog."""

    def __init__(self, cluster: JobCluster, start_timeout_s: float):
        self.cluster = cluster
        self.start_timeout_s = start_timeout_s
        self._records: dict[str, FleetWorker] = {}
        self._handlers: dict[WorkerKind, LossHandler] = {}
        self._handling: set[asyncio.Task] = set()
        self._closing = False
        """No more watching: the job is ending."""
        self._aborting = False
        """A worker still starting is given up (after the losses being handled finished)."""

    # -- records -----------------------------------------------------------------------------

    def get(self, name: str) -> FleetWorker:
        return self._records[name]

    def instance(self, instance_id: int) -> FleetWorker | None:
        """The rollout instance of that pool id, until it is forgotten."""
        return next(
            (r for r in self.of_kind(WorkerKind.ROLLOUT_INSTANCE) if r.instance_id == instance_id), None
        )

    def of_kind(self, kind: WorkerKind) -> list[FleetWorker]:
        return [r for r in self._records.values() if r.kind is kind]

    def rollout_instances(self) -> list[FleetWorker]:
        """Rollout instances in the pool (or joining it), by pool id."""
        live = (WorkerPhase.STARTING, WorkerPhase.SERVING)
        instances = [
            r
            for r in self.of_kind(WorkerKind.ROLLOUT_INSTANCE)
            if r.phase in live and r.instance_id is not None
        ]
        return sorted(instances, key=lambda r: r.instance_id)

    def forget(self, name: str) -> FleetWorker | None:
        """Drops the record (its worker was stopped, or its loss was handled for good)."""
        return self._records.pop(name, None)

    # -- start and stop ------------------------------------------------------------------------

    def launch(
        self,
        name: str,
        kind: WorkerKind,
        placement: Placement,
        argv: list[str] | tuple[str, ...],
        ready_file: Path,
        **fields,
    ) -> FleetWorker:
        """Asks the placement's node agent to start the worker; it serves once it wrote
        `ready_file` (its address or port): see `wait_serving`."""
        if name in self._records:
            raise ValueError(f"the fleet already has a worker named {name!r}")
        record = FleetWorker(name, kind, placement, tuple(argv), ready_file, **fields)
        self._records[name] = record
        self._start_process(record)
        return record

    def relaunch(self, record: FleetWorker) -> FleetWorker:
        """Starts a lost worker again, under its name, on its placement, with its command line
        (a new process: a new worker id); `wait_serving` as after `launch`."""
        record.restarts += 1
        record.phase, record.address, record.lost_reason = WorkerPhase.STARTING, "", ""
        self._start_process(record)
        return record

    def _start_process(self, record: FleetWorker) -> None:
        if record.ready_file is not None:
            record.ready_file.unlink(missing_ok=True)
        record.worker_id = record.name if not record.restarts else f"{record.name}.r{record.restarts}"
        env = {"LIBRA_TOKEN": self.cluster.token, "PYTHONWARNINGS": "ignore"}
        spec = WorkerSpec(
            record.worker_id,
            record.kind.role,
            record.placement.devices,
            record.argv,
            env,
            cwd=str(Path.cwd()),
        )
        self.cluster.client.start_worker(record.placement.agent_id, spec)

    def wait_ready(self, record: FleetWorker) -> FleetWorker:
        """Waits until the worker wrote its ready file, whose text becomes its `address`; it stays
        STARTING (unwatched) until `serving`. Blocking: call it from a thread. Raises with the
        worker's log tail when it ended first or took longer than the start timeout; a worker that
        never got ready is stopped and forgotten."""
        try:
            record.address = self._wait_for(record)
        except BaseException:
            self.stop(record.name)
            self.forget(record.name)
            raise
        return record

    def wait_serving(self, record: FleetWorker) -> FleetWorker:
        """`wait_ready`, then watched as serving."""
        self.wait_ready(record)
        return self.serving(record.name, record.address)

    def start(self, *args, **fields) -> FleetWorker:
        """`launch`, then `wait_serving` (blocking)."""
        return self.wait_serving(self.launch(*args, **fields))

    def serving(self, name: str, address: str, **fields) -> FleetWorker:
        """The worker serves at `address` (e.g. an instance in the pool, on the current weights):
        from now on the watchdog watches it. `fields` (pool id, TP size, plan id) complete its
        record. RuntimeError when its process ended meanwhile."""
        record = self._records.get(name)
        if record is None:
            raise LookupError(f"the fleet started no worker named {name!r}")
        status = self.status(name)
        if status is None or status.state.ended:
            raise RuntimeError(f"worker {name} is not running")
        for key, value in fields.items():
            setattr(record, key, value)
        record.address = address
        if record.phase == WorkerPhase.STARTING:
            record.phase = WorkerPhase.SERVING
        return record

    def _wait_for(self, record: FleetWorker) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        worker_id, path = record.worker_id, record.ready_file
        while time.monotonic() < deadline:
            if self._aborting:
                raise RuntimeError(f"the job stopped while worker {worker_id} was starting")
            if path.is_file():
                return path.read_text().strip()
            status = self.status(record.name)
            if status is not None and status.state.ended:
                raise RuntimeError(
                    f"worker {worker_id} ended ({status.state.name}, exit {status.exit_code}):\n"
                    f"{_tail(status.log_path)}"
                )
            time.sleep(0.2)
        status = self.status(record.name)
        raise RuntimeError(
            f"worker {worker_id} did not serve within {self.start_timeout_s} s:\n"
            f"{_tail(status.log_path if status else '')}"
        )

    def stop(self, name: str, planned: bool = True, grace_s: float = _STOP_GRACE_S) -> WorkerStatus | None:
        """Asks the worker's agent to stop its process; returns the controller's view afterwards.
        `planned=False`: its end is handled as a loss (the kind's handler restarts it), e.g. an
        instance that cannot load the current weights."""
        record = self._records.get(name)
        if record is not None and planned and record.phase in (WorkerPhase.STARTING, WorkerPhase.SERVING):
            record.phase = WorkerPhase.STOPPING
        status = self.status(name)
        if status is not None and status.state in (WorkerState.STARTING, WorkerState.RUNNING):
            try:
                status = self.cluster.client.stop_worker(status.spec.worker_id, grace_s=grace_s)
            except Exception:  # noqa: BLE001 - the agent may be gone already; nothing left to stop
                pass
        if record is not None and record.phase == WorkerPhase.STOPPING:
            record.phase = WorkerPhase.ENDED
        return status

    def status(self, name: str) -> WorkerStatus | None:
        """The controller's view of the process running the worker `name` now."""
        record = self._records.get(name)
        worker_id = record.worker_id if record is not None else name
        return next((w for w in self._snapshot().workers if w.spec.worker_id == worker_id), None)

    def pids(self, kind: WorkerKind) -> dict[str, int]:
        workers = {w.spec.worker_id: w for w in self._snapshot().workers}
        return {
            r.name: workers[r.worker_id].pid
            for r in self.of_kind(kind)
            if r.worker_id in workers and r.phase != WorkerPhase.ENDED
        }

    def _snapshot(self) -> ClusterState:
        return self.cluster.controller.cluster.snapshot()

    # -- the plan executor's `ClusterApi` (`libra.planner.actions`) -------------------------------

    def cluster_state(self) -> ClusterState:
        return self._snapshot()

    def start_worker(self, agent_id: str, spec: WorkerSpec) -> WorkerStatus:
        """The executor starts a rollout instance or a hybrid replica: it gets a record under the
        executor's worker id; the executor waits for it to serve (`serving` then marks it)."""
        kind = WorkerKind.ROLLOUT_INSTANCE if spec.role == WorkerRole.ROLLOUT else WorkerKind.HYBRID_REPLICA
        if spec.worker_id in self._records:
            raise ValueError(f"the fleet already has a worker named {spec.worker_id!r}")
        record = FleetWorker(
            spec.worker_id,
            kind,
            Placement(agent_id, tuple(spec.devices)),
            tuple(spec.argv),
            worker_id=spec.worker_id,
        )
        self._records[record.name] = record
        try:
            return self.cluster.client.start_worker(agent_id, spec)
        except BaseException:
            self.forget(record.name)
            raise

    def stop_worker(self, worker_id: str, grace_s: float = 0.0) -> WorkerStatus:
        """The executor stops a worker by its name (whatever process runs it now); the record goes."""
        status = self.stop(worker_id, grace_s=grace_s)
        if status is None:
            raise LookupError(f"the controller knows no process of worker {worker_id!r}")
        if status.state.ended:
            self.forget(worker_id)
        return status

    # -- loss ------------------------------------------------------------------------------------

    def describe_lost(self, names: list[str]) -> list[str]:
        """What happened to those of `names` that ended or whose agent is gone, one line each
        (the controller's view now)."""
        snapshot = self._snapshot()
        agents = {a.agent_id: a for a in snapshot.agents}
        workers = {w.spec.worker_id: w for w in snapshot.workers}
        lost = []
        for name in names:
            record = self._records.get(name)
            worker = workers.get(record.worker_id if record is not None else name)
            agent = agents.get(worker.agent_id) if worker is not None else None
            where = f"on agent {agent.agent_id} ({agent.host})" if agent is not None else ""
            if agent is not None and agent.state != AgentState.ALIVE:
                lost.append(f"{name} {where}: the agent is {agent.state.name.lower()}")
            elif worker is not None and worker.state.ended:
                lost.append(
                    f"{name} {where}: {worker.state.name.lower()} with code "
                    f"{worker.exit_code} (log {worker.log_path})"
                )
        return lost

    def on_loss(self, kind: WorkerKind, handler: LossHandler) -> None:
        """`handler(record)` runs (as its own task) once for each worker of `kind` lost."""
        self._handlers[kind] = handler

    async def watch(self) -> None:
        """The watchdog: every serving worker that ended unasked, or whose agent was lost, is
        marked LOST once and handed to its kind's handler."""
        while not self._closing:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            snapshot = self._snapshot()
            agents = {a.agent_id: a.state for a in snapshot.agents}
            statuses = {w.spec.worker_id: w for w in snapshot.workers}
            for record in list(self._records.values()):
                if self._closing:
                    return
                status = statuses.get(record.worker_id)
                ended = status is not None and status.state.ended
                if record.kind not in self._handlers:
                    if ended:  # a hybrid replica that left: its lane said why
                        self.forget(record.name)
                    continue
                agent_lost = agents.get(record.placement.agent_id) != AgentState.ALIVE
                if record.phase != WorkerPhase.SERVING or not (agent_lost or ended):
                    continue
                record.phase, record.agent_lost = WorkerPhase.LOST, agent_lost
                record.lost_reason = (
                    f"{status.state.name} with code {status.exit_code}"
                    if ended
                    else f"its agent {record.placement.agent_id} is lost"
                )
                logger.warning("%s %s lost: %s", record.kind.value, record.name, record.lost_reason)
                task = asyncio.create_task(self._handlers[record.kind](record))
                self._handling.add(task)
                task.add_done_callback(self._handled)

    def _handled(self, task: asyncio.Task) -> None:
        self._handling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("handling a lost worker failed", exc_info=task.exception())

    @property
    def handling(self) -> int:
        """Losses being handled now (e.g. instances restarting)."""
        return len(self._handling)

    async def close(self, timeout_s: float) -> None:
        """Stops watching; a loss being handled (a restart) finishes first, within `timeout_s`, so
        the run's fault record is complete and no worker is left half-started; then stops every
        worker still running."""
        self._closing = True
        if self._handling:
            await asyncio.wait(list(self._handling), timeout=timeout_s)
        for task in list(self._handling):
            task.cancel()
        await asyncio.gather(*self._handling, return_exceptions=True)
        self._aborting = True
        for name in list(self._records):
            await asyncio.to_thread(self.stop, name)


def _tail(path: str, num_chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-num_chars:]
    except OSError:
        return f"(no log at {path!r})"
