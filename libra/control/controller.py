"""The controller process: agent registry, heartbeats, liveness, the external cluster API.

Node agents register and keep a heartbeat stream open; a monitor thread marks an agent lost after
three silent intervals (a broken stream marks it lost at once). Users' orchestration reads the
cluster state, watches events and starts/stops workers; worker control is forwarded to the agent
that owns the devices. Components above the control plane sit beside this and use the same
`Cluster` and `EventBus`; whoever starts the controller may serve their services on its port
(`Controller.start(services=...)`: the job adds the planner's `PlannerService`). This module
imports nothing above the control plane, and no torch (tests/test_layers.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from libra.control import convert
from libra.control.aio_server import (
    ServerThread,
    add_service,
    concurrency_limit,
    start_aio_server,
    stream_lifetime_s,
)
from libra.control.auth import (
    Authorizer,
    Verdict,
    bearer_metadata,
    bearer_of,
    open_aio_channel,
    resolve_token,
    token_authorizer,
)
from libra.control.cluster import MISSED_BEATS_BEFORE_LOST, Cluster
from libra.control.events import EventBus
from libra.control.server import rpc_errors
from libra.control.types import AgentState
from libra.v1 import agent_pb2, agent_pb2_grpc, controller_pb2

if TYPE_CHECKING:
    from libra.config import LibraConfig
    from libra.control.config import ControlConfig

logger = logging.getLogger(__name__)

_SERVICES = controller_pb2.DESCRIPTOR.services_by_name
AGENT_SESSION_METHODS = frozenset(
    f"/{_SERVICES['AgentRegistry'].full_name}/{name}" for name in ("Heartbeat", "ReportWorker", "Deregister")
)
"""Called by an agent on its own credential only; every other method takes the run's token."""
MAX_WATCHERS = 1024
"""Open `WatchEvents` streams; more are refused with RESOURCE_EXHAUSTED."""
MAX_WATCH_BACKLOG = 4096
"""Events a watcher may leave unread before its stream ends with RESOURCE_EXHAUSTED. Less than the
bus's history (10,000), so that it can resume where it stopped without a gap."""

ServiceAdder = Callable[[grpc.aio.Server], Iterable[str]]
"""Registers servicers on the controller's server and returns their full names (for health and
reflection); e.g. `libra.planner.service.add_planner_service`."""


def controller_authorizer(token: str, cluster: Cluster) -> Authorizer:
    """The run's token may call everything but an agent's own session; an agent's credential
    may call only that."""
    is_token = token_authorizer(token)

    def authorize(method: str, bearer: str) -> Verdict:
        session = method in AGENT_SESSION_METHODS
        if is_token(method, bearer) == Verdict.ALLOW:
            return Verdict.FORBIDDEN if session else Verdict.ALLOW
        if cluster.agent_of_credential(bearer) is not None:
            return Verdict.ALLOW if session else Verdict.FORBIDDEN
        return Verdict.UNKNOWN

    return authorize


class AgentRegistryServicer:
    """`libra.v1.AgentRegistry`: agents register on the run's token and receive a credential;
    their heartbeats, reports and deregistration name no agent the credential does not."""

    def __init__(self, cluster: Cluster, stream_lifetime_s: float):
        self._cluster = cluster
        self._stream_lifetime_s = stream_lifetime_s

    def _session_agent(self, context, claimed: str) -> str:
        agent_id = self._cluster.agent_of_credential(bearer_of(context.invocation_metadata()))
        if agent_id is None:  # expired since the interceptor let the call in
            raise PermissionError("this agent credential has expired; register again")
        if claimed and claimed != agent_id:
            raise PermissionError(f"this credential belongs to {agent_id}, not {claimed!r}")
        return agent_id

    @concurrency_limit(64)
    @rpc_errors
    async def Register(self, request, context):
        host, address, backend, devices = convert.registration_from_proto(request)
        agent_id, credential = self._cluster.register_agent(host, address, backend, devices)
        logger.info("agent %s registered from %s with %d device(s)", agent_id, address, len(devices))
        return controller_pb2.RegisterReply(
            agent_id=agent_id, heartbeat_interval_s=self._cluster.heartbeat_interval_s, credential=credential
        )

    @rpc_errors
    async def Heartbeat(self, request_iterator, context):
        agent_id = self._session_agent(context, "")
        # A beat is due every interval; a stream silent for longer than the liveness monitor
        # waits is over (the agent is lost by then) and must not hold its coroutine forever.
        silence_s = (MISSED_BEATS_BEFORE_LOST + 1) * self._cluster.heartbeat_interval_s
        # The stream ends cleanly before its connection ages out; the agent opens the next one
        # at once and stays alive throughout.
        renew_at = asyncio.get_running_loop().time() + self._stream_lifetime_s
        reason = "heartbeat stream closed"
        try:
            while True:
                wait_s = min(silence_s, renew_at - asyncio.get_running_loop().time())
                try:
                    beat = await asyncio.wait_for(context.read(), max(wait_s, 0.0))
                except TimeoutError:
                    if wait_s < silence_s:
                        reason = ""
                        return
                    reason = f"no heartbeat for {silence_s:.1f} s"
                    break
                if beat is grpc.aio.EOF:
                    break
                self._session_agent(context, beat.agent_id)
                known = self._cluster.heartbeat(agent_id)
                await context.write(controller_pb2.HeartbeatReply(known=known))
                if not known:
                    return
        finally:
            if reason and self._cluster.mark_agent_gone(agent_id, AgentState.LOST, reason):
                logger.warning("agent %s lost: %s", agent_id, reason)

    @concurrency_limit(256)
    @rpc_errors
    async def ReportWorker(self, request, context):
        agent_id = self._session_agent(context, request.agent_id)
        self._cluster.record_report(agent_id, convert.worker_status_from_proto(request.worker))
        return controller_pb2.ReportWorkerReply()

    @concurrency_limit(64)
    @rpc_errors
    async def Deregister(self, request, context):
        agent_id = self._session_agent(context, request.agent_id)
        self._cluster.mark_agent_gone(agent_id, AgentState.LEFT, "deregistered")
        return controller_pb2.DeregisterReply()


class ClusterApiServicer:
    """`libra.v1.ClusterApi`: the external controller API (docs/grpc-api.md)."""

    def __init__(self, cluster: Cluster, agents: AgentClients):
        self._cluster = cluster
        self._agents = agents
        self._encoder = convert.ClusterStateEncoder()
        self._encoded: tuple[tuple[int, int], bytes] = ((-1, -1), b"")

    @concurrency_limit(64)
    @rpc_errors
    async def GetClusterState(self, request, context) -> bytes:
        # Readers far outnumber changes under load: one encoding serves every read until the next.
        version = self._cluster.version
        if self._encoded[0] != version:
            self._encoded = (version, self._encoder.encode(self._cluster.snapshot()))
        return self._encoded[1]

    @concurrency_limit(MAX_WATCHERS)
    @rpc_errors
    async def WatchEvents(self, request, context):
        if request.after_sequence < 0:
            raise convert.InvalidArgument(f"after_sequence must be >= 0, got {request.after_sequence}")
        kinds = convert.event_kinds_from_proto(list(request.kinds))
        events = self._cluster.events.watch_async(
            request.after_sequence, kinds, request.only_new, max_pending=MAX_WATCH_BACKLOG
        )
        async for event in events:
            yield convert.event_to_proto(event)

    @concurrency_limit(64)
    @rpc_errors
    async def StartWorker(self, request, context):
        spec = convert.worker_spec_from_proto(request.spec)
        agent = self._cluster.live_agent(request.agent_id)
        running = self._cluster.running_worker(spec.worker_id)
        if running is not None:
            raise convert.InvalidArgument(
                f"spec.worker_id {spec.worker_id!r} is already running on agent {running.agent_id}"
            )
        owned = {d.index for d in agent.devices}
        foreign = [d for d in spec.devices if d not in owned]
        if foreign:
            raise convert.InvalidArgument(f"spec.devices {foreign} do not exist on agent {agent.agent_id}")
        reply = await self._agents.call(
            agent.agent_id, "StartWorker", agent_pb2.AgentStartWorkerRequest(spec=request.spec)
        )
        self._cluster.record_worker(convert.worker_status_from_proto(reply))
        return reply

    @concurrency_limit(64)
    @rpc_errors
    async def StopWorker(self, request, context):
        if request.grace_s < 0:
            raise convert.InvalidArgument(f"grace_s must be >= 0, got {request.grace_s}")
        worker = self._cluster.worker(request.worker_id)
        agent = self._cluster.live_agent(worker.agent_id)
        reply = await self._agents.call(
            agent.agent_id,
            "StopWorker",
            agent_pb2.AgentStopWorkerRequest(worker_id=request.worker_id, grace_s=request.grace_s),
        )
        self._cluster.record_worker(convert.worker_status_from_proto(reply))
        return reply


class AgentClients:
    """Channels from the controller to node agents, one per address, opened on first use. Each
    call presents the called agent's own credential: an address that a caller registered never
    sees the run's token."""

    def __init__(self, cluster: Cluster, control: ControlConfig, rpc_timeout_s: float = 30.0):
        self._cluster = cluster
        self._control = control
        self._timeout = rpc_timeout_s
        self._clients: dict[str, tuple[grpc.aio.Channel, agent_pb2_grpc.NodeAgentStub]] = {}
        """Agent address -> its channel and the stub over it."""

    async def call(self, agent_id: str, method: str, request):
        address = self._cluster.live_agent(agent_id).address
        if address in self._clients:
            _, stub = self._clients[address]
        else:
            channel = open_aio_channel(address, self._control)
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            self._clients[address] = channel, stub
            await self._close_departed(keep=address)
        try:
            return await getattr(stub, method)(
                request, timeout=self._timeout, metadata=bearer_metadata(self._cluster.credential(agent_id))
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise convert.InvalidArgument(e.details()) from None
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise LookupError(e.details()) from None
            raise RuntimeError(
                f"agent {agent_id} at {address} failed {method}: {e.code().name}: {e.details()}"
            ) from None

    async def _close_departed(self, keep: str) -> None:
        """Closes the channels to addresses no live agent has (but `keep`): agents come and go
        over a long run on a large cluster, and each channel holds a connection and its buffers."""
        live = self._cluster.live_addresses() | {keep}
        # Taken out before the first await: a call meanwhile opens a fresh channel, never a closing one.
        departed = [self._clients.pop(a)[0] for a in list(self._clients) if a not in live]
        for channel in departed:
            await channel.close()

    @property
    def open_addresses(self) -> list[str]:
        """The agent addresses it holds a channel to."""
        return sorted(self._clients)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for channel, _ in clients:
            await channel.close()


class Controller:
    """Runs the controller's gRPC server (on its own asyncio loop thread) and its liveness monitor
    until `stop()`. It serves `AgentRegistry` and `ClusterApi`, plus the services given to `start`
    (the job's planner: `libra.planner.service.serve_planner`, whose plan decisions it publishes on
    `events`)."""

    def __init__(self, config: LibraConfig, token: str | None = None):
        self.config = config
        self.token = token or resolve_token(config.control, Path(config.run_dir), create=True)
        self.events = EventBus()
        self.cluster = Cluster(
            config.control.heartbeat_interval_s, self.events, record_ttl_s=config.control.record_ttl_s
        )
        self._stopping = threading.Event()
        self._agents = AgentClients(self.cluster, config.control)
        self._server = ServerThread("libra-controller")
        self._port = 0
        self._monitor = threading.Thread(target=self._watch_liveness, name="libra-liveness", daemon=True)

    @property
    def port(self) -> int:
        assert self._port, "start() first"
        return self._port

    @property
    def address(self) -> str:
        return f"{self.config.control.host}:{self.port}"

    def start(self, services: Sequence[ServiceAdder] = ()) -> Controller:
        """Serves the control plane's services and `services` (each registers its own servicers),
        then watches liveness."""

        def add_servicers(server: grpc.aio.Server) -> list[str]:
            names = [
                add_service(
                    server,
                    _SERVICES["AgentRegistry"],
                    AgentRegistryServicer(
                        self.cluster, stream_lifetime_s(self.config.control.max_connection_age_s)
                    ),
                ),
                add_service(
                    server,
                    _SERVICES["ClusterApi"],
                    ClusterApiServicer(self.cluster, self._agents),
                    encoded_replies=["GetClusterState"],
                ),
            ]
            for add in services:
                names += add(server)
            return names

        running = self._server.start(
            lambda: start_aio_server(
                self.config.control,
                controller_authorizer(self.token, self.cluster),
                add_servicers,
                max_message_bytes=4 << 20,
                max_reply_bytes=256 << 20,  # the state of thousands of agents and workers
                sync_handler_threads=4,  # added servicers, e.g. the planner's: its searches are CPU work
            )
        )
        self._port = running.port
        self._monitor.start()
        logger.info("controller listening on %s", self.address)
        return self

    def _watch_liveness(self) -> None:
        # Checking at a third of the interval detects a silent agent within 3⅓ intervals at most.
        while not self._stopping.wait(self.config.control.heartbeat_interval_s / 3):
            for agent_id in self.cluster.expire_silent_agents():
                logger.warning("agent %s lost: missed heartbeats", agent_id)
            self.cluster.forget_expired()

    def wait(self) -> None:
        self._stopping.wait()

    def stop(self) -> None:
        self._stopping.set()
        self._server.stop(then=self._agents.close)
