"""The starting layout of each policy: the training configuration, the rollout instances and the
router's buckets, built with the real planner (search, cost models, plan placement).

- PLANNED: the planner's initial plan (what Libra launches with).
- HOMOGENEOUS: one TP size for every rollout instance -- the policy's (`PolicySpec.rollout_tp`)
  or the one with the best per-device decode throughput that still holds the longest context --
  on the planned split (disaggregated) or on every device (colocated).
- FIXED_PATTERN: the original's hand-made layout, a fixed share of nodes training and each
  rollout node split into a fixed pattern of TP sizes, with thresholds fitted to the buckets'
  capacity (`libra.planner.routing_thresholds`) or the original's (`PolicySpec.original_thresholds`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from libra.planner.config import PlanningProblem, RequestRecord, TrainingBatch
from libra.planner.plan import Plan, RolloutInstance, place_rollout
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_thresholds import capacity_thresholds
from libra.planner.search import search
from libra.planner.training_cost import (
    SequenceStats,
    TrainingConfig,
    TrainingCostModel,
    batch_split_error,
)
from libra.scheduler.config import BucketConfig, CmlfqConfig, bucket_of
from libra.sim.config import Mode, PolicySpec, Pool, SimConfig
from libra.training.elastic import HybridPoolLimits

_MAX_TOKENS = 2**31 - 1
DEFAULT_THRESHOLDS = {1: 4000, 2: 12000, 4: 30000, 8: 40960}
"""C-MLFQ's per-TP thresholds in the original's configs (`reference/libra-notes.md` §4)."""


@dataclass(frozen=True)
class Layout:
    training: TrainingConfig
    train_devices: tuple[int, ...]
    instances: tuple[RolloutInstance, ...]
    bucket_tps: tuple[int, ...]
    """TP size of each router bucket, ascending."""
    thresholds: tuple[int, ...]
    plan: Plan | None = None

    def bucket_of(self, tp: int) -> int:
        return bucket_of(self.bucket_tps, tp)

    def cmlfq_config(self, settings: CmlfqConfig, max_queue_length: int) -> CmlfqConfig:
        """`settings` on this layout's buckets, with `max_queue_length`."""
        return replace(
            settings,
            buckets=bucket_configs(self.bucket_tps, self.thresholds),
            max_queue_length=max_queue_length,
        )


def planning_problem(
    config: SimConfig,
    history: tuple[RequestRecord, ...],
    max_staleness: int,
    elastic: bool = False,
    tail_staleness: int | None = None,
) -> PlanningProblem:
    """The planner's problem for the config. `elastic`: the policy has the elastic hybrid pool
    (the design's k-replica pool, unbounded), whose replicas take group-granular unequal shares,
    so training may take DP sizes that do not divide the batch's groups
    (`SearchConfig.uneven_data_parallel`). Without it (and for the launch plan) training forms
    Megatron DP groups with equal shares, and the pool pairs nothing: every training change is a
    restart. `tail_staleness`: the policy's (None: the config's, which the policies that take the
    config's staleness use)."""
    tail = config.tail_staleness if tail_staleness is None else tail_staleness
    batch = replace(config.batch, max_staleness=max_staleness, tail_staleness=tail)
    search = replace(config.planner.search, uneven_data_parallel=elastic)
    pool = HybridPoolLimits() if elastic else HybridPoolLimits(per_core_replica=0)
    return PlanningProblem(
        config.cluster, config.model, batch, history, replace(config.planner, search=search, hybrid_pool=pool)
    )


def best_training_config(
    config: SimConfig, batch: TrainingBatch, history: tuple[RequestRecord, ...], num_devices: int
) -> TrainingConfig:
    """The fastest feasible training layout on at most `num_devices` devices (the planner's
    training cost and memory models; the same divisibility rules as its search, so e.g. 48
    devices train on 32 when the batch's 32 groups cannot split over a DP of 3)."""
    cost = TrainingCostModel(config.cluster, config.model, batch, config.planner, config.train_factors)
    seqs = SequenceStats.of(history)
    groups = batch.global_batch // batch.group_size
    search_space = config.planner.search
    best: tuple[float, int, TrainingConfig] | None = None
    for tp in search_space.train_tp_sizes:
        if (
            config.devices_per_node % tp
            or config.model.num_attention_heads % tp
            or config.model.num_kv_heads % tp
        ):
            continue
        for pp in search_space.train_pp_sizes:
            if config.model.num_layers % pp:
                continue
            for dp, mb in ((d, m) for d in range(1, groups + 1) for m in batch.micro_batch_sizes):
                cfg = TrainingConfig(tp, pp, dp, mb)
                # These layouts never change (no elastic pool): equal shares, as Megatron DP.
                if tp * pp * dp > num_devices or batch_split_error(batch, cfg, uneven_data_parallel=False):
                    continue
                if cost.fits(cfg, seqs):
                    step = cost.step_s(cfg, seqs)
                    if best is None or (step, cfg.num_devices, cfg) < best:
                        best = (step, cfg.num_devices, cfg)
    if best is None:
        raise ValueError(f"no training layout of the model fits on {num_devices} devices")
    return best[2]


def homogeneous_tp(config: SimConfig, history: tuple[RequestRecord, ...]) -> int:
    """The TP size with the best per-device decode throughput among those that can serve the
    workload (`rollout_size_error`)."""
    cost = RolloutCostModel(config.cluster, config.model, config.planner, config.rollout_factors)
    best = None
    for tp in config.planner.search.rollout_tp_sizes:
        if rollout_size_error(config, history, tp) is not None:
            continue
        per_device = cost.instance_profile(tp, history).throughput_tokens_per_s / tp
        if best is None or per_device > best[0]:
            best = (per_device, tp)
    if best is None:
        raise ValueError("no rollout TP size holds the longest context of the history")
    return best[1]


def rollout_size_error(config: SimConfig, history: tuple[RequestRecord, ...], tp: int) -> str | None:
    """Why TP-tp instances cannot serve the workload (None: they can): the size does not divide
    a node, cannot shard the model's heads, or an instance's KV does not hold the history's
    longest context."""
    if tp < 1 or config.devices_per_node % tp:
        return f"rollout TP-{tp} does not divide a node of {config.devices_per_node} devices"
    if not config.model.serves_at_tp(tp):
        return (
            f"rollout TP-{tp} cannot shard the model's {config.model.num_attention_heads} query / "
            f"{config.model.num_kv_heads} KV heads"
        )
    capacity = RolloutCostModel(
        config.cluster, config.model, config.planner, config.rollout_factors
    ).token_capacity(tp)
    longest = max(r.total_tokens for r in history)
    if capacity < longest:
        return f"a TP-{tp} instance holds {capacity} KV tokens, not the history's longest context ({longest})"
    return None


def build_layout(
    config: SimConfig, policy: PolicySpec, history: tuple[RequestRecord, ...], initial_plan: Plan | None
) -> Layout:
    """The policy's starting layout. `initial_plan` is the planner's (computed once per run and
    shared, so that every policy that starts from it starts from the same one)."""
    n, dpn = config.num_devices, config.devices_per_node
    if policy.mode is Mode.COLOCATED_SYNC:
        tp = homogeneous_tp(config, history)
        training = best_training_config(config, replace(config.batch, max_staleness=0), history, n)
        instances = place_rollout(0, n, dpn, [tp] * (n // tp))
        return Layout(training, tuple(range(n)), instances, (tp,), (_MAX_TOKENS,))
    if policy.pool is Pool.FIXED_PATTERN:
        train_nodes = min(config.num_nodes - 1, max(1, round(config.num_nodes * config.fixed_train_fraction)))
        n_train = train_nodes * dpn
        training = best_training_config(config, config.batch, history, n_train)
        sizes = [tp for _ in range(config.num_nodes - train_nodes) for tp in config.fixed_node_pattern]
        tps = tuple(sorted(set(sizes)))
        if policy.original_thresholds:
            thresholds = _strictly_increasing([DEFAULT_THRESHOLDS.get(tp, 2**20) for tp in tps])
        else:
            cost = RolloutCostModel(config.cluster, config.model, config.planner, config.rollout_factors)
            counts = [(tp, sizes.count(tp)) for tp in tps]
            thresholds = capacity_thresholds(cost, counts, history, config.cmlfq.demote)
        return Layout(training, tuple(range(n_train)), place_rollout(n_train, n, dpn, sizes), tps, thresholds)
    if initial_plan is None:
        raise ValueError(f"policy {policy.name} needs the planner's initial plan")
    training = initial_plan.training.config
    n_train = training.num_devices
    if policy.pool is Pool.HOMOGENEOUS:
        tp = policy.rollout_tp or homogeneous_tp(config, history)
        error = rollout_size_error(config, history, tp)
        if error is not None:
            raise ValueError(error)
        if (n - n_train) // tp == 0:
            raise ValueError(f"the {n - n_train} rollout devices hold no TP-{tp} instance")
        instances = place_rollout(n_train, n, dpn, [tp] * ((n - n_train) // tp))
        return Layout(training, tuple(range(n_train)), instances, (tp,), (_MAX_TOKENS,))
    tps, thresholds = plan_buckets(initial_plan)
    return Layout(
        training, initial_plan.training.devices, initial_plan.instances, tps, thresholds, initial_plan
    )


def plan_buckets(plan: Plan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The router buckets of a plan: the TP sizes it runs instances of, ascending, and their
    thresholds (each bucket's largest output length in the planned history)."""
    planned = [b for b in plan.buckets if b.num_instances > 0]
    return tuple(b.tp for b in planned), _strictly_increasing([b.max_output_tokens for b in planned])


def bucket_configs(tps: tuple[int, ...], thresholds: tuple[int, ...]) -> tuple[BucketConfig, ...]:
    return tuple(BucketConfig(f"tp{tp}", tp, t) for tp, t in zip(tps, thresholds, strict=True))


def initial_plan(config: SimConfig, history: tuple[RequestRecord, ...], max_staleness: int) -> Plan:
    return search(
        planning_problem(config, history, max_staleness), config.train_factors, config.rollout_factors
    )


def trajectories_in_flight(config: SimConfig, policy: PolicySpec) -> int:
    """What the policy's rollout holds at once: the train batch, once per version it runs ahead."""
    staleness = config.batch.max_staleness if policy.max_staleness is None else policy.max_staleness
    return config.batch.global_batch * (1 if policy.mode is Mode.COLOCATED_SYNC else staleness + 1)


def _strictly_increasing(values: list[int]) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        out.append(max(v, out[-1] + 1) if out else max(v, 1))
    return tuple(min(v, _MAX_TOKENS) for v in out)
