"""Plan diffs as actions (hybrid join/release, drain/cut, restart) and the Planner state machine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from libra.planner.config import TriggerPolicy, load_problem
from libra.planner.diff import (
    JoinHybridReplica,
    ReleaseHybridReplica,
    RestartTraining,
    SetBucketThresholds,
    StartRolloutInstance,
    StopRolloutInstance,
    diff_plans,
)
from libra.planner.plan import Plan, TrainingPlacement, place_rollout
from libra.planner.planner import Planner
from libra.planner.training_cost import TrainingConfig
from libra.planner.triggers import StepObservation

SAMPLE = "configs/planner_qwen3_14b_48xa800.py"


def make_plan(tp: int, pp: int, dp: int, rollout: list[int], thresholds=((1, 1000), (4, 9000))) -> Plan:
    training = TrainingPlacement(TrainingConfig(tp, pp, dp, 1))
    instances = place_rollout(training.num_devices, 48, 8, rollout)
    from libra.planner.plan import BucketPlan

    buckets = tuple(
        BucketPlan(k, sum(1 for r in rollout if r == k), limit, 0, 0.0) for k, limit in thresholds
    )
    return Plan(48, training, instances, buckets, 1.0, 1.0)


def test_first_plan_starts_everything():
    new, actions = diff_plans(None, make_plan(8, 1, 4, [4, 4, 1, 1, 1, 1, 1, 1, 1, 1]))
    assert isinstance(actions[0], RestartTraining) and actions[0].new_devices == tuple(range(32))
    assert sum(isinstance(a, StartRolloutInstance) for a in actions) == 10
    assert isinstance(actions[-1], SetBucketThresholds)


def test_growing_training_joins_hybrid_replicas_and_stops_rollout_first():
    old = make_plan(8, 1, 3, [4, 4, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1])  # 24 training + 24 rollout
    grown = make_plan(8, 1, 4, [4, 4, 1, 1, 1, 1, 1, 1, 1, 1])
    new, actions = diff_plans(old, grown, cut_inflight=True)
    assert new.training.hybrid_replicas == (3,)
    stops = [a for a in actions if isinstance(a, StopRolloutInstance)]
    joins = [a for a in actions if isinstance(a, JoinHybridReplica)]
    assert joins == [JoinHybridReplica(3, tuple(range(24, 32)))]
    assert all(a.cut_inflight for a in stops)
    stopped = {d for a in stops for d in a.devices}
    assert set(range(24, 32)) <= stopped  # the joining replica's devices are freed first
    assert actions.index(stops[-1]) < actions.index(joins[0])
    assert not any(isinstance(a, RestartTraining) for a in actions)
    # Kept instances are not restarted: every start lands on a device that was stopped or free.
    started = {d for a in actions if isinstance(a, StartRolloutInstance) for d in a.devices}
    assert started <= stopped
    # Shrinking back releases the hybrid replica only.
    back, actions = diff_plans(new, old)
    assert back.training.hybrid_replicas == ()
    assert actions[0] == ReleaseHybridReplica(3, tuple(range(24, 32)))
    assert not any(isinstance(a, RestartTraining) for a in actions)


def test_shape_change_or_losing_core_replicas_restarts_training():
    old = make_plan(8, 1, 4, [4, 4, 1, 1, 1, 1, 1, 1, 1, 1])
    _, actions = diff_plans(old, make_plan(4, 2, 4, [4, 4, 1, 1, 1, 1, 1, 1, 1, 1]))
    assert any(isinstance(a, RestartTraining) for a in actions)
    _, actions = diff_plans(old, make_plan(8, 1, 2, [4] * 6 + [1] * 8))  # core replicas 2, 3 would leave
    assert any(isinstance(a, RestartTraining) for a in actions)
    same, actions = diff_plans(old, old)
    assert actions == []


def test_planner_applies_only_worthwhile_plans_and_emits_events():
    problem = load_problem(SAMPLE)
    events = []
    planner = Planner(problem, on_event=events.append)
    first = planner.initial_plan()
    assert first.version == 1 and planner.current is first.plan
    # A current step much slower than the candidate: periodic trigger at step 10 applies.
    planner.set_policy(
        TriggerPolicy(
            plan_interval=10, warmup_steps=0, cooldown_steps=0, min_history=1, reconfiguration_cost_s=0.0
        )
    )
    applied = [planner.observe(StepObservation(s, train_s=100.0, rollout_s=100.0)) for s in range(11)]
    assert applied[0] is not None and applied[0].version == 2
    assert all(a is None for a in applied[1:10]) and applied[10] is not None
    # Measured reconfiguration costs outweigh a small gain: rejected.
    planner.record_reconfiguration(1e6)
    assert planner.observe(StepObservation(20, train_s=30.0, rollout_s=30.0)) is None
    assert events[-1].kind == "rejected"


def test_external_controller_vetoes_accepts_and_proposes():
    problem = load_problem(SAMPLE)
    policy = TriggerPolicy(
        plan_interval=1,
        warmup_steps=0,
        cooldown_steps=0,
        min_history=1,
        reconfiguration_cost_s=0.0,
        auto_apply=False,
        min_gain_ratio=0.0,
    )
    problem = dataclasses.replace(problem, config=dataclasses.replace(problem.config, policy=policy))
    planner = Planner(problem)
    planner.initial_plan()
    assert planner.observe(StepObservation(0, train_s=500.0, rollout_s=500.0)) is None
    assert planner.candidate is not None
    planner.veto_candidate("not now")
    assert planner.candidate is None
    with pytest.raises(RuntimeError):
        planner.accept_candidate()
    planner.observe(StepObservation(1, train_s=500.0, rollout_s=500.0))
    assert planner.accept_candidate().version == 2
    # An external plan is validated and re-priced.
    external = make_plan(8, 1, 4, [4, 4, 1, 1, 1, 1, 1, 1, 1, 1])
    adopted = planner.propose(external)
    assert adopted.plan.predicted_train_s > 0 and sum(b.num_requests for b in adopted.plan.buckets) == len(
        problem.history
    )
    clash = dataclasses.replace(external, instances=external.instances + (external.instances[0],))
    with pytest.raises(ValueError, match="used twice"):
        planner.propose(clash)


def test_rollout_placement_fills_any_range_its_sizes_fit():
    """Every set of power-of-two sizes whose sum fits in [first, end) is placed on disjoint blocks
    aligned to their sizes inside one node, even when training ends mid-block; a set that does
    not fit is refused. The reference is the count alone (top-down packing proves it suffices)."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        dpn = int(rng.choice([1, 2, 4, 8]))
        n = dpn * int(rng.integers(1, 4))
        first = int(rng.integers(0, n))
        sizes = [int(rng.choice([k for k in (1, 2, 4, 8) if k <= dpn])) for _ in range(rng.integers(1, 6))]
        if sum(sizes) > n - first:
            with pytest.raises(ValueError, match="cannot place"):
                place_rollout(first, n, dpn, sizes)
            continue
        instances = place_rollout(first, n, dpn, sizes)
        assert sorted(i.tp for i in instances) == sorted(sizes)
        used = [d for i in instances for d in i.devices]
        assert len(used) == len(set(used)) and all(first <= d < n for d in used)
        for i in instances:
            assert i.devices == tuple(range(i.devices[0], i.devices[0] + i.tp))
            assert i.devices[0] % i.tp == 0 and i.node == i.devices[0] // dpn == i.devices[-1] // dpn
