"""Control-plane speed on loopback: heartbeats/s and the round-trip latency of a trivial RPC
through Libra's controller (auth interceptor, health, reflection, typed conversion), against a
bare grpcio echo server measured in the same run.

    python benchmarks/control_plane.py [--seconds 3] [--calls 3000]

Both servers run in this process with the same thread-pool size; the client is in this process
too, so the figures include client-side cost on the same 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent import futures

import grpc
from rich.console import Console
from rich.table import Table

from libra.config import ControlConfig, LibraConfig
from libra.control import Controller
from libra.control.auth import open_channel
from libra.v1 import common_pb2, controller_pb2, controller_pb2_grpc

TOKEN = "benchmark-token"


def start_echo_server(threads: int) -> tuple[grpc.Server, int]:
    """A bare grpcio server: one unary and one bidi-streaming method that echo bytes."""

    def unary(request: bytes, context) -> bytes:
        return request

    def stream(requests, context):
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def stream_rate(call, make_request, seconds: float) -> float:
    """Messages/s through a bidi stream, one in flight at a time (as heartbeats are)."""
    count = 0
    deadline = time.perf_counter() + seconds

    def requests():
        nonlocal count
        while time.perf_counter() < deadline:
            count += 1
            yield make_request()

    start = time.perf_counter()
    for _ in call(requests()):
        pass
    return count / (time.perf_counter() - start)


def latencies_us(call, calls: int) -> list[float]:
    for _ in range(min(200, calls)):  # warm-up: connections, thread pool, caches
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(0.99 * (len(samples) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each heartbeat measurement")
    parser.add_argument("--calls", type=int, default=3000, help="unary calls per latency measurement")
    args = parser.parse_args()

    control = ControlConfig(port=0, token=TOKEN, heartbeat_interval_s=60.0)
    controller = Controller(LibraConfig(run_dir=tempfile.mkdtemp(), control=control)).start()
    echo_server, echo_port = start_echo_server(control.max_rpc_threads)
    try:
        registry = controller_pb2_grpc.AgentRegistryStub(open_channel(controller.address, TOKEN))
        api = controller_pb2_grpc.ClusterApiStub(open_channel(controller.address, TOKEN))
        device = common_pb2.Device(index=0, kind="cpu-slot", memory_bytes=1 << 30)
        agent_id = registry.Register(
            controller_pb2.RegisterRequest(
                host="bench", address="127.0.0.1:1", backend="cpu", devices=[device]
            )
        ).agent_id
        beat = controller_pb2.HeartbeatRequest(agent_id=agent_id, running_worker_ids=["w0", "w1"])
        echo = grpc.insecure_channel(f"127.0.0.1:{echo_port}")
        echo_stream = echo.stream_stream("/bench.Echo/Stream")
        echo_unary = echo.unary_unary("/bench.Echo/Unary")
        payload = beat.SerializeToString()

        libra_beats = stream_rate(registry.Heartbeat, lambda: beat, args.seconds)
        echo_beats = stream_rate(echo_stream, lambda: payload, args.seconds)
        request = controller_pb2.GetClusterStateRequest()
        libra_lat = latencies_us(lambda: api.GetClusterState(request), args.calls)
        echo_lat = latencies_us(lambda: echo_unary(payload), args.calls)
    finally:
        controller.stop()
        echo_server.stop(0)

    table = Table(title="Control plane on loopback (same process, same run)")
    for column in ("measure", "libra controller", "bare grpcio echo", "libra / echo"):
        table.add_column(column, justify="right")
    table.add_row(
        "heartbeats/s (one stream)",
        f"{libra_beats:,.0f}",
        f"{echo_beats:,.0f}",
        f"{libra_beats / echo_beats:.2f}",
    )
    for name, fn in (("median", statistics.median), ("p99", p99)):
        lib, base = fn(libra_lat), fn(echo_lat)
        table.add_row(f"unary round trip {name} (µs)", f"{lib:,.0f}", f"{base:,.0f}", f"{lib / base:.2f}")
    Console(width=120).print(table)
    print("GetClusterState carries auth + typed conversion of a one-agent cluster; echo returns raw bytes.")


if __name__ == "__main__":
    main()
