"""The node agent: one process per host that owns the host's devices and runs workers on the
controller's word.

It registers its device inventory (from the backend), keeps a heartbeat stream to the controller,
serves `NodeAgent` (start/stop/list workers) and reports every worker exit. If the controller
answers a beat with `known=False` (it declared this agent lost, and so its workers lost), the agent
stops its workers — somebody else now owns their work — and registers afresh.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from libra.backends import get_backend
from libra.control import convert
from libra.control.aio_server import ServerThread, add_service, concurrency_limit, start_aio_server
from libra.control.auth import Verdict, open_channel, token_authorizer
from libra.control.server import rpc_errors
from libra.control.supervisor import WorkerSupervisor
from libra.control.types import WorkerStatus
from libra.v1 import agent_pb2, controller_pb2, controller_pb2_grpc

if TYPE_CHECKING:
    from libra.config import LibraConfig

logger = logging.getLogger(__name__)


class NodeAgentServicer:
    """`libra.v1.NodeAgent`. Spawning and stopping block (a fork, a grace period), so they run on
    worker threads; the loop keeps serving meanwhile."""

    def __init__(self, supervisor: WorkerSupervisor):
        self._supervisor = supervisor

    @concurrency_limit(16)
    @rpc_errors
    async def StartWorker(self, request, context):
        spec = convert.worker_spec_from_proto(request.spec)
        return convert.worker_status_to_proto(await asyncio.to_thread(self._supervisor.start, spec))

    @concurrency_limit(64)
    @rpc_errors
    async def StopWorker(self, request, context):
        if request.grace_s < 0:
            raise convert.InvalidArgument(f"grace_s must be >= 0, got {request.grace_s}")
        status = await asyncio.to_thread(self._supervisor.stop, request.worker_id, request.grace_s)
        return convert.worker_status_to_proto(status)

    @rpc_errors
    async def ListWorkers(self, request, context):
        return agent_pb2.ListWorkersReply(
            workers=[convert.worker_status_to_proto(w) for w in self._supervisor.list()]
        )


class NodeAgent:
    def __init__(self, config: LibraConfig, controller_address: str, token: str, port: int = 0):
        self.config = config
        self.controller_address = controller_address
        self.backend = get_backend(config.backend.name, **config.backend.options())
        self.devices = tuple(self.backend.devices())
        self.host = socket.gethostname()
        self._token_authorizer = token_authorizer(token)
        self._port = port
        self._stopping = threading.Event()
        self._leaving = threading.Event()
        self.agent_id = ""
        self._credential_authorizer = None
        self._interval_s = config.control.heartbeat_interval_s
        log_dir = Path(config.run_dir) / "logs" / "workers"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.supervisor = WorkerSupervisor(
            self.backend, {d.index for d in self.devices}, log_dir, on_change=self._report
        )
        # Register on the run's token; everything after on the credential it returns.
        self._channel = open_channel(controller_address, token, config.control)
        self._registry = controller_pb2_grpc.AgentRegistryStub(self._channel)
        self._session_lock = threading.Lock()
        self._session_channel: grpc.Channel | None = None
        self._session: controller_pb2_grpc.AgentRegistryStub | None = None
        self._server = ServerThread("libra-agent")
        self._bound_port = 0
        self._heartbeat = threading.Thread(target=self._keep_heartbeat, name="libra-heartbeat", daemon=True)

    @property
    def address(self) -> str:
        assert self._bound_port, "start() first"
        return f"{self.config.control.host}:{self._bound_port}"

    def _authorize(self, method: str, bearer: str) -> Verdict:
        # The controller calls on this agent's credential; the run's token (the operator's) also
        # works. A caller that merely registered some address holds neither.
        own = self._credential_authorizer
        if own is not None and own(method, bearer) == Verdict.ALLOW:
            return Verdict.ALLOW
        return self._token_authorizer(method, bearer)

    def start(self, register_timeout_s: float = 30.0) -> NodeAgent:
        def add_servicers(server: grpc.aio.Server) -> list[str]:
            service = agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"]
            return [add_service(server, service, NodeAgentServicer(self.supervisor))]

        running = self._server.start(
            lambda: start_aio_server(
                self.config.control,
                self._authorize,
                add_servicers,
                port=self._port,
                max_message_bytes=4 << 20,
            )
        )
        self._bound_port = running.port
        self._register(timeout_s=register_timeout_s)
        self._heartbeat.start()
        return self

    def _register(self, timeout_s: float) -> None:
        request = controller_pb2.RegisterRequest(
            host=self.host,
            address=self.address,
            backend=self.backend.name,
            devices=[convert.device_to_proto(d) for d in self.devices],
        )
        # wait_for_ready lets the agent start before the controller is up (launch order is free).
        reply = self._registry.Register(request, timeout=timeout_s, wait_for_ready=True)
        with self._session_lock:
            if self._session_channel is not None:
                self._session_channel.close()
            self._session_channel = open_channel(
                self.controller_address, reply.credential, self.config.control
            )
            self._session = controller_pb2_grpc.AgentRegistryStub(self._session_channel)
            self._credential_authorizer = token_authorizer(reply.credential)
            self.agent_id = reply.agent_id
            self.supervisor.agent_id = reply.agent_id
            self._interval_s = reply.heartbeat_interval_s
        logger.info("registered as %s with %s", self.agent_id, self.controller_address)

    def _beats(self):
        while not self._stopping.is_set():
            yield controller_pb2.HeartbeatRequest(running_worker_ids=self.supervisor.running_ids())
            self._stopping.wait(self._interval_s)

    def _keep_heartbeat(self) -> None:
        while not self._stopping.is_set():
            try:
                for reply in self._session.Heartbeat(self._beats()):
                    if not reply.known:
                        if self._leaving.is_set():
                            return
                        self._register_again("the controller no longer knows this agent")
                        break
            except grpc.RpcError as e:
                if self._stopping.is_set():
                    return
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    # The controller restarted or forgot this agent: its credential is void.
                    self._register_again(f"the controller refused this agent's credential: {e.details()}")
                    continue
                logger.warning(
                    "heartbeat stream to %s broke (%s); retrying", self.controller_address, e.code().name
                )
                self._stopping.wait(self._interval_s)

    def _register_again(self, why: str) -> None:
        logger.warning("%s: stopping workers of %s, registering again", why, self.agent_id)
        self.supervisor.stop_all()
        self._register(timeout_s=60.0)

    def _report(self, status: WorkerStatus) -> None:
        request = controller_pb2.ReportWorkerRequest(
            agent_id=status.agent_id, worker=convert.worker_status_to_proto(status)
        )
        try:
            with self._session_lock:
                session = self._session
            session.ReportWorker(request, timeout=10.0)
        except grpc.RpcError as e:
            logger.warning("could not report worker %s: %s", status.spec.worker_id, e.details())

    def wait(self) -> None:
        self._stopping.wait()

    def stop(self) -> None:
        """Stops workers, deregisters, and shuts the server down."""
        if self._leaving.is_set():
            return
        # Deregister before the heartbeat stream closes, so the controller records a clean leave
        # rather than a lost agent.
        self._leaving.set()
        self.supervisor.stop_all()
        if self._session is not None:
            try:
                self._session.Deregister(
                    controller_pb2.DeregisterRequest(agent_id=self.agent_id), timeout=5.0
                )
            except grpc.RpcError as e:
                logger.warning("deregistration failed: %s", e.details())
        self._stopping.set()
        self._server.stop()
        self._channel.close()
        if self._session_channel is not None:
            self._session_channel.close()
        deadline = time.monotonic() + 2.0
        while self._heartbeat.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
