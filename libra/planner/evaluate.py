"""Checking and pricing a plan that did not come from the search (an external controller's
`ProposePlan`, or the current plan under a new workload history)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from libra.planner.config import PlanningProblem
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.plan import BucketPlan, Plan
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS, DEFAULT_TRAIN_FACTORS, build_rollout_space
from libra.planner.training_cost import SequenceStats, TrainingCostModel, batch_split_error


def validate_plan(problem: PlanningProblem, plan: Plan) -> None:
    """Raises ValueError naming the first constraint the plan breaks."""
    cluster, batch = problem.cluster, problem.batch
    cfg = plan.training.config
    dpn = cluster.devices_per_node
    if plan.num_devices != cluster.num_devices:
        raise ValueError(f"plan.num_devices is {plan.num_devices}, the cluster has {cluster.num_devices}")
    if min(cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch) < 1:
        raise ValueError(f"training TP, PP, DP and micro-batch must be >= 1, got {cfg}")
    if dpn % cfg.tp or plan.training.first_device % cfg.tp:
        raise ValueError(f"training TP {cfg.tp} must divide the node ({dpn}) and align its first device")
    if problem.model.num_layers % cfg.pp:
        raise ValueError(f"training PP {cfg.pp} must divide the {problem.model.num_layers} layers")
    split_error = batch_split_error(batch, cfg, problem.config.search.uneven_data_parallel)
    if split_error:
        raise ValueError(f"global batch {batch.global_batch} cannot feed training {cfg}: {split_error}")
    train_cost = TrainingCostModel(cluster, problem.model, batch, problem.config, DEFAULT_TRAIN_FACTORS)
    if not train_cost.fits(cfg, SequenceStats.of(problem.history)):
        raise ValueError(f"training layout {cfg} does not fit device memory")
    if any(h >= cfg.dp or h < 0 for h in plan.training.hybrid_replicas):
        raise ValueError(f"hybrid replicas {plan.training.hybrid_replicas} must be in 0..{cfg.dp - 1}")
    used = Counter(plan.training.devices)
    for inst in plan.instances:
        if len(inst.devices) != inst.tp or inst.devices != tuple(
            range(inst.devices[0], inst.devices[0] + inst.tp)
        ):
            raise ValueError(
                f"instance {inst.instance_id}: needs {inst.tp} consecutive devices, got {inst.devices}"
            )
        if inst.devices[0] % inst.tp or inst.devices[0] // dpn != inst.devices[-1] // dpn:
            raise ValueError(
                f"instance {inst.instance_id}: devices {inst.devices} straddle a node or are not aligned"
            )
        used.update(inst.devices)
    clashes = sorted(d for d, count in used.items() if count > 1)
    outside = sorted(d for d in used if not 0 <= d < cluster.num_devices)
    if clashes or outside:
        raise ValueError(f"devices used twice {clashes} or outside the cluster {outside}")
    tps = [b.tp for b in plan.buckets]
    if tps != sorted(set(tps)) or Counter(i.tp for i in plan.instances) != Counter(
        {b.tp: b.num_instances for b in plan.buckets if b.num_instances}
    ):
        raise ValueError("buckets must be one per TP size, ascending, and match the instances")
    thresholds = [b.max_output_tokens for b in plan.buckets]
    if thresholds != sorted(thresholds):
        raise ValueError(f"bucket thresholds must ascend with TP, got {thresholds}")


def evaluate_plan(
    problem: PlanningProblem,
    plan: Plan,
    train_factors: EfficiencyFactors = DEFAULT_TRAIN_FACTORS,
    rollout_factors: EfficiencyFactors = DEFAULT_ROLLOUT_FACTORS,
) -> Plan:
    """The plan with predictions recomputed for `problem`: requests are routed by the plan's
    thresholds (the last bucket takes everything longer) and each bucket priced as the search does."""
    validate_plan(problem, plan)
    train_cost = TrainingCostModel(
        problem.cluster, problem.model, problem.batch, problem.config, train_factors
    )
    train_s = train_cost.step_s(plan.training.config, SequenceStats.of(problem.history))
    # Priced as the search prices it: batches bounded by the plan's own rollout size.
    space = build_rollout_space(problem, rollout_factors, plan.num_devices - plan.training.config.num_devices)
    buckets, first = [], 0
    for i, b in enumerate(plan.buckets):
        last = i == len(plan.buckets) - 1
        end = (
            len(space.outputs)
            if last
            else int(np.searchsorted(space.outputs, b.max_output_tokens, side="right"))
        )
        end = max(end, first)
        span = (
            space.bucket_makespan(b.tp, first, end, b.num_instances)
            if b.tp in space.work
            else (math.inf if end > first else 0.0)
        )
        buckets.append(BucketPlan(b.tp, b.num_instances, b.max_output_tokens, end - first, span))
        first = end
    rollout_s = max((b.predicted_makespan_s for b in buckets), default=math.inf)
    return Plan(
        plan.num_devices,
        plan.training,
        plan.instances,
        tuple(buckets),
        train_s,
        rollout_s,
        plan.search_time_s,
    )
