"""Small planning problems and an independent brute-force optimiser over the search's space."""

from __future__ import annotations

import itertools
import math

import numpy as np

from libra.backends.base import HardwareProfile
from libra.planner.config import (
    ClusterSpec,
    ModelArch,
    PlannerConfig,
    PlanningProblem,
    RequestRecord,
    SearchConfig,
    TrainingBatch,
    TriggerPolicy,
)
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS, DEFAULT_TRAIN_FACTORS, build_rollout_space
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel

TOY_PROFILE = HardwareProfile(
    name="toy",
    peak_bf16_flops=2e12,
    memory_bandwidth_bytes_per_s=1.5e12,
    memory_capacity_bytes=int(16e9),
    intra_node_bandwidth_bytes_per_s=5e10,
    inter_node_bandwidth_bytes_per_s=5e9,
    devices_per_node=4,
)

EVERY_STEP = TriggerPolicy(
    plan_interval=1,
    warmup_steps=0,
    cooldown_steps=0,
    min_history=1,
    reconfiguration_cost_s=0.0,
    restart_cost_s=0.0,
)
"""A policy that considers a re-plan at every step and prices moves at nothing."""


def random_problem(seed: int) -> PlanningProblem:
    """A small random cluster/model/workload whose whole space brute force can enumerate."""
    rng = np.random.default_rng(seed)
    dpn = int(rng.choice([2, 4]))
    num_nodes = int(rng.integers(1, 4 if dpn == 4 else 6))
    n = dpn * num_nodes
    heads = int(rng.choice([4, 8]))
    model = ModelArch(
        num_layers=int(rng.choice([4, 8])),
        hidden_size=heads * 64,
        num_attention_heads=heads,
        num_kv_heads=int(rng.choice([2, 4])),
        ffn_hidden_size=heads * 64 * 3,
        vocab_size=8192,
        num_params=int(rng.choice([1e8, 4e8, 1.6e9, 4e9])),
    )
    outputs = rng.choice([64, 256, 1024, 4096], size=int(rng.integers(3, 8)), p=[0.4, 0.3, 0.2, 0.1])
    history = tuple(RequestRecord(int(rng.integers(16, 2048)), int(o)) for o in outputs)
    granularity = int(rng.choice([0, dpn, 2 * dpn])) if n >= 2 * dpn else 0
    rollout_sizes = tuple(int(k) for k in rng.choice([1, 2, 4], size=int(rng.integers(1, 4)), replace=False))
    if granularity == 0 and rng.random() < 0.3:  # sub-node split: rollout starts mid-block
        granularity = 1
    search = SearchConfig(
        rollout_tp_sizes=rollout_sizes,
        train_tp_sizes=(1, 2, 4),
        train_pp_sizes=(1, 2),
        split_granularity=granularity,
        min_train_devices=int(rng.integers(1, 3)),
        min_rollout_devices=int(rng.integers(1, 3)),
    )
    group = int(rng.choice([2, 4]))
    batch = TrainingBatch(
        global_batch=group * int(rng.choice([2, 4, 8])),
        group_size=group,
        micro_batch_sizes=(1, 2, 4),
        max_staleness=int(rng.integers(0, 2)),
    )
    cluster = ClusterSpec(num_nodes, dpn, TOY_PROFILE)
    return PlanningProblem(
        cluster, model, batch, history, PlannerConfig(search=search, activation_workspace_bytes=2**28)
    )


def group_shares(num_groups: int, dp: int) -> list[int]:
    """Whole groups per replica, dealt one at a time round the replicas (independent of the
    planner's ceil formula)."""
    shares = [0] * dp
    for g in range(num_groups):
        shares[g % dp] += 1
    return shares


def brute_force_training(problem: PlanningProblem) -> list[tuple[TrainingConfig, float]]:
    """Every training configuration satisfying the constraints, written out independently. With
    `uneven_data_parallel` every replica gets at least one whole group and the largest share
    splits into whole micro-batches; without it the DP shares are equal."""
    cluster, model, batch, search = problem.cluster, problem.model, problem.batch, problem.config.search
    g = search.split_granularity or cluster.devices_per_node
    cost = TrainingCostModel(cluster, model, batch, problem.config, DEFAULT_TRAIN_FACTORS)
    seqs = SequenceStats.of(problem.history)
    num_groups = batch.global_batch // batch.group_size
    found = []
    for tp, pp, dp, mb in itertools.product(
        search.train_tp_sizes,
        search.train_pp_sizes,
        range(1, cluster.num_devices + 1),
        batch.micro_batch_sizes,
    ):
        n = tp * pp * dp
        if search.uneven_data_parallel:
            shares = group_shares(num_groups, dp)
            splits = min(shares) >= 1 and (max(shares) * batch.group_size) % mb == 0
        else:
            per_replica = batch.global_batch // dp
            splits = batch.global_batch % (dp * mb) == 0 and per_replica % batch.group_size == 0
        ok = (
            tp <= cluster.devices_per_node
            and model.num_attention_heads % tp == 0
            and model.num_kv_heads % tp == 0
            and model.num_layers % pp == 0
            and n % g == 0
            and search.min_train_devices <= n <= cluster.num_devices - search.min_rollout_devices
            and splits
        )
        cfg = TrainingConfig(tp, pp, dp, mb)
        if ok and cost.fits(cfg, seqs):
            found.append((cfg, cost.step_s(cfg, seqs)))
    return found


def brute_force_rollout(
    problem: PlanningProblem, max_devices: int, rollout_devices: int | None = None
) -> list[float]:
    """best[n] = least rollout makespan over every multiset of instances with total size <= n and
    every assignment of consecutive ranges of the sorted history to its TP sizes (batches bounded
    by the in-flight trajectories over `rollout_devices`, as the search's space of that size)."""
    space = build_rollout_space(problem, DEFAULT_ROLLOUT_FACTORS, rollout_devices)
    sizes = space.tp_sizes
    cuts = [int(b) for b in space.boundaries]
    r = len(space.outputs)
    best = [math.inf] * (max_devices + 1)
    ranges = [range(max_devices // k + 1) for k in sizes]
    for counts in itertools.product(*ranges):
        used = sum(k * m for k, m in zip(sizes, counts, strict=True))
        if used > max_devices:
            continue
        present = [(k, m) for k, m in zip(sizes, counts, strict=True) if m > 0]
        makespan = math.inf
        for inner in itertools.combinations_with_replacement(cuts, len(present) - 1) if present else []:
            bounds = [0, *inner, r]
            span = 0.0
            for (k, m), first, end in zip(present, bounds, bounds[1:], strict=False):
                if first == end:
                    continue
                span = max(span, sum(space.work[k][first:end]) / m, max(space.latency[k][first:end]))
            makespan = min(makespan, span)
        for n in range(used, max_devices + 1):
            best[n] = min(best[n], makespan)
    return best


def brute_force_optimum(problem: PlanningProblem, rollout_devices: int | None = None) -> float:
    training = brute_force_training(problem)
    rollout = brute_force_rollout(problem, problem.cluster.num_devices, rollout_devices)
    return min(
        (max(step, rollout[problem.cluster.num_devices - cfg.num_devices]) for cfg, step in training),
        default=math.inf,
    )
