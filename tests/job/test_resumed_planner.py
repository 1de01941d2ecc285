"""A resumed run's planner starts from the trajectories the stopped run recorded up to its
checkpoint, not from the launch's seed request: the default job (planner on) for two steps, then
resumed for a third through the CLI. Real processes, a tiny batch, about 2 minutes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from libra.job.recorder import read_jsonl
from libra.trace import read_traces

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(600)]

OVERRIDES = [
    "job.prompts_per_step=4",
    "job.group_size=4",
    "training.num_minibatches=1",
    "job.live_progress=false",
    "job.eval_tasks=0",
]
if os.environ.get("LIBRA_JOB_TEST_MODEL"):
    OVERRIDES.append(f"job.model={os.environ['LIBRA_JOB_TEST_MODEL']}")


def _run(run_dir, steps: int, *args: str) -> None:
    argv = [sys.executable, "-m", "libra.cli", "run", "configs/tiny_cpu.py", *args, f"run_dir={run_dir}"]
    done = subprocess.run(
        [*argv, *OVERRIDES, f"job.num_steps={steps}"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_resumed_planner_starts_from_the_stopped_runs_trajectories(tmp_path):
    run_dir = tmp_path / "run"
    _run(run_dir, 2)
    recorded = list(read_traces(run_dir / "trajectories.jsonl"))
    assert len(recorded) >= 2 * 16
    _run(run_dir, 3, "--resume", str(run_dir))
    (resume,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"]
    assert resume["planner_history"] == len(recorded)
    assert [s["step"] for s in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
