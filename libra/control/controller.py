"""The controller process: agent registry, heartbeats, liveness, the external cluster API.

Node agents register and keep a heartbeat stream open; a monitor thread marks an agent lost after
three silent intervals (a broken stream marks it lost at once). Users' orchestration reads the
cluster state, watches events and starts/stops workers; worker control is forwarded to the agent
that owns the devices. Later components (RL loop, planner, scheduler) sit beside this and use the
same `Cluster` and `EventBus`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from libra.control import convert
from libra.control.auth import open_channel, resolve_token
from libra.control.cluster import Cluster
from libra.control.events import EventBus
from libra.control.server import RunningServer, rpc_errors, start_server
from libra.control.types import AgentState, EventKind
from libra.planner.config import PlanningProblem
from libra.planner.planner import Planner, PlannerEvent
from libra.planner.service import add_planner_service
from libra.v1 import agent_pb2, agent_pb2_grpc, controller_pb2, controller_pb2_grpc

if TYPE_CHECKING:
    from libra.config import LibraConfig

logger = logging.getLogger(__name__)


class AgentRegistryServicer(controller_pb2_grpc.AgentRegistryServicer):
    def __init__(self, cluster: Cluster):
        self._cluster = cluster

    @rpc_errors
    def Register(self, request, context):
        if not request.host:
            raise convert.InvalidArgument("host must not be empty")
        if ":" not in request.address:
            raise convert.InvalidArgument(f"address must be host:port, got {request.address!r}")
        devices = tuple(convert.device_from_proto(d, f"devices[{i}]") for i, d in enumerate(request.devices))
        if len({d.index for d in devices}) != len(devices):
            raise convert.InvalidArgument("devices have duplicate indices")
        agent_id = self._cluster.register_agent(request.host, request.address, request.backend, devices)
        logger.info("agent %s registered from %s with %d device(s)", agent_id, request.address, len(devices))
        return controller_pb2.RegisterReply(
            agent_id=agent_id, heartbeat_interval_s=self._cluster.heartbeat_interval_s
        )

    def Heartbeat(self, request_iterator, context):
        agent_id = ""
        try:
            for beat in request_iterator:
                agent_id = beat.agent_id
                known = self._cluster.heartbeat(agent_id)
                yield controller_pb2.HeartbeatReply(known=known)
                if not known:
                    return
        except grpc.RpcError:
            pass  # the agent's side of the stream broke: handled below like a closed stream
        if agent_id and self._cluster.mark_agent_gone(agent_id, AgentState.LOST, "heartbeat stream closed"):
            logger.warning("agent %s lost: heartbeat stream closed", agent_id)

    @rpc_errors
    def ReportWorker(self, request, context):
        self._cluster.live_agent(request.agent_id)
        status = convert.worker_status_from_proto(request.worker)
        if status.agent_id != request.agent_id:
            raise convert.InvalidArgument("worker.agent_id must equal agent_id")
        self._cluster.record_worker(status)
        return controller_pb2.ReportWorkerReply()

    @rpc_errors
    def Deregister(self, request, context):
        self._cluster.mark_agent_gone(request.agent_id, AgentState.LEFT, "deregistered")
        return controller_pb2.DeregisterReply()


class ClusterApiServicer(controller_pb2_grpc.ClusterApiServicer):
    def __init__(self, cluster: Cluster, agents: AgentClients, stopping: threading.Event):
        self._cluster = cluster
        self._agents = agents
        self._stopping = stopping

    @rpc_errors
    def GetClusterState(self, request, context):
        return convert.cluster_state_to_proto(self._cluster.snapshot())

    @rpc_errors
    def WatchEvents(self, request, context):
        if request.after_sequence < 0:
            raise convert.InvalidArgument(f"after_sequence must be >= 0, got {request.after_sequence}")
        kinds = convert.event_kinds_from_proto(list(request.kinds))
        events = self._cluster.events.watch(
            request.after_sequence,
            kinds,
            is_active=lambda: context.is_active() and not self._stopping.is_set(),
        )
        return (convert.event_to_proto(e) for e in events)

    @rpc_errors
    def StartWorker(self, request, context):
        spec = convert.worker_spec_from_proto(request.spec)
        agent = self._cluster.live_agent(request.agent_id)
        owned = {d.index for d in agent.devices}
        foreign = [d for d in spec.devices if d not in owned]
        if foreign:
            raise convert.InvalidArgument(f"spec.devices {foreign} do not exist on agent {agent.agent_id}")
        reply = self._agents.call(
            agent.address, "StartWorker", agent_pb2.AgentStartWorkerRequest(spec=request.spec)
        )
        self._cluster.record_worker(convert.worker_status_from_proto(reply))
        return reply

    @rpc_errors
    def StopWorker(self, request, context):
        worker = self._cluster.worker(request.worker_id)
        agent = self._cluster.live_agent(worker.agent_id)
        reply = self._agents.call(
            agent.address,
            "StopWorker",
            agent_pb2.AgentStopWorkerRequest(worker_id=request.worker_id, grace_s=request.grace_s),
        )
        self._cluster.record_worker(convert.worker_status_from_proto(reply))
        return reply


class AgentClients:
    """Channels from the controller to node agents, one per address, opened on first use."""

    def __init__(self, token: str, config: LibraConfig, rpc_timeout_s: float = 30.0):
        self._token = token
        self._config = config
        self._timeout = rpc_timeout_s
        self._stubs: dict[str, agent_pb2_grpc.NodeAgentStub] = {}
        self._lock = threading.Lock()

    def call(self, address: str, method: str, request):
        with self._lock:
            if address not in self._stubs:
                self._stubs[address] = agent_pb2_grpc.NodeAgentStub(
                    open_channel(address, self._token, self._config.control)
                )
            stub = self._stubs[address]
        try:
            return getattr(stub, method)(request, timeout=self._timeout)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                raise (
                    convert.InvalidArgument if e.code() == grpc.StatusCode.INVALID_ARGUMENT else LookupError
                )(e.details()) from None
            raise RuntimeError(
                f"agent at {address} failed {method}: {e.code().name}: {e.details()}"
            ) from None


_EVENT_OF_PLANNER_EVENT = {
    "applied": EventKind.PLAN_APPLIED,
    "proposed": EventKind.PLAN_PROPOSED,
    "rejected": EventKind.PLAN_REJECTED,
    "vetoed": EventKind.PLAN_VETOED,
}


class Controller:
    """Runs the controller's gRPC server and its liveness monitor until `stop()`. With a planning
    problem it also owns the global planner, serves `PlannerService` and publishes plan events."""

    def __init__(
        self, config: LibraConfig, token: str | None = None, planning_problem: PlanningProblem | None = None
    ):
        self.config = config
        self.token = token or resolve_token(config.control, Path(config.run_dir), create=True)
        self.events = EventBus()
        self.cluster = Cluster(config.control.heartbeat_interval_s, self.events)
        self._planning_problem = planning_problem
        self.planner = (
            Planner(planning_problem, on_event=self._publish_planner_event) if planning_problem else None
        )
        self._stopping = threading.Event()
        self._agents = AgentClients(self.token, config)
        self._server: RunningServer | None = None
        self._monitor = threading.Thread(target=self._watch_liveness, name="libra-liveness", daemon=True)

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.port

    @property
    def address(self) -> str:
        return f"{self.config.control.host}:{self.port}"

    def start(self) -> Controller:
        def add_servicers(server: grpc.Server) -> list[str]:
            controller_pb2_grpc.add_AgentRegistryServicer_to_server(
                AgentRegistryServicer(self.cluster), server
            )
            controller_pb2_grpc.add_ClusterApiServicer_to_server(
                ClusterApiServicer(self.cluster, self._agents, self._stopping), server
            )
            services = controller_pb2.DESCRIPTOR.services_by_name
            names = [services["AgentRegistry"].full_name, services["ClusterApi"].full_name]
            if self.planner is not None:
                devices_per_node = self._planning_problem.cluster.devices_per_node
                names += add_planner_service(self.planner, devices_per_node)(server)
            return names

        self._server = start_server(self.config.control, self.token, add_servicers)
        self._monitor.start()
        logger.info("controller listening on %s", self.address)
        return self

    def _publish_planner_event(self, event: PlannerEvent) -> None:
        self.events.publish(
            _EVENT_OF_PLANNER_EVENT[event.kind], plan_version=event.version, message=event.message
        )

    def _watch_liveness(self) -> None:
        # Checking at a third of the interval detects a silent agent within 3⅓ intervals at most.
        while not self._stopping.wait(self.config.control.heartbeat_interval_s / 3):
            for agent_id in self.cluster.expire_silent_agents():
                logger.warning("agent %s lost: missed heartbeats", agent_id)

    def wait(self) -> None:
        self._stopping.wait()

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.stop()
