"""The gRPC control plane: the controller (agent registry, liveness, external cluster API, and the
services a caller adds: the job adds the planner's), node agents (device inventory, worker
processes), bearer-token auth and TLS, the typed messages that the protobuf edge converts to, and
its config section (`config.ControlConfig`). Imports only `backends` below it, and no torch. Stubs
are generated into `libra.v1` at build time."""

from libra.control.agent import NodeAgent
from libra.control.client import ClusterClient
from libra.control.config import ControlConfig
from libra.control.controller import Controller
from libra.control.types import (
    AgentState,
    AgentStatus,
    ClusterState,
    Event,
    EventKind,
    WorkerRole,
    WorkerSpec,
    WorkerState,
    WorkerStatus,
)

__all__ = [
    "AgentState",
    "AgentStatus",
    "ClusterClient",
    "ClusterState",
    "ControlConfig",
    "Controller",
    "Event",
    "EventKind",
    "NodeAgent",
    "WorkerRole",
    "WorkerSpec",
    "WorkerState",
    "WorkerStatus",
]
