"""Check 6: five steps of the tiny job (`configs/tiny_cpu.py`) on the backend, as a user runs it
(`libra run`): the controller, a node agent, a Megatron train rank and a vLLM instance on two
device slots (on a single GPU: both on it, each with its memory share), the tiny Qwen3 policy on
a few math rows, ending with the run's report."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from libra.checks.context import CheckContext
from libra.checks.result import CheckResult

NAME = "job"
NUM_STEPS = 5
TIMEOUT_S = 600
"""About 2 minutes on 2 CPU cores; below the CPU test's budget for the whole check."""
LOST_OUTCOMES = {"error", "no_instance", "aborted", "running"}
"""Outcomes of trajectories the job failed to finish (the rest ended by the model or a budget)."""
PROBLEMS = [("What is 17 + 25?", "42"), ("Compute 6 * 7 - 12.", "30"), ("What is 2 to the power 10?", "1024")]
INSTRUCTION = "Solve the problem. The last line of your response should be of the form Answer: $Answer"


def overrides(ctx: CheckContext, run_dir: Path, dataset: Path) -> list[str]:
    """The tiny job on two slots of the backend: the planner's layout there is a train rank and
    one TP-1 instance. On an accelerator the two share device 0 (`backend.slots_per_device=2`),
    the instance taking a third of its memory, and both run bf16 (the production dtype)."""
    common = [
        f"run_dir={run_dir}",
        f"backend.name={ctx.backend_name}",
        f"job.model={ctx.tiny_model()}",
        f"tasks.dataset_path={dataset}",
        f"job.num_steps={NUM_STEPS}",
        "job.rollout_tp_sizes=",
        # 4 groups of 4 a step: a short check, still more trajectories than the instance batches.
        "job.prompts_per_step=4",
        "job.group_size=4",
        "job.eval_tasks=0",
        "job.checkpoint_interval=0",
        "job.live_progress=false",
    ]
    if ctx.backend_name == "cpu":
        return [*common, "backend.num_devices=2"]
    return [
        *common,
        "backend.slots_per_device=2",
        "rollout.instance.gpu_memory_utilization=0.3",
        "rollout.instance.dtype=bfloat16",
        "training.dtype=bfloat16",
    ]


def run(ctx: CheckContext) -> CheckResult:
    ctx.stop_instance()  # the job's own instance and train rank need device 0
    run_dir = ctx.workdir / "job"
    dataset = _write_dataset(ctx.workdir / "math.jsonl")
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.py"
    argv = [sys.executable, "-m", "libra.cli", "run", str(config), *overrides(ctx, run_dir, dataset)]
    log = ctx.workdir / "job.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
    wall = time.perf_counter() - started
    if code != 0:
        tail = log.read_text(errors="replace")[-1500:]
        return CheckResult(NAME, False, f"`libra run` exited {code} after {wall:.0f} s (log {log}):\n{tail}")
    steps = _read_jsonl(run_dir / "metrics.jsonl")
    samples = _read_jsonl(run_dir / "samples.jsonl")
    lost = [s["trajectory_id"] for s in samples if s["outcome"] in LOST_OUTCOMES]
    tokens = sum(s["generated_tokens"] for s in steps)
    trained_rate = tokens / max(sum(s["step_time_s"] for s in steps), 1e-9)
    report = run_dir / "report.md"
    values: dict[str, float | int | str] = {
        "steps": len(steps),
        "trajectories": len(samples),
        "lost": len(lost),
        "trained_tokens_per_s": trained_rate,
        "wall_s": wall,
    }
    figure = (
        f"{len(steps)} steps in {wall:.0f} s ({len(samples)} trajectories, {len(lost)} lost), "
        f"{trained_rate:,.0f} trained tok/s, report {'written' if report.is_file() else 'MISSING'}"
    )
    passed = len(steps) == NUM_STEPS and not lost and report.is_file() and tokens > 0
    return CheckResult(NAME, passed, figure, values)


def _write_dataset(path: Path) -> Path:
    """A few DAPO-Math-shaped rows: the random policy earns no reward on them, but every part of
    the job runs."""
    with open(path, "w") as f:
        for index, (question, answer) in enumerate(PROBLEMS):
            row = {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}],
                "reward_model": {"ground_truth": answer, "style": "rule"},
                "extra_info": {"index": index},
            }
            f.write(json.dumps(row) + "\n")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )
