"""The controller killed (issues #10, #22): `libra run` — the controller lives in the job's
process — is SIGKILLed after step 2, before its first periodic checkpoint (every 10 steps); its
node agent and workers go with it; `libra run CONFIG --resume RUN_DIR` restores the checkpoint of
the starting state (model, optimizer, data position, router state and staleness gate) and runs to
the end. The run folder then holds every step and trajectory id once, one held-out evaluation
before and one after, and what the killed run recorded after the checkpoint under `superseded/`.
Real processes through the CLI, a tiny batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libra.job.recorder import read_jsonl

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(600)]

NUM_STEPS = 5
KILL_AFTER_STEP = 2
OVERRIDES = [
    f"job.num_steps={NUM_STEPS}",
    "job.prompts_per_step=4",
    "job.group_size=4",
    "training.num_minibatches=1",
    "job.checkpoint_interval=10",
    "job.live_progress=false",
    "job.eval_tasks=2",
    "job.eval_samples=2",
    "job.planner=false",
    # The 3-slot TP-1 layout: what this test exercises does not need the default's TP-2
    # instance, and it starts faster.
    "backend.num_devices=3",
    "job.rollout_tp_sizes=1,1",
]
if os.environ.get("LIBRA_JOB_TEST_MODEL"):
    OVERRIDES.append(f"job.model={os.environ['LIBRA_JOB_TEST_MODEL']}")
LOST_OUTCOMES = {"error", "no_instance", "aborted", "running"}


def _libra_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "libra.cli", "run", "configs/tiny_cpu.py", *args, *OVERRIDES]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent, the killed job, is gone).
    return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()


def _children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(proc.name))
    return found


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("crash") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(_libra_run(f"run_dir={run_dir}"), env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 400
    while len(read_jsonl(run_dir / "metrics.jsonl")) < KILL_AFTER_STEP:
        assert job.poll() is None, f"the job ended before step {KILL_AFTER_STEP} (exit {job.returncode})"
        assert time.monotonic() < deadline, f"no step {KILL_AFTER_STEP} within 400 s"
        time.sleep(0.2)
    agents = _children(job.pid)
    job.send_signal(signal.SIGKILL)
    job.wait()
    checkpoints = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step_*/job_state.json"))
    steps_before = read_jsonl(run_dir / "metrics.jsonl")
    # The agent dies with the controller (parent-death signal), and its workers with it.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in agents) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in agents if _alive(pid)]
    state = json.loads((run_dir / "checkpoints" / "step_000000" / "job_state.json").read_text())
    resumed = subprocess.run(
        _libra_run("--resume", str(run_dir)), env=env, capture_output=True, text=True, timeout=450
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {
        "run_dir": run_dir,
        "checkpoints": checkpoints,
        "steps_before": steps_before,
        "agents": agents,
        "orphans": orphans,
        "state": state,
    }


def test_the_killed_controllers_workers_do_not_outlive_it(killed_and_resumed):
    assert killed_and_resumed["agents"], "the job had no child process to check"
    assert killed_and_resumed["orphans"] == []


def test_a_run_killed_before_its_first_periodic_checkpoint_resumes_from_its_start(killed_and_resumed):
    run_dir = killed_and_resumed["run_dir"]
    assert killed_and_resumed["checkpoints"] == ["step_000000"]
    resume = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"]
    assert len(resume) == 1 and "version 0" in resume[0]["message"]
    assert (run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}" / "job_state.json").is_file()
    final = json.loads((run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}" / "job_state.json").read_text())
    assert final["version"] == NUM_STEPS
    assert final["data_position"] > killed_and_resumed["state"]["data_position"]
    # The instances of the resumed run got the checkpoint's weights: their logprobs agree with
    # the trainer's.
    assert all(
        s["logprob_abs_diff"] < 1e-3 for s in read_jsonl(run_dir / "metrics.jsonl") if s["num_current_tokens"]
    )


def test_after_the_resume_every_step_and_trajectory_is_recorded_once(killed_and_resumed):
    run_dir = killed_and_resumed["run_dir"]
    assert len(killed_and_resumed["steps_before"]) >= KILL_AFTER_STEP
    assert [s["step"] for s in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, NUM_STEPS + 1))
    assert not [s for s in read_jsonl(run_dir / "samples.jsonl") if s["outcome"] in LOST_OUTCOMES]
    for name in ("samples", "trajectories"):
        ids = [r["trajectory_id"] for r in read_jsonl(run_dir / f"{name}.jsonl")]
        assert len(ids) == len(set(ids)) >= NUM_STEPS * 16, name
    # What the killed run recorded after the checkpoint is kept aside, not mixed in.
    superseded = [s["step"] for s in read_jsonl(run_dir / "superseded" / "metrics.jsonl")]
    assert superseded == [s["step"] for s in killed_and_resumed["steps_before"]]
    evaluations = read_jsonl(run_dir / "evaluations.jsonl")
    assert [(e["when"], e["version"]) for e in evaluations] == [("before", 0), ("after", NUM_STEPS)]
    assert f"- steps: {NUM_STEPS};" in (run_dir / "report.md").read_text()
