"""Fixtures for control-plane tests: an in-process controller on a free loopback port and node
agents started as real `libra agent` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from libra.backends.config import BackendConfig
from libra.config import LibraConfig
from libra.control import ClusterClient, Controller
from libra.control.config import ControlConfig
from libra.control.types import AgentState
from tests.control.helpers import HEARTBEAT_S, TOKEN, wait_for


@pytest.fixture
def config(tmp_path) -> LibraConfig:
    return LibraConfig(
        run_dir=str(tmp_path / "run"),
        control=ControlConfig(port=0, token=TOKEN, heartbeat_interval_s=HEARTBEAT_S),
        backend=BackendConfig(name="cpu", num_devices=2),
    )


@pytest.fixture
def controller(config):
    controller = Controller(config).start()
    yield controller
    controller.stop()


@pytest.fixture
def client(controller, config):
    with ClusterClient(controller.address, TOKEN, config.control) as client:
        yield client


class AgentProcess:
    """A `libra agent` subprocess and the id it registered under."""

    def __init__(self, process: subprocess.Popen, agent_id: str):
        self.process = process
        self.agent_id = agent_id

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def spawn_agent(controller, config, tmp_path):
    processes: list[subprocess.Popen] = []

    def spawn(num_devices: int = 2, overrides: tuple[str, ...] = ()) -> AgentProcess:
        known = {a.agent_id for a in controller.cluster.snapshot().agents}
        env = {**os.environ, "LIBRA_TOKEN": TOKEN}
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "libra.cli",
                "agent",
                "--controller",
                controller.address,
                f"run_dir={tmp_path / f'agent{len(processes)}'}",
                f"backend.num_devices={num_devices}",
                *overrides,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        processes.append(process)

        def joined():
            if process.poll() is not None:
                raise AssertionError(f"agent exited early: {process.stderr.read().decode()}")
            fresh = [
                a
                for a in controller.cluster.snapshot().agents
                if a.agent_id not in known and a.state == AgentState.ALIVE
            ]
            return fresh[0].agent_id if fresh else None

        return AgentProcess(process, wait_for(joined, what="agent registration"))

    yield spawn
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
