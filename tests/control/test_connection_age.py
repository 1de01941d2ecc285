"""Connections are recycled (`control.max_connection_age_s`): a caller that stalls cannot keep one
for good, while agents stay alive across it (their heartbeat streams are renewed in time) and
event watchers resume without a gap."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control import EventKind
from libra.control.auth import bearer_metadata
from libra.control.config import ControlConfig
from libra.control.types import AgentState
from tests.control.helpers import TOKEN

pytestmark = pytest.mark.multiprocess

MAX_AGE_S = 3.0
HEARTBEAT_S = 0.5


@pytest.fixture
def config(tmp_path) -> LibraConfig:
    control = ControlConfig(
        port=0, token=TOKEN, heartbeat_interval_s=HEARTBEAT_S, max_connection_age_s=MAX_AGE_S
    )
    return LibraConfig(run_dir=str(tmp_path / "run"), control=control, backend=BackendConfig(name="cpu"))


def test_recycled_connections_keep_agents_and_watchers_whole(controller, client, spawn_agent):
    agent = spawn_agent()
    start = client.cluster_state().last_event_sequence
    received = []

    def watch():
        try:
            received.extend(e.message for e in client.watch_events(start, [EventKind.JOB]))
        except grpc.RpcError:
            pass  # the client closes at the end of the test

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    sent = []
    deadline = time.monotonic() + 3 * MAX_AGE_S
    while time.monotonic() < deadline:  # across at least two recycles of every connection
        sent.append(f"tick {len(sent)}")
        controller.events.publish(EventKind.JOB, message=sent[-1])
        time.sleep(0.1)
    wait = time.monotonic() + 10
    while len(received) < len(sent) and time.monotonic() < wait:
        time.sleep(0.05)
    assert received == sent
    state = {a.agent_id: a for a in controller.cluster.snapshot().agents}[agent.agent_id]
    assert state.state == AgentState.ALIVE and time.time() - state.last_heartbeat_at < 3 * HEARTBEAT_S
    assert not [e for e in controller.events._history if e.kind == EventKind.AGENT_LOST]


def test_a_stalled_call_cannot_keep_its_connection(controller):
    async def stall():
        channel = grpc.aio.insecure_channel(controller.address)

        async def never():
            await asyncio.Event().wait()
            yield b""  # pragma: no cover

        call = channel.stream_unary("/libra.v1.ClusterApi/GetClusterState")(
            never(), metadata=bearer_metadata(TOKEN)
        )
        started = time.monotonic()
        code = await asyncio.wait_for(call.code(), timeout=30)
        await channel.close()
        return code, time.monotonic() - started

    code, held_s = asyncio.run(stall())
    assert code == grpc.StatusCode.UNAVAILABLE and held_s < 4 * MAX_AGE_S
