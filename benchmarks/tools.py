"""Sandboxed tool calls per second against spawning a bare `python -c` per call, in the same run,
and the latency of a trivial sandboxed call.

    python benchmarks/tools.py [--calls 400] [--workers 2] [--concurrency 2]

Throughput: `--calls` trivial calls (`print(1)`) with `--concurrency` callers, through the
sandbox pool (fork of a warm worker + rlimits + audit hook + uid sweep) and through
`asyncio.create_subprocess_exec(python, "-c", ...)` (a fresh interpreter, no isolation at all).
Latency: the same call made one at a time through the pool (p50 / p99). Everything runs on this
machine's cores alongside whatever else is running; say so when quoting the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from libra.rollout.tools.config import SandboxConfig
from libra.rollout.tools.sandbox import SandboxPool
from libra.trajectory import ToolStatus

CODE = "print(1)"


async def throughput(call, num_calls: int, concurrency: int) -> float:
    """Calls per second of `call()` issued by `concurrency` concurrent callers."""
    remaining = iter(range(num_calls))

    async def caller():
        for _ in remaining:
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return num_calls / (time.perf_counter() - start)


async def bare_python_call() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CODE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, _ = await process.communicate()
    assert process.returncode == 0 and stdout == b"1\n"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    async with SandboxPool(SandboxConfig(num_workers=args.workers)) as pool:

        async def sandbox_call() -> None:
            result = await pool.run(CODE)
            assert result.status == ToolStatus.SUCCESS and result.stdout == "1\n", result

        for _ in range(20):  # warm-up: page in the workers' forks
            await sandbox_call()
        sandbox_rate = await throughput(sandbox_call, args.calls, args.concurrency)
        bare_rate = await throughput(bare_python_call, args.calls, args.concurrency)
        latencies = []
        for _ in range(args.calls):
            start = time.perf_counter()
            await sandbox_call()
            latencies.append(time.perf_counter() - start)
        layers = ", ".join(pool.layers)

    print(f"machine: {os.cpu_count()} cores; sandbox layers: {layers}")
    print(f"calls: {args.calls}, concurrency: {args.concurrency}, sandbox workers: {args.workers}")
    print(f"sandboxed calls/s:            {sandbox_rate:8.1f}")
    print(f"bare `python -c` spawns/s:    {bare_rate:8.1f}")
    print(f"ratio sandbox / bare:         {sandbox_rate / bare_rate:8.2f}x")
    print(f"trivial call latency p50:     {statistics.median(latencies) * 1e3:8.2f} ms")
    print(f"trivial call latency p99:     {percentile(latencies, 0.99) * 1e3:8.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
