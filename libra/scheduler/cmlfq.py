"""`CmlfqRouter`: the C-MLFQ scheduler, a typed facade over the C++ core `libra._native`.

The routing rules are documented at the top of `csrc/cmlfq/scheduler.cpp`. The core releases
the GIL for its work and is safe to call from several threads. Its learned state (trees and the
recent trajectories they are rebuilt from) is saved with `serialize`, restored with `restore`
and combined across controllers with `merge`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from libra import _native
from libra.scheduler.config import BucketConfig, CmlfqConfig, check_queue_length, check_resolved
from libra.scheduler.interface import Decision, Reason, check_kv
from libra.scheduler.tool_state import ToolReturnState

_REASONS = tuple(Reason)
_MAX_TOKENS = 2**31 - 1
"""Token counts are int32 in the core."""


@dataclass(frozen=True)
class Prediction:
    """What the causal model predicts after a causal path (the node routing would use)."""

    from_prompt_tree: bool
    """Else from the global tree (the prompt has no history)."""
    depth: int
    """Tool-return states of the path that the tree matched."""
    count: int
    """Completed trajectories that went through the node."""
    mean_remaining_tokens: float
    p90_remaining_tokens: int


@dataclass(frozen=True)
class InstanceLoad:
    instance_id: int
    bucket: int
    active: int
    """Live trajectories placed on the instance."""
    ready: bool
    kv_used: int = 0
    """KV tokens last reported by `set_instance_kv`."""
    kv_capacity: int = 0
    """0: never reported."""


class CmlfqRouter:
    """The `Router` of Libra: causal routing of trajectories across TP buckets."""

    def __init__(self, config: CmlfqConfig | None = None) -> None:
        self.config = config or CmlfqConfig()
        check_resolved(self.config, type(self).__name__)
        self._core = _native.CmlfqScheduler(
            bucket_thresholds=self.config.thresholds,
            max_queue_length=self.config.max_queue_length,
            p90_window=self.config.p90_window,
            rebuild_window=self.config.rebuild_window,
            rebuild_interval=self.config.rebuild_interval,
            demote=self.config.demote,
            kv_full_fraction=self.config.kv_full_fraction,
            bucket_speeds=self.config.speeds,
            draining_fraction=self.config.draining_fraction,
            fair_share_headroom=self.config.fair_share_headroom,
        )

    def admit(self, trajectory_id: str, prompt_id: str) -> Decision:
        return _decision(trajectory_id, self._core.admit(trajectory_id, prompt_id))

    def on_tool_return(
        self, trajectory_id: str, state: ToolReturnState, generated_tokens: int, context_tokens: int = 0
    ) -> Decision:
        if not 0 <= generated_tokens <= _MAX_TOKENS:
            raise ValueError(f"generated_tokens must be in 0..{_MAX_TOKENS}, got {generated_tokens}")
        if not 0 <= context_tokens <= _MAX_TOKENS:
            raise ValueError(f"context_tokens must be in 0..{_MAX_TOKENS}, got {context_tokens}")
        bucket, instance, reason, migrated = self._core.on_tool_return(
            trajectory_id, state.key, generated_tokens, context_tokens
        )
        return Decision(trajectory_id, bucket, None if instance < 0 else instance, _REASONS[reason], migrated)

    def on_finish(self, trajectory_id: str, total_output_tokens: int) -> None:
        if not 0 <= total_output_tokens <= _MAX_TOKENS:
            raise ValueError(f"total_output_tokens must be in 0..{_MAX_TOKENS}, got {total_output_tokens}")
        self._core.on_finish(trajectory_id, total_output_tokens)

    def on_abort(self, trajectory_id: str) -> None:
        self._core.on_abort(trajectory_id)

    def reroute(self, trajectory_id: str) -> Decision:
        return _decision(trajectory_id, self._core.reroute(trajectory_id))

    def add_instance(self, instance_id: int, bucket: int, ready: bool = True, weight: int = 1) -> None:
        if not 0 <= bucket < len(self.config.buckets):
            raise ValueError(f"bucket must be in 0..{len(self.config.buckets) - 1}, got {bucket}")
        if not 1 <= weight <= _MAX_TOKENS:
            raise ValueError(f"instance {instance_id}: weight must be in 1..{_MAX_TOKENS}, got {weight}")
        self._core.add_instance(instance_id, bucket, ready, weight)

    def remove_instance(self, instance_id: int) -> list[str]:
        return self._core.remove_instance(instance_id)

    def on_instance_lost(self, instance_id: int) -> list[str]:
        return self._core.remove_instance(instance_id)

    def set_instance_ready(self, instance_id: int, ready: bool) -> None:
        self._core.set_instance_ready(instance_id, ready)

    def set_instance_kv(self, instance_id: int, used_tokens: int, capacity_tokens: int) -> None:
        check_kv(instance_id, used_tokens, capacity_tokens)
        self._core.set_instance_kv(instance_id, used_tokens, capacity_tokens)

    def update_buckets(
        self, buckets: Sequence[BucketConfig], instance_buckets: Mapping[int, int]
    ) -> list[Decision]:
        """See `Router.update_buckets`. A trajectory that has not yet returned from a tool, or
        whose path's mean and P90 disagree under the new thresholds, stays on its instance (now in
        that instance's new bucket); one whose mean and P90 agree on another bucket moves there
        (the rules of `on_tool_return`, applied to its path so far)."""
        config = dataclasses.replace(self.config, buckets=tuple(buckets))
        check_instance_buckets(
            instance_buckets, [load.instance_id for load in self.instance_loads()], len(config.buckets)
        )
        moved = self._core.update_buckets(config.thresholds, sorted(instance_buckets.items()), config.speeds)
        self.config = config
        return [_decision(trajectory_id, decision) for trajectory_id, decision in moved]

    def set_max_queue_length(self, max_queue_length: int) -> None:
        """See `Router.set_max_queue_length`."""
        check_queue_length(max_queue_length)
        self._core.set_max_queue_length(max_queue_length)
        self.config = dataclasses.replace(self.config, max_queue_length=max_queue_length)

    def set_bucket_speeds(self, buckets: Sequence[BucketConfig]) -> None:
        """New speeds for the same buckets (`BucketConfig.speed`; names, TP sizes and thresholds
        as now, else ValueError): they apply from each trajectory's next tool return, and nobody
        is decided again (unlike `update_buckets`)."""
        config = dataclasses.replace(self.config, buckets=tuple(buckets))
        unchanged = [(b.name, b.tp_size, b.max_remaining_tokens) for b in self.config.buckets]
        if [(b.name, b.tp_size, b.max_remaining_tokens) for b in config.buckets] != unchanged:
            raise ValueError(
                f"set_bucket_speeds keeps the buckets {unchanged}; use update_buckets to change them"
            )
        self._core.set_speeds(config.speeds)
        self.config = config

    @property
    def thresholds(self) -> list[int]:
        """The core's bucket thresholds now (they change with `update_buckets`)."""
        return self._core.thresholds()

    def instance_loads(self) -> list[InstanceLoad]:
        return [InstanceLoad(*load) for load in self._core.instance_loads()]

    @property
    def num_live(self) -> int:
        return self._core.num_live()

    def predict(self, prompt_id: str, path: list[ToolReturnState]) -> Prediction | None:
        """The prediction routing would act on for a trajectory of `prompt_id` after `path`;
        None while nothing has been learned."""
        found = self._core.predict(prompt_id, [state.key for state in path])
        if found is None:
            return None
        from_prompt_tree, depth, count, total, p90 = found
        return Prediction(from_prompt_tree, depth, count, total / count, p90)

    def rebuild(self) -> None:
        """Relearn the trees from the last `rebuild_window` completed trajectories only."""
        self._core.rebuild()

    def serialize(self) -> bytes:
        """The learned state, for checkpoints (live trajectories and instances are not part of it)."""
        return self._core.serialize()

    def restore(self, state: bytes) -> None:
        """Replace the learned state by a checkpoint's. Raises ValueError on a malformed one."""
        self._core.restore(state)

    def merge(self, state: bytes) -> None:
        """Add another controller's learned state: node statistics add up, histories concatenate."""
        self._core.merge(state)


def _decision(trajectory_id: str, core_decision: tuple[int, int, int, bool]) -> Decision:
    """From the core's (bucket, instance or -1, reason, migrated)."""
    bucket, instance, reason, migrated = core_decision
    return Decision(trajectory_id, bucket, None if instance < 0 else instance, _REASONS[reason], migrated)


def check_instance_buckets(
    instance_buckets: Mapping[int, int], instances: list[int], num_buckets: int
) -> None:
    """ValueError naming the first instance `instance_buckets` misses, does not know, or puts in
    a bucket outside 0..num_buckets-1."""
    missing = sorted(set(instances) - set(instance_buckets))
    unknown = sorted(set(instance_buckets) - set(instances))
    if missing or unknown:
        raise ValueError(
            f"instance_buckets must name every instance exactly once: missing {missing}, unknown {unknown}"
        )
    bad = sorted(i for i, b in instance_buckets.items() if not 0 <= b < num_buckets)
    if bad:
        raise ValueError(
            f"instance_buckets: instance {bad[0]} has bucket {instance_buckets[bad[0]]}, "
            f"not in 0..{num_buckets - 1}"
        )
