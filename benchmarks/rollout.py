"""Rollout overhead: generated tok/s of concurrent multi-turn trajectories through Libra's path
(agent loop → gRPC → rollout instance process → vLLM AsyncLLM) against calling vLLM's
`AsyncLLM.generate` directly, in this process, on the same prompts.

Both sides run the same work: the Libra run records every generation call (context and output
length); the direct run replays those calls — each trajectory's calls in order, trajectories
concurrently — with the same contexts and output lengths (greedy, EOS ignored, so the token
counts match exactly). Tool execution is instant on both sides. Ratio = Libra tok/s / direct
tok/s; the target is >= 0.85 (under 15 % overhead). Each repeat also reports the CPU time the
whole process tree spent (this process, the instance and both engine cores): on a shared host the
wall-time ratio swings with other programs' load, while the CPU-time ratio (direct / Libra) shows
what the path itself costs. Where the Libra side's extra CPU goes (per-process CPU of 64
trajectories, same engine arguments on both sides, 2-core host at load 2-7): the instance's
engine core 0.15-0.3 s more than the direct one (likely more, smaller engine steps: each turn
reaches the engine a round trip later; not counted), the instance frontend 0.1-0.25 s more than
the direct frontend (grpc.aio's unary-stream call, ~0.5 ms of CPU per call client and server
together, and the engine wrapper), the agent loop and client 0.1-0.2 s. The
instance no longer wakes per generated token (FINAL_ONLY outputs when nothing is streamed) and
runs without vLLM's Prometheus and console stat loggers.

Usage: python benchmarks/rollout.py [--trajectories 64] [--model DIR] [--repeats 10]
Without --model it builds the tiny model and fine-tunes it to call the calculator (a few seconds).
The machine is shared: the report prints the load average, and what ran concurrently was the
benchmark alone plus whatever else the host runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra.backends import get_backend  # noqa: E402
from libra.rollout.config import InstanceConfig  # noqa: E402
from libra.rollout.engine import configure_vllm_env  # noqa: E402
from libra.rollout.instance_server import instance_argv  # noqa: E402

TOKEN = "benchmark-token"
MAX_MODEL_LEN = 1024


def _engine_env() -> dict[str, str]:
    """Both engines on CPU slot 0 of two (one core, one OpenMP thread), as the cpu backend gives a
    worker: the same threads and binding on both sides, and the other core left to the frontends
    and the agent loop. (Two OpenMP threads stall badly when other processes share the cores.)"""
    return get_backend("cpu", num_devices=2).worker_env([0])


def _trajectories(tokenizer, count: int, prefix: str):
    from libra.trajectory import Trajectory
    from tests.rollout.scripted_model import CALCULATOR_QUESTIONS, LOOPING_QUESTION, scripted_chat

    chat = scripted_chat(tokenizer)
    questions = [f"What is {q}?" for q in CALCULATOR_QUESTIONS] + [LOOPING_QUESTION]
    picked = [questions[i % len(questions)] for i in range(count)]
    return [
        Trajectory(f"{prefix}{i}", q, "g", chat.prompt_ids([{"role": "user", "content": q}]))
        for i, q in enumerate(picked)
    ]


class _LibraSide:
    """A rollout instance process and the agent loop over it."""

    def __init__(self, model_dir: Path, tokenizer, workdir: Path):
        self.model_dir, self.tokenizer, self.workdir = model_dir, tokenizer, workdir
        self.process: subprocess.Popen | None = None

    async def start(self) -> None:
        from libra.rollout import AgentLoop, AgentLoopConfig, InstancePool
        from libra.rollout.tools import Calculator
        from libra.scheduler import CmlfqConfig, LeastLoadRouter
        from tests.rollout.scripted_model import scripted_chat

        address_file = self.workdir / "instance.addr"
        env = {**os.environ, **_engine_env(), "LIBRA_TOKEN": TOKEN}
        with open(self.workdir / "instance.log", "wb") as log:
            self.process = subprocess.Popen(
                instance_argv(
                    InstanceConfig(model=str(self.model_dir), max_model_len=MAX_MODEL_LEN), address_file
                ),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while not address_file.is_file():
            if self.process.poll() is not None:
                raise RuntimeError(f"instance exited: see {self.workdir / 'instance.log'}")
            await asyncio.sleep(0.1)
        self.pool = InstancePool(LeastLoadRouter(), TOKEN, CmlfqConfig())
        await self.pool.add(0, address_file.read_text().strip())
        self.calls = []
        self.loop = AgentLoop(
            self.pool,
            scripted_chat(self.tokenizer),
            [Calculator()],
            AgentLoopConfig(temperature=0.0, max_turns=3, max_tokens_per_turn=256),
            on_call=self.calls.append,
        )

    async def run(self, count: int, prefix: str):
        """Runs `count` trajectories; returns (generated tokens, seconds, trajectories, calls)."""
        self.calls.clear()
        trajectories = _trajectories(self.tokenizer, count, prefix)
        start = time.perf_counter()
        await self.loop.run_all(trajectories)
        elapsed = time.perf_counter() - start
        return sum(t.num_generated_tokens for t in trajectories), elapsed, trajectories, list(self.calls)

    async def stop(self) -> None:
        await self.pool.close()
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)


class _DirectSide:
    """vLLM's AsyncLLM in this process, replaying recorded calls."""

    def __init__(self, model_dir: Path):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0
            )
        )
        self._ids = iter(range(1 << 40))

    async def _replay(self, trajectory_calls) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        produced = 0
        for call in trajectory_calls:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=len(call.output_ids),
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            prompt = TokensPrompt(prompt_token_ids=list(call.context_ids))
            async for out in self.engine.generate(prompt, params, f"d{next(self._ids)}"):
                if out.finished:
                    produced += len(out.outputs[0].token_ids)
        return produced

    async def run(self, calls):
        """Replays each trajectory's calls in order, trajectories concurrently; (tokens, seconds)."""
        grouped: dict[str, list] = {}
        for call in calls:
            grouped.setdefault(call.trajectory_id, []).append(call)
        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(self._replay(c) for c in grouped.values())))
        return produced, time.perf_counter() - start

    def stop(self) -> None:
        self.engine.shutdown()


def _cpu_seconds() -> float:
    """CPU time used so far by this process and every process below it (the instance and the
    engine-core processes of both sides). Unlike wall time it hardly moves with the load other
    programs put on the host, so it shows the path's own cost even on a busy machine."""
    total = 0.0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


async def _measured(coro):
    """(result, wall seconds, CPU seconds of the whole process tree) of awaiting `coro`."""
    cpu, start = _cpu_seconds(), time.perf_counter()
    result = await coro
    return result, time.perf_counter() - start, _cpu_seconds() - cpu


async def _compare(model_dir: Path, tokenizer, workdir: Path, count: int, repeats: int):
    """Both sides stay up the whole time and alternate, so that the host's varying load hits
    them alike; each repeat's ratio compares neighbouring runs of identical work. Greedy decoding
    makes every repeat's calls the same, so odd repeats run the direct side first (replaying the
    previous repeat's calls): neither side always runs right after the other. Returns the
    per-repeat wall-time ratios and CPU-time ratios (direct / Libra)."""
    libra = _LibraSide(model_dir, tokenizer, workdir)
    await libra.start()
    direct = _DirectSide(model_dir)
    try:
        _, _, _, calls = await libra.run(count, "warm")
        await direct.run(calls)
        _, idle_s, idle_cpu = await _measured(asyncio.sleep(2.0))
        print(
            f"idle process tree: {idle_cpu / idle_s:.3f} CPU s per s (counted in both sides' CPU)", flush=True
        )
        ratios, cpu_ratios = [], []
        for repeat in range(repeats):
            direct_first = repeat % 2 == 1
            if direct_first:
                (direct_tokens, _), direct_s, direct_cpu = await _measured(direct.run(calls))
            (tokens, _, trajectories, calls), libra_s, libra_cpu = await _measured(
                libra.run(count, f"r{repeat}-")
            )
            if not direct_first:
                (direct_tokens, _), direct_s, direct_cpu = await _measured(direct.run(calls))
            if direct_tokens != tokens:
                raise AssertionError(f"replay produced {direct_tokens} tokens, Libra {tokens}")
            ratios.append(direct_s / libra_s)
            cpu_ratios.append(direct_cpu / libra_cpu)
            turns = sum(t.num_turns for t in trajectories)
            print(
                f"repeat {repeat}: {count} trajectories, {turns} turns, {len(calls)} generate calls "
                f"(one response message each), {tokens} generated tokens | "
                f"libra {tokens / libra_s:,.0f} tok/s ({libra_s:.2f} s, CPU {libra_cpu:.2f} s) | "
                f"direct vLLM {tokens / direct_s:,.0f} tok/s ({direct_s:.2f} s, CPU {direct_cpu:.2f} s) | "
                f"ratio {ratios[-1]:.3f}, CPU ratio {cpu_ratios[-1]:.3f}"
                f"{' (direct ran first)' if direct_first else ''}",
                flush=True,
            )
        return ratios, cpu_ratios
    finally:
        await libra.stop()
        direct.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--model", help="a model folder with the tiny chat format (default: build one)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    os.environ.update(_engine_env())
    configure_vllm_env(InstanceConfig(model="unused"))
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="libra-bench-rollout-") as tmp:
        workdir = Path(tmp)
        model_dir = Path(args.model) if args.model else _build_model(workdir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ratios, cpu_ratios = asyncio.run(
            _compare(model_dir, tokenizer, workdir, args.trajectories, args.repeats)
        )
    load = os.getloadavg()
    print(
        f"rollout path / direct vLLM tok/s: median {statistics.median(ratios):.3f}, best {max(ratios):.3f} "
        f"(target >= 0.85); CPU-time ratio (direct / Libra, whole process tree): median "
        f"{statistics.median(cpu_ratios):.3f}; load average {load[0]:.2f} on {os.cpu_count()} cores"
    )
    return 0


def _build_model(workdir: Path) -> Path:
    from libra.tasks.tiny_model import make_tiny_model
    from tests.rollout.scripted_model import train_scripted_model

    return train_scripted_model(make_tiny_model(workdir / "random"), workdir / "scripted")


if __name__ == "__main__":
    sys.exit(main())
