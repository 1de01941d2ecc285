"""The controller killed (issue #10): `libra run` — the controller lives in the job's process — is
SIGKILLed after a checkpoint; its node agent and workers go with it; `libra run CONFIG --resume
RUN_DIR` restores model, optimizer, data position, router state and staleness gate from the last
checkpoint and runs to the end. Real processes through the CLI, a tiny batch.
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

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

NUM_STEPS = 6
KILL_AFTER_CHECKPOINT = 2
OVERRIDES = [
    f"job.num_steps={NUM_STEPS}",
    "job.prompts_per_step=4",
    "job.group_size=4",
    "training.train_batch_size=16",
    "training.num_minibatches=1",
    f"job.checkpoint_interval={KILL_AFTER_CHECKPOINT}",
    "job.live_progress=false",
    "job.eval_tasks=0",
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
    checkpoint = run_dir / "checkpoints" / f"step_{KILL_AFTER_CHECKPOINT:06d}" / "job_state.json"
    deadline = time.monotonic() + 400
    while not checkpoint.is_file():
        assert job.poll() is None, f"the job ended before its checkpoint (exit {job.returncode})"
        assert time.monotonic() < deadline, "no checkpoint within 400 s"
        time.sleep(0.2)
    agents = _children(job.pid)
    job.send_signal(signal.SIGKILL)
    job.wait()
    steps_before = read_jsonl(run_dir / "metrics.jsonl")
    # The agent dies with the controller (parent-death signal), and its workers with it.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in agents) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in agents if _alive(pid)]
    resumed = subprocess.run(
        _libra_run("--resume", str(run_dir)), env=env, capture_output=True, text=True, timeout=450
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {
        "run_dir": run_dir,
        "steps_before": steps_before,
        "agents": agents,
        "orphans": orphans,
        "state": json.loads(checkpoint.read_text()),
    }


def test_the_killed_controllers_workers_do_not_outlive_it(killed_and_resumed):
    assert killed_and_resumed["agents"], "the job had no child process to check"
    assert killed_and_resumed["orphans"] == []


def test_resume_continues_from_the_last_checkpoint_to_the_end(killed_and_resumed):
    run_dir = killed_and_resumed["run_dir"]
    events = read_jsonl(run_dir / "events.jsonl")
    resume = [e for e in events if e["kind"] == "resume"]
    assert len(resume) == 1 and f"version {KILL_AFTER_CHECKPOINT}" in resume[0]["message"]
    steps = [s["step"] for s in read_jsonl(run_dir / "metrics.jsonl")]
    before = len(killed_and_resumed["steps_before"])
    # Steps recorded after the checkpoint by the killed run are run again from the checkpoint.
    assert before >= KILL_AFTER_CHECKPOINT
    assert steps[before:] == list(range(KILL_AFTER_CHECKPOINT + 1, NUM_STEPS + 1))
    assert (run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}" / "job_state.json").is_file()
    # The data position came back: the resumed run drew from where the checkpoint stood.
    final = json.loads((run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}" / "job_state.json").read_text())
    assert final["data_position"] > killed_and_resumed["state"]["data_position"]
    assert final["version"] == NUM_STEPS
    # The instances of the resumed run got the checkpoint's weights: their logprobs agree with
    # the trainer's.
    resumed_steps = read_jsonl(run_dir / "metrics.jsonl")[before:]
    assert all(s["logprob_abs_diff"] < 1e-3 for s in resumed_steps if s["num_current_tokens"] > 0)


def test_no_trajectory_of_the_resumed_run_is_lost(killed_and_resumed):
    run_dir = killed_and_resumed["run_dir"]
    samples = read_jsonl(run_dir / "samples.jsonl")
    resumed_at = next(e["time_s"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume")
    after = [s for s in samples if s["finished_s"] >= resumed_at]
    assert len(after) >= (NUM_STEPS - KILL_AFTER_CHECKPOINT) * 16
    assert not [s for s in after if s["outcome"] in LOST_OUTCOMES]
