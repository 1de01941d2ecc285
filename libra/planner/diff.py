"""From the current plan to a new one: which replicas become hybrid, and the typed actions the
controller executes on node agents (in order).

Training grows or shrinks by whole DP replicas through the elastic hybrid pool when its shape
(TP, PP, micro-batch) is unchanged, the core replicas stay and the pool can pair the hybrids
(`HybridPoolLimits`): new replicas join as hybrid (the core process groups are not rebuilt), and
only hybrid replicas may leave. Any other change
of the training layout restarts training from its latest checkpoint. Rollout instances are
matched by (TP, devices): unchanged ones keep running; the others are stopped -- draining their
in-flight trajectories, or cutting them (they resume elsewhere from their kept tokens) -- before
new ones start on the freed devices; instances whose devices go to training stop after the new
ones have started, and new hybrid replicas join last.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from libra.planner.plan import Plan, RolloutInstance
from libra.training.elastic import HybridPoolLimits

UNBOUNDED_POOL = HybridPoolLimits()


@dataclass(frozen=True)
class ReleaseHybridReplica:
    replica: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class StopRolloutInstance:
    instance_id: str
    devices: tuple[int, ...]
    cut_inflight: bool
    """True: abort in-flight trajectories now (they resume on another instance); False: drain."""


@dataclass(frozen=True)
class RestartTraining:
    """Checkpoint, stop every training rank, start the new layout and load the checkpoint."""

    old_devices: tuple[int, ...]
    new_devices: tuple[int, ...]
    tp: int
    pp: int
    dp: int
    micro_batch: int


@dataclass(frozen=True)
class JoinHybridReplica:
    replica: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class StartRolloutInstance:
    instance_id: str
    tp: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class SetBucketThresholds:
    thresholds: tuple[tuple[int, int], ...]
    """(TP size, max output tokens) per bucket, ascending."""


Action = (
    ReleaseHybridReplica
    | StopRolloutInstance
    | RestartTraining
    | JoinHybridReplica
    | StartRolloutInstance
    | SetBucketThresholds
)


def mark_hybrid(old: Plan | None, new: Plan, pool: HybridPoolLimits = UNBOUNDED_POOL) -> Plan:
    """`new` with its hybrid replicas set relative to `old` (see the module docstring)."""
    if old is None or not _elastic_compatible(old, new, pool):
        return dataclasses.replace(new, training=dataclasses.replace(new.training, hybrid_replicas=()))
    core = len(old.training.core_replicas)
    hybrid = tuple(range(core, new.training.config.dp))
    return dataclasses.replace(new, training=dataclasses.replace(new.training, hybrid_replicas=hybrid))


def _elastic_compatible(old: Plan, new: Plan, pool: HybridPoolLimits) -> bool:
    a, b = old.training, new.training
    core = len(a.core_replicas)
    return (
        (a.config.tp, a.config.pp, a.config.micro_batch, a.first_device)
        == (b.config.tp, b.config.pp, b.config.micro_batch, b.first_device)
        and b.config.dp >= core
        and a.core_replicas == tuple(range(core))
        and pool.allows(core, a.config.pp, b.config.dp - core)
    )


def diff_plans(
    old: Plan | None, new: Plan, cut_inflight: bool = False, pool: HybridPoolLimits = UNBOUNDED_POOL
) -> tuple[Plan, list[Action]]:
    """The new plan (hybrid replicas marked) and the actions that turn `old` into it; `pool`
    bounds what may join as hybrid replicas."""
    new = mark_hybrid(old, new, pool)
    actions: list[Action] = []
    old_instances: dict[tuple, RolloutInstance] = (
        {} if old is None else {(i.tp, i.devices): i for i in old.instances}
    )
    new_instances = {(i.tp, i.devices): i for i in new.instances}

    if old is not None and _elastic_compatible(old, new, pool):
        for r in range(new.training.config.dp, old.training.config.dp):
            actions.append(ReleaseHybridReplica(r, old.training.replica_devices(r)))
        restart = False
    else:
        restart = (
            old is None
            or old.training.config != new.training.config
            or old.training.first_device != new.training.first_device
        )
    stops = [
        StopRolloutInstance(instance.instance_id, instance.devices, cut_inflight)
        for key, instance in old_instances.items()
        if key not in new_instances
    ]
    starts = [
        StartRolloutInstance(instance.instance_id, instance.tp, instance.devices)
        for key, instance in new_instances.items()
        if key not in old_instances
    ]
    if restart:
        cfg = new.training.config
        actions += stops
        actions.append(
            RestartTraining(
                () if old is None else old.training.devices,
                new.training.devices,
                cfg.tp,
                cfg.pp,
                cfg.dp,
                cfg.micro_batch,
            )
        )
        actions += starts
    else:
        # Rollout keeps serving through the change as far as devices allow: only instances on
        # devices a new instance needs stop before the starts; those whose devices go to
        # training stop after them, and new hybrid replicas join last (while rollout is empty the
        # whole loop waits; a missing replica only makes training slower).
        needed = {d for start in starts for d in start.devices}
        actions += [stop for stop in stops if needed.intersection(stop.devices)]
        actions += starts
        actions += [stop for stop in stops if not needed.intersection(stop.devices)]
        if old is not None:
            for r in range(old.training.config.dp, new.training.config.dp):
                actions.append(JoinHybridReplica(r, new.training.replica_devices(r)))
    thresholds = tuple((b.tp, b.max_output_tokens) for b in new.buckets)
    if old is None or thresholds != tuple((b.tp, b.max_output_tokens) for b in old.buckets):
        actions.append(SetBucketThresholds(thresholds))
    return new, actions
