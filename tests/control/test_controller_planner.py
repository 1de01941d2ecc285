"""A planner served on the controller (as the job wires it, `serve_planner`): PlannerService on the
controller's port (authenticated) and plan decisions as events in WatchEvents."""

from __future__ import annotations

import grpc
import pytest

from libra.config import LibraConfig, load_from_file
from libra.control import ClusterClient, Controller, EventKind
from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from libra.planner.config import PlanningProblem
from libra.planner.service import serve_planner
from libra.v1 import planner_pb2, planner_pb2_grpc
from tests.control.helpers import TOKEN


@pytest.fixture
def controller(tmp_path):
    problem = load_from_file("configs/planner_qwen3_14b_48xa800.py", "planning_problem", PlanningProblem)
    config = LibraConfig(run_dir=str(tmp_path), control=ControlConfig(port=0, token=TOKEN))
    controller = Controller(config)
    planner, service = serve_planner(problem, controller.events)
    controller.start(services=[service])
    yield controller, planner
    controller.stop()


def test_plan_decisions_reach_watchers_and_the_plan_is_served(controller):
    controller, planner = controller
    with ClusterClient(controller.address, TOKEN) as client:
        planner.initial_plan()
        applied = next(client.watch_events(kinds=[EventKind.PLAN_APPLIED]))
        assert applied.kind == EventKind.PLAN_APPLIED and applied.plan_version == 1
        assert applied.message

    stub = planner_pb2_grpc.PlannerServiceStub(open_channel(controller.address, TOKEN))
    reply = stub.GetPlan(planner_pb2.GetPlanRequest())
    assert reply.current.version == 1 and reply.current.num_devices == 48
    anonymous = planner_pb2_grpc.PlannerServiceStub(open_channel(controller.address, None))
    with pytest.raises(grpc.RpcError) as err:
        anonymous.GetPlan(planner_pb2.GetPlanRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
