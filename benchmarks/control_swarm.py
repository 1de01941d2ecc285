"""A swarm of simulated node agents and event watchers against a controller, in one process.

Each simulated agent registers on the run's token, then beats on its own credential at the
interval the controller asks for. Once every agent has had a beat answered, the watchers follow
`WatchEvents` (worker events) from the sequence current then, and it prints `ready`; it runs
until SIGTERM or SIGINT, then prints one JSON line: beats answered, errors by status code,
agents the controller stopped knowing, and per watcher the worker ids it saw start. Used by
`benchmarks/control_plane.py` and by
the control plane's load test.

    python benchmarks/control_swarm.py --address HOST:PORT --token-file F --agents 500 --watchers 100
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import sys
from pathlib import Path

import grpc

from libra.v1 import common_pb2, controller_pb2, controller_pb2_grpc

AGENTS_PER_CHANNEL = 100
WORKER_EVENTS = [
    common_pb2.EVENT_KIND_WORKER_STARTED,
    common_pb2.EVENT_KIND_WORKER_EXITED,
    common_pb2.EVENT_KIND_WORKER_STOPPED,
    common_pb2.EVENT_KIND_WORKER_LOST,
]


def _bearer(secret: str):
    return (("authorization", f"Bearer {secret}"),)


class Swarm:
    def __init__(self, address: str, token: str, name: str):
        self.address = address
        self.token = token
        self.name = name
        self.beats = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.forgotten = 0
        self.first_beats = 0
        self.started_seen: list[set[str]] = []
        self._channels: list[grpc.aio.Channel] = []
        self._stopping = False

    def _stub(self, i: int):
        while len(self._channels) <= i // AGENTS_PER_CHANNEL:
            # A channel of its own per group: separate connections, as separate hosts would have.
            options = [("grpc.use_local_subchannel_pool", 1)]
            self._channels.append(grpc.aio.insecure_channel(self.address, options=options))
        return self._channels[i // AGENTS_PER_CHANNEL]

    async def agent(self, i: int, beating: asyncio.Semaphore) -> None:
        registry = controller_pb2_grpc.AgentRegistryStub(self._stub(i))
        request = controller_pb2.RegisterRequest(
            host=f"{self.name}-{i}",
            address=f"127.0.0.1:{20000 + i}",
            backend="cpu",
            devices=[common_pb2.Device(index=d, kind="cpu-slot", memory_bytes=1 << 30) for d in range(8)],
        )
        try:
            reply = await registry.Register(request, metadata=_bearer(self.token), timeout=60)
        except grpc.aio.AioRpcError as e:
            self.errors[f"Register:{e.code().name}"] += 1
            return
        call = registry.Heartbeat(metadata=_bearer(reply.credential))
        first = True
        try:
            while True:
                await call.write(controller_pb2.HeartbeatRequest(agent_id=reply.agent_id))
                answer = await call.read()
                if answer is grpc.aio.EOF:
                    self.errors["Heartbeat:EOF"] += 1
                    return
                self.beats += 1
                if first:
                    first = False
                    beating.release()
                if not answer.known:
                    self.forgotten += 1
                    return
                await asyncio.sleep(reply.heartbeat_interval_s)
        except grpc.aio.AioRpcError as e:
            self.errors[f"Heartbeat:{e.code().name}"] += 1
        finally:
            call.cancel()

    async def watcher(self, index: int, after_sequence: int) -> None:
        api = controller_pb2_grpc.ClusterApiStub(self._stub(index))
        seen = self.started_seen[index]
        # Worker events only: the other swarms' agents joining and leaving are not this test's.
        request = controller_pb2.WatchEventsRequest(after_sequence=after_sequence, kinds=WORKER_EVENTS)
        call = api.WatchEvents(request, metadata=_bearer(self.token))
        try:
            async for event in call:
                if event.kind == common_pb2.EVENT_KIND_WORKER_STARTED:
                    seen.add(event.worker_id)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or not self._stopping:
                self.errors[f"WatchEvents:{e.code().name}"] += 1

    async def run(self, num_agents: int, num_watchers: int) -> dict:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        beating = asyncio.Semaphore(0)
        agents = [asyncio.create_task(self.agent(i, beating)) for i in range(num_agents)]
        for _ in range(num_agents):
            await beating.acquire()
        # Watchers follow from here on: what the agents' registrations published is history.
        api = controller_pb2_grpc.ClusterApiStub(self._stub(0))
        state = await api.GetClusterState(
            controller_pb2.GetClusterStateRequest(), metadata=_bearer(self.token), timeout=60
        )
        self.started_seen = [set() for _ in range(num_watchers)]
        watchers = [
            asyncio.create_task(self.watcher(w, state.last_event_sequence)) for w in range(num_watchers)
        ]
        print("ready", flush=True)
        await stop.wait()
        self._stopping = True
        for task in agents + watchers:
            task.cancel()
        await asyncio.gather(*agents, *watchers, return_exceptions=True)
        for channel in self._channels:
            await channel.close()
        return {
            "agents": num_agents,
            "beats": self.beats,
            "forgotten": self.forgotten,
            "errors": dict(self.errors),
            "started_seen": [sorted(s) for s in self.started_seen],
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--agents", type=int, default=500)
    p.add_argument("--watchers", type=int, default=100)
    p.add_argument("--name", default="sim")
    args = p.parse_args()
    token = Path(args.token_file).read_text().strip()
    result = asyncio.run(Swarm(args.address, token, args.name).run(args.agents, args.watchers))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
