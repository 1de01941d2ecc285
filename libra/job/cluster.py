"""The job's cluster: the controller (in the job's own process), the node agents, and where
workers go.

The job runs the controller itself. It starts a node agent on this host (the embedded default) or
waits for the agents a launcher started; the fleet (`libra.job.fleet`) then asks the agents,
through the controller's ClusterApi like any orchestration would, to start each rollout instance
and train rank as a worker process on the devices placed here.

Placement is first-fit over the agents' devices in registration order, in aligned blocks.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from libra.config import LibraConfig
from libra.control import ClusterClient, Controller
from libra.control.types import AgentState
from libra.control.worker_guard import end_guarded, guarded, make_private_tmp, remove_private_tmp
from libra.planner.device_map import DeviceMap
from libra.planner.planner import Planner
from libra.planner.service import serve_planner


@dataclass(frozen=True)
class Placement:
    agent_id: str
    devices: tuple[int, ...]


def section_overrides(prefix: str, section: object, skip: tuple[str, ...] = ()) -> list[str]:
    """`prefix.field=value` overrides that give a config section's values to a `libra` command."""
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name not in skip}
    return [f"{prefix}.{name}={'none' if value is None else value}" for name, value in values.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobCluster:
    """The controller, the node agents and the job's workers; `stop()` ends what it started."""

    def __init__(self, config: LibraConfig):
        self.config = config
        self.job = config.job
        self.run_dir = Path(config.run_dir)
        self.controller: Controller | None = None
        self.planner: Planner | None = None
        """The global planner, when the cluster was started with a planning problem."""
        self._agent_process: subprocess.Popen | None = None
        self._agent_tmp: str | None = None
        self._client: ClusterClient | None = None
        self._free: list[tuple[str, list[int]]] = []

    @property
    def client(self) -> ClusterClient:
        """The controller's ClusterApi, as the job's orchestration calls it."""
        assert self._client is not None, "the cluster is not started"
        return self._client

    @property
    def token(self) -> str:
        assert self.controller is not None
        return self.controller.token

    def start(self, planning_problem=None, rescorer=None) -> JobCluster:
        """Starts the controller (with `planning_problem`, a `libra.planner.PlanningProblem`, it
        also runs the global planner, serves it as PlannerService and publishes its decisions as
        events; `rescorer`: how the planner re-scores its candidates) and waits for the node agents."""
        self.controller = Controller(self.config)
        services = []
        if planning_problem is not None:
            self.planner, service = serve_planner(planning_problem, self.controller.events, rescorer)
            services.append(service)
        self.controller.start(services)
        (self.run_dir / "controller.addr").write_text(self.controller.address + "\n")
        if self.job.spawn_agent:
            self._spawn_agent()
        self._client = ClusterClient(self.controller.address, self.token, self.config.control)
        self._wait_for_agents()
        return self

    def _spawn_agent(self) -> None:
        log = open(self.run_dir / "logs" / "agent.log", "ab")
        argv = [
            sys.executable,
            "-m",
            "libra.cli",
            "agent",
            "--controller",
            self.controller.address,
            f"run_dir={self.run_dir / 'agent'}",
            # The sections the agent serves and places by (TLS, heartbeats, the backend's
            # options); the token travels in the environment, the controller's port is its own.
            *section_overrides("control", self.config.control, skip=("token", "port")),
            *section_overrides("backend", self.config.backend),
        ]
        # Under a guard: a killed job leaves no agent, no worker and nothing they spawned behind,
        # in /dev/shm or in the temp directory (the agent's workers get theirs inside the agent's).
        self._agent_tmp = make_private_tmp()
        self._agent_process = subprocess.Popen(
            guarded(argv, self._agent_tmp),
            start_new_session=True,
            env={**os.environ, "LIBRA_TOKEN": self.token},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def _wait_for_agents(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = [a for a in self.controller.cluster.snapshot().agents if a.state == AgentState.ALIVE]
            if len(alive) >= self.job.num_agents:
                self._free = [(a.agent_id, sorted(d.index for d in a.devices)) for a in alive]
                return
            if self._agent_process is not None and self._agent_process.poll() is not None:
                raise RuntimeError(
                    f"the node agent exited with {self._agent_process.returncode}; "
                    f"see {self.run_dir}/logs/agent.log"
                )
            time.sleep(0.2)
        raise RuntimeError(f"{self.job.num_agents} node agent(s) did not register within {timeout_s} s")

    def place(self, num_devices: int, what: str) -> Placement:
        """Takes `num_devices` free devices of one agent: the lowest free block aligned to its size,
        the planner's rule (`libra.planner.plan.place_rollout`), so that the launch layout is a
        plan it can hold."""
        for i, (agent_id, devices) in enumerate(self._free):
            free = set(devices)
            for start in range(0, max(devices, default=-1) + 1, num_devices):
                block = list(range(start, start + num_devices))
                if free.issuperset(block):
                    self._free[i] = (agent_id, sorted(free.difference(block)))
                    return Placement(agent_id, tuple(block))
        free = {a: len(d) for a, d in self._free}
        raise ValueError(
            f"no agent has {num_devices} free device(s) in an aligned block for {what}; "
            f"free devices per agent: {free} "
            "(raise backend.num_devices, or use fewer rollout instances / a smaller training.tensor_parallel)"
        )

    def device_map(self) -> DeviceMap:
        """The agents' devices as the planner numbers them, from the controller's current state."""
        return DeviceMap.from_cluster_state(self.controller.cluster.snapshot())

    def agent_alive(self, agent_id: str) -> bool:
        return any(
            a.agent_id == agent_id and a.state == AgentState.ALIVE
            for a in self.controller.cluster.snapshot().agents
        )

    def agent_host(self, agent_id: str) -> str:
        """The host part of the agent's address: where its workers serve."""
        for a in self.controller.cluster.snapshot().agents:
            if a.agent_id == agent_id:
                return a.address.rsplit(":", 1)[0]
        raise LookupError(f"no agent {agent_id!r}")

    def stop(self) -> None:
        """Ends the agent it spawned (which stops every worker it runs) and the controller."""
        if self._client is not None:
            self._client.close()
        if self._agent_process is not None:
            # The agent stops its workers on SIGTERM; past the grace its guard kills the tree.
            end_guarded(self._agent_process, grace_s=30.0)
            remove_private_tmp(self._agent_tmp)  # if its guard was killed outright
        if self.controller is not None:
            self.controller.stop()
