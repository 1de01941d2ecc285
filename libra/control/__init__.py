"""The gRPC control plane: the controller (agent registry, liveness, external cluster API), node
agents (device inventory, worker processes), bearer-token auth and TLS, and the typed messages
that the protobuf edge converts to. Stubs are generated into `libra.v1` at build time."""

from libra.control.agent import NodeAgent
from libra.control.client import ClusterClient
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
    "Controller",
    "Event",
    "EventKind",
    "NodeAgent",
    "WorkerRole",
    "WorkerSpec",
    "WorkerState",
    "WorkerStatus",
]
