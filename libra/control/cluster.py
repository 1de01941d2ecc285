"""The controller's view of the cluster: which agents are alive, which workers run where.

Pure bookkeeping behind one lock, with no gRPC in it, so it can be driven directly by tests. Every
change is published on the event bus. An agent that has not beaten for `3 × heartbeat interval` is
marked lost together with its workers (their processes may still run, but the controller can no
longer reach or vouch for them, so whoever owns them must treat them as gone).
"""

from __future__ import annotations

import dataclasses
import itertools
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
    def __init__(self, heartbeat_interval_s: float, events: EventBus, clock=time.time):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.events = events
        self._clock = clock
        self._lock = threading.Lock()
        self._agents: dict[str, AgentStatus] = {}
        self._workers: dict[str, WorkerStatus] = {}
        self._agent_numbers = itertools.count(1)

    # -- agents ---------------------------------------------------------------------------------

    def register_agent(self, host: str, address: str, backend: str, devices: tuple[DeviceInfo, ...]) -> str:
        now = self._clock()
        with self._lock:
            agent_id = f"agent-{next(self._agent_numbers)}-{host}"
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
        self.events.publish(
            EventKind.AGENT_JOINED,
            agent_id=agent_id,
            message=f"{host} at {address}: {len(devices)} {backend} device(s)",
        )
        return agent_id

    def heartbeat(self, agent_id: str) -> bool:
        """Records a beat; False if the agent is unknown or already declared lost (it must
        register again: its old workers were handed back)."""
        with self._lock:
            agent = self._agents.get(agent_id)
            if agent is None or agent.state != AgentState.ALIVE:
                return False
            agent.last_heartbeat_at = self._clock()
            return True

    def mark_agent_gone(self, agent_id: str, state: AgentState, reason: str) -> bool:
        """Marks a live agent lost or left, and every running worker of it lost. False if it was
        not alive."""
        with self._lock:
            agent = self._agents.get(agent_id)
            if agent is None or agent.state != AgentState.ALIVE:
                return False
            agent.state = state
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

    def live_agent(self, agent_id: str) -> AgentStatus:
        with self._lock:
            agent = self._agents.get(agent_id)
            if agent is None:
                raise LookupError(f"unknown agent_id {agent_id!r}")
            if agent.state != AgentState.ALIVE:
                raise RuntimeError(f"agent {agent_id} is {agent.state.name.lower()}")
            return agent

    # -- workers --------------------------------------------------------------------------------

    def record_worker(self, status: WorkerStatus) -> None:
        """Takes a worker's status as its agent reports it; publishes the transition once."""
        with self._lock:
            previous = self._workers.get(status.spec.worker_id)
            if previous is not None and previous.state.ended:
                return  # an ended worker stays ended (e.g. a late exit report after LOST)
            self._workers[status.spec.worker_id] = status
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

    def snapshot(self) -> ClusterState:
        with self._lock:
            return ClusterState(
                agents=[dataclasses.replace(a) for a in self._agents.values()],
                workers=[dataclasses.replace(w) for w in self._workers.values()],
                last_event_sequence=self.events.last_sequence,
            )
