"""The protobuf edge: proto messages <-> control-plane dataclasses, validating on the way in.

Validation errors raise `InvalidArgument` naming the offending field; servicers turn it into the
gRPC status INVALID_ARGUMENT.
"""

from __future__ import annotations

import re

from libra.backends.base import DeviceInfo
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
from libra.v1 import common_pb2, controller_pb2

_WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class InvalidArgument(ValueError):
    """A request field is malformed; the message names the field."""


def device_from_proto(msg: common_pb2.Device, field: str = "devices") -> DeviceInfo:
    if msg.index < 0:
        raise InvalidArgument(f"{field}.index must be >= 0, got {msg.index}")
    if msg.memory_bytes < 0:
        raise InvalidArgument(f"{field}.memory_bytes must be >= 0, got {msg.memory_bytes}")
    return DeviceInfo(index=msg.index, kind=msg.kind, memory_bytes=msg.memory_bytes, cores=tuple(msg.cores))


def device_to_proto(device: DeviceInfo) -> common_pb2.Device:
    return common_pb2.Device(
        index=device.index, kind=device.kind, memory_bytes=device.memory_bytes, cores=list(device.cores)
    )


def worker_spec_from_proto(msg: common_pb2.WorkerSpec, field: str = "spec") -> WorkerSpec:
    if not _WORKER_ID.match(msg.worker_id):
        raise InvalidArgument(
            f"{field}.worker_id must be 1-128 characters of letters, digits, '.', '_' or '-' "
            f"starting with a letter or digit, got {msg.worker_id!r}"
        )
    if msg.role not in WorkerRole.__members__.values():
        raise InvalidArgument(f"{field}.role must be one of {[r.name for r in WorkerRole]}, got {msg.role}")
    if not msg.argv or not msg.argv[0]:
        raise InvalidArgument(f"{field}.argv must name a command")
    devices = tuple(msg.devices)
    if any(d < 0 for d in devices):
        raise InvalidArgument(f"{field}.devices must be >= 0, got {list(devices)}")
    if len(set(devices)) != len(devices):
        raise InvalidArgument(f"{field}.devices has duplicates: {list(devices)}")
    bad_env = [name for name in msg.env if not _ENV_NAME.match(name)]
    if bad_env:
        raise InvalidArgument(f"{field}.env has invalid variable names: {bad_env}")
    # The kernel takes argv, the environment and paths as C strings: a NUL cannot reach a process.
    for index, arg in enumerate(msg.argv):
        if "\0" in arg:
            raise InvalidArgument(f"{field}.argv[{index}] contains a NUL byte")
    for name, value in msg.env.items():
        if "\0" in value:
            raise InvalidArgument(f"{field}.env[{name!r}] contains a NUL byte")
    if "\0" in msg.cwd:
        raise InvalidArgument(f"{field}.cwd contains a NUL byte")
    return WorkerSpec(
        worker_id=msg.worker_id,
        role=WorkerRole(msg.role),
        devices=devices,
        argv=tuple(msg.argv),
        env=dict(msg.env),
        cwd=msg.cwd,
    )


def worker_spec_to_proto(spec: WorkerSpec) -> common_pb2.WorkerSpec:
    return common_pb2.WorkerSpec(
        worker_id=spec.worker_id,
        role=int(spec.role),
        devices=list(spec.devices),
        argv=list(spec.argv),
        env=spec.env,
        cwd=spec.cwd,
    )


def worker_status_to_proto(status: WorkerStatus) -> common_pb2.WorkerStatus:
    return common_pb2.WorkerStatus(
        spec=worker_spec_to_proto(status.spec),
        agent_id=status.agent_id,
        state=int(status.state),
        pid=status.pid,
        exit_code=status.exit_code,
        started_at=status.started_at,
        ended_at=status.ended_at,
        log_path=status.log_path,
    )


def worker_status_from_proto(msg: common_pb2.WorkerStatus, field: str = "worker") -> WorkerStatus:
    if msg.state not in WorkerState.__members__.values():
        raise InvalidArgument(
            f"{field}.state must be one of {[s.name for s in WorkerState]}, got {msg.state}"
        )
    return WorkerStatus(
        spec=worker_spec_from_proto(msg.spec, f"{field}.spec"),
        agent_id=msg.agent_id,
        state=WorkerState(msg.state),
        pid=msg.pid,
        exit_code=msg.exit_code,
        started_at=msg.started_at,
        ended_at=msg.ended_at,
        log_path=msg.log_path,
    )


def agent_status_to_proto(agent: AgentStatus) -> common_pb2.AgentStatus:
    return common_pb2.AgentStatus(
        agent_id=agent.agent_id,
        host=agent.host,
        address=agent.address,
        backend=agent.backend,
        devices=[device_to_proto(d) for d in agent.devices],
        state=int(agent.state),
        registered_at=agent.registered_at,
        last_heartbeat_at=agent.last_heartbeat_at,
    )


def agent_status_from_proto(msg: common_pb2.AgentStatus) -> AgentStatus:
    return AgentStatus(
        agent_id=msg.agent_id,
        host=msg.host,
        address=msg.address,
        backend=msg.backend,
        devices=tuple(device_from_proto(d) for d in msg.devices),
        state=AgentState(msg.state),
        registered_at=msg.registered_at,
        last_heartbeat_at=msg.last_heartbeat_at,
    )


def event_to_proto(event: Event) -> common_pb2.Event:
    return common_pb2.Event(
        sequence=event.sequence,
        time=event.time,
        kind=int(event.kind),
        agent_id=event.agent_id,
        worker_id=event.worker_id,
        exit_code=event.exit_code,
        message=event.message,
        plan_version=event.plan_version,
    )


def event_from_proto(msg: common_pb2.Event) -> Event:
    return Event(
        sequence=msg.sequence,
        time=msg.time,
        kind=EventKind(msg.kind),
        agent_id=msg.agent_id,
        worker_id=msg.worker_id,
        exit_code=msg.exit_code,
        message=msg.message,
        plan_version=msg.plan_version,
    )


def event_kinds_from_proto(kinds: list[int], field: str = "kinds") -> frozenset[EventKind]:
    unknown = [k for k in kinds if k not in EventKind.__members__.values()]
    if unknown:
        raise InvalidArgument(
            f"{field} has unknown event kinds {unknown}; known: {[k.name for k in EventKind]}"
        )
    return frozenset(EventKind(k) for k in kinds)


def cluster_state_to_proto(state: ClusterState) -> controller_pb2.ClusterState:
    return controller_pb2.ClusterState(
        agents=[agent_status_to_proto(a) for a in state.agents],
        workers=[worker_status_to_proto(w) for w in state.workers],
        last_event_sequence=state.last_event_sequence,
    )


def cluster_state_from_proto(msg: controller_pb2.ClusterState) -> ClusterState:
    return ClusterState(
        agents=[agent_status_from_proto(a) for a in msg.agents],
        workers=[worker_status_from_proto(w) for w in msg.workers],
        last_event_sequence=msg.last_event_sequence,
    )
