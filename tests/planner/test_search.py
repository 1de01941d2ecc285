"""The exact search against brute force, and every constraint on the plans it returns."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from libra.planner.config import load_problem
from libra.planner.search import (
    DEFAULT_ROLLOUT_FACTORS,
    DEFAULT_TRAIN_FACTORS,
    NoFeasiblePlan,
    build_rollout_space,
    search,
)
from libra.planner.training_cost import SequenceStats, TrainingCostModel
from tests.planner.helpers import brute_force_optimum, random_problem

NUM_RANDOM_CLUSTERS = 100


def check_constraints(problem, plan) -> None:
    cluster, batch, search_cfg = problem.cluster, problem.batch, problem.config.search
    cfg = plan.training.config
    g = search_cfg.split_granularity or cluster.devices_per_node
    n_train = cfg.num_devices
    assert n_train % g == 0
    assert search_cfg.min_train_devices <= n_train <= cluster.num_devices - search_cfg.min_rollout_devices
    assert batch.global_batch % (cfg.dp * cfg.micro_batch) == 0
    assert (batch.global_batch // cfg.dp) % batch.group_size == 0
    assert cluster.devices_per_node % cfg.tp == 0 and problem.model.num_layers % cfg.pp == 0
    train_cost = TrainingCostModel(cluster, problem.model, batch, problem.config, DEFAULT_TRAIN_FACTORS)
    assert train_cost.fits(cfg, SequenceStats.of(problem.history))
    # Devices: disjoint, in range, instances aligned inside one node.
    used = Counter(plan.training.devices)
    for inst in plan.instances:
        assert inst.tp in search_cfg.rollout_tp_sizes
        assert len(inst.devices) == inst.tp and inst.devices[0] % inst.tp == 0
        assert {d // cluster.devices_per_node for d in inst.devices} == {inst.node}
        used.update(inst.devices)
    assert all(count == 1 for count in used.values())
    assert all(0 <= d < cluster.num_devices for d in used)
    for r in range(cfg.dp):  # TP groups of each replica stay inside a node
        devices = plan.training.replica_devices(r)
        for start in range(0, len(devices), cfg.tp):
            group = devices[start : start + cfg.tp]
            assert len({d // cluster.devices_per_node for d in group}) == 1
    # Buckets: ascending TP and thresholds, every request routed to a bucket whose KV it fits.
    rollout_devices = plan.num_devices - cfg.num_devices
    space = build_rollout_space(problem, DEFAULT_ROLLOUT_FACTORS, rollout_devices)
    assert [b.tp for b in plan.buckets] == sorted(b.tp for b in plan.buckets)
    assert sum(b.num_requests for b in plan.buckets) == len(problem.history)
    assert Counter(i.tp for i in plan.instances) == Counter({b.tp: b.num_instances for b in plan.buckets})
    first = 0
    for b in plan.buckets:
        end = first + b.num_requests
        assert math.isfinite(space.bucket_makespan(b.tp, first, end, b.num_instances))
        assert b.predicted_makespan_s == pytest.approx(
            space.bucket_makespan(b.tp, first, end, b.num_instances)
        )
        first = end
    thresholds = [b.max_output_tokens for b in plan.buckets]
    assert thresholds == sorted(thresholds) and len(set(thresholds)) == len(thresholds)


@pytest.mark.parametrize("seed", range(NUM_RANDOM_CLUSTERS))
def test_search_matches_brute_force(seed):
    """Exact in the space of a given rollout size (the one the fixed point settled on, or any
    size when no plan is feasible)."""
    problem = random_problem(seed)
    try:
        plan = search(problem)
    except NoFeasiblePlan:
        assert not math.isfinite(brute_force_optimum(problem, problem.cluster.num_devices // 2))
        return
    rollout_devices = plan.num_devices - plan.training.config.num_devices
    expected = brute_force_optimum(problem, rollout_devices)
    fixed = search(problem, rollout_devices=rollout_devices)
    assert fixed.predicted_step_s == pytest.approx(expected, rel=1e-7)
    check_constraints(problem, fixed)
    check_constraints(problem, plan)


def test_random_clusters_exercise_the_space():
    """The randomized cases are not degenerate: several training shapes, rollout spaces with
    several TP sizes to mix (the brute force enumerates every multiset of them), infeasible ones.
    (Whether the optimum mixes sizes is the cost model's call: when the trajectories in flight
    bound the batches, the larger TP size's fewer weight copies usually win outright.)"""
    shapes, mixable, infeasible = set(), 0, 0
    for seed in range(NUM_RANDOM_CLUSTERS):
        problem = random_problem(seed)
        try:
            plan = search(problem)
        except NoFeasiblePlan:
            infeasible += 1
            continue
        shapes.add((plan.training.config.tp, plan.training.config.pp))
        mixable += len(build_rollout_space(problem, DEFAULT_ROLLOUT_FACTORS).tp_sizes) > 1
    assert len(shapes) >= 3 and mixable >= 10 and infeasible >= 1


def test_sample_config_plans_within_constraints():
    problem = load_problem("configs/planner_qwen3_14b_48xa800.py")
    plan = search(problem)
    check_constraints(problem, plan)
    assert plan.predicted_step_s < math.inf and plan.num_devices == 48
