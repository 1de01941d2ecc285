"""The controller's bookkeeping driven directly, with a fake clock: liveness, worker transitions,
event history and resumption, credentials, record expiry, the cached state encoding."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from libra.backends.base import DeviceInfo
from libra.control.cluster import Cluster
from libra.control.convert import ClusterStateEncoder, cluster_state_to_proto
from libra.control.events import EventBus, WatcherFellBehind
from libra.control.types import AgentState, EventKind, WorkerRole, WorkerSpec, WorkerState, WorkerStatus
from libra.v1 import controller_pb2


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def cluster(clock):
    return Cluster(heartbeat_interval_s=1.0, events=EventBus(), clock=clock)


def register(cluster: Cluster, host: str = "h") -> str:
    devices = (DeviceInfo(index=0, kind="cpu-slot", memory_bytes=1 << 30),)
    agent_id, _credential = cluster.register_agent(host, f"{host}:1", "cpu", devices)
    return agent_id


def running(agent_id: str, worker_id: str) -> WorkerStatus:
    spec = WorkerSpec(worker_id=worker_id, role=WorkerRole.TRAIN, devices=(0,), argv=("x",))
    return WorkerStatus(spec=spec, agent_id=agent_id, state=WorkerState.RUNNING, pid=42)


def kinds(cluster: Cluster) -> list[EventKind]:
    return [e.kind for e in cluster.events._history]


def test_agent_is_lost_after_three_silent_intervals_not_before(cluster, clock):
    agent = register(cluster)
    clock.now += 2.9
    assert cluster.expire_silent_agents() == []
    assert cluster.heartbeat(agent)
    clock.now += 3.0
    assert cluster.expire_silent_agents() == []
    clock.now += 0.01
    assert cluster.expire_silent_agents() == [agent]
    assert cluster.snapshot().agents[0].state == AgentState.LOST
    assert not cluster.heartbeat(agent), "a lost agent must register again"


def test_losing_an_agent_loses_its_running_workers_once(cluster, clock):
    a, b = register(cluster, "a"), register(cluster, "b")
    cluster.record_worker(running(a, "w1"))
    cluster.record_worker(running(b, "w2"))
    done = running(a, "w3")
    cluster.record_worker(done)
    cluster.record_worker(WorkerStatus(**{**done.__dict__, "state": WorkerState.EXITED}))
    assert cluster.mark_agent_gone(a, AgentState.LOST, "test")
    assert not cluster.mark_agent_gone(a, AgentState.LOST, "again")
    states = {w.spec.worker_id: w.state for w in cluster.snapshot().workers}
    assert states == {"w1": WorkerState.LOST, "w2": WorkerState.RUNNING, "w3": WorkerState.EXITED}
    assert kinds(cluster).count(EventKind.WORKER_LOST) == 1
    # A late exit report of a lost worker does not bring it back.
    cluster.record_worker(WorkerStatus(**{**running(a, "w1").__dict__, "state": WorkerState.EXITED}))
    assert cluster.worker("w1").state == WorkerState.LOST


def test_worker_transition_is_published_once(cluster):
    agent = register(cluster)
    cluster.record_worker(running(agent, "w"))
    cluster.record_worker(running(agent, "w"))
    assert kinds(cluster) == [EventKind.AGENT_JOINED, EventKind.WORKER_STARTED]


def test_lookup_errors_name_the_id(cluster):
    with pytest.raises(LookupError, match="nope"):
        cluster.worker("nope")
    with pytest.raises(LookupError, match="agent-9"):
        cluster.live_agent("agent-9")
    agent = register(cluster)
    cluster.mark_agent_gone(agent, AgentState.LEFT, "bye")
    with pytest.raises(RuntimeError, match="left"):
        cluster.live_agent(agent)


def test_watch_resumes_after_a_sequence_and_filters_kinds():
    bus = EventBus()
    for i in range(5):
        bus.publish(EventKind.WORKER_STARTED if i % 2 else EventKind.AGENT_JOINED, message=str(i))
    active = threading.Event()
    active.set()
    stream = bus.watch(after_sequence=2, kinds=frozenset({EventKind.AGENT_JOINED}), is_active=active.is_set)
    replayed = [next(stream).sequence]  # only 3 and 5 are joins after 2
    replayed.append(next(stream).sequence)
    bus.publish(EventKind.WORKER_STARTED)
    live = bus.publish(EventKind.AGENT_JOINED)
    assert replayed == [3, 5]
    assert next(stream).sequence == live.sequence
    active.clear()
    assert list(stream) == []
    active.set()
    everything = bus.watch(after_sequence=0, kinds=frozenset(), is_active=active.is_set)
    assert [next(everything).sequence for _ in range(7)] == [1, 2, 3, 4, 5, 6, 7]
    fresh = bus.watch(after_sequence=0, kinds=frozenset(), is_active=active.is_set, only_new=True)
    bus.publish(EventKind.AGENT_LEFT)
    assert next(fresh).sequence == 8


def test_departed_agents_and_ended_workers_are_forgotten_after_the_ttl(clock):
    # 5,000 registrations used to leave 5,000 records behind for good.
    cluster = Cluster(heartbeat_interval_s=1.0, events=EventBus(), clock=clock, record_ttl_s=60.0)
    agents = [cluster.register_agent(f"h{i}", f"h{i}:1", "cpu", ()) for i in range(50)]
    keeper, keeper_credential = agents[0]
    cluster.record_worker(running(keeper, "done"))
    cluster.record_worker(
        dataclasses.replace(running(keeper, "done"), state=WorkerState.EXITED, ended_at=clock.now)
    )
    cluster.record_worker(running(keeper, "busy"))
    clock.now += 10.0
    for _ in range(2):
        cluster.heartbeat(keeper)
        cluster.expire_silent_agents()
    assert cluster.forget_expired() == 0  # lost just now: kept for inspection
    clock.now += 61.0
    cluster.heartbeat(keeper)
    assert cluster.forget_expired() == 49 + 1
    state = cluster.snapshot()
    assert [a.agent_id for a in state.agents] == [keeper]
    assert [w.spec.worker_id for w in state.workers] == ["busy"]
    assert cluster.agent_of_credential(agents[1][1]) is None
    assert cluster.agent_of_credential(keeper_credential) == keeper


def test_an_agent_reports_for_its_own_workers_only(cluster):
    mine, other = register(cluster, "a"), register(cluster, "b")
    cluster.record_worker(running(other, "theirs"))
    with pytest.raises(PermissionError, match="may not report for agent"):
        cluster.record_report(mine, running(other, "theirs"))
    with pytest.raises(PermissionError, match="runs on agent"):
        cluster.record_report(mine, dataclasses.replace(running(mine, "theirs"), state=WorkerState.EXITED))
    assert (
        cluster.worker("theirs").state == WorkerState.RUNNING and cluster.worker("theirs").agent_id == other
    )
    cluster.record_report(mine, running(mine, "own"))
    assert cluster.worker("own").agent_id == mine


def test_credentials_are_distinct_and_name_their_agent(cluster):
    first = cluster.register_agent("a", "a:1", "cpu", ())
    second = cluster.register_agent("a", "a:1", "cpu", ())
    assert first[1] != second[1] and len(first[1]) >= 40
    assert cluster.agent_of_credential(first[1]) == first[0]
    assert cluster.agent_of_credential(second[1]) == second[0]
    assert cluster.agent_of_credential("guess") is None
    assert cluster.credential(first[0]) == first[1]


def test_encoded_cluster_state_decodes_to_the_protobuf_encoding(cluster, clock):
    encoder = ClusterStateEncoder()
    agents = [register(cluster, f"h{i}") for i in range(3)]
    cluster.record_worker(running(agents[0], "w"))
    for step in range(3):  # cached parts must follow heartbeats and state changes
        clock.now += 0.5
        cluster.heartbeat(agents[1])
        if step == 1:
            cluster.mark_agent_gone(agents[2], AgentState.LEFT, "bye")
            cluster.record_worker(dataclasses.replace(running(agents[0], "w"), state=WorkerState.EXITED))
        state = cluster.snapshot()
        decoded = controller_pb2.ClusterState.FromString(encoder.encode(state))
        assert decoded == cluster_state_to_proto(state)
        assert decoded.agents[1].last_heartbeat_at == state.agents[1].last_heartbeat_at


def test_async_watch_replays_follows_and_ends_a_watcher_that_fell_behind():
    bus = EventBus()
    for _ in range(3):
        bus.publish(EventKind.AGENT_JOINED)

    async def scenario():
        replay = bus.watch_async(1, frozenset())
        assert [(await anext(replay)).sequence for _ in range(2)] == [2, 3]
        fresh = bus.watch_async(0, frozenset(), only_new=True)
        first = asyncio.ensure_future(anext(fresh))
        await asyncio.sleep(0)
        # Published from another thread, as the job and the planner do.
        await asyncio.to_thread(bus.publish, EventKind.WORKER_STARTED)
        assert (await first).sequence == 4 and (await anext(replay)).sequence == 4
        slow = bus.watch_async(4, frozenset(), max_pending=5)
        head = asyncio.ensure_future(anext(slow))
        await asyncio.sleep(0)
        for _ in range(20):
            bus.publish(EventKind.WORKER_EXITED)
        await asyncio.sleep(0.05)
        with pytest.raises(WatcherFellBehind, match="after_sequence=4"):
            await head
        await fresh.aclose()
        await replay.aclose()
        assert not any(bus._loop_inboxes.values())

    asyncio.run(scenario())


def test_an_ended_record_is_kept_against_its_own_process_and_replaced_by_a_new_one(cluster):
    agent = register(cluster)
    first = running(agent, "w")
    cluster.record_worker(dataclasses.replace(first, state=WorkerState.EXITED, exit_code=1))
    cluster.record_worker(first)  # the start reply, after the exit report of the same process
    assert cluster.worker("w").state == WorkerState.EXITED
    assert cluster.running_worker("w") is None
    cluster.record_worker(dataclasses.replace(first, pid=43))  # the id started again
    assert cluster.worker("w").state == WorkerState.RUNNING and cluster.running_worker("w").pid == 43


def test_the_version_moves_with_every_change_a_snapshot_shows(cluster, clock):
    versions = [cluster.version]
    agent = register(cluster)
    versions.append(cluster.version)
    clock.now += 0.5
    cluster.heartbeat(agent)
    versions.append(cluster.version)
    cluster.events.publish(EventKind.JOB, message="progress")
    versions.append(cluster.version)
    cluster.record_worker(running(agent, "w"))
    versions.append(cluster.version)
    cluster.mark_agent_gone(agent, AgentState.LEFT, "bye")
    versions.append(cluster.version)
    assert len(set(versions)) == len(versions)
    assert cluster.version == versions[-1]  # reading changes nothing
