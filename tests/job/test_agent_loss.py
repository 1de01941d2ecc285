"""A node agent killed mid-run (issue #10's fault tolerance): two agents of 2 CPU slots each, the
job's own (the train rank on device 0, a TP-1 instance on device 1) and a second one started by
the test (a TP-1 instance on device 2). The test SIGKILLs the second agent; its instance dies with
it. The controller must detect the agent's loss (missed heartbeats), the job must reroute the
instance's trajectories, not restart it on the dead node, drop it from the plan (the planner
reconciled to the remaining devices) and finish every step with no trajectory lost. Once the job
has ended, nothing that ran under a worker guard (the killed agent's vLLM engine among them) may
still run, and no /dev/shm file those processes used may remain.

Needs the cached warm-started policy (`tests/job/test_default_run.py`) and about two minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from libra.control.client import ClusterClient
from libra.control.config import ControlConfig
from libra.control.types import AgentState
from libra.job.recorder import read_jsonl
from tests.job.driven_job import LOST_OUTCOMES, run_driven_job
from tests.job.leftovers import RunWatch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start]

NUM_STEPS = 30
KILL_AFTER_STEP = 2
OVERRIDES = [
    f"job.num_steps={NUM_STEPS}",
    "job.prompts_per_step=2",
    "job.group_size=4",
    "job.checkpoint_interval=0",
    "job.live_progress=false",
    "job.num_agents=2",
    "backend.num_devices=2",
    "job.rollout_tp_sizes=1,1",  # one TP-1 instance on each agent
    "planner.policy.auto_apply=false",
]


def _second_agent(run_dir: Path, fault: dict) -> None:
    """Starts the second agent once the job's own registered; kills it after KILL_AFTER_STEP."""
    while not (run_dir / "controller.addr").is_file() or not (run_dir / "token").is_file():
        if fault.get("stop"):
            return
        time.sleep(0.1)
    address = (run_dir / "controller.addr").read_text().strip()
    token = (run_dir / "token").read_text().strip()
    with ClusterClient(address, token, ControlConfig()) as client:
        while not [a for a in client.cluster_state().agents if a.state == AgentState.ALIVE]:
            if fault.get("stop"):
                return
            time.sleep(0.2)
        known = {a.agent_id for a in client.cluster_state().agents}
        argv = [sys.executable, "-m", "libra.cli", "agent", "--controller", address]
        argv += [f"run_dir={run_dir / 'agent-b'}", "backend.name=cpu", "backend.num_devices=2"]
        with open(run_dir / "logs" / "agent-b.log", "ab") as log:
            agent = subprocess.Popen(
                argv, env={**os.environ, "LIBRA_TOKEN": token}, stdout=log, stderr=subprocess.STDOUT
            )
        fault["process"] = agent
        while len(read_jsonl(run_dir / "metrics.jsonl")) < KILL_AFTER_STEP:
            if fault.get("stop"):
                return
            time.sleep(0.2)
        fault["agent_id"] = next(a.agent_id for a in client.cluster_state().agents if a.agent_id not in known)
    agent.kill()  # SIGKILL: no goodbye; its workers die with it (parent-death signal)
    agent.wait()
    fault["killed_at_step"] = len(read_jsonl(run_dir / "metrics.jsonl"))


@pytest.fixture(scope="module")
def fault() -> dict:
    return {}


@pytest.fixture(scope="module")
def watch() -> RunWatch:
    return RunWatch()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, fault, watch) -> Path:
    run_dir = tmp_path_factory.mktemp("agentloss") / "run"
    (run_dir / "logs").mkdir(parents=True)
    try:
        with watch:
            result = run_driven_job(run_dir, OVERRIDES, _second_agent, fault)
    finally:
        if "process" in fault and fault["process"].poll() is None:
            fault["process"].kill()
    assert result.version == NUM_STEPS
    return run_dir


def test_lost_agent_is_detected_and_its_instance_replanned_away(run_dir, fault):
    assert fault.get("killed_at_step", 0) >= KILL_AFTER_STEP
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    abandoned = [e for e in events if e["kind"] == "instance_abandoned"]
    assert abandoned and fault["agent_id"] in abandoned[0]["message"], events
    assert abandoned[0]["live_instances"] == 1
    assert "instance_restarted" not in kinds  # nothing restarted on the dead node
    replanned = [e["message"] for e in events if e["kind"] == "plan_applied" and "reconciled" in e["message"]]
    assert any("rollout-tp1-d2 lost and not restarted" in m for m in replanned), replanned


def test_run_finishes_with_no_trajectory_lost(run_dir):
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert not [s for s in samples if s["outcome"] in LOST_OUTCOMES], "trajectories were lost"


def test_nothing_of_the_run_outlives_it(run_dir, watch):
    seen = sorted({cmdline[:60] for cmdline in watch.processes.values()})
    assert len(watch.engines) >= 2, f"the watch missed the two instances' vLLM engines: {seen}"
    processes, shm_files = watch.leftovers(timeout_s=15.0)
    assert processes == [], "processes of the run outlived it"
    assert shm_files == [], "/dev/shm files of the run outlived it"
