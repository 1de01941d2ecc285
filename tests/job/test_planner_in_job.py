"""The planner and the elastic hybrid pool inside a short run of the embedded default
(configs/tiny_cpu.py on 6 CPU slots: a core replica of TP 2 on devices 0 and 1, TP-1 instances on
devices 2, 3 and 4, device 5 idle), with a fault.

The launch layout is the planner's current plan. An external controller follows the run through
the gRPC API and proposes (`ProposePlan`) a plan that moves devices 2 and 3 from rollout to
training: the job drains the instances there and hybrid DP replica 1 of TP 2 joins on them (one
worker started through the node agent, two processes, each TP rank following the lane of the core
rank of its TP rank: FETCHING_STATE, then ACTIVE, training one of two DP shares). Once it is
ACTIVE the test SIGKILLs its TP rank 1 only. The core must roll the whole replica back and keep
training with no step lost (both core ranks fill the replica's share in); the job retires the
replica and reconciles the planner, and a last proposed plan gives devices 2 and 3 back to rollout
(new instances, brought to the current weights). No trajectory may be lost, and the plan
decisions, executed actions and hybrid states must be in the run's events and its report.

Needs the cached warm-started policy (`tests/job/test_default_run.py`), about 5 GB and about three
minutes (the hybrid's engine and the new instance start on a busy 2-core machine).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from libra.control.client import ClusterClient
from libra.control.config import ControlConfig
from libra.job.recorder import read_jsonl
from libra.job.report import write_report
from libra.v1 import planner_pb2
from tests.job.driven_job import EXTERNALLY_PLANNED, LOST_OUTCOMES, planner_stub, run_driven_job, wait_for
from tests.job.driven_job import events as _events

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start]

NUM_STEPS = 56
BATCH = 8
GROUP = 2
OVERRIDES = [
    *EXTERNALLY_PLANNED,
    f"job.num_steps={NUM_STEPS}",
    f"job.prompts_per_step={BATCH // GROUP}",
    f"job.group_size={GROUP}",
    # A core replica of TP 2, so the hybrid is two processes whose lanes must move as one; TP-1
    # instances start faster than the default's TP-2 one.
    "backend.num_devices=6",
    "training.tensor_parallel=2",
    "job.rollout_tp_sizes=1,1,1",
]
HYBRID_DEVICES = [2, 3]


def _with_hybrid(launch: planner_pb2.Plan) -> planner_pb2.Plan:
    """Devices 2 and 3 train: DP 2 (replica 1 on them), rollout keeps device 4."""
    plan = planner_pb2.Plan()
    plan.CopyFrom(launch)
    plan.training.dp = 2
    del plan.instances[:]
    plan.instances.extend(i for i in launch.instances if list(i.devices) == [4])
    plan.buckets[0].num_instances = 1
    return plan


def _external_controller(run_dir: Path, driver: dict) -> None:
    if not wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 1, driver):
        return
    channel, stub = planner_stub(run_dir)
    address = (run_dir / "controller.addr").read_text().strip()
    token = (run_dir / "token").read_text().strip()
    launch = stub.GetPlan(planner_pb2.GetPlanRequest()).current
    driver["launch"] = launch
    driver["join"] = stub.ProposePlan(
        planner_pb2.ProposePlanRequest(plan=_with_hybrid(launch), reason="test: devices 2-3 train")
    )
    if not wait_for(lambda: any(e["kind"] == "hybrid_active" for e in _events(run_dir)), driver):
        return
    driver["active_at_step"] = len(read_jsonl(run_dir / "metrics.jsonl"))
    time.sleep(3.0)  # into the next steps: the kill lands while the core relies on the replica
    with ClusterClient(address, token, ControlConfig()) as client:
        hybrid = next(
            w
            for w in client.cluster_state().workers
            if w.spec.worker_id.startswith("hybrid-1") and not w.state.ended
        )
    # The worker's process is TP rank 0; its child is TP rank 1, the one that dies.
    children = Path(f"/proc/{hybrid.pid}/task/{hybrid.pid}/children").read_text().split()
    driver["tp_ranks"] = 1 + len(children)
    os.kill(int(children[0]), signal.SIGKILL)
    driver["killed"] = hybrid.spec.worker_id
    if not wait_for(lambda: any(e["kind"] == "hybrid_retired" for e in _events(run_dir)), driver):
        return
    driver["back"] = stub.ProposePlan(
        planner_pb2.ProposePlanRequest(plan=launch, reason="test: devices 2-3 roll out again")
    )
    channel.close()


@pytest.fixture(scope="module")
def driver() -> dict:
    return {}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, driver) -> Path:
    run_dir = tmp_path_factory.mktemp("hybrid") / "run"
    result = run_driven_job(run_dir, OVERRIDES, _external_controller, driver)
    assert result.version == NUM_STEPS
    write_report(run_dir)
    return run_dir


def test_launch_layout_is_the_planners_current_plan(run_dir, driver):
    launch = driver["launch"]
    assert (launch.training.tp, launch.training.dp, launch.training.first_device) == (2, 1, 0)
    assert sorted(tuple(i.devices) for i in launch.instances) == [(2,), (3,), (4,)]
    assert [(b.tp, b.num_instances) for b in launch.buckets] == [(1, 3)]


def test_hybrid_replica_joins_becomes_active_and_is_killed(run_dir, driver):
    kinds = planner_pb2.PlanActionKind
    assert [(a.kind, a.replica if a.replica else a.instance_id) for a in driver["join"].actions] == [
        (kinds.PLAN_ACTION_KIND_STOP_ROLLOUT_INSTANCE, "rollout-tp1-d2"),
        (kinds.PLAN_ACTION_KIND_STOP_ROLLOUT_INSTANCE, "rollout-tp1-d3"),
        (kinds.PLAN_ACTION_KIND_JOIN_HYBRID_REPLICA, 1),
    ]
    events = _events(run_dir)
    states = [e["kind"] for e in events if e["kind"].startswith("hybrid_")]
    assert "hybrid_active" in states, states
    assert driver.get("killed", "").startswith("hybrid-1") and driver["tp_ranks"] == 2
    assert states.index("hybrid_rolled_back") > states.index("hybrid_active")
    # While ACTIVE its rows and gradients were added to the core's (TP rank 0's lane speaks for
    # the replica).
    rolled_back = next(e for e in events if e["kind"] == "hybrid_rolled_back")
    assert rolled_back["accepted_payloads"] >= 1, rolled_back
    # TP rank 1 died; core rank 0 rolled back with it (its own peer was fine, or lost when TP
    # rank 0 ended with its child), and the worker was retired.
    retired = next(e for e in events if e["kind"] == "hybrid_retired")
    assert "another rank of hybrid replica 1" in retired["message"] or "PeerLost" in retired["message"], (
        retired
    )
    if "of step" in retired["message"]:
        # It died while the core waited for its share of a step: the core computed that share.
        assert retired["filled_in_shares"] >= 1, retired


def test_training_continued_with_no_step_lost_or_shortened(run_dir, driver):
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    # Every step trained on a full batch, also the ones the hybrid was ACTIVE in and died in
    # (stale drops are replaced by fresh groups before a step).
    # (A group partly dropped as stale can make a batch overshoot by less than a group; never short.)
    sizes = [s["num_trajectories"] for s in steps]
    assert all(BATCH <= n < BATCH + GROUP for n in sizes), sizes
    assert all(s["loss"] == s["loss"] and abs(s["loss"]) < 1e3 for s in steps)  # finite
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert not [s for s in samples if s["outcome"] in LOST_OUTCOMES], "trajectories were lost"


def test_device_goes_back_to_rollout(run_dir, driver):
    back = driver["back"]
    kinds = planner_pb2.PlanActionKind
    assert [(a.kind, a.instance_id) for a in back.actions] == [
        (kinds.PLAN_ACTION_KIND_START_ROLLOUT_INSTANCE, "rollout-tp1-d2"),
        (kinds.PLAN_ACTION_KIND_START_ROLLOUT_INSTANCE, "rollout-tp1-d3"),
    ]
    executed = {e["plan_version"]: e for e in _events(run_dir) if e["kind"] == "plan_executed"}
    join = driver["join"].plan.version
    assert executed[join]["ok"] and executed[join]["live_instances"] == 1
    assert executed[back.plan.version]["ok"] and executed[back.plan.version]["live_instances"] == 3


def test_decisions_and_actions_are_recorded_and_reported(run_dir):
    events = _events(run_dir)
    applied = [e["message"] for e in events if e["kind"] == "plan_applied"]
    assert any("test: devices 2-3 train" in m and "step " in m for m in applied), applied
    assert any("reconciled: hybrid replica 1 rolled back" in m for m in applied), applied
    actions = [e["message"] for e in events if e["kind"] == "plan_action"]
    assert any(m.startswith("0: stop rollout rollout-tp1-d2 (drain)") and ": ok " in m for m in actions)
    assert any(m.startswith("2: join hybrid replica 1 on [2, 3]: ok") for m in actions), actions
    # The drained instance's end was planned: the watchdog did not restart it.
    assert not [e for e in events if e["kind"] in ("instance_lost", "instance_restarted")]
    report = (run_dir / "report.md").read_text()
    assert "plan_executed" in report and "hybrid_active" in report
