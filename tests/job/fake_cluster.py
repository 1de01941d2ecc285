"""A fake of what the fleet reads and calls of `JobCluster` (the controller's snapshot,
StartWorker and StopWorker), for tests of the fleet and of its users without processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

from libra.control import WorkerSpec, WorkerState
from libra.control.types import AgentState, ClusterState, WorkerStatus
from tests.control.helpers import cpu_agent


class FakeCluster:
    """What the fleet reads and calls of `JobCluster`: the controller's snapshot, StartWorker and
    StopWorker. A started worker writes its ready file at once, unless `silent`."""

    token = "token"

    def __init__(self, tmp_path, agents=None):
        self.agents = agents or [cpu_agent("agent-0", range(4)), cpu_agent("agent-1", range(4))]
        self.workers: dict[str, WorkerStatus] = {}
        self.silent: set[str] = set()
        self.stopped: list[str] = []
        self.controller = SimpleNamespace(
            cluster=SimpleNamespace(
                snapshot=lambda: ClusterState(list(self.agents), list(self.workers.values()), 0)
            )
        )
        self.client = SimpleNamespace(start_worker=self._start_worker, stop_worker=self._stop_worker)
        self.ready_dir = tmp_path

    def _start_worker(self, agent_id: str, spec: WorkerSpec) -> WorkerStatus:
        status = WorkerStatus(spec, agent_id, WorkerState.RUNNING, pid=1000 + len(self.workers))
        self.workers[spec.worker_id] = status
        if spec.worker_id not in self.silent:
            # The worker's command line names its ready file (as the real ones do).
            Path(spec.argv[-1]).write_text(f"127.0.0.1:{7000 + len(self.workers)}\n")
        return status

    def _stop_worker(self, worker_id: str, grace_s: float) -> WorkerStatus:
        self.stopped.append(worker_id)
        self.end(worker_id, WorkerState.STOPPED)
        return self.workers[worker_id]

    def end(self, worker_id: str, state: WorkerState, exit_code: int = 0) -> None:
        self.workers[worker_id] = dataclasses.replace(
            self.workers[worker_id], state=state, exit_code=exit_code
        )

    def lose_agent(self, agent_id: str) -> None:
        self.agents = [
            dataclasses.replace(a, state=AgentState.LOST) if a.agent_id == agent_id else a
            for a in self.agents
        ]
