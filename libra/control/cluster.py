"""The controller's view of the cluster: which agents are alive, which workers run where.

Pure bookkeeping behind one lock, with no gRPC in it, so it can be driven directly by tests. Every
change is published on the event bus. An agent that has not beaten for `3 × heartbeat interval` is
marked lost together with its workers (their processes may still run, but the controller can no
longer reach or vouch for them, so whoever owns them must treat them as gone).

Each agent gets a credential of its own when it registers: only that credential may beat, report
or deregister for it, and the controller presents it (never the run's token) when it calls the
agent, so registering an address gains a caller nothing it did not already hold. Records of
departed agents, and of ended workers, are dropped `record_ttl_s` after they ended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import secrets
import threading
import time

from libra.backends.base import DeviceInfo
from libra.control.events import EventBus
from libra.control.types import (
    AgentState,
    AgentStatus,
    ClusterState,
    EventKind,
    WorkerState,
    WorkerStatus,
)

MISSED_BEATS_BEFORE_LOST = 3

_EVENT_OF_WORKER_STATE = {
    WorkerState.RUNNING: EventKind.WORKER_STARTED,
    WorkerState.EXITED: EventKind.WORKER_EXITED,
    WorkerState.STOPPED: EventKind.WORKER_STOPPED,
    WorkerState.LOST: EventKind.WORKER_LOST,
}


class Cluster:
    def __init__(
        self, heartbeat_interval_s: float, events: EventBus, clock=time.time, record_ttl_s: float = 600.0
    ):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.events = events
        self.record_ttl_s = record_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._agents: dict[str, AgentStatus] = {}
        self._workers: dict[str, WorkerStatus] = {}
        self._agent_numbers = itertools.count(1)
        self._agent_of_digest: dict[bytes, str] = {}
        self._credential_of: dict[str, str] = {}
        self._departed_at: dict[str, float] = {}
        self._changes = 0

    # -- agents ---------------------------------------------------------------------------------

    def register_agent(
        self, host: str, address: str, backend: str, devices: tuple[DeviceInfo, ...]
    ) -> tuple[str, str]:
        """Records a new live agent; returns its id and its credential."""
        now = self._clock()
        credential = secrets.token_urlsafe(32)
        with self._lock:
            agent_id = f"agent-{next(self._agent_numbers)}-{host}"
            self._agent_of_digest[_digest(credential)] = agent_id
            self._credential_of[agent_id] = credential
            self._agents[agent_id] = AgentStatus(
                agent_id=agent_id,
                host=host,
                address=address,
                backend=backend,
                devices=devices,
                state=AgentState.ALIVE,
                registered_at=now,
                last_heartbeat_at=now,
            )
            self._changes += 1
        self.events.publish(
            EventKind.AGENT_JOINED,
            agent_id=agent_id,
            message=f"{host} at {address}: {len(devices)} {backend} device(s)",
        )
        return agent_id, credential

    def agent_of_credential(self, credential: str) -> str | None:
        """The agent a credential was issued to (live or departed, until its record expires)."""
        with self._lock:
            return self._agent_of_digest.get(_digest(credential))

    def credential(self, agent_id: str) -> str:
        with self._lock:
            return self._credential_of[agent_id]

    def heartbeat(self, agent_id: str) -> bool:
        """Records a beat; False if the agent is unknown or already declared lost (it must
        register again: its old workers were handed back)."""
        with self._lock:
            agent = self._agents.get(agent_id)
            if agent is None or agent.state != AgentState.ALIVE:
                return False
            agent.last_heartbeat_at = self._clock()
            self._changes += 1
            return True

    def mark_agent_gone(self, agent_id: str, state: AgentState, reason: str) -> bool:
        """Marks a live agent lost or left, and every running worker of it lost. False if it was
        not alive."""
        with self._lock:
            agent = self._agents.get(agent_id)
            if agent is None or agent.state != AgentState.ALIVE:
                return False
            agent.state = state
            self._departed_at[agent_id] = self._clock()
            self._changes += 1
            orphans = [w for w in self._workers.values() if w.agent_id == agent_id and not w.state.ended]
            for worker in orphans:
                worker.state = WorkerState.LOST
                worker.ended_at = self._clock()
        kind = EventKind.AGENT_LOST if state == AgentState.LOST else EventKind.AGENT_LEFT
        self.events.publish(kind, agent_id=agent_id, message=reason)
        for worker in orphans:
            self.events.publish(
                EventKind.WORKER_LOST,
                agent_id=agent_id,
                worker_id=worker.spec.worker_id,
                message=f"agent {agent_id} {state.name.lower()}: {reason}",
            )
        return True

    def expire_silent_agents(self) -> list[str]:
        """Marks lost every live agent silent for more than MISSED_BEATS_BEFORE_LOST intervals."""
        deadline = self._clock() - MISSED_BEATS_BEFORE_LOST * self.heartbeat_interval_s
        with self._lock:
            silent = [
                a.agent_id
                for a in self._agents.values()
                if a.state == AgentState.ALIVE and a.last_heartbeat_at < deadline
            ]
        return [
            agent_id
            for agent_id in silent
            if self.mark_agent_gone(
                agent_id, AgentState.LOST, f"no heartbeat for {MISSED_BEATS_BEFORE_LOST} intervals"
            )
        ]

    def forget_expired(self) -> int:
        """Drops the records of agents departed, and of workers ended, more than `record_ttl_s`
        ago (with the departed agents' credentials); returns how many records went."""
        horizon = self._clock() - self.record_ttl_s
        with self._lock:
            agents = [a for a, at in self._departed_at.items() if at < horizon]
            for agent_id in agents:
                del self._agents[agent_id], self._departed_at[agent_id]
                del self._agent_of_digest[_digest(self._credential_of.pop(agent_id))]
            workers = [w for w, s in self._workers.items() if s.state.ended and s.ended_at < horizon]
            for worker_id in workers:
                del self._workers[worker_id]
            self._changes += len(agents) + len(workers)
        return len(agents) + len(workers)

    def live_addresses(self) -> set[str]:
        """The NodeAgent addresses of the agents alive now."""
        with self._lock:
            return {a.address for a in self._agents.values() if a.state == AgentState.ALIVE}

    def live_agent(self, agent_id: str) -> AgentStatus:
        with self._lock:
            agent = self._agents.get(agent_id)
            if agent is None:
                raise LookupError(f"unknown agent_id {agent_id!r}")
            if agent.state != AgentState.ALIVE:
                raise RuntimeError(f"agent {agent_id} is {agent.state.name.lower()}")
            return agent

    # -- workers --------------------------------------------------------------------------------

    def record_report(self, agent_id: str, status: WorkerStatus) -> None:
        """A worker status that agent `agent_id` reports itself: it may speak for its own workers
        only."""
        if status.agent_id != agent_id:
            raise PermissionError(f"agent {agent_id} may not report for agent {status.agent_id!r}")
        self.live_agent(agent_id)
        self.record_worker(status, reported_by=agent_id)

    def record_worker(self, status: WorkerStatus, reported_by: str | None = None) -> None:
        """Takes a worker's status as its agent reports it; publishes the transition once."""
        with self._lock:
            previous = self._workers.get(status.spec.worker_id)
            if reported_by is not None and previous is not None and previous.agent_id != reported_by:
                raise PermissionError(
                    f"worker {status.spec.worker_id!r} runs on agent {previous.agent_id}, not {reported_by}"
                )
            if previous is not None and previous.state.ended and previous.pid == status.pid:
                # That process ended: a late exit report after LOST, or a start reply after the
                # exit report. A new process under the same id replaces the record.
                return
            self._workers[status.spec.worker_id] = status
            self._changes += 1
            changed = previous is None or previous.state != status.state
        event_kind = _EVENT_OF_WORKER_STATE.get(status.state)
        if changed and event_kind is not None:
            self.events.publish(
                event_kind,
                agent_id=status.agent_id,
                worker_id=status.spec.worker_id,
                exit_code=status.exit_code,
                message=f"pid {status.pid}"
                if status.state == WorkerState.RUNNING
                else f"exit {status.exit_code}",
            )

    def worker(self, worker_id: str) -> WorkerStatus:
        with self._lock:
            if worker_id not in self._workers:
                raise LookupError(f"unknown worker_id {worker_id!r}")
            return self._workers[worker_id]

    def running_worker(self, worker_id: str) -> WorkerStatus | None:
        with self._lock:
            worker = self._workers.get(worker_id)
            return None if worker is None or worker.state.ended else dataclasses.replace(worker)

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever what `snapshot()` returns changes (a beat, a record, an event)."""
        with self._lock:
            return self._changes, self.events.last_sequence

    def snapshot(self) -> ClusterState:
        with self._lock:
            return ClusterState(
                agents=[dataclasses.replace(a) for a in self._agents.values()],
                workers=[dataclasses.replace(w) for w in self._workers.values()],
                last_event_sequence=self.events.last_sequence,
            )


def _digest(credential: str) -> bytes:
    return hashlib.sha256(credential.encode()).digest()
