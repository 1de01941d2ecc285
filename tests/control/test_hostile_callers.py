"""The controller against callers that misbehave: anonymous ones, ones that stall, agents that
speak for other agents, and addresses registered to collect secrets. Each case here once got
through (issue #20)."""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from concurrent import futures

import grpc
import pytest

from libra.control import EventKind, WorkerRole, WorkerSpec, WorkerState
from libra.control.auth import bearer_metadata, open_channel
from libra.v1 import agent_pb2, common_pb2, controller_pb2, controller_pb2_grpc
from tests.control.helpers import TOKEN, wait_for

pytestmark = pytest.mark.multiprocess

CLUSTER_STATE = "/libra.v1.ClusterApi/GetClusterState"


def _register(stub, host: str, address: str = "127.0.0.1:9") -> controller_pb2.RegisterReply:
    device = common_pb2.Device(index=0, kind="cpu-slot", memory_bytes=1 << 30)
    request = controller_pb2.RegisterRequest(host=host, address=address, backend="cpu", devices=[device])
    return stub.Register(request, timeout=10)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_anonymous_calls_are_refused_before_the_body_is_read(controller):
    anonymous = grpc.insecure_channel(controller.address)
    garbage = anonymous.unary_unary(CLUSTER_STATE)  # raw bytes out, raw bytes in
    # An undecodable body used to answer INTERNAL (and log a traceback) before auth ran.
    assert _code(lambda: garbage(b"\xff\xff\xff\xff", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    unknown = anonymous.unary_unary("/libra.v1.NoSuchService/Probe")
    assert _code(lambda: unknown(b"", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    authenticated = open_channel(controller.address, TOKEN).unary_unary("/libra.v1.NoSuchService/Probe")
    assert _code(lambda: authenticated(b"", timeout=5)) == grpc.StatusCode.UNIMPLEMENTED


def test_an_agent_session_takes_only_that_agents_credential(controller, client, spawn_agent):
    real = spawn_agent()
    operator = controller_pb2_grpc.AgentRegistryStub(open_channel(controller.address, TOKEN))
    impostor = _register(operator, "impostor")
    session = controller_pb2_grpc.AgentRegistryStub(open_channel(controller.address, impostor.credential))
    victim = client.start_worker(
        real.agent_id,
        WorkerSpec("victim", WorkerRole.GENERIC, (0,), (sys.executable, "-c", "import time; time.sleep(60)")),
    )

    # The run's token no longer reaches agent sessions, and a credential reaches nothing else.
    beat = controller_pb2.HeartbeatRequest(agent_id=real.agent_id)
    assert (
        _code(lambda: list(operator.Heartbeat(iter([beat]), timeout=5))) == grpc.StatusCode.PERMISSION_DENIED
    )
    leave = controller_pb2.DeregisterRequest(agent_id=real.agent_id)
    assert _code(lambda: operator.Deregister(leave, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    api = controller_pb2_grpc.ClusterApiStub(open_channel(controller.address, impostor.credential))
    state = controller_pb2.GetClusterStateRequest()
    assert _code(lambda: api.GetClusterState(state, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED

    # One agent's credential cannot end, or speak for, another agent.
    assert _code(lambda: session.Deregister(leave, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    forged = common_pb2.WorkerStatus()
    forged.CopyFrom(client._stub.GetClusterState(state).workers[0])
    forged.state, forged.exit_code = common_pb2.WORKER_STATE_EXITED, 0
    for claimed in (real.agent_id, impostor.agent_id):
        forged.agent_id = claimed
        report = controller_pb2.ReportWorkerRequest(agent_id=claimed, worker=forged)
        with pytest.raises(grpc.RpcError) as err:
            session.ReportWorker(report, timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, claimed
    assert controller.cluster.worker("victim").state == WorkerState.RUNNING
    assert controller.cluster.live_agent(real.agent_id)
    client.stop_worker(victim.spec.worker_id)
    session.Deregister(controller_pb2.DeregisterRequest(agent_id=impostor.agent_id), timeout=5)
    assert not any(
        a.agent_id == impostor.agent_id and a.state.name == "ALIVE" for a in client.cluster_state().agents
    )


def test_the_controller_never_sends_the_token_to_a_registered_address(controller, client):
    """A caller that registers its own address as an agent's sees the credential it was issued,
    never the run's token."""
    seen: list[str] = []

    def start_worker(request: bytes, context):
        seen.extend(v for k, v in context.invocation_metadata() if k == "authorization")
        spec = agent_pb2.AgentStartWorkerRequest.FromString(request).spec
        return common_pb2.WorkerStatus(spec=spec, state=common_pb2.WORKER_STATE_RUNNING, pid=1)

    trap = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(
        start_worker, response_serializer=lambda m: m.SerializeToString()
    )
    trap.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("libra.v1.NodeAgent", {"StartWorker": handler}),)
    )
    port = trap.add_insecure_port("127.0.0.1:0")
    trap.start()
    try:
        registry = controller_pb2_grpc.AgentRegistryStub(open_channel(controller.address, TOKEN))
        reply = _register(registry, "trap", f"127.0.0.1:{port}")
        client.start_worker(reply.agent_id, WorkerSpec("bait", WorkerRole.GENERIC, (0,), ("true",)))
    finally:
        trap.stop(0)
    assert seen == [f"Bearer {reply.credential}"] and TOKEN not in seen[0]


def test_workers_start_without_the_agents_token(client, spawn_agent, tmp_path):
    agent = spawn_agent()  # its own environment holds LIBRA_TOKEN
    probe = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('LIBRA_TOKEN', 'absent'))"
    for worker_id, env in (("inherits", {}), ("given", {"LIBRA_TOKEN": "passed-on-purpose"})):
        out = tmp_path / worker_id
        spec = WorkerSpec(worker_id, WorkerRole.GENERIC, (0,), (sys.executable, "-c", probe, str(out)), env)
        client.start_worker(agent.agent_id, spec)
        wait_for(out.is_file, what=f"{worker_id} to write its environment")
        wait_for(functools.partial(_ended, client, worker_id), what=f"{worker_id} to end")
    assert (tmp_path / "inherits").read_text() == "absent"
    assert (tmp_path / "given").read_text() == "passed-on-purpose"


def _ended(client, worker_id: str) -> bool:
    return any(w.spec.worker_id == worker_id and w.state.ended for w in client.cluster_state().workers)


def test_watch_events_only_new_skips_the_replay(controller):
    for i in range(3):
        controller.events.publish(EventKind.JOB, message=f"old {i}")
    stub = controller_pb2_grpc.ClusterApiStub(open_channel(controller.address, TOKEN))
    stream = stub.WatchEvents(controller_pb2.WatchEventsRequest(only_new=True))
    publisher = threading.Timer(0.5, lambda: controller.events.publish(EventKind.JOB, message="new"))
    publisher.start()
    try:
        first = next(stream)
    finally:
        stream.cancel()
    assert first.message == "new" and first.sequence == 4


def test_streams_and_stalled_calls_hold_no_thread(controller):
    """40 heartbeat streams, 40 watchers, 64 anonymous and 64 authenticated calls that send headers
    and never a body: 32 of any of these used to leave no thread for anyone else."""

    async def scenario():
        channel = grpc.aio.insecure_channel(controller.address)
        registry = controller_pb2_grpc.AgentRegistryStub(channel)
        api = controller_pb2_grpc.ClusterApiStub(channel)
        token = bearer_metadata(TOKEN)
        open_calls = []
        device = common_pb2.Device(index=0, kind="cpu-slot", memory_bytes=1)
        for i in range(40):
            request = controller_pb2.RegisterRequest(
                host=f"s{i}", address="127.0.0.1:9", backend="cpu", devices=[device]
            )
            reply = await registry.Register(request, metadata=token, timeout=10)
            beats = registry.Heartbeat(metadata=bearer_metadata(reply.credential))
            await beats.write(controller_pb2.HeartbeatRequest())
            assert (await beats.read()).known
            open_calls.append(beats)
            open_calls.append(
                api.WatchEvents(controller_pb2.WatchEventsRequest(only_new=True), metadata=token)
            )

        async def never():
            await asyncio.Event().wait()
            yield b""  # pragma: no cover

        stalled = channel.stream_unary(CLUSTER_STATE)
        anonymous = [stalled(never()) for _ in range(64)]
        authenticated = [stalled(never(), metadata=token) for _ in range(64)]
        await asyncio.sleep(0.5)
        # Others are answered at once meanwhile; the anonymous stalls were refused at their headers.
        state = await api.GetClusterState(controller_pb2.GetClusterStateRequest(), metadata=token, timeout=10)
        late = await registry.Register(
            controller_pb2.RegisterRequest(
                host="late", address="127.0.0.1:9", backend="cpu", devices=[device]
            ),
            metadata=token,
            timeout=10,
        )
        codes = [await call.code() for call in anonymous]
        assert not any(call.done() for call in authenticated)
        for call in open_calls + authenticated:
            call.cancel()
        await channel.close()
        return state, late, codes

    state, late, codes = asyncio.run(scenario())
    assert len(state.agents) == 40 and late.agent_id
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
