"""Runs a job of the embedded default with a driver thread beside it: the driver plays an
external controller or a fault injector (it watches the run folder and acts through the gRPC API
or on processes). Shared by the job tests that steer a run from outside."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from libra.config import load_config
from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from libra.job.loop import GrpoJob, JobResult
from libra.job.recorder import read_jsonl
from libra.v1 import planner_pb2_grpc

LOST_OUTCOMES = {"error", "no_instance", "aborted", "running"}
"""Trajectory outcomes that mean a trajectory was lost."""
EXTERNALLY_PLANNED = [
    "job.checkpoint_interval=0",
    "job.live_progress=false",
    "planner.policy.auto_apply=false",
    "planner.execution.drain_timeout_s=10",
]
"""Overrides of a run whose plans come from the driver (`ProposePlan`), not the planner's own
candidates, with no periodic checkpoint in the way."""

ONE_INSTANCE = [
    "job.rollout_tp_sizes=",  # planned: on two slots, the train rank and one TP-1 instance
    "backend.num_devices=2",
    "job.checkpoint_interval=0",
    "job.live_progress=false",
]
"""Overrides of a small job: one TP-1 instance and a train rank on two CPU slots, no periodic
checkpoint, no live table."""


def model_overrides() -> list[str]:
    """`LIBRA_JOB_TEST_MODEL` names a policy to use instead of the cached warm-started one."""
    model = os.environ.get("LIBRA_JOB_TEST_MODEL")
    return [f"job.model={model}"] if model else []


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "events.jsonl")


def wait_for(condition: Callable[[], bool], driver: dict) -> bool:
    """Polls `condition` until it holds (True) or the run ended (False)."""
    while not condition():
        if driver.get("stop"):
            return False
        time.sleep(0.3)
    return True


def planner_stub(run_dir: Path):
    """(channel, PlannerService stub) of the run's controller, authenticated."""
    address = (run_dir / "controller.addr").read_text().strip()
    token = (run_dir / "token").read_text().strip()
    channel = open_channel(address, token, ControlConfig())
    return channel, planner_pb2_grpc.PlannerServiceStub(channel)


def run_driven_job(
    run_dir: Path, overrides: list[str], drive: Callable[[Path, dict], None], driver: dict
) -> JobResult:
    """Runs `configs/tiny_cpu.py` with `overrides` while `drive(run_dir, driver)` runs on a
    thread; `driver["stop"]` is set when the job ends, and the thread is joined."""
    config = load_config("configs/tiny_cpu.py", [f"run_dir={run_dir}", *overrides, *model_overrides()])
    thread = threading.Thread(target=drive, args=(run_dir, driver))
    thread.start()
    try:
        return GrpoJob(config).run()
    finally:
        driver["stop"] = True
        thread.join()


def run_with_reward_spy(config) -> tuple[JobResult, list]:
    """Runs the job of `config`, recording (task, trajectory, reward) of every reward it gives."""
    import pytest

    from libra.job.rollouts import GroupRollout

    seen: list = []
    real_reward = GroupRollout.reward

    async def spy(self, task, trajectory):
        reward = await real_reward(self, task, trajectory)
        seen.append((task, trajectory, reward))
        return reward

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GroupRollout, "reward", spy)
        result = GrpoJob(config).run()
    return result, seen
