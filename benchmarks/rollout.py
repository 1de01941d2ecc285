"""Rollout overhead: generated tok/s of concurrent multi-turn trajectories through Libra's path
(agent loop → gRPC → rollout instance process → vLLM AsyncLLM) against calling vLLM's
`AsyncLLM.generate` directly, in this process, on the same prompts.

Both sides run the same work: the Libra run records every generation call (context and output
length); the direct run replays those calls — each trajectory's calls in order, trajectories
concurrently — with the same contexts and output lengths (greedy, EOS ignored, so the token
counts match exactly), on an engine built from the instance's own `engine_args` with the same
step-counting stat logger. Tool execution is instant on both sides; prompts are tokenized before
the measured runs. Ratio = Libra tok/s / direct tok/s; the target is >= 0.85 (under 15 %
overhead). Each repeat also reports the CPU time of the process tree by role (`ROLES`) and the
engine steps each side ran with their generated and prefilled tokens per step: on a shared host
the wall-time ratio swings with other programs' load, while the CPU-time ratio (direct / Libra)
and the step counts show what the path itself costs.

Measured (64 trajectories, 144 calls, 2,416 tokens per repeat; 10 interleaved repeats; 2-core
host shared with other work at load 8.7): tok/s ratio median 1.09 (quartiles 0.88-1.20, range
0.61-1.55); CPU ratio median 1.01 (quartiles 0.87-1.10, range 0.60-1.15), i.e. ~5 % more CPU on
average (0.684 s vs 0.650 s). Engine cores: 0.515 s vs 0.516 s on average, 67-87 steps vs 67-73
(the same tokens per step except in two repeats); the instance 0.12-0.20 s and the agent loop
and client 0.02-0.04 s, against 0.10-0.17 s for the direct side's vLLM frontend.

What it took (measured with py-spy --subprocesses, cProfile via --profile, and the step counts):
- generation calls share one long-lived GenerateStream per instance instead of a unary-stream
  call each (call setup, auth and handler per call; calls starting or finishing together share
  a message): the agent loop and client went from 0.08-0.09 s to 0.04-0.05 s per repeat (and to
  0.02-0.04 s once prompt tokenization left the measured window), the instance from
  0.21-0.31 s to 0.15-0.21 s; the Libra side's engine steps from 74-113 (direct: 67-68; both
  under py-spy) to about the direct side's count, since each turn reaches the engine sooner;
- the instance freezes its start-up heap (as vLLM's API server does): full garbage collections
  walked ~600k module objects, ~0.09 s per repeat (cProfile: 0.46 s over 5 repeats, landing in
  whatever allocated; 0.007 s after);
- the comparison itself: the direct side used to run vLLM's defaults, max_num_seqs 128 against
  the instance's 256 (13 % less engine-core CPU per step on this CPU at batches of <= 64), and
  vLLM's Prometheus logger (~0.8 ms of frontend CPU per step) which the instance drops.
Earlier: the instance no longer wakes per generated token (FINAL_ONLY outputs when nothing is
streamed) and runs without vLLM's Prometheus and console stat loggers.

Usage: python benchmarks/rollout.py [--trajectories 64] [--model DIR] [--repeats 10] [--profile DIR]
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

from libra.backends import BackendConfig, get_backend  # noqa: E402
from libra.rollout.config import InstanceConfig  # noqa: E402
from libra.rollout.engine import (  # noqa: E402
    EngineStatsLogger,
    configure_vllm_env,
    engine_args,
    keep_only_stat_logger,
)
from libra.rollout.instance_server import PROFILE_ENV, InstanceSpec, freeze_startup_heap  # noqa: E402

TOKEN = "benchmark-token"
MAX_MODEL_LEN = 1024


def _instance_config(model_dir: Path) -> InstanceConfig:
    return InstanceConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN).for_backend(get_backend("cpu"))


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
                InstanceSpec(
                    _instance_config(self.model_dir), BackendConfig("cpu"), address_file=str(address_file)
                ).to_argv(),
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

    def trajectories(self, count: int, prefix: str):
        """New trajectories, their prompts tokenized (data preparation, outside the measured
        runs: the direct side gets its prompts as token ids too)."""
        return _trajectories(self.tokenizer, count, prefix)

    async def run(self, trajectories):
        """Runs `trajectories`; returns (generated tokens, seconds, trajectories, calls)."""
        self.calls.clear()
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
        from vllm.v1.engine.async_llm import AsyncLLM

        # The instance's engine arguments exactly (vLLM's defaults differ: max_num_seqs 128, not
        # the instance's 256, which costs the engine core more per step on CPU), and one
        # step-counting stat logger in place of vLLM's console and Prometheus loggers (~0.8 ms
        # of frontend CPU per step, which only the direct side used to pay).
        self.stats = EngineStatsLogger(stats_window_s=5.0)
        self.engine = AsyncLLM.from_engine_args(
            engine_args(_instance_config(model_dir)), stat_loggers=[lambda *a, **k: self.stats]
        )
        keep_only_stat_logger(self.engine, self.stats)
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


ROLES = ("bench", "instance", "instance_core", "direct_core")
"""The processes of the tree: this one (agent loop and client while Libra runs, vLLM's frontend
while the direct side runs), the instance (gRPC server, engine wrapper, its vLLM frontend), and
the two engine cores."""


def _cpu_seconds(instance_pid: int | None = None) -> dict[str, float]:
    """CPU time used so far by this process and every process below it, by role (`ROLES`). Unlike
    wall time it hardly moves with the load other programs put on the host, so it shows the
    path's own cost even on a busy machine; the sides alternate, so the roles of the side not
    running show what idling costs."""
    me = psutil.Process()
    instance_tree = set()
    if instance_pid is not None:
        try:
            instance_tree = {p.pid for p in psutil.Process(instance_pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    totals = dict.fromkeys(ROLES, 0.0)
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        if process.pid == me.pid:
            role = "bench"
        elif process.pid == instance_pid:
            role = "instance"
        elif process.pid in instance_tree:
            role = "instance_core"
        else:
            role = "direct_core"
        totals[role] += times.user + times.system
    return totals


async def _measured(coro, instance_pid: int | None):
    """(result, wall seconds, CPU seconds by role of the whole process tree) of awaiting `coro`."""
    cpu, start = _cpu_seconds(instance_pid), time.perf_counter()
    result = await coro
    elapsed, after = time.perf_counter() - start, _cpu_seconds(instance_pid)
    return result, elapsed, {role: after[role] - cpu[role] for role in ROLES}


def _roles(cpu: dict[str, float]) -> str:
    return " ".join(f"{role} {cpu[role]:.2f}" for role in ROLES)


async def _compare(model_dir: Path, tokenizer, workdir: Path, count: int, repeats: int):
    """Both sides stay up the whole time and alternate, so that the host's varying load hits
    them alike; each repeat's ratio compares neighbouring runs of identical work. Greedy decoding
    makes every repeat's calls the same, so odd repeats run the direct side first (replaying the
    previous repeat's calls): neither side always runs right after the other. Returns the
    per-repeat wall-time ratios and CPU-time ratios (direct / Libra)."""
    libra = _LibraSide(model_dir, tokenizer, workdir)
    await libra.start()
    direct = _DirectSide(model_dir)
    pid = libra.process.pid
    client = libra.pool.get(0).client
    try:
        _, _, _, calls = await libra.run(libra.trajectories(count, "warm"))
        await direct.run(calls)
        # As the instance does after its start-up: full collections no longer walk the modules
        # loaded here (vLLM's frontend and the agent loop share this process, so both sides gain).
        freeze_startup_heap()
        _, idle_s, idle_cpu = await _measured(asyncio.sleep(2.0), pid)
        print(
            f"idle process tree: {sum(idle_cpu.values()) / idle_s:.3f} CPU s per s (counted in both sides' "
            f"CPU; by role: {_roles(idle_cpu)})",
            flush=True,
        )
        ratios, cpu_ratios = [], []
        for repeat in range(repeats):
            direct_first = repeat % 2 == 1
            direct_steps = (direct.stats.num_steps, direct.stats.num_prompt_tokens)
            if direct_first:
                (direct_tokens, _), direct_s, direct_cpu = await _measured(direct.run(calls), pid)
            batch = libra.trajectories(count, f"r{repeat}-")
            before = await client.stats()
            (tokens, _, trajectories, calls), libra_s, libra_cpu = await _measured(libra.run(batch), pid)
            after = await client.stats()
            if not direct_first:
                (direct_tokens, _), direct_s, direct_cpu = await _measured(direct.run(calls), pid)
            if direct_tokens != tokens:
                raise AssertionError(f"replay produced {direct_tokens} tokens, Libra {tokens}")
            ratios.append(direct_s / libra_s)
            cpu_ratios.append(sum(direct_cpu.values()) / sum(libra_cpu.values()))
            turns = sum(t.num_turns for t in trajectories)
            libra_steps = after.num_engine_steps - before.num_engine_steps
            libra_prefill = after.num_prompt_tokens - before.num_prompt_tokens
            direct_steps = (
                direct.stats.num_steps - direct_steps[0],
                direct.stats.num_prompt_tokens - direct_steps[1],
            )
            print(
                f"repeat {repeat}: {count} trajectories, {turns} turns, {len(calls)} generate calls "
                f"(one response message each), {tokens} generated tokens | "
                f"libra {tokens / libra_s:,.0f} tok/s ({libra_s:.2f} s, CPU {sum(libra_cpu.values()):.2f} s: "
                f"{_roles(libra_cpu)}; {libra_steps} engine steps, {tokens / max(libra_steps, 1):.1f} "
                f"generated + {libra_prefill / max(libra_steps, 1):.1f} prefilled tokens per step) | "
                f"direct vLLM {tokens / direct_s:,.0f} tok/s ({direct_s:.2f} s, CPU "
                f"{sum(direct_cpu.values()):.2f} s: {_roles(direct_cpu)}; {direct_steps[0]} engine steps, "
                f"{tokens / max(direct_steps[0], 1):.1f} generated + "
                f"{direct_steps[1] / max(direct_steps[0], 1):.1f} prefilled tokens per step) | "
                f"ratio {ratios[-1]:.3f}, CPU ratio {cpu_ratios[-1]:.3f}"
                f"{' (direct ran first)' if direct_first else ''}",
                flush=True,
            )
        return ratios, cpu_ratios
    finally:
        await libra.stop()
        direct.stop()


async def _profile(model_dir: Path, tokenizer, workdir: Path, count: int, repeats: int, out: Path) -> None:
    """Only the Libra side, `repeats` times after a warm-up, with cProfile on this process (agent
    loop and client) and on the instance (`LIBRA_INSTANCE_PROFILE`); prints where each spends."""
    import cProfile
    import pstats

    out.mkdir(parents=True, exist_ok=True)
    os.environ[PROFILE_ENV] = str(out / "instance.prof")
    libra = _LibraSide(model_dir, tokenizer, workdir)
    await libra.start()
    del os.environ[PROFILE_ENV]
    pid = libra.process.pid
    try:
        await libra.run(libra.trajectories(count, "warm"))
        freeze_startup_heap()
        profiler = cProfile.Profile()
        total = dict.fromkeys(ROLES, 0.0)
        for repeat in range(repeats):
            batch = libra.trajectories(count, f"p{repeat}-")
            profiler.enable()
            _, _, cpu = await _measured(libra.run(batch), pid)
            profiler.disable()
            total = {role: total[role] + cpu[role] for role in ROLES}
        profiler.dump_stats(out / "agent_loop.prof")
        print(f"CPU over {repeats} profiled runs (profilers included): {_roles(total)}", flush=True)
    finally:
        await libra.stop()
    print(f"instance garbage collection: {(out / 'instance.prof.gc').read_text().strip()}")
    for name in ("agent_loop.prof", "instance.prof"):
        print(f"== {name} (cumulative)")
        pstats.Stats(str(out / name)).sort_stats("cumulative").print_stats(45)
        print(f"== {name} (own time)")
        pstats.Stats(str(out / name)).sort_stats("tottime").print_stats(30)


def _spread(values: list[float]) -> str:
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return (
        f"median {statistics.median(values):.3f} (quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, "
        f"range {min(values):.3f}-{max(values):.3f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--model", help="a model folder with the tiny chat format (default: build one)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--profile", type=Path, help="profile the Libra side only (cProfile, both processes); stats go here"
    )
    args = parser.parse_args()
    os.environ.update(_engine_env())
    configure_vllm_env(InstanceConfig(model="unused").for_backend(get_backend("cpu")))
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="libra-bench-rollout-") as tmp:
        workdir = Path(tmp)
        model_dir = Path(args.model) if args.model else _build_model(workdir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if args.profile:
            profile = _profile(model_dir, tokenizer, workdir, args.trajectories, args.repeats, args.profile)
            asyncio.run(profile)
            return 0
        ratios, cpu_ratios = asyncio.run(
            _compare(model_dir, tokenizer, workdir, args.trajectories, args.repeats)
        )
    load = os.getloadavg()
    print(
        f"rollout path / direct vLLM tok/s: {_spread(ratios)} (target >= 0.85); CPU-time ratio "
        f"(direct / Libra, whole process tree): {_spread(cpu_ratios)}; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores"
    )
    return 0


def _build_model(workdir: Path) -> Path:
    from libra.tasks.tiny_model import make_tiny_model
    from tests.rollout.scripted_model import train_scripted_model

    return train_scripted_model(make_tiny_model(workdir / "random"), workdir / "scripted")


if __name__ == "__main__":
    sys.exit(main())
