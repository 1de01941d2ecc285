"""Multi-process control-plane tests on loopback: a controller, node agents as real processes,
workers as real child processes."""

from __future__ import annotations

import os
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libra.control import EventKind, WorkerRole, WorkerSpec, WorkerState
from libra.control.auth import open_channel
from libra.v1 import agent_pb2, agent_pb2_grpc, common_pb2, controller_pb2, controller_pb2_grpc
from tests.control.helpers import HEARTBEAT_S, TOKEN, wait_for

pytestmark = pytest.mark.multiprocess


def python_worker(worker_id: str, devices: tuple[int, ...], code: str) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id, role=WorkerRole.GENERIC, devices=devices, argv=(sys.executable, "-c", code)
    )


class EventCollector:
    """Collects WatchEvents from the start of the test in a background thread."""

    def __init__(self, client, after_sequence: int = 0):
        self.events = []
        self._thread = threading.Thread(target=self._run, args=(client, after_sequence), daemon=True)
        self._thread.start()

    def _run(self, client, after_sequence):
        try:
            for event in client.watch_events(after_sequence=after_sequence):
                self.events.append(event)
        except grpc.RpcError:
            pass  # the channel closed at the end of the test

    def first(self, kind: EventKind, **match):
        def find():
            return next(
                (
                    e
                    for e in self.events
                    if e.kind == kind and all(getattr(e, k) == v for k, v in match.items())
                ),
                None,
            )

        return wait_for(find, what=f"event {kind.name} {match}")


def test_two_agents_register_with_their_devices(client, spawn_agent):
    first, second = spawn_agent(num_devices=2), spawn_agent(num_devices=1)
    agents = {a.agent_id: a for a in client.cluster_state().agents}
    assert set(agents) == {first.agent_id, second.agent_id}
    assert [d.index for d in agents[first.agent_id].devices] == [0, 1]
    assert [d.index for d in agents[second.agent_id].devices] == [0]
    assert all(d.kind == "cpu-slot" and d.memory_bytes > 0 for a in agents.values() for d in a.devices)


def test_worker_sees_its_devices_and_its_exit_is_reported(client, spawn_agent, tmp_path):
    agent = spawn_agent(num_devices=2)
    watcher = EventCollector(client, after_sequence=client.cluster_state().last_event_sequence)
    out = tmp_path / "visible.txt"
    code = f"import os, sys; open({str(out)!r}, 'w').write(os.environ['LIBRA_VISIBLE_DEVICES']); sys.exit(3)"
    started = client.start_worker(agent.agent_id, python_worker("probe-1", (1,), code))
    assert started.state == WorkerState.RUNNING and started.pid > 0

    exited = watcher.first(EventKind.WORKER_EXITED, worker_id="probe-1")
    assert exited.exit_code == 3 and exited.agent_id == agent.agent_id
    assert out.read_text() == "1"
    worker = next(w for w in client.cluster_state().workers if w.spec.worker_id == "probe-1")
    assert worker.state == WorkerState.EXITED and worker.exit_code == 3


def test_stop_worker_stops_its_process_group(client, spawn_agent):
    agent = spawn_agent()
    code = (
        "import subprocess, sys, time;"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    started = client.start_worker(agent.agent_id, python_worker("sleeper", (0,), code))
    stopped = client.stop_worker("sleeper", grace_s=2.0)
    assert stopped.state == WorkerState.STOPPED
    with pytest.raises(ProcessLookupError):
        os.killpg(started.pid, 0)


def test_a_worker_that_exits_takes_its_process_group_with_it(client, spawn_agent, tmp_path):
    agent = spawn_agent()
    watcher = EventCollector(client, after_sequence=client.cluster_state().last_event_sequence)
    child_pid = tmp_path / "child.pid"
    code = (
        "import subprocess, sys;"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid)); sys.exit(5)"
    )
    started = client.start_worker(agent.agent_id, python_worker("crasher", (0,), code))
    assert watcher.first(EventKind.WORKER_EXITED, worker_id="crasher").exit_code == 5
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _group_alive(started.pid):
        time.sleep(0.05)
    assert not _group_alive(started.pid), f"child {child_pid.read_text()} outlived its worker"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_devices_are_exclusive_until_the_worker_ends(client, spawn_agent):
    agent = spawn_agent()
    client.start_worker(agent.agent_id, python_worker("holder", (0,), "import time; time.sleep(60)"))
    with pytest.raises(grpc.RpcError) as err:
        client.start_worker(agent.agent_id, python_worker("intruder", (0,), "pass"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.devices [0] are held" in err.value.details()
    client.stop_worker("holder")
    client.start_worker(agent.agent_id, python_worker("next-holder", (0,), "pass"))


def test_killed_agent_is_detected_and_its_workers_lost(controller, client, spawn_agent):
    survivor, victim = spawn_agent(), spawn_agent()
    watcher = EventCollector(client, after_sequence=client.cluster_state().last_event_sequence)
    orphan = client.start_worker(
        victim.agent_id, python_worker("orphan", (0,), "import time; time.sleep(60)")
    )

    victim.kill()
    lost = watcher.first(EventKind.AGENT_LOST, agent_id=victim.agent_id)
    # Detected by its agent, not by the worker's own end (it sleeps for 60 s).
    assert lost.time - watcher.first(EventKind.WORKER_STARTED, worker_id="orphan").time < 30
    watcher.first(EventKind.WORKER_LOST, worker_id="orphan")
    # The worker dies with its agent: nothing keeps holding the devices.
    wait_for(lambda: _gone(orphan.pid), timeout_s=20, what="orphan worker to die")
    agents = {a.agent_id: a for a in client.cluster_state().agents}
    assert {name: a.state.name for name, a in agents.items()} == {
        survivor.agent_id: "ALIVE",
        victim.agent_id: "LOST",
    }
    # The controller's channel to the lost agent is closed once it opens another.
    assert controller._agents.open_addresses == [agents[victim.agent_id].address]
    client.start_worker(
        survivor.agent_id, python_worker("survivor-worker", (0,), "import time; time.sleep(60)")
    )
    assert controller._agents.open_addresses == [agents[survivor.agent_id].address]


def test_silent_agent_is_lost_within_three_heartbeats(controller, client, spawn_agent):
    agent = spawn_agent()
    watcher = EventCollector(client, after_sequence=client.cluster_state().last_event_sequence)
    os.kill(agent.process.pid, 19)  # SIGSTOP: the stream stays open but no beat comes
    try:
        lost = watcher.first(EventKind.AGENT_LOST, agent_id=agent.agent_id)
        last_beat = next(
            a for a in client.cluster_state().agents if a.agent_id == agent.agent_id
        ).last_heartbeat_at
        # The monitor checks every third of an interval; the rest is slack for a loaded host.
        assert lost.time - last_beat <= 3 * HEARTBEAT_S + HEARTBEAT_S / 3 + 1.0
        assert "no heartbeat" in lost.message
    finally:
        os.kill(agent.process.pid, 18)  # SIGCONT so the fixture can end it


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_unauthenticated_calls_are_refused(controller, spawn_agent, token):
    agent = spawn_agent()
    channel = open_channel(controller.address, token)
    calls = [
        lambda: controller_pb2_grpc.ClusterApiStub(channel).GetClusterState(
            controller_pb2.GetClusterStateRequest()
        ),
        lambda: list(
            controller_pb2_grpc.ClusterApiStub(channel).WatchEvents(controller_pb2.WatchEventsRequest())
        ),
        lambda: controller_pb2_grpc.AgentRegistryStub(channel).Register(
            controller_pb2.RegisterRequest(host="evil", address="127.0.0.1:1")
        ),
    ]
    agent_address = next(
        a.address for a in controller.cluster.snapshot().agents if a.agent_id == agent.agent_id
    )
    agent_channel = open_channel(agent_address, token)
    calls.append(
        lambda: agent_pb2_grpc.NodeAgentStub(agent_channel).ListWorkers(agent_pb2.ListWorkersRequest())
    )
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [a.host for a in controller.cluster.snapshot().agents].count("evil") == 0


def test_malformed_requests_name_the_field(controller, client, spawn_agent):
    agent = spawn_agent()
    stub = controller_pb2_grpc.ClusterApiStub(open_channel(controller.address, TOKEN))
    good = common_pb2.WorkerSpec(
        worker_id="w", role=common_pb2.WORKER_ROLE_GENERIC, devices=[0], argv=["true"]
    )

    def spec(**changes):
        s = common_pb2.WorkerSpec()
        s.CopyFrom(good)
        for name, value in changes.items():
            s.ClearField(name)
            if isinstance(value, list):
                getattr(s, name).extend(value)
            elif isinstance(value, dict):
                getattr(s, name).update(value)
            else:
                setattr(s, name, value)
        return s

    cases = {
        "spec.worker_id": controller_pb2.StartWorkerRequest(agent_id=agent.agent_id, spec=spec(worker_id="")),
        "spec.argv": controller_pb2.StartWorkerRequest(agent_id=agent.agent_id, spec=spec(argv=[])),
        "spec.role": controller_pb2.StartWorkerRequest(agent_id=agent.agent_id, spec=spec(role=99)),
        "spec.devices [7]": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(devices=[7])
        ),
        "spec.devices has duplicates": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(devices=[0, 0])
        ),
        # A NUL byte once hung the agent for good (the spawn raised past its wait).
        "spec.argv[1] contains a NUL byte": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(argv=["true", "a\0b"])
        ),
        "spec.env['X'] contains a NUL byte": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(env={"X": "a\0b"})
        ),
        "spec.cwd contains a NUL byte": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(cwd="/tmp\0x")
        ),
        # An empty device list used to answer FAILED_PRECONDITION or UNKNOWN.
        "spec.devices must name at least one device": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(devices=[])
        ),
        "spec.cwd must be an absolute path": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(cwd="relative/dir")
        ),
        "spec.argv[1] is longer than": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(argv=["true", "x" * 200_000])
        ),
        "spec.env has invalid variable names": controller_pb2.StartWorkerRequest(
            agent_id=agent.agent_id, spec=spec(env={"BAD=NAME": "1"})
        ),
    }
    for field, request in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.StartWorker(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in err.value.details()

    registry = controller_pb2_grpc.AgentRegistryStub(open_channel(controller.address, TOKEN))
    for request, field in (
        (controller_pb2.RegisterRequest(host="h", address="nowhere", backend="cpu"), "address"),
        (controller_pb2.RegisterRequest(host="h\n", address="h:1", backend="cpu"), "host"),
        (controller_pb2.RegisterRequest(host="h", address="h:1", backend=""), "backend"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            registry.Register(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.WatchEvents(controller_pb2.WatchEventsRequest(after_sequence=-1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "after_sequence" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.StartWorker(controller_pb2.StartWorkerRequest(agent_id="agent-404", spec=good))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "agent-404" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # reaches the agent: it still serves after the NULs
        stub.StartWorker(
            controller_pb2.StartWorkerRequest(agent_id=agent.agent_id, spec=spec(argv=["/no/such/binary"])),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.argv" in err.value.details()


def test_health_check_from_a_stock_client_needs_no_token(controller):
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(controller.address))
    for service in ("", "libra.v1.ClusterApi", "libra.v1.AgentRegistry"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(controller):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(open_channel(controller.address, TOKEN))
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in next(replies).list_services_response.service}
    assert {"libra.v1.ClusterApi", "libra.v1.AgentRegistry", "grpc.health.v1.Health"} <= names
