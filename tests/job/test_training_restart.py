"""A plan that changes the core training layout restarts training inside the run: the embedded
default launched as TP-2 + TP-1 (train rank on device 0, a TP-1 instance on 1, a TP-2 instance on
2-3) is told by an
external controller (`ProposePlan`) to train with TP 2 on devices 0-1. The job drains the TP-1
instance, and at a step boundary checkpoints the rank, stops it, starts two TP-2 ranks, loads the
checkpoint (Megatron's distributed checkpoint, resharded from TP 1 to TP 2), and publishes the
current version again, while rollout keeps serving on the TP-2 instance.

What must hold: no step lost or repeated, no trajectory lost, the restarted ranks score the
rollout's tokens as the old rank did (the logprob gap after the restart stays at float rounding:
the resharded weights are the same weights), and the planner's plan is the new layout.

Needs the cached warm-started policy (`tests/job/test_default_run.py`), and about three minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.job.recorder import read_jsonl
from libra.v1 import planner_pb2
from tests.job.driven_job import (
    EXTERNALLY_PLANNED,
    LOST_OUTCOMES,
    events,
    planner_stub,
    run_driven_job,
    wait_for,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start]

NUM_STEPS = 14
BATCH = 8
RESTART_AFTER_STEP = 2
OVERRIDES = [
    *EXTERNALLY_PLANNED,
    "job.rollout_tp_sizes=2,1",
    f"job.num_steps={NUM_STEPS}",
    "job.prompts_per_step=2",
    "job.group_size=4",
    "job.eval_tasks=0",
    # On-policy: every batch is sampled wholly under the version it trains, so every step's
    # logprob gap is measured, the first one after the restart included.
    "training.max_staleness=0",
]


def _tp2_training(launch: planner_pb2.Plan) -> planner_pb2.Plan:
    plan = planner_pb2.Plan()
    plan.CopyFrom(launch)
    plan.training.tp = 2
    del plan.instances[:]
    plan.instances.extend(i for i in launch.instances if i.tp == 2)
    del plan.buckets[:]
    plan.buckets.extend(b for b in launch.buckets if b.tp == 2)
    return plan


def _external_controller(run_dir: Path, driver: dict) -> None:
    if not wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= RESTART_AFTER_STEP, driver):
        return
    channel, stub = planner_stub(run_dir)
    launch = stub.GetPlan(planner_pb2.GetPlanRequest()).current
    driver["launch"] = launch
    driver["restart"] = stub.ProposePlan(
        planner_pb2.ProposePlanRequest(plan=_tp2_training(launch), reason="test: train with TP 2")
    )
    if wait_for(lambda: any(e["kind"] == "plan_executed" for e in events(run_dir)), driver):
        driver["after"] = stub.GetPlan(planner_pb2.GetPlanRequest()).current
    channel.close()


@pytest.fixture(scope="module")
def driver() -> dict:
    return {}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, driver) -> Path:
    run_dir = tmp_path_factory.mktemp("restart") / "run"
    result = run_driven_job(run_dir, OVERRIDES, _external_controller, driver)
    assert result.version == NUM_STEPS
    return run_dir


def test_plan_restarts_training_in_the_new_layout(run_dir, driver):
    launch = driver["launch"]
    assert (launch.training.tp, launch.training.dp) == (1, 1)
    assert sorted((i.tp, tuple(i.devices)) for i in launch.instances) == [(1, (1,)), (2, (2, 3))]
    kinds = planner_pb2.PlanActionKind
    assert [a.kind for a in driver["restart"].actions][:2] == [
        kinds.PLAN_ACTION_KIND_STOP_ROLLOUT_INSTANCE,
        kinds.PLAN_ACTION_KIND_RESTART_TRAINING,
    ]
    executed = [e for e in events(run_dir) if e["kind"] == "plan_executed"]
    restart = next(e for e in executed if e["plan_version"] == driver["restart"].plan.version)
    assert restart["ok"], restart
    actions = [e["message"] for e in events(run_dir) if e["kind"] == "plan_action"]
    assert any(
        "restart training TP=2 PP=1 DP=1 on [0, 1]: ok checkpoint" in m and "loaded" in m for m in actions
    ), actions
    after = driver["after"]
    assert (after.training.tp, after.training.dp, after.training.first_device) == (2, 1, 0)
    assert [(i.tp, tuple(i.devices)) for i in after.instances] == [(2, (2, 3))]
    # Two new train ranks ran (a new generation of worker ids), on devices 0 and 1.
    logs = sorted(p.name for p in (run_dir / "logs").glob("*.jsonl"))
    assert (
        any(name.startswith("train-g2-") or "train-g2" in name for name in logs)
        or (run_dir / "train-g2-rank-1.port").exists()
    ), logs


def test_no_step_or_trajectory_lost_and_the_weights_survived_the_reshard(run_dir):
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    assert all(BATCH <= s["num_trajectories"] < BATCH + 4 for s in steps)  # (see test_planner_in_job)
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert not [s for s in samples if s["outcome"] in LOST_OUTCOMES], "trajectories were lost"
    assert all(s["loss"] == s["loss"] for s in steps)


def test_restarted_ranks_score_tokens_as_the_old_rank_sampled_them(run_dir, driver):
    """The steps after the restart score trajectories sampled under the version being trained:
    the first under the version the old TP-1 rank published, with the TP-2 ranks' resharded copy
    of it, later ones under what the TP-2 ranks published themselves. The gap is float rounding
    only if the weights the new ranks hold are the weights rollout sampled with."""
    version = driver["restart"].plan.version
    done = next(e for e in events(run_dir) if e["kind"] == "plan_executed" and e["plan_version"] == version)
    after = [s for s in read_jsonl(run_dir / "metrics.jsonl") if s["time_s"] > done["time_s"]]
    scored = [s for s in after if s["num_current_tokens"] > 0]
    assert scored and scored[0]["step"] == after[0]["step"], after
    assert max(s["logprob_max_abs_diff"] for s in scored) < 1e-3, scored
