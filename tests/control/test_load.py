"""The controller under a cluster's worth of load on loopback, as separate processes: 1,000
simulated agents beating and 200 event watchers (`benchmarks/control_swarm.py`, two processes),
a real node agent, 2,000-call bursts and stalled callers, repeated three times. Every call must be
answered (no CANCELLED, no UNAVAILABLE), every watcher must see every worker start, and the
controller's memory and file descriptors must not grow from one flood to the next."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from libra.control.auth import bearer_metadata
from libra.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.control.helpers import TOKEN, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SWARMS, AGENTS_PER_SWARM, WATCHERS_PER_SWARM = 2, 500, 100
BURST, STALLED, ROUNDS = 2000, 64, 3


def _resources(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of a process."""
    rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), len(os.listdir(f"/proc/{pid}/fd"))


def _p99(samples: list[float]) -> float:
    return sorted(samples)[int(0.99 * (len(samples) - 1))]


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for process in reversed(started):
        if process.poll() is None:
            process.terminate()
    for process in started:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _flood(address: str, agent_id: str, round_: int, latencies: dict[str, list[float]]) -> Counter:
    """One round: stalled callers held open while a burst of `BURST` concurrent calls runs and
    cluster reads and worker starts are timed; returns the burst's status codes."""
    channel = grpc.aio.insecure_channel(address)
    api = controller_pb2_grpc.ClusterApiStub(channel)
    token = bearer_metadata(TOKEN)

    async def never():
        await asyncio.Event().wait()
        yield b""  # pragma: no cover

    stalled = channel.stream_unary("/libra.v1.ClusterApi/GetClusterState")
    stalls = [stalled(never()) for _ in range(STALLED)] + [
        stalled(never(), metadata=token) for _ in range(STALLED)
    ]

    async def timed(kind: str, call):
        start = time.perf_counter()
        reply = await call
        latencies[kind].append(time.perf_counter() - start)
        return reply

    async def start_and_stop(index: int):
        worker_id = f"load-{round_}-{index}"
        spec = common_pb2.WorkerSpec(
            worker_id=worker_id, role=common_pb2.WORKER_ROLE_GENERIC, devices=[0], argv=["sleep", "30"]
        )
        request = controller_pb2.StartWorkerRequest(agent_id=agent_id, spec=spec)
        await timed("StartWorker", api.StartWorker(request, metadata=token, timeout=60))
        stop = controller_pb2.StopWorkerRequest(worker_id=worker_id, grace_s=1.0)
        await api.StopWorker(stop, metadata=token, timeout=60)

    async def probe():
        for index in range(3):
            for _ in range(5):
                read = api.GetClusterState(
                    controller_pb2.GetClusterStateRequest(), metadata=token, timeout=60
                )
                await timed("GetClusterState", read)
            await start_and_stop(index)

    async def burst_call():
        try:
            await api.GetClusterState(controller_pb2.GetClusterStateRequest(), metadata=token, timeout=120)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()

    probing = asyncio.ensure_future(probe())
    codes = Counter(await asyncio.gather(*(burst_call() for _ in range(BURST))))
    await probing
    assert not any(call.done() for call in stalls[STALLED:]), "an authenticated stall was ended early"
    for call in stalls:
        call.cancel()
    await channel.close()
    return codes


def test_a_thousand_agents_two_hundred_watchers_bursts_and_stalls(tmp_path, processes):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = {**os.environ, "LIBRA_TOKEN": TOKEN, "PYTHONWARNINGS": "ignore"}
    log = open(tmp_path / "controller.log", "wb")
    controller = subprocess.Popen(
        [sys.executable, "-m", "libra.cli", "controller", f"run_dir={run_dir}", "control.port=0",
         "control.heartbeat_interval_s=3.0"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    processes.append(controller)
    address = wait_for(
        lambda: (run_dir / "controller.addr").is_file() and (run_dir / "controller.addr").read_text().strip(),
        timeout_s=60,
        what="the controller's address",
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "libra.cli", "agent", "--controller", address, f"run_dir={tmp_path / 'agent'}",
         "backend.num_devices=1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    processes.append(agent)
    client = controller_pb2_grpc.ClusterApiStub(grpc.insecure_channel(address))

    def agents():
        request = controller_pb2.GetClusterStateRequest()
        return client.GetClusterState(request, metadata=bearer_metadata(TOKEN), timeout=60).agents

    agent_id = wait_for(lambda: agents() and agents()[0].agent_id, timeout_s=120, what="the node agent")
    swarms = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "control_swarm.py"),
                "--address",
                address,
                "--token-file",
                str(token_file),
                "--agents",
                str(AGENTS_PER_SWARM),
                "--watchers",
                str(WATCHERS_PER_SWARM),
                "--name",
                f"sim{k}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in range(SWARMS)
    ]
    processes.extend(swarms)
    for swarm in swarms:
        assert swarm.stdout.readline().strip() == "ready"
    assert len(agents()) == SWARMS * AGENTS_PER_SWARM + 1

    latencies: dict[str, list[float]] = {"GetClusterState": [], "StartWorker": []}
    resources, bursts = [], []
    for round_ in range(ROUNDS):
        bursts.append(asyncio.run(_flood(address, agent_id, round_, latencies)))
        resources.append(_resources(controller.pid))

    results = []
    for swarm in swarms:
        swarm.terminate()
        out, _ = swarm.communicate(timeout=60)
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"\n{BURST}-call bursts: {[dict(b) for b in bursts]}; "
        + "; ".join(f"{k} p99 {_p99(v) * 1e3:.0f} ms over {len(v)}" for k, v in latencies.items())
        + f"; controller RSS/fds per round: {[(r // 2**20, f) for r, f in resources]}"
        + f"; heartbeats answered: {sum(r['beats'] for r in results)}"
    )
    assert all(set(b) == {grpc.StatusCode.OK} for b in bursts), bursts
    assert all(r["errors"] == {} and r["forgotten"] == 0 for r in results), [r["errors"] for r in results]
    started = {f"load-{r}-{i}" for r in range(ROUNDS) for i in range(3)}
    assert all(started <= set(seen) for r in results for seen in r["started_seen"])
    assert sum(a.state == common_pb2.AGENT_STATE_ALIVE for a in agents()) == 1  # the swarms left
    (rss_first, fds_first), (rss_last, fds_last) = resources[0], resources[-1]
    assert fds_last <= fds_first + 8, resources
    # The controller (no torch: ~110 MB) moves by up to ~70 MB between floods without a trend
    # (allocator arenas; measured 110 -> 177, 188 -> 171, 123 -> 115 MB over three floods), so
    # this catches a flood's calls being kept (>= 24 KB a call), not the allocator's noise.
    assert rss_last <= rss_first + (96 << 20), resources
