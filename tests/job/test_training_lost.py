"""The node agent that hosts the train rank killed (issue #22): in the embedded default that agent
holds every device, so no training layout can survive it. The job must end promptly with a
message naming the train rank and agent lost, a `training_lost` event and a written report; the
run folder stays resumable from its last checkpoint, and the resumed run rolls the groups that
were unfinished at that checkpoint out again under their ids, records every step and trajectory
once, and finishes. Real processes through the CLI, a tiny batch.
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
from tests.job.test_controller_kill import LOST_OUTCOMES, _alive, _children

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(600)]

NUM_STEPS = 5
CHECKPOINT_INTERVAL = 2
KILL_AFTER_STEP = 3
OVERRIDES = [
    f"job.num_steps={NUM_STEPS}",
    "job.prompts_per_step=4",
    "job.group_size=4",
    "training.num_minibatches=1",
    f"job.checkpoint_interval={CHECKPOINT_INTERVAL}",
    "job.live_progress=false",
    "job.eval_tasks=0",
    "job.planner=false",
    "backend.num_devices=3",
    "job.rollout_tp_sizes=1,1",
]
if os.environ.get("LIBRA_JOB_TEST_MODEL"):
    OVERRIDES.append(f"job.model={os.environ['LIBRA_JOB_TEST_MODEL']}")


def _libra_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "libra.cli", "run", "configs/tiny_cpu.py", *args, *OVERRIDES]


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = _children(frontier.pop())
        found += children
        frontier += children
    return found


@pytest.fixture(scope="module")
def lost_and_resumed(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("lost") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        _libra_run(f"run_dir={run_dir}"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 400
    while len(read_jsonl(run_dir / "metrics.jsonl")) < KILL_AFTER_STEP:
        assert job.poll() is None, f"the job ended before step {KILL_AFTER_STEP}: {job.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {KILL_AFTER_STEP} within 400 s"
        time.sleep(0.2)
    (agent,) = [pid for pid in _children(job.pid) if b"agent" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    workers = _descendants(agent)
    os.kill(agent, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        _, stderr = job.communicate(timeout=180)
    finally:
        job.kill()
    ended_after_s = time.monotonic() - killed_at
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    lost = {
        "returncode": job.returncode,
        "stderr": stderr,
        "ended_after_s": ended_after_s,
        "orphans": [pid for pid in workers if _alive(pid)],
        "events": read_jsonl(run_dir / "events.jsonl"),
        "report": (run_dir / "report.md").read_text() if (run_dir / "report.md").is_file() else "",
    }
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*/job_state.json"))
    state = json.loads(checkpoints[-1].read_text())
    resumed = subprocess.run(
        _libra_run("--resume", str(run_dir)), env=env, capture_output=True, text=True, timeout=450
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"run_dir": run_dir, "lost": lost, "state": state}


def test_losing_the_train_ranks_host_ends_the_job_naming_what_was_lost(lost_and_resumed):
    lost = lost_and_resumed["lost"]
    assert lost["returncode"] == 1, lost["stderr"][-3000:]
    message = lost["stderr"].strip().splitlines()[-1]
    assert message.startswith("libra run: training lost during"), lost["stderr"][-3000:]
    assert "train rank train-0 on agent" in message and "--resume" in message
    assert lost["ended_after_s"] < 120
    (event,) = [e for e in lost["events"] if e["kind"] == "training_lost"]
    assert event["lost"] and event["checkpoint"].endswith(f"step_{CHECKPOINT_INTERVAL:06d}")
    assert "training_lost" in lost["report"] and f"- steps: {KILL_AFTER_STEP}" in lost["report"]
    assert lost["orphans"] == []


def test_the_lost_run_resumes_with_every_step_and_trajectory_once(lost_and_resumed):
    run_dir, state = lost_and_resumed["run_dir"], lost_and_resumed["state"]
    assert state["version"] == CHECKPOINT_INTERVAL
    assert [s["step"] for s in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, NUM_STEPS + 1))
    samples = read_jsonl(run_dir / "samples.jsonl")
    ids = [s["trajectory_id"] for s in samples]
    assert len(ids) == len(set(ids)) >= NUM_STEPS * 16
    assert not [s for s in samples if s["outcome"] in LOST_OUTCOMES]
    # The groups in flight at the checkpoint (asynchronous rollout runs ahead of training) are
    # rolled out again under their ids, before any new draw, and trained on.
    unfinished = [index for index, _ in state["unfinished_groups"]]
    assert unfinished, "no group was in flight at the checkpoint; the test no longer checks relaunch"
    events = read_jsonl(run_dir / "events.jsonl")
    # The timeline keeps the fault; the resume follows it.
    assert [e["kind"] for e in events if e["kind"] in ("training_lost", "resume")] == [
        "training_lost",
        "resume",
    ]
    resume = next(e for e in events if e["kind"] == "resume")
    assert resume["rolled_out_again"] == unfinished
    trained_groups = {s["trajectory_id"].split("-")[0] for s in samples}
    assert {f"g{index}" for index in unfinished} <= trained_groups
