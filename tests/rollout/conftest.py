"""Session fixtures of the rollout tests: the tiny models (built once), two rollout instances
started as real processes (each a vLLM engine, ~1.7 GB, 3-60 s to start on a busy 2-core box),
and a controller with a node agent that starts a third instance like any worker (for the test
that kills it). All three instances start in parallel.

Tests that need an engine are marked `multiprocess`; the agent loop runs in the test process on
its own event loop (`run`), talking gRPC to the instances like the controller does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from libra.backends import get_backend
from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control import ClusterClient, Controller, WorkerRole, WorkerSpec, WorkerStatus
from libra.control.config import ControlConfig
from libra.control.types import AgentState
from libra.rollout.config import InstanceConfig
from libra.rollout.instance_server import InstanceSpec
from tests.control.helpers import wait_for
from tests.rollout.scripted_model import train_scripted_model

TOKEN = "rollout-test-token-0123"
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 180.0


@dataclass
class ModelDirs:
    random: Path
    """The factory's random model (`make_tiny_model`)."""
    scripted: Path
    """The random model fine-tuned on `scripted_model.dialogs`: greedy decoding follows them."""


@dataclass
class InstanceProcess:
    process: subprocess.Popen
    address: str
    log_path: Path

    def kill(self) -> None:
        """SIGKILL to the whole process group (the frontend and its engine-core process)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def instance_argv(model_dir: Path, address_file: Path, max_model_len: int = MAX_MODEL_LEN) -> list[str]:
    config = InstanceConfig(model=str(model_dir), max_model_len=max_model_len)
    return InstanceSpec(config, BackendConfig(name="cpu"), address_file=str(address_file)).to_argv()


def spawn_instance(
    model_dir: Path, run_dir: Path, name: str, device: int
) -> tuple[subprocess.Popen, Path, Path]:
    run_dir.mkdir(parents=True, exist_ok=True)
    address_file, log_path = run_dir / f"{name}.addr", run_dir / f"{name}.log"
    env = {**os.environ, **get_backend("cpu", num_devices=2).worker_env([device]), "LIBRA_TOKEN": TOKEN}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            instance_argv(model_dir, address_file),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return process, address_file, log_path


def wait_for_address(process: subprocess.Popen | None, address_file: Path, log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if address_file.is_file():
            return address_file.read_text().strip()
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"instance exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"instance did not start in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> ModelDirs:
    from libra.tasks.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    random_dir = make_tiny_model(root / "tiny-random")
    return ModelDirs(random=random_dir, scripted=train_scripted_model(random_dir, root / "tiny-scripted"))


@dataclass
class AgentStartedInstance:
    """A rollout instance started through the controller's StartWorker on a node agent."""

    controller: Controller
    status: WorkerStatus
    address_file: Path

    def address(self) -> str:
        return wait_for_address(None, self.address_file, Path(self.status.log_path))


@dataclass
class RolloutCluster:
    instances: list[InstanceProcess]
    agent_instance: AgentStartedInstance


def start_controller_and_agent(run_dir: Path) -> tuple[Controller, subprocess.Popen, str]:
    config = LibraConfig(
        run_dir=str(run_dir / "controller"),
        control=ControlConfig(port=0, token=TOKEN, heartbeat_interval_s=2.0),  # a busy box delays beats
        backend=BackendConfig(name="cpu", num_devices=2),
    )
    controller = Controller(config).start()
    agent = subprocess.Popen(
        [sys.executable, "-m", "libra.cli", "agent", "--controller", controller.address,
         f"run_dir={run_dir / 'agent'}", "backend.num_devices=2"],
        env={**os.environ, "LIBRA_TOKEN": TOKEN}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    agent_id = wait_for(
        lambda: next(
            (a.agent_id for a in controller.cluster.snapshot().agents if a.state == AgentState.ALIVE), None
        ),
        timeout_s=120,
        what="agent registration",
    )
    return controller, agent, agent_id


@pytest.fixture(scope="session")
def rollout_cluster(model_dirs, tmp_path_factory) -> RolloutCluster:
    run_dir = tmp_path_factory.mktemp("instances")
    spawned = [spawn_instance(model_dirs.scripted, run_dir, f"instance{i}", device=i) for i in range(2)]
    controller, agent = None, None
    try:
        controller, agent, agent_id = start_controller_and_agent(run_dir)
        address_file = run_dir / "agent-instance.addr"
        spec = WorkerSpec(
            worker_id="rollout-2",
            role=WorkerRole.ROLLOUT,
            devices=(0,),
            argv=tuple(instance_argv(model_dirs.scripted, address_file)),
            env={"LIBRA_TOKEN": TOKEN},
        )
        with ClusterClient(controller.address, TOKEN) as client:
            status = client.start_worker(agent_id, spec)
        started = [
            InstanceProcess(process, wait_for_address(process, address_file_, log_path), log_path)
            for process, address_file_, log_path in spawned
        ]
        yield RolloutCluster(started, AgentStartedInstance(controller, status, address_file))
    finally:
        for process, _, log_path in spawned:
            InstanceProcess(process, "", log_path).stop()
        if agent is not None:
            agent.terminate()  # stops its workers
            agent.wait(timeout=30)
        if controller is not None:
            controller.stop()


@pytest.fixture(scope="session")
def instances(rollout_cluster) -> list[InstanceProcess]:
    """Two instances of the scripted model, on CPU slots 0 and 1."""
    return rollout_cluster.instances


@pytest.fixture(scope="session")
def tokenizer(model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs.scripted)


def run(coro):
    """Runs a coroutine on a fresh event loop (gRPC aio channels belong to the loop they start on)."""
    return asyncio.run(coro)
