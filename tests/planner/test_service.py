"""PlannerService over gRPC, in process, through the control plane's authenticated server."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
import pytest

from libra.config import load_from_file
from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from libra.control.server import start_server
from libra.planner.config import PlanningProblem
from libra.planner.planner import Planner
from libra.planner.service import add_planner_service, plan_to_proto
from libra.v1 import planner_pb2, planner_pb2_grpc

TOKEN = "planner-test-token-0123"


@dataclass
class Served:
    planner: Planner
    stub: planner_pb2_grpc.PlannerServiceStub
    events: list
    port: int


def serve(planner: Planner, devices_per_node: int):
    config = ControlConfig(port=0, token=TOKEN)
    server = start_server(
        config,
        TOKEN,
        add_planner_service(planner, devices_per_node),
        host="127.0.0.1",
        port=0,
    )
    return server, open_channel(f"127.0.0.1:{server.port}", TOKEN, config)


@pytest.fixture(scope="module")
def problem() -> PlanningProblem:
    return load_from_file("configs/planner_qwen3_14b_48xa800.py", "planning_problem", PlanningProblem)


@pytest.fixture(scope="module")
def served(problem):
    events = []
    planner = Planner(problem, on_event=events.append)
    server, channel = serve(planner, problem.cluster.devices_per_node)
    yield Served(planner, planner_pb2_grpc.PlannerServiceStub(channel), events, server.port)
    channel.close()
    server.stop()


def test_get_plan_before_and_after_initial_plan(served):
    planner, stub, events = served.planner, served.stub, served.events
    reply = stub.GetPlan(planner_pb2.GetPlanRequest())
    assert reply.current.version == 0 and reply.policy.plan_interval == planner.policy.plan_interval
    planner.initial_plan()
    reply = stub.GetPlan(planner_pb2.GetPlanRequest())
    assert reply.current.version == 1 and reply.current.num_devices == 48
    assert reply.current.predicted_step_s == pytest.approx(planner.current.predicted_step_s)
    assert events[-1].kind == "applied"


def test_propose_external_plan_and_invalid_ones(served):
    planner, stub = served.planner, served.stub
    if planner.current is None:
        planner.initial_plan()
    proposal = plan_to_proto(planner.current, 0)
    reply = stub.ProposePlan(planner_pb2.ProposePlanRequest(plan=proposal, reason="operator"))
    assert reply.plan.version == planner.version and reply.message.startswith("plan v")
    bad = planner_pb2.Plan()
    bad.CopyFrom(proposal)
    bad.instances.append(proposal.instances[0])
    with pytest.raises(grpc.RpcError) as err:
        stub.ProposePlan(planner_pb2.ProposePlanRequest(plan=bad))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "used twice" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.ProposePlan(planner_pb2.ProposePlanRequest(veto_candidate=True))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_set_policy_with_field_mask_and_validation(served):
    planner, stub = served.planner, served.stub
    reply = stub.SetPlannerPolicy(
        planner_pb2.SetPlannerPolicyRequest(
            policy=planner_pb2.PlannerPolicy(plan_interval=3, auto_apply=False),
            fields=["plan_interval", "auto_apply"],
        )
    )
    assert reply.policy.plan_interval == 3 and not reply.policy.auto_apply
    assert planner.policy.plan_interval == 3 and planner.policy.min_gain_ratio == 0.05  # untouched field kept
    with pytest.raises(grpc.RpcError) as err:
        stub.SetPlannerPolicy(
            planner_pb2.SetPlannerPolicyRequest(
                policy=planner_pb2.PlannerPolicy(hysteresis=2.0), fields=["hysteresis"]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hysteresis" in err.value.details()


def test_calls_need_the_token(served):
    channel = open_channel(f"127.0.0.1:{served.port}", "wrong-token", ControlConfig(port=0, token=TOKEN))
    with pytest.raises(grpc.RpcError) as err:
        planner_pb2_grpc.PlannerServiceStub(channel).GetPlan(planner_pb2.GetPlanRequest())
    channel.close()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_operator_calls_do_not_wait_out_a_long_rescoring(problem):
    """A re-scoring at a large cluster's size simulates for minutes under the planner's lock: the
    operator's calls that need the lock answer UNAVAILABLE saying so, and GetPlan answers at once."""
    release, rescoring = threading.Event(), threading.Event()

    def slow_rescorer(plans):
        rescoring.set()
        release.wait(30)
        return [1.0] * len(plans)

    planner = Planner(problem, rescorer=slow_rescorer)
    server, channel = serve(planner, problem.cluster.devices_per_node)
    stub = planner_pb2_grpc.PlannerServiceStub(channel)
    choosing = threading.Thread(target=planner.initial_plan)
    choosing.start()
    try:
        assert rescoring.wait(30)
        assert stub.GetPlan(planner_pb2.GetPlanRequest(), timeout=10).current.version == 0
        for request in (
            planner_pb2.ProposePlanRequest(veto_candidate=True),
            planner_pb2.ProposePlanRequest(accept_candidate=True),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.ProposePlan(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "re-scoring" in err.value.details() and "retry" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.SetPlannerPolicy(
                planner_pb2.SetPlannerPolicyRequest(
                    policy=planner_pb2.PlannerPolicy(plan_interval=3), fields=["plan_interval"]
                ),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        release.set()
        choosing.join(30)
        channel.close()
        server.stop()
    assert planner.version == 1 and planner.policy.plan_interval != 3


def test_policy_changes_merge_into_the_policy_in_force(problem):
    """SetPlannerPolicy hands the planner only the fields it sets, merged under its lock into the
    policy in force then: two operators setting different fields both keep theirs."""
    planner = Planner(problem)
    planner.update_policy(plan_interval=3)
    assert planner.update_policy(min_gain_ratio=0.2).plan_interval == 3
    assert (planner.policy.plan_interval, planner.policy.min_gain_ratio) == (3, 0.2)
    with pytest.raises(ValueError, match="hysteresis"):
        planner.update_policy(hysteresis=2.0)
    assert planner.policy.hysteresis == problem.config.policy.hysteresis
