"""docs/examples/external_controller.py, the worked external controller of docs/grpc-api.md, run as a
user would run it: a separate process against a controller and a real `libra agent`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from libra.config import load_from_file
from libra.control import Controller, WorkerState
from libra.control.auth import open_channel
from libra.planner.config import PlanningProblem
from libra.planner.service import serve_planner
from libra.v1 import planner_pb2, planner_pb2_grpc
from tests.control.helpers import TOKEN

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "external_controller.py"
PLANNING_PROBLEM = str(REPO / "configs" / "planner_qwen3_14b_48xa800.py")


@pytest.fixture
def controller(config, request):
    """conftest's controller; indirectly parametrised with a planner config file, it also serves a
    planner (as the job does: PlannerService) whose initial plan is adopted."""
    problem_file = getattr(request, "param", None)
    controller = Controller(config)
    planner, services = None, []
    if problem_file:
        planner, service = serve_planner(
            load_from_file(problem_file, "planning_problem", PlanningProblem), controller.events
        )
        services.append(service)
    controller.start(services)
    if planner is not None:
        planner.initial_plan()
    yield controller
    controller.stop()


def run_example(controller, tmp_path) -> str:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--address",
            controller.address,
            "--token-file",
            str(token_file),
            "--python",
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def assert_worker_lifecycle_seen(out: str, agent_id: str) -> str:
    started = re.search(r"^StartWorker: (example-[0-9a-f]{8}) RUNNING on (\S+) device 0, pid \d+", out, re.M)
    assert started, out
    worker_id = started.group(1)
    assert started.group(2) == agent_id
    assert re.search(
        rf"^event #\d+ WORKER_STARTED agent={agent_id} worker={worker_id}: pid \d+$", out, re.M
    ), out
    assert re.search(rf"^worker {worker_id} started: seen as event #\d+$", out, re.M), out
    assert f"StopWorker: {worker_id} STOPPED, exit code -15" in out
    assert re.search(
        rf"^event #\d+ WORKER_STOPPED agent={agent_id} worker={worker_id} exit_code=-15", out, re.M
    ), out
    assert re.search(rf"^worker {worker_id} stopped: seen as event #\d+ \(exit code -15\)$", out, re.M), out
    assert f"cluster: {worker_id} is STOPPED" in out
    assert re.search(r"^saw \d+ event\(s\): .*WORKER_STARTED.*WORKER_STOPPED", out, re.M), out
    return worker_id


def test_external_controller_runs_a_worker_through_the_wire_api(controller, spawn_agent, tmp_path):
    agent = spawn_agent(num_devices=2)
    out = run_example(controller, tmp_path)

    assert f"agent {agent.agent_id} ALIVE" in out
    assert "planner: not served by this controller (UNIMPLEMENTED); skipping the plan" in out
    worker_id = assert_worker_lifecycle_seen(out, agent.agent_id)
    worker = next(w for w in controller.cluster.snapshot().workers if w.spec.worker_id == worker_id)
    assert worker.state == WorkerState.STOPPED


@pytest.mark.parametrize("controller", [PLANNING_PROBLEM], indirect=True, ids=["planner"])
def test_external_controller_reads_and_proposes_the_plan(controller, spawn_agent, tmp_path):
    agent = spawn_agent(num_devices=1)
    out = run_example(controller, tmp_path)

    assert re.search(r"^planner: current plan: v1 on 48 devices; training TP=\d+", out, re.M), out
    assert "planner: proposed the current plan back: plan v2 adopted, 0 action(s)" in out
    assert re.search(
        r"^event #\d+ PLAN_APPLIED plan_version=2: v2: external plan: external controller", out, re.M
    ), out
    assert re.search(r"^planner: plan v2 applied: seen as event #\d+$", out, re.M), out
    stub = planner_pb2_grpc.PlannerServiceStub(open_channel(controller.address, TOKEN))
    assert stub.GetPlan(planner_pb2.GetPlanRequest()).current.version == 2
    assert_worker_lifecycle_seen(out, agent.agent_id)
