"""Control-plane speed on loopback, against the controller as it is deployed (`libra controller`
in its own process, serving on `grpc.aio`):

1. Routed unary requests/s: `GetClusterState` of a small cluster (a few simulated agents that keep
   beating), with `--inflight` calls in flight from an asyncio client, against a bare `grpc.aio`
   echo server (generic handler returning the request bytes, no auth, no interceptor) started in
   the same run and driven by the same client code. The echo request is a copy of the controller's
   reply, so both replies have the same size. The issue's target is >= 5,000 routed requests/s.
2. Heartbeats/s at 1,000 agents: `--swarms` processes of `benchmarks/control_swarm.py` (no
   watchers) beat every `--heartbeat-interval` s for `--seconds`; answered beats/s against offered.
3. Latency of a single `GetClusterState` (p50/p99) at 1,000 agents while that swarm runs, sampled
   `--latency-hz` times a second. The same replies count heartbeats on the controller's side: each
   change of an agent's `last_heartbeat_at` is one beat it recorded.

    python benchmarks/control_plane.py [--seconds 15] [--inflight 128] [--client-procs 1]
        [--agents 1000] [--swarms 2] [--heartbeat-interval 0.5] [--latency-hz 25]

The controller, the echo server, the swarms and the load client(s) each run in their own process
(`--serve-echo` and `--load` are this script's internal modes), so no two share a GIL; on the
shared 2-core machines they still share the cores, and the table says how much CPU the server and
the client used during each rate measurement (a process near 100% of one core is the bottleneck).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from rich.console import Console
from rich.table import Table

from libra.v1 import common_pb2, controller_pb2

TOKEN = "benchmark-token"
TARGET_ROUTED_PER_S = 5_000
STATE_METHOD = "/libra.v1.ClusterApi/GetClusterState"
ECHO_METHOD = "/bench.Echo/Unary"
SMALL_CLUSTER_AGENTS = 4
REPO = Path(__file__).resolve().parent.parent
SWARM = REPO / "benchmarks" / "control_swarm.py"
WARMUP_S = 1.0


# --- internal mode: the bare echo server -------------------------------------------------------


async def serve_echo() -> None:
    async def unary(request: bytes, context) -> bytes:
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Echo", {"Unary": grpc.unary_unary_rpc_method_handler(unary)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"port {port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


# --- internal mode: one load-client process ----------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(
    address: str, method: str, payload: bytes, inflight: int, start_at: float, seconds: float, server_pid: int
) -> dict:
    """Keeps `inflight` unary calls in flight until `start_at + seconds` (wall clock, shared by all
    load processes); counts those that complete in between."""
    channel = grpc.aio.insecure_channel(address)
    call = channel.unary_unary(method)  # bytes in, bytes out: no (de)serialisation on either side
    metadata = (("authorization", f"Bearer {TOKEN}"),)  # sent to the echo server too (it ignores it)
    end_at = start_at + seconds
    done, errors = 0, {}

    async def worker() -> None:
        nonlocal done
        while time.time() < end_at:
            try:
                await call(payload, metadata=metadata, timeout=30)
            except grpc.aio.AioRpcError as e:
                errors[e.code().name] = errors.get(e.code().name, 0) + 1
                continue
            if start_at <= time.time() < end_at:
                done += 1

    async def measure_cpu() -> tuple[float, float]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        c0, s0 = time.process_time(), cpu_seconds(server_pid)
        await asyncio.sleep(max(0.0, end_at - time.time()))
        return time.process_time() - c0, cpu_seconds(server_pid) - s0

    await channel.channel_ready()
    workers = [asyncio.create_task(worker()) for _ in range(inflight)]
    client_cpu, server_cpu = await measure_cpu()
    await asyncio.gather(*workers)
    await channel.close()
    return {"calls": done, "errors": errors, "client_cpu_s": client_cpu, "server_cpu_s": server_cpu}


# --- the orchestrating process -----------------------------------------------------------------


class Child:
    """A subprocess whose stdout lines arrive on a queue (stderr goes to a log file)."""

    def __init__(self, argv: list[str], log: Path, children: list[Child]):
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        children.append(self)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def expect(self, predicate, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.proc.args[:4]}: nothing expected within {timeout_s} s") from None
            if line is None:
                raise RuntimeError(f"{self.proc.args[:4]} exited ({self.proc.wait()}); see {self.log.name}")
            if predicate(line):
                return line

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_controller(run_dir: Path, interval_s: float, children: list[Child]) -> tuple[Child, str]:
    argv = [sys.executable, "-m", "libra.cli", "controller", f"run_dir={run_dir}", "control.port=0"]
    argv += [f"control.token={TOKEN}", f"control.heartbeat_interval_s={interval_s}"]
    controller = Child(argv, run_dir / "controller.out", children)
    controller.expect(lambda line: line.startswith("controller listening"), 60)
    return controller, (run_dir / "controller.addr").read_text().strip()


def start_swarm(address: str, token_file: Path, agents: int, name: str, log: Path, children) -> Child:
    argv = [sys.executable, str(SWARM), "--address", address, "--token-file", str(token_file)]
    return Child(argv + ["--agents", str(agents), "--watchers", "0", "--name", name], log, children)


def swarm_summary(swarm: Child) -> dict:
    swarm.proc.send_signal(signal.SIGTERM)
    return json.loads(swarm.expect(lambda line: line.startswith("{"), 30))


def measure_rate(args, address: str, method: str, payload: bytes, server_pid: int, run_dir: Path) -> dict:
    """Requests/s from `--client-procs` load processes that split `--inflight` between them."""
    start_at = time.time() + 2.0 + WARMUP_S  # imports, connection, then a warm-up second
    payload_file = run_dir / "payload.bin"
    payload_file.write_bytes(payload)
    procs = []
    for i in range(args.client_procs):
        share = args.inflight // args.client_procs + (i < args.inflight % args.client_procs)
        argv = [sys.executable, str(Path(__file__).resolve()), "--load", address, "--load-method", method]
        argv += ["--payload-file", str(payload_file), "--inflight", str(share), "--start-at", str(start_at)]
        argv += ["--seconds", str(args.seconds), "--server-pid", str(server_pid)]
        procs.append(subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=args.seconds + 60)
        if proc.returncode != 0:
            raise RuntimeError(f"load client failed ({proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    errors: dict[str, int] = {}
    for r in results:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    return {
        "rate": sum(r["calls"] for r in results) / args.seconds,
        "errors": errors,
        "client_cpu": sum(r["client_cpu_s"] for r in results) / args.seconds,
        "server_cpu": results[0]["server_cpu_s"] / args.seconds,
    }


def sample_state(args, address: str, interval_s: float) -> dict:
    """Sequential `GetClusterState` calls at `--latency-hz` for `--seconds`: latencies, and the
    heartbeats the controller recorded meanwhile (changes of each agent's `last_heartbeat_at`)."""
    channel = grpc.insecure_channel(address)
    get_state = channel.unary_unary(STATE_METHOD)  # raw bytes: parsing is not part of the latency
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    for _ in range(10):
        get_state(b"", metadata=metadata, timeout=30)
    period = 1.0 / args.latency_hz
    latencies_ms, last_beat, beats, max_gap = [], {}, 0, 0.0
    reply = b""
    start = prev = time.perf_counter()
    first = last = None
    next_at = start
    while (now := time.perf_counter()) < start + args.seconds:
        time.sleep(max(0.0, next_at - now))
        next_at += period
        t0 = time.perf_counter()
        reply = get_state(b"", metadata=metadata, timeout=30)
        t1 = time.perf_counter()
        latencies_ms.append((t1 - t0) * 1e3)
        max_gap, prev = max(max_gap, t1 - prev), t1
        for agent in controller_pb2.ClusterState.FromString(reply).agents:
            seen = last_beat.get(agent.agent_id)
            if seen is not None and agent.last_heartbeat_at != seen:
                beats += 1
            last_beat[agent.agent_id] = agent.last_heartbeat_at
        first = first if first is not None else t1
        last = t1
    channel.close()
    state = controller_pb2.ClusterState.FromString(reply)
    alive = sum(a.state == common_pb2.AGENT_STATE_ALIVE for a in state.agents)
    return {
        "latencies_ms": latencies_ms,
        "reply_bytes": len(reply),
        "agents_in_state": len(state.agents),
        "alive": alive,
        "server_beats_per_s": beats / (last - first),
        # A poll gap longer than a beat period can hide a beat from the count above.
        "count_exact": max_gap < interval_s,
    }


def percentile(samples: list[float], q: float) -> float:
    return sorted(samples)[round(q * (len(samples) - 1))]


def run(args) -> None:
    children: list[Child] = []
    run_dir = Path(tempfile.mkdtemp(prefix="libra-bench-control-"))
    token_file = run_dir / "bench.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    wall0 = time.perf_counter()
    try:
        controller, address = start_controller(run_dir, args.heartbeat_interval, children)
        echo = Child(
            [sys.executable, str(Path(__file__).resolve()), "--serve-echo"], run_dir / "echo.err", children
        )
        echo_address = "127.0.0.1:" + echo.expect(lambda line: line.startswith("port "), 60).split()[1]

        # 1. Routed requests/s on a small cluster, then the same client against the echo server.
        small = start_swarm(
            address, token_file, SMALL_CLUSTER_AGENTS, "small", run_dir / "small.err", children
        )
        small.expect(lambda line: line == "ready", 60)
        with grpc.insecure_channel(address) as channel:
            get_state = channel.unary_unary(STATE_METHOD)
            state_reply = get_state(b"", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
        libra = measure_rate(args, address, STATE_METHOD, b"", controller.proc.pid, run_dir)
        bare = measure_rate(args, echo_address, ECHO_METHOD, state_reply, echo.proc.pid, run_dir)
        small_summary = swarm_summary(small)
        echo.stop()

        # 2 + 3. A swarm of --agents beating; GetClusterState sampled meanwhile.
        per_swarm = [args.agents // args.swarms + (i < args.agents % args.swarms) for i in range(args.swarms)]
        swarms = [
            start_swarm(address, token_file, n, f"swarm{i}", run_dir / f"swarm{i}.err", children)
            for i, n in enumerate(per_swarm)
        ]
        for swarm in swarms:
            swarm.expect(lambda line: line == "ready", 120)
        ready_at = time.perf_counter()
        pids = [controller.proc.pid] + [swarm.proc.pid for swarm in swarms]
        cpu0, own0 = [cpu_seconds(pid) for pid in pids], time.process_time()
        sampled = sample_state(args, address, args.heartbeat_interval)
        window_s = time.perf_counter() - ready_at
        cpu = [(cpu_seconds(pid) - c) / window_s for pid, c in zip(pids, cpu0, strict=True)]
        cpu.append((time.process_time() - own0) / window_s)
        summaries = [swarm_summary(swarm) for swarm in swarms]
        stopped_at = time.perf_counter()
    finally:
        for child in reversed(children):
            child.stop()
    wall_s = time.perf_counter() - wall0

    errors: dict[str, int] = {}
    for s in [small_summary, *summaries]:
        for code, n in s["errors"].items():
            errors[code] = errors.get(code, 0) + n
    forgotten = sum(s["forgotten"] for s in [small_summary, *summaries])
    swarm_beats = sum(s["beats"] for s in summaries)
    offered = args.agents / args.heartbeat_interval
    lat = sampled["latencies_ms"]
    client = f"{args.client_procs} client process{'es' if args.client_procs > 1 else ''}"

    table = Table(
        title=f"Control plane on loopback ({os.cpu_count()} cores; each server and client its own process)"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("notes")
    table.add_row(
        "routed GetClusterState/s (libra)",
        f"{libra['rate']:,.0f}",
        f"{SMALL_CLUSTER_AGENTS} agents, {len(state_reply)} B reply; {args.inflight} in flight, {client}",
    )
    table.add_row("unary echo/s (bare grpc.aio)", f"{bare['rate']:,.0f}", "same client; request = that reply")
    table.add_row("libra / echo", f"{libra['rate'] / bare['rate']:.2f}", "")
    met = libra["rate"] >= TARGET_ROUTED_PER_S
    table.add_row(
        f"target >= {TARGET_ROUTED_PER_S:,}/s routed",
        "[green]met[/]" if met else "[red]NOT met[/]",
        "",
    )
    for name, r in (("libra", libra), ("echo", bare)):
        per_call = f"{r['server_cpu'] / r['rate'] * 1e6:.0f} / {r['client_cpu'] / r['rate'] * 1e6:.0f}"
        table.add_row(
            f"CPU during {name} run: cores (µs/call)",
            f"{r['server_cpu']:.2f} / {r['client_cpu']:.2f}",
            f"server / client(s) ({per_call}); 1.0 is a saturated process",
        )
        if r["errors"]:
            table.add_row(
                f"[red]{name} call errors[/]", str(sum(r["errors"].values())), json.dumps(r["errors"])
            )
    table.add_row(
        "heartbeats offered/s",
        f"{offered:,.0f}",
        f"{args.agents} agents, {args.swarms} processes; beat {args.heartbeat_interval} s after each answer",
    )
    table.add_row(
        "heartbeats answered/s",
        f"{sampled['server_beats_per_s']:,.0f}",
        f"recorded by the controller; per agent one every {args.agents / sampled['server_beats_per_s']:.3f} s"
        + ("" if sampled["count_exact"] else " [red](lower bound)[/]"),
    )
    table.add_row(
        "beats answered (swarm JSON)",
        f"{swarm_beats:,}",
        f"= {swarm_beats / (stopped_at - ready_at):,.0f}/s from ready to stop (+ the registration ramp's)",
    )
    table.add_row(
        "swarm errors / agents forgotten",
        f"{'[red]' if errors else ''}{sum(errors.values())}{'[/]' if errors else ''} / {forgotten}",
        json.dumps(errors) if errors else "must be 0 / 0",
    )
    table.add_row(
        "agents alive at the end",
        f"{sampled['alive']:,} / {sampled['agents_in_state']:,}",
        f"incl. the {SMALL_CLUSTER_AGENTS} stopped small-cluster agents (lost)",
    )
    table.add_row(
        f"GetClusterState p50 / p99 (ms), {args.agents:,} agents",
        f"{percentile(lat, 0.5):.1f} / {percentile(lat, 0.99):.1f}",
        f"{len(lat)} calls, one at a time at {args.latency_hz} Hz; {sampled['reply_bytes']:,} B reply",
    )
    table.add_row("GetClusterState max / mean (ms)", f"{max(lat):.1f} / {statistics.fmean(lat):.1f}", "")
    table.add_row(
        "CPU during the swarm (cores)",
        f"{cpu[0]:.2f} / {sum(cpu[1:-1]):.2f} / {cpu[-1]:.2f}",
        "controller / swarm processes / this sampler",
    )
    Console(width=140).print(table)
    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"total runtime {wall_s:.0f} s; load average at the end {load_avg} (all processes); logs in {run_dir}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=15.0, help="length of each measurement")
    p.add_argument("--inflight", type=int, default=128, help="unary calls kept in flight by the client(s)")
    p.add_argument("--client-procs", type=int, default=1, choices=(1, 2), help="load-client processes")
    p.add_argument("--agents", type=int, default=1000, help="simulated agents for the heartbeat run")
    p.add_argument("--swarms", type=int, default=2, help="control_swarm.py processes sharing the agents")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="the controller's, in seconds")
    p.add_argument("--latency-hz", type=float, default=25.0, help="GetClusterState samples per second")
    # Internal modes: this script's own child processes.
    p.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("--load-method", help=argparse.SUPPRESS)
    p.add_argument("--payload-file", help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_echo:
        asyncio.run(serve_echo())
    elif args.load:
        payload = Path(args.payload_file).read_bytes()
        result = asyncio.run(
            load(
                args.load,
                args.load_method,
                payload,
                args.inflight,
                args.start_at,
                args.seconds,
                args.server_pid,
            )
        )
        print(json.dumps(result), flush=True)
    else:
        run(args)


if __name__ == "__main__":
    main()
