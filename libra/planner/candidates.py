"""The plans worth re-scoring outside the cost model (`Planner`'s rescorer simulates each).

The model prices a plan by its work and its slowest request; where it finds a mixed pool and a
homogeneous one within a percent or two of each other, or never proposes a mix at all because
every pool it tries bounds the step the same way, only a simulation can tell them apart. So the
candidates are the model's optimum, the best plan of each single TP size, and pools of two TP
sizes on the optimum's training split: for each pair of sizes the larger takes about a quarter,
a half and three quarters of the rollout devices, with thresholds fitted to the buckets'
capacity (`libra.planner.routing_thresholds`), as C-MLFQ would route them.
"""

from __future__ import annotations

from libra.planner.config import PlanningProblem
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.evaluate import evaluate_plan
from libra.planner.plan import BucketPlan, Plan, place_rollout
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_thresholds import capacity_thresholds
from libra.planner.search import (
    DEFAULT_ROLLOUT_FACTORS,
    DEFAULT_TRAIN_FACTORS,
    NoFeasiblePlan,
    search,
    search_within,
)

MIXED_SHARES = (0.25, 0.5, 0.75)
"""Shares of the rollout devices the larger TP size of a two-size pool takes."""


def candidate_plans(
    problem: PlanningProblem,
    train_factors: EfficiencyFactors = DEFAULT_TRAIN_FACTORS,
    rollout_factors: EfficiencyFactors = DEFAULT_ROLLOUT_FACTORS,
    optimum: Plan | None = None,
    mixed: bool = True,
) -> list[Plan]:
    """The optimum (`optimum`, or `search`'s), then the best plan with rollout instances of one TP
    size only, for each size of the space, in order of predicted step, then (`mixed`) the
    two-size pools of `mixed_pool_plans`. A size no plan of the space can use is left out, and so
    is a plan with the same training layout and rollout pool as one already listed."""
    plans = [optimum if optimum is not None else search(problem, train_factors, rollout_factors)]
    singles = []
    for tp in problem.config.search.rollout_tp_sizes:
        try:
            singles.append(search_within(problem, train_factors, rollout_factors, rollout_tp_sizes=(tp,)))
        except NoFeasiblePlan:
            continue
    others = sorted(singles, key=lambda p: p.predicted_step_s)
    if mixed:
        others += mixed_pool_plans(problem, plans[0], train_factors, rollout_factors)
    seen = {plans[0].layout_key}
    for plan in others:
        if plan.layout_key not in seen:
            seen.add(plan.layout_key)
            plans.append(plan)
    return plans


def mixed_pool_plans(
    problem: PlanningProblem,
    base: Plan,
    train_factors: EfficiencyFactors = DEFAULT_TRAIN_FACTORS,
    rollout_factors: EfficiencyFactors = DEFAULT_ROLLOUT_FACTORS,
) -> list[Plan]:
    """Pools of two TP sizes on `base`'s training split, priced by the model: for each pair of
    sizes that can serve the model on a node, the larger size's instance count nearest each of
    `MIXED_SHARES` of the rollout devices (at least one; the rest of the devices in the smaller
    size, at least one instance). Pools that cannot be placed are left out."""
    cluster = problem.cluster
    cost = RolloutCostModel(cluster, problem.model, problem.config, rollout_factors)
    sizes = [
        tp
        for tp in problem.config.search.rollout_tp_sizes
        if cluster.devices_per_node % tp == 0
        and problem.model.serves_at_tp(tp)
        and cost.token_capacity(tp) > 0
    ]
    train_devices = base.training.config.num_devices
    rollout_devices = cluster.num_devices - train_devices
    plans = []
    for i, small in enumerate(sizes):
        for large in sizes[i + 1 :]:
            counts = {max(1, round(share * rollout_devices / large)) for share in MIXED_SHARES}
            for n_large in sorted(counts):
                rest = rollout_devices - n_large * large
                if rest < small or rest % small:
                    continue
                pool = ((small, rest // small), (large, n_large))
                plan = _pool_plan(problem, base, pool, cost, train_factors, rollout_factors)
                if plan is not None:
                    plans.append(plan)
    return plans


def _pool_plan(problem, base, pool, cost, train_factors, rollout_factors) -> Plan | None:
    cluster = problem.cluster
    sizes = [tp for tp, n in pool for _ in range(n)]
    try:
        instances = place_rollout(
            base.training.config.num_devices, cluster.num_devices, cluster.devices_per_node, sizes
        )
    except ValueError:
        return None
    # Thresholds as the router would fit them without demotion (C-MLFQ's default).
    thresholds = capacity_thresholds(cost, pool, problem.history, demote=False)
    buckets = tuple(BucketPlan(tp, n, t, 0, 0.0) for (tp, n), t in zip(pool, thresholds, strict=True))
    unpriced = Plan(cluster.num_devices, base.training, instances, buckets, 0.0, 0.0)
    return evaluate_plan(problem, unpriced, train_factors, rollout_factors)
