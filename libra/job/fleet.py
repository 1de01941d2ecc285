"""The job's one owner of its workers.

Every worker process the job runs — a rollout instance or a train rank, the launch's own and the
instances a plan starts — has one record here: its role, placement, address, pool id and phase.
Workers start and stop through the fleet, and one watchdog notices each worker that ends without
being asked (it exited, or its node agent was lost) exactly once, and hands it to the job's
handler for its role (`JobWorkers` restarts an instance, or reports the train ranks lost).

    STARTING --(ready file written)--> SERVING --(stop asked)--> STOPPING --> ENDED
                                          \\--(ended unasked, or its agent lost)--> LOST
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
    worker_id: str
    role: WorkerRole
    placement: Placement
    tp_size: int = 1
    instance_id: int | None = None
    """The instance pool's id of a rollout instance."""
    ready_file: Path | None = None
    address: str = ""
    phase: WorkerPhase = WorkerPhase.STARTING
    lost_reason: str = ""
    agent_lost: bool = False
    """It was lost with its node agent: nothing can be restarted on its devices."""


LossHandler = Callable[[FleetWorker], Awaitable[None]]


class Fleet:
    """The records of the job's workers on `cluster`, their start and stop, and the watchdog."""

    def __init__(self, cluster: JobCluster, start_timeout_s: float):
        self.cluster = cluster
        self.start_timeout_s = start_timeout_s
        self._records: dict[str, FleetWorker] = {}
        self._handlers: dict[WorkerRole, LossHandler] = {}
        self._handling: set[asyncio.Task] = set()
        self._closing = False
        """No more watching: the job is ending."""
        self._aborting = False
        """A worker still starting is given up (after the losses being handled finished)."""

    # -- records -----------------------------------------------------------------------------

    def get(self, worker_id: str) -> FleetWorker:
        return self._records[worker_id]

    def instance(self, instance_id: int) -> FleetWorker | None:
        """The rollout instance of that pool id, until it is forgotten."""
        return next(
            (
                r
                for r in self._records.values()
                if r.role == WorkerRole.ROLLOUT and r.instance_id == instance_id
            ),
            None,
        )

    def rollout_instances(self) -> list[FleetWorker]:
        """Rollout instances starting or serving, by pool id."""
        live = (WorkerPhase.STARTING, WorkerPhase.SERVING)
        instances = [r for r in self._records.values() if r.role == WorkerRole.ROLLOUT and r.phase in live]
        return sorted(instances, key=lambda r: r.instance_id)

    def adopt(
        self, worker_id: str, role: WorkerRole, placement: Placement, address: str, **fields
    ) -> FleetWorker:
        """A worker someone else started (a plan's instance) that serves at `address` becomes the
        fleet's, watched like its own."""
        record = FleetWorker(worker_id, role, placement, address=address, phase=WorkerPhase.SERVING, **fields)
        self._records[worker_id] = record
        return record

    def forget(self, worker_id: str) -> FleetWorker | None:
        """Drops the record (a plan stopped the worker, or its loss was handled)."""
        return self._records.pop(worker_id, None)

    # -- start and stop ------------------------------------------------------------------------

    def launch(
        self,
        worker_id: str,
        role: WorkerRole,
        placement: Placement,
        argv: list[str],
        ready_file: Path,
        **fields,
    ) -> FleetWorker:
        """Asks the placement's node agent to start the worker; it serves once it wrote
        `ready_file` (its address or port): see `wait_serving`."""
        ready_file.unlink(missing_ok=True)
        env = {"LIBRA_TOKEN": self.cluster.token, "PYTHONWARNINGS": "ignore"}
        spec = WorkerSpec(worker_id, role, placement.devices, tuple(argv), env, cwd=str(Path.cwd()))
        record = FleetWorker(worker_id, role, placement, ready_file=ready_file, **fields)
        self._records[worker_id] = record
        self.cluster.client.start_worker(placement.agent_id, spec)
        return record

    def wait_serving(self, record: FleetWorker) -> FleetWorker:
        """Waits until the worker wrote its ready file, whose text becomes its `address`.
        Blocking: call it from a thread. Raises with the worker's log tail when it ended first or
        took longer than the start timeout."""
        try:
            record.address = self._wait_for(record.worker_id, record.ready_file)
        except BaseException:
            # Never served: stopped (if it still runs) and forgotten, not watched as a loss.
            self.stop(record.worker_id)
            self.forget(record.worker_id)
            raise
        if record.phase == WorkerPhase.STARTING:
            record.phase = WorkerPhase.SERVING
        return record

    def start(self, *args, **fields) -> FleetWorker:
        """`launch`, then `wait_serving` (blocking)."""
        return self.wait_serving(self.launch(*args, **fields))

    def _wait_for(self, worker_id: str, path: Path) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._aborting:
                raise RuntimeError(f"the job stopped while worker {worker_id} was starting")
            if path.is_file():
                return path.read_text().strip()
            status = self.status(worker_id)
            if status is not None and status.state.ended:
                raise RuntimeError(
                    f"worker {worker_id} ended ({status.state.name}, exit {status.exit_code}):\n"
                    f"{_tail(status.log_path)}"
                )
            time.sleep(0.2)
        status = self.status(worker_id)
        raise RuntimeError(
            f"worker {worker_id} did not serve within {self.start_timeout_s} s:\n"
            f"{_tail(status.log_path if status else '')}"
        )

    def stop(self, worker_id: str, planned: bool = True) -> None:
        """Asks the worker's agent to stop it. `planned=False`: its end is handled as a loss (the
        role's handler restarts it), e.g. an instance that cannot load the current weights."""
        record = self._records.get(worker_id)
        if record is not None and planned and record.phase in (WorkerPhase.STARTING, WorkerPhase.SERVING):
            record.phase = WorkerPhase.STOPPING
        status = self.status(worker_id)
        if status is not None and status.state in (WorkerState.STARTING, WorkerState.RUNNING):
            try:
                self.cluster.client.stop_worker(worker_id, grace_s=_STOP_GRACE_S)
            except Exception:  # noqa: BLE001 - the agent may be gone already; nothing left to stop
                pass
        if record is not None and record.phase == WorkerPhase.STOPPING:
            record.phase = WorkerPhase.ENDED

    def status(self, worker_id: str) -> WorkerStatus | None:
        """The controller's view of the worker."""
        return next((w for w in self._snapshot().workers if w.spec.worker_id == worker_id), None)

    def pids(self, role: WorkerRole) -> dict[str, int]:
        workers = {w.spec.worker_id: w for w in self._snapshot().workers}
        return {
            r.worker_id: workers[r.worker_id].pid
            for r in self._records.values()
            if r.role == role and r.worker_id in workers and r.phase != WorkerPhase.ENDED
        }

    def _snapshot(self) -> ClusterState:
        return self.cluster.controller.cluster.snapshot()

    # -- loss ------------------------------------------------------------------------------------

    def describe_lost(self, worker_ids: list[str]) -> list[str]:
        """What happened to those of `worker_ids` that ended or whose agent is gone, one line each
        (the controller's view now)."""
        snapshot = self._snapshot()
        agents = {a.agent_id: a for a in snapshot.agents}
        workers = {w.spec.worker_id: w for w in snapshot.workers}
        lost = []
        for worker_id in worker_ids:
            worker = workers.get(worker_id)
            agent = agents.get(worker.agent_id) if worker is not None else None
            where = f"on agent {agent.agent_id} ({agent.host})" if agent is not None else ""
            if agent is not None and agent.state != AgentState.ALIVE:
                lost.append(f"{worker_id} {where}: the agent is {agent.state.name.lower()}")
            elif worker is not None and worker.state.ended:
                lost.append(
                    f"{worker_id} {where}: {worker.state.name.lower()} with code "
                    f"{worker.exit_code} (log {worker.log_path})"
                )
        return lost

    def on_loss(self, role: WorkerRole, handler: LossHandler) -> None:
        """`handler(record)` runs (as its own task) once for each worker of `role` lost."""
        self._handlers[role] = handler

    async def watch(self) -> None:
        """The watchdog: every serving worker that ended unasked, or whose agent was lost, is
        marked LOST once and handed to its role's handler."""
        while not self._closing:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            snapshot = self._snapshot()
            agents = {a.agent_id: a.state for a in snapshot.agents}
            statuses = {w.spec.worker_id: w for w in snapshot.workers}
            for record in list(self._records.values()):
                if self._closing:
                    return
                if record.phase != WorkerPhase.SERVING:
                    continue
                status = statuses.get(record.worker_id)
                agent_lost = agents.get(record.placement.agent_id) != AgentState.ALIVE
                if not agent_lost and (status is None or not status.state.ended):
                    continue
                record.phase, record.agent_lost = WorkerPhase.LOST, agent_lost
                record.lost_reason = (
                    f"{status.state.name} with code {status.exit_code}"
                    if status is not None and status.state.ended
                    else f"its agent {record.placement.agent_id} is lost"
                )
                logger.warning("worker %s lost: %s", record.worker_id, record.lost_reason)
                handler = self._handlers.get(record.role)
                if handler is not None:
                    task = asyncio.create_task(handler(record))
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
        for worker_id in list(self._records):
            await asyncio.to_thread(self.stop, worker_id)


def _tail(path: str, num_chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-num_chars:]
    except OSError:
        return f"(no log at {path!r})"
