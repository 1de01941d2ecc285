"""The exact search against brute force, and every constraint on the plans it returns."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import Counter

import numpy as np
import pytest

from libra.backends.profiles import A800_SXM4_80GB
from libra.config import load_from_file
from libra.planner.config import ClusterSpec, PlanningProblem
from libra.planner.search import (
    DEFAULT_ROLLOUT_FACTORS,
    DEFAULT_TRAIN_FACTORS,
    NoFeasiblePlan,
    RolloutSpace,
    build_rollout_space,
    search,
)
from libra.planner.training_cost import SequenceStats, TrainingCostModel
from libra.planner.workload import synthetic_history
from tests.planner.helpers import brute_force_optimum, random_problem

NUM_RANDOM_CLUSTERS = 100
search_module = sys.modules["libra.planner.search"]  # the package re-exports the function `search`


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
    problem = load_from_file("configs/planner_qwen3_14b_48xa800.py", "planning_problem", PlanningProblem)
    plan = search(problem)
    check_constraints(problem, plan)
    assert plan.predicted_step_s < math.inf and plan.num_devices == 48


def _reference_search(problem, **kwargs):
    """`search` with the fast path off: every device count from the full DP with its choices
    (`RolloutSpace.min_devices`), no memo, and a fresh space for every round -- the code as it
    was before the device-count fast path."""
    patch = pytest.MonkeyPatch()
    original = search_module._search_space
    patch.setattr(RolloutSpace, "min_device_count", lambda self, t, cap=None: self.min_devices(t, cap)[0])
    patch.setattr(
        search_module,
        "_search_space",
        lambda problem, candidates, factors, devices, tolerance=None, spaces=None: original(
            problem, candidates, factors, devices, tolerance, None
        ),
    )
    try:
        return search(problem, **kwargs)
    finally:
        patch.undo()


def _problem_at(num_devices: int, seed: int = 0) -> PlanningProblem:
    sample = load_from_file("configs/planner_qwen3_14b_48xa800.py", "planning_problem", PlanningProblem)
    return dataclasses.replace(
        sample,
        cluster=ClusterSpec(num_devices // 8, 8, A800_SXM4_80GB),
        history=synthetic_history(256, seed=seed, median_output_tokens=1500, sigma=0.8),
    )


def _same_plan(a, b) -> bool:
    return (a.training, a.instances, a.buckets, a.predicted_train_s, a.predicted_rollout_s) == (
        b.training,
        b.instances,
        b.buckets,
        b.predicted_train_s,
        b.predicted_rollout_s,
    )


@pytest.mark.parametrize("num_devices, seed", [(48, 0), (48, 3), (160, 1), (1024, 2)])
def test_fast_path_returns_the_reference_plan_at_scale(num_devices, seed):
    """Fixed inputs like benchmarks/planner.py's: the plan -- layout, buckets, predictions to the
    last bit -- is the one the reference path returns."""
    problem = _problem_at(num_devices, seed)
    assert _same_plan(search(problem), _reference_search(problem))


@pytest.mark.parametrize("seed", range(0, NUM_RANDOM_CLUSTERS, 5))
def test_fast_path_returns_the_reference_plan_on_small_clusters(seed):
    problem = random_problem(seed)
    for kwargs in ({}, {"rollout_devices": problem.cluster.num_devices // 2}):
        try:
            fast = search(problem, **kwargs)
        except NoFeasiblePlan:
            with pytest.raises(NoFeasiblePlan):
                _reference_search(problem, **kwargs)
            continue
        assert _same_plan(fast, _reference_search(problem, **kwargs))


def test_device_count_equals_the_full_dp_bit_for_bit():
    rng = np.random.default_rng(0)
    for seed in range(10):
        problem = _problem_at(48, seed) if seed < 3 else random_problem(seed)
        space = build_rollout_space(problem, DEFAULT_ROLLOUT_FACTORS, problem.cluster.num_devices // 2)
        if not space.tp_sizes:
            continue
        for target in space.upper_bound * rng.uniform(0.0005, 1.2, size=40):
            for cap in (None, float(target) * rng.uniform(1.0, 3.0)):
                full = space.min_devices(float(target), cap)[0]
                assert space.min_device_count(float(target), cap) == full
                assert space.min_device_count(float(target), cap) == full  # the remembered one


def test_the_tail_bound_widens_the_latency_window_not_the_launch():
    """`tail_staleness` t: a trajectory may span s + t + 1 steps, so its latency weighs 1/(s+t+1)
    of a step; the trajectories in flight (what fills the batches, hence the work) stay those of
    the launch depth s."""
    problem = _problem_at(48)
    batch = dataclasses.replace(problem.batch, max_staleness=1)
    plain = dataclasses.replace(problem, batch=batch)
    tailed = dataclasses.replace(problem, batch=dataclasses.replace(batch, tail_staleness=2))
    a = build_rollout_space(plain, DEFAULT_ROLLOUT_FACTORS, 16)
    b = build_rollout_space(tailed, DEFAULT_ROLLOUT_FACTORS, 16)
    for k in a.tp_sizes:
        np.testing.assert_allclose(b.work[k], a.work[k])
        np.testing.assert_allclose(b.latency[k], a.latency[k] * 2 / 4)
