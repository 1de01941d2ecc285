"""A resumed run's planner starts from the trajectories the stopped run recorded up to its
checkpoint, not from the launch's seed request: the default job (planner on) for two steps, its
last checkpoint removed (as if it had stopped before writing it), then resumed from step 1 to a
third step through the CLI. Real processes, a tiny batch, about 2 minutes."""

from __future__ import annotations

import json
import os
import shutil
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
    "job.checkpoint_interval=1",
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


def test_the_resumed_planner_starts_from_the_trajectories_up_to_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    _run(run_dir, 2)
    total = len(read_traces(run_dir / "trajectories.jsonl"))
    shutil.rmtree(run_dir / "checkpoints" / "step_000002")
    state = json.loads((run_dir / "checkpoints" / "step_000001" / "job_state.json").read_text())
    with open(run_dir / "trajectories.jsonl", "rb") as f:
        up_to_checkpoint = f.read(state["records"]["trajectories"]).count(b"\n")
    assert 16 <= up_to_checkpoint < total
    _run(run_dir, 3, "--resume", str(run_dir))
    (resume,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"]
    # What was recorded after the checkpoint moved aside first: the planner never sees it.
    assert resume["planner_history"] == up_to_checkpoint
    assert [s["step"] for s in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
