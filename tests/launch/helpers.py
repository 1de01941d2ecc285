"""The short job both launcher tests run through `scripts/launch_cuda.sh` (BACKEND=cpu), and what
they check of its run folder and of the processes it leaves."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.launch.daemons import describe, marked_pids

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny_cpu.py"
NUM_STEPS = 1
NUM_SLOTS = 3
OVERRIDES = [
    # One step of 2 prompts x 2 trajectories, a train rank and one TP-1 instance, no held-out
    # evaluation, planner or metrics endpoint: 40-80 s on a 2-core machine, by load.
    f"job.num_steps={NUM_STEPS}",
    "job.prompts_per_step=2",
    "job.group_size=2",
    "training.num_minibatches=1",
    "job.eval_tasks=0",
    "job.checkpoint_interval=0",
    "job.live_progress=false",
    "job.planner=false",
    "job.metrics_port=-1",
    "job.rollout_tp_sizes=1",
    # Neither the config's 4 slots nor the agent's default (one per core): the agent registering
    # 3 shows that it loaded CONFIG with the overrides.
    f"backend.num_devices={NUM_SLOTS}",
    "rollout.agent.max_turns=2",
]
if os.environ.get("LIBRA_JOB_TEST_MODEL"):
    OVERRIDES.append(f"job.model={os.environ['LIBRA_JOB_TEST_MODEL']}")
JOB_TIMEOUT_S = 900
"""The whole launch: the job takes 40-80 s on 2 cores; a cold tiny-policy cache adds minutes."""
LEFTOVER_TIMEOUT_S = 60


def launch_env(base: dict[str, str], **extra: str) -> dict[str, str]:
    """The launcher's environment: CPU slots, controller and agents on loopback."""
    env = {**base, "BACKEND": "cpu", "LIBRA_CONTROLLER_IP": "127.0.0.1", "LIBRA_AGENT_IP": "127.0.0.1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **extra}


@dataclass
class Launch:
    run_dir: Path
    returncode: int
    output: str
    seconds: float
    leftovers: list[str]
    """Processes of the job still running `LEFTOVER_TIMEOUT_S` after the launcher returned."""

    def log(self, name: str) -> str:
        path = self.run_dir / "logs" / name
        return path.read_text(errors="replace") if path.is_file() else ""

    def explain(self) -> str:
        return (
            f"launcher output:\n{self.output[-3000:]}\ncontroller log:\n{self.log('controller.log')[-3000:]}"
        )


def launch(prefix: list[str], run_dir: Path, env: dict[str, str], marker_root: Path) -> Launch:
    """Runs `PREFIX bash scripts/launch_cuda.sh CONFIG RUN_DIR OVERRIDES` to its end, then waits for
    the processes it started to end: those marked with `marker_root` (but for the daemons, marked
    before) and those naming `run_dir`."""
    keep = set(marked_pids(marker_root))
    argv = [*prefix, "bash", "scripts/launch_cuda.sh", CONFIG, str(run_dir), *OVERRIDES]
    start = time.monotonic()
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.terminate()  # the launcher's own cleanup (its EXIT trap) first; salloc ends the step
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        output = f"timed out after {JOB_TIMEOUT_S} s\n{output}"
    seconds = time.monotonic() - start

    def left() -> list[int]:
        pids = set(marked_pids(marker_root)) | set(marked_pids(run_dir))
        return sorted(pids - keep)

    deadline = time.monotonic() + LEFTOVER_TIMEOUT_S
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    return Launch(run_dir, process.returncode, output, seconds, describe(left()))


def check_finished(launch: Launch) -> None:
    """The job ran its steps to the end: exit 0, every step in metrics.jsonl, the report written."""
    assert launch.returncode == 0, launch.explain()
    steps = [json.loads(line) for line in (launch.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1)), steps
    assert all(s["num_trajectories"] > 0 for s in steps), steps
    assert "mean reward" in (launch.run_dir / "report.md").read_text()
    assert f"[libra] done: {NUM_STEPS} steps" in launch.log("controller.log"), launch.explain()


def check_agent_registered(launch: Launch, agent_log: str) -> None:
    """One agent, the launcher's, served on loopback with the slots of CONFIG and its overrides and
    registered with the controller; the controller waited for it (no agent of its own)."""
    slots = f"with {NUM_SLOTS} device(s)"
    log = launch.log(agent_log)
    assert "serving on 127.0.0.1:" in log and slots in log, log or launch.explain()
    controller_log = launch.log("controller.log")
    registered = [line for line in controller_log.splitlines() if " registered from 127.0.0.1:" in line]
    assert len(registered) == 1 and slots in registered[0], controller_log[-3000:]
    host = os.uname().nodename
    assert (launch.run_dir / "agents" / host / "logs" / "workers").is_dir()
    assert not (launch.run_dir / "agent").exists()  # the job's own agent's folder: none was spawned
