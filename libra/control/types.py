"""Typed messages of the control plane. Protobuf stays at the edge (`convert.py`); everything
inside the controller and agents works on these dataclasses. Enum values equal the proto's."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from libra.backends.base import DeviceInfo


class WorkerRole(enum.IntEnum):
    ROLLOUT = 1
    TRAIN = 2
    TOOL = 3
    GENERIC = 4


class WorkerState(enum.IntEnum):
    STARTING = 1
    RUNNING = 2
    EXITED = 3
    STOPPED = 4
    LOST = 5

    @property
    def ended(self) -> bool:
        return self in (WorkerState.EXITED, WorkerState.STOPPED, WorkerState.LOST)


class AgentState(enum.IntEnum):
    ALIVE = 1
    LOST = 2
    LEFT = 3


class EventKind(enum.IntEnum):
    AGENT_JOINED = 1
    AGENT_LOST = 2
    AGENT_LEFT = 3
    WORKER_STARTED = 4
    WORKER_EXITED = 5
    WORKER_STOPPED = 6
    WORKER_LOST = 7
    PLAN_APPLIED = 8
    PLAN_PROPOSED = 9
    PLAN_REJECTED = 10
    PLAN_VETOED = 11
    PLAN_EXECUTED = 12
    JOB = 13
    """The RL job's own progress: each step with its metrics, checkpoints, restarts, resume."""


@dataclass(frozen=True)
class WorkerSpec:
    """What an agent runs: a command on some of its devices."""

    worker_id: str
    role: WorkerRole
    devices: tuple[int, ...]
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""


@dataclass
class WorkerStatus:
    spec: WorkerSpec
    agent_id: str
    state: WorkerState
    pid: int = 0
    exit_code: int = 0
    """Negative: killed by that signal."""
    started_at: float = 0.0
    ended_at: float = 0.0
    log_path: str = ""


@dataclass
class AgentStatus:
    agent_id: str
    host: str
    address: str
    backend: str
    devices: tuple[DeviceInfo, ...]
    state: AgentState
    registered_at: float
    last_heartbeat_at: float


@dataclass(frozen=True)
class Event:
    sequence: int
    time: float
    kind: EventKind
    agent_id: str = ""
    worker_id: str = ""
    exit_code: int = 0
    message: str = ""
    plan_version: int = 0


@dataclass
class ClusterState:
    agents: list[AgentStatus]
    workers: list[WorkerStatus]
    last_event_sequence: int
