"""The controller's bookkeeping driven directly, with a fake clock: liveness, worker transitions,
event history and resumption."""

from __future__ import annotations

import threading

import pytest

from libra.backends.base import DeviceInfo
from libra.control.cluster import Cluster
from libra.control.events import EventBus
from libra.control.types import AgentState, EventKind, WorkerRole, WorkerSpec, WorkerState, WorkerStatus


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
    return cluster.register_agent(host, f"{host}:1", "cpu", devices)


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
