"""A typed client of the controller's external API, for users' orchestration and `libra status`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import grpc

from libra.control import convert
from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from libra.control.types import ClusterState, Event, EventKind, WorkerSpec, WorkerStatus
from libra.v1 import controller_pb2, controller_pb2_grpc

_RESUME_AFTER_S = 1.0
"""A watch cut after at least this long is resumed; one that fails sooner is the caller's error."""


class ClusterClient:
    def __init__(
        self, address: str, token: str, config: ControlConfig | None = None, timeout_s: float = 30.0
    ):
        self._channel = open_channel(address, token, config)
        self._stub = controller_pb2_grpc.ClusterApiStub(self._channel)
        self._timeout = timeout_s

    def cluster_state(self) -> ClusterState:
        reply = self._stub.GetClusterState(controller_pb2.GetClusterStateRequest(), timeout=self._timeout)
        return convert.cluster_state_from_proto(reply)

    def watch_events(self, after_sequence: int = 0, kinds: Iterable[EventKind] = ()) -> Iterator[Event]:
        """Blocks on the stream; cancel by closing the client (or breaking out and calling close).
        When the controller recycles the connection under a stream that had been open a while, it
        resumes after the last event received, so the caller sees no gap and no repeat."""
        last = after_sequence
        while True:
            request = controller_pb2.WatchEventsRequest(after_sequence=last, kinds=[int(k) for k in kinds])
            opened = time.monotonic()
            try:
                for msg in self._stub.WatchEvents(request):
                    last = msg.sequence
                    yield convert.event_from_proto(msg)
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() - opened < _RESUME_AFTER_S:
                    raise

    def start_worker(self, agent_id: str, spec: WorkerSpec) -> WorkerStatus:
        reply = self._stub.StartWorker(
            controller_pb2.StartWorkerRequest(agent_id=agent_id, spec=convert.worker_spec_to_proto(spec)),
            timeout=self._timeout,
        )
        return convert.worker_status_from_proto(reply)

    def stop_worker(self, worker_id: str, grace_s: float = 0.0) -> WorkerStatus:
        reply = self._stub.StopWorker(
            controller_pb2.StopWorkerRequest(worker_id=worker_id, grace_s=grace_s), timeout=self._timeout
        )
        return convert.worker_status_from_proto(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
