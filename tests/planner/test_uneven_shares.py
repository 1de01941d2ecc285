"""Training DP sizes that do not divide the GRPO groups (`SearchConfig.uneven_data_parallel`):
replicas take whole groups, ceil(G/DP) or floor(G/DP) of them, and the step waits for the largest
share. The search against an independent brute force over that space, the pricing of the largest
share, and the validation of plans with and without the option."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from libra.config import load_from_file
from libra.planner.config import PlanningProblem, TrainingBatch
from libra.planner.evaluate import validate_plan
from libra.planner.plan import TrainingPlacement
from libra.planner.search import DEFAULT_TRAIN_FACTORS, NoFeasiblePlan, search
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel
from tests.planner.helpers import brute_force_optimum, group_shares, random_problem

NUM_RANDOM_CLUSTERS = 100
SAMPLE = "configs/planner_qwen3_14b_48xa800.py"


def with_uneven(problem: PlanningProblem, on: bool = True) -> PlanningProblem:
    search_cfg = dataclasses.replace(problem.config.search, uneven_data_parallel=on)
    return dataclasses.replace(problem, config=dataclasses.replace(problem.config, search=search_cfg))


def random_uneven_problem(seed: int) -> PlanningProblem:
    """`random_problem` with the option on, group counts that few DP sizes divide, and (often)
    a split granularity of one device, so that uneven DP sizes are reachable and sometimes best."""
    problem = random_problem(seed)
    rng = np.random.default_rng(10_000 + seed)
    group_size = problem.batch.group_size
    batch = dataclasses.replace(problem.batch, global_batch=group_size * int(rng.choice([3, 5, 6, 7, 8, 12])))
    granularity = 1 if rng.random() < 0.6 else problem.config.search.split_granularity
    search_cfg = dataclasses.replace(
        problem.config.search, split_granularity=granularity, uneven_data_parallel=True
    )
    return dataclasses.replace(
        problem, batch=batch, config=dataclasses.replace(problem.config, search=search_cfg)
    )


@pytest.fixture(scope="module")
def random_plans() -> dict[int, tuple[PlanningProblem, object]]:
    """seed -> (problem with uneven shares on, its plan or None when infeasible)."""
    plans = {}
    for seed in range(NUM_RANDOM_CLUSTERS):
        problem = random_uneven_problem(seed)
        try:
            plans[seed] = (problem, search(problem))
        except NoFeasiblePlan:
            plans[seed] = (problem, None)
    return plans


@pytest.mark.parametrize("seed", range(NUM_RANDOM_CLUSTERS))
def test_uneven_search_matches_brute_force(seed, random_plans):
    problem, plan = random_plans[seed]
    if plan is None:
        assert not math.isfinite(brute_force_optimum(problem, problem.cluster.num_devices // 2))
        return
    rollout_devices = plan.num_devices - plan.training.config.num_devices
    fixed = search(problem, rollout_devices=rollout_devices)
    assert fixed.predicted_step_s == pytest.approx(brute_force_optimum(problem, rollout_devices), rel=1e-7)
    for p in (plan, fixed):
        cfg, batch = p.training.config, problem.batch
        shares = group_shares(batch.global_batch // batch.group_size, cfg.dp)
        assert min(shares) >= 1 and (max(shares) * batch.group_size) % cfg.micro_batch == 0
        validate_plan(problem, p)


def test_uneven_space_is_exercised_and_never_worse(random_plans):
    """Some optima use a DP that does not divide the groups (so the brute-force comparison above
    covers uneven shares), and at a fixed rollout size the larger space is never worse."""
    uneven_optima, strictly_better = 0, 0
    for problem, plan in random_plans.values():
        if plan is None:
            continue
        groups = problem.batch.global_batch // problem.batch.group_size
        uneven_optima += groups % plan.training.config.dp != 0
        rollout_devices = plan.num_devices - plan.training.config.num_devices
        uneven = search(problem, rollout_devices=rollout_devices)
        try:
            even_s = search(with_uneven(problem, False), rollout_devices=rollout_devices).predicted_step_s
        except NoFeasiblePlan:
            even_s = math.inf
        assert uneven.predicted_step_s <= even_s * (1 + 1e-7)
        strictly_better += uneven.predicted_step_s < even_s * (1 - 1e-6)
    assert uneven_optima >= 5 and strictly_better >= 4


def test_uneven_step_is_priced_on_the_largest_share():
    """DP 3 over 8 groups waits for a replica with 3 groups: exactly the step (and the memory)
    of DP 3 over 9 groups, where every replica carries 3 -- and slower than DP 4 (2 groups each),
    faster than DP 2 (4 each)."""
    problem = load_from_file(SAMPLE, "planning_problem", PlanningProblem)
    seqs = SequenceStats.of(problem.history)

    def cost(num_groups: int) -> TrainingCostModel:
        batch = TrainingBatch(global_batch=4 * num_groups, group_size=4, recompute="full")
        return TrainingCostModel(problem.cluster, problem.model, batch, problem.config, DEFAULT_TRAIN_FACTORS)

    for mb in (1, 2, 4):
        uneven, full = cost(8), cost(9)
        cfg = TrainingConfig(4, 2, 3, mb)
        assert uneven.num_micro_batches(cfg) == 12 // mb
        assert uneven.step_s(cfg, seqs) == full.step_s(cfg, seqs)
        assert uneven.memory_bytes(cfg, seqs) == full.memory_bytes(cfg, seqs)
        faster, slower = TrainingConfig(4, 2, 4, mb), TrainingConfig(4, 2, 2, mb)
        assert uneven.step_s(faster, seqs) < uneven.step_s(cfg, seqs) < uneven.step_s(slower, seqs)


def test_validate_plan_needs_the_option_for_uneven_shares():
    problem = load_from_file(SAMPLE, "planning_problem", PlanningProblem)  # 128 sequences in 32 groups of 4
    plan = search(problem)
    cfg = plan.training.config
    assert 32 % cfg.dp == 0
    # One more replica of the same shape (a hybrid replica joining): 32 groups over DP+1.
    grown = TrainingConfig(cfg.tp, cfg.pp, cfg.dp + 1, cfg.micro_batch)
    assert 32 % grown.dp != 0
    instances = tuple(i for i in plan.instances if min(i.devices) >= grown.num_devices)
    counts = {b.tp: sum(1 for i in instances if i.tp == b.tp) for b in plan.buckets}
    buckets = tuple(dataclasses.replace(b, num_instances=counts[b.tp]) for b in plan.buckets)
    candidate = dataclasses.replace(
        plan, training=TrainingPlacement(grown), instances=instances, buckets=buckets
    )
    with pytest.raises(ValueError, match="uneven_data_parallel"):
        validate_plan(problem, candidate)
    validate_plan(with_uneven(problem), candidate)
    too_many = dataclasses.replace(candidate, training=TrainingPlacement(TrainingConfig(1, 1, 33, 1)))
    with pytest.raises(ValueError, match="exceeds the 32 groups"):
        validate_plan(with_uneven(problem), too_many)
    odd_micro = dataclasses.replace(
        candidate, training=TrainingPlacement(TrainingConfig(cfg.tp, cfg.pp, 5, 8))
    )  # shares of 7 and 6 groups: 28 sequences do not split into micro-batches of 8
    with pytest.raises(ValueError, match="micro-batches of 8"):
        validate_plan(with_uneven(problem), odd_micro)
