"""Baseline routers behind the `Router` interface, for benchmarks and ablations (pure Python).

- `RoundRobinRouter`, `LeastLoadRouter`: a homogeneous pool; buckets are ignored and a
  trajectory keeps the instance it was admitted to.
- `LengthMlfqRouter`: length-aware MLFQ; a trajectory moves to a longer bucket once the tokens it
  has generated pass its bucket's threshold, and never back.
- `OracleRouter`: knows each trajectory's true output length, so routes by the true remaining
  tokens; the bound C-MLFQ's predictions are measured against.

On `update_buckets` the baselines re-label instances and thresholds and move nobody: a
trajectory's bucket becomes its instance's new one, and the new thresholds apply from its next
tool return.

The bucketed baselines place trajectories with C-MLFQ's placement rules (least loaded, capped by
`max_queue_length`, nearest other bucket, then any ready instance), so that comparisons measure
the choice of bucket alone. They record what `set_instance_kv` reports (`instance_loads` shows
it) but do not place by it: every baseline places as it did before the KV caps, so comparisons
with earlier runs stay valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from libra.scheduler.config import BucketConfig, CmlfqConfig, check_queue_length, check_resolved
from libra.scheduler.interface import Decision, Reason, check_kv
from libra.scheduler.tool_state import ToolReturnState

if TYPE_CHECKING:
    from libra.scheduler.cmlfq import InstanceLoad


@dataclass
class _Instance:
    bucket: int
    ready: bool
    active: int = 0
    weight: int = 1
    kv_used: int = 0
    kv_capacity: int = 0
    loading: bool = False
    """Added not ready and not ready since: it will serve (one set not ready after serving is
    leaving, a drain)."""


@dataclass
class _Live:
    bucket: int
    instance: int | None = None


class _BaselineRouter:
    """Live trajectories, the instance pool and placement; subclasses choose buckets."""

    capped = True
    """Whether placement honours `max_queue_length` (which must then be resolved)."""

    def __init__(self, config: CmlfqConfig | None = None) -> None:
        self.config = config or CmlfqConfig()
        if self.capped:
            check_resolved(self.config, type(self).__name__)
        self._instances: dict[int, _Instance] = {}
        self._live: dict[str, _Live] = {}

    # Bucket choice: overridden by the policies.

    def _admission_bucket(self, trajectory_id: str) -> int:
        return 0

    def _bucket_after_tool(
        self, trajectory_id: str, current: int, generated_tokens: int
    ) -> tuple[int, Reason]:
        return current, Reason.STAY_SAME_BUCKET

    def _bucket_for_tokens(self, tokens: int) -> int:
        thresholds = self.config.thresholds
        return next((b for b, t in enumerate(thresholds) if tokens <= t), len(thresholds) - 1)

    @staticmethod
    def _migration(current: int, target: int) -> tuple[int, Reason]:
        if target == current:
            return current, Reason.STAY_SAME_BUCKET
        return target, Reason.MIGRATE_UP if target > current else Reason.MIGRATE_DOWN

    # The Router interface.

    def admit(self, trajectory_id: str, prompt_id: str) -> Decision:
        if trajectory_id in self._live:
            raise ValueError(f"trajectory {trajectory_id} is already live")
        self._live[trajectory_id] = _Live(bucket=0)
        return self._move(trajectory_id, self._admission_bucket(trajectory_id), Reason.ADMITTED)

    def on_tool_return(
        self, trajectory_id: str, state: ToolReturnState, generated_tokens: int, context_tokens: int = 0
    ) -> Decision:
        live = self._live[trajectory_id]
        bucket, reason = self._bucket_after_tool(trajectory_id, live.bucket, generated_tokens)
        if bucket == live.bucket and live.instance is not None and self._instances[live.instance].ready:
            return Decision(trajectory_id, live.bucket, live.instance, reason, False)
        return self._move(trajectory_id, bucket, reason)

    def on_finish(self, trajectory_id: str, total_output_tokens: int) -> None:
        self.on_abort(trajectory_id)

    def on_abort(self, trajectory_id: str) -> None:
        live = self._live.pop(trajectory_id)
        if live.instance is not None:
            self._instances[live.instance].active -= 1

    def reroute(self, trajectory_id: str) -> Decision:
        return self._move(trajectory_id, self._live[trajectory_id].bucket, Reason.REROUTED)

    def add_instance(self, instance_id: int, bucket: int, ready: bool = True, weight: int = 1) -> None:
        if instance_id in self._instances:
            raise ValueError(f"instance {instance_id} already exists")
        if weight < 1:
            raise ValueError(f"instance {instance_id}: weight must be >= 1, got {weight}")
        self._instances[instance_id] = _Instance(bucket, ready, weight=weight, loading=not ready)

    def remove_instance(self, instance_id: int) -> list[str]:
        del self._instances[instance_id]
        displaced = sorted(t for t, live in self._live.items() if live.instance == instance_id)
        for trajectory_id in displaced:
            self._live[trajectory_id].instance = None
        return displaced

    def on_instance_lost(self, instance_id: int) -> list[str]:
        return self.remove_instance(instance_id)

    def set_instance_ready(self, instance_id: int, ready: bool) -> None:
        instance = self._instances[instance_id]
        instance.ready = ready
        instance.loading = instance.loading and not ready

    def set_instance_kv(self, instance_id: int, used_tokens: int, capacity_tokens: int) -> None:
        """Recorded for `instance_loads`; placement ignores it (see the module's docstring)."""
        instance = self._instances[instance_id]
        check_kv(instance_id, used_tokens, capacity_tokens)
        instance.kv_used, instance.kv_capacity = used_tokens, capacity_tokens

    def instance_loads(self) -> list[InstanceLoad]:
        """Live trajectories placed on each instance (what a plan's drain waits on), in id order."""
        # C-MLFQ's type, imported here: its module loads the native core, which baselines do not need.
        from libra.scheduler.cmlfq import InstanceLoad

        return [
            InstanceLoad(
                instance_id,
                instance.bucket,
                instance.active,
                instance.ready,
                instance.kv_used,
                instance.kv_capacity,
            )
            for instance_id, instance in sorted(self._instances.items())
        ]

    def update_buckets(
        self, buckets: Sequence[BucketConfig], instance_buckets: Mapping[int, int]
    ) -> list[Decision]:
        from libra.scheduler.cmlfq import check_instance_buckets

        config = dataclasses.replace(self.config, buckets=tuple(buckets))
        check_instance_buckets(instance_buckets, list(self._instances), len(config.buckets))
        self.config = config
        for instance_id, bucket in instance_buckets.items():
            self._instances[instance_id].bucket = bucket
        last = len(config.buckets) - 1
        for live in self._live.values():
            live.bucket = (
                self._instances[live.instance].bucket if live.instance is not None else min(live.bucket, last)
            )
        return []

    def set_max_queue_length(self, max_queue_length: int) -> None:
        check_queue_length(max_queue_length)
        self.config = dataclasses.replace(self.config, max_queue_length=max_queue_length)

    # Placement.

    def _move(self, trajectory_id: str, bucket: int, reason: Reason) -> Decision:
        live = self._live[trajectory_id]
        previous = live.instance
        if previous is not None:
            self._instances[previous].active -= 1
        live.bucket, live.instance, fallback = self._place(bucket, previous)
        if live.instance is not None:
            self._instances[live.instance].active += 1
        migrated = previous is not None and live.instance is not None and live.instance != previous
        return Decision(trajectory_id, live.bucket, live.instance, fallback or reason, migrated)

    def _place(self, bucket: int, previous: int | None) -> tuple[int, int | None, Reason | None]:
        num_buckets = len(self.config.buckets)
        chosen = self._least_loaded(bucket, previous, capped=True)
        if chosen is not None:
            return bucket, chosen, None
        for distance in range(1, num_buckets):
            for other in (bucket + distance, bucket - distance):
                if (
                    0 <= other < num_buckets
                    and (chosen := self._least_loaded(other, previous, True)) is not None
                ):
                    return other, chosen, Reason.BUCKET_SATURATED_FALLBACK
        # Full everywhere: wait for an instance still loading (as C-MLFQ does), else overflow.
        loading = any(instance.loading for instance in self._instances.values())
        chosen = None if loading else self._least_loaded(None, previous, capped=False)
        if chosen is not None:
            return self._instances[chosen].bucket, chosen, Reason.ANY_INSTANCE_FALLBACK
        return bucket, None, Reason.NO_INSTANCE

    def _least_loaded(self, bucket: int | None, previous: int | None, capped: bool) -> int | None:
        """The least-loaded (live trajectories / weight) ready instance of `bucket` (None: of
        all), under the cap (max_queue_length x weight) if `capped`; ties go to `previous`, then
        to the lowest id."""
        candidates = [
            (Fraction(instance.active, instance.weight), instance_id != previous, instance_id)
            for instance_id, instance in self._instances.items()
            if instance.ready
            and (bucket is None or instance.bucket == bucket)
            and (not capped or instance.active < self.config.max_queue_length * instance.weight)
        ]
        return min(candidates)[2] if candidates else None


class LeastLoadRouter(_BaselineRouter):
    """Each trajectory goes to the ready instance with the fewest live trajectories per unit of
    weight (on a homogeneous pool: the fewest)."""

    capped = False

    def _place(self, bucket: int, previous: int | None) -> tuple[int, int | None, Reason | None]:
        chosen = self._least_loaded(None, previous, capped=False)
        if chosen is None:
            return bucket, None, Reason.NO_INSTANCE
        return self._instances[chosen].bucket, chosen, None


class RoundRobinRouter(_BaselineRouter):
    """Homogeneous pool: trajectories go to the ready instances in turn, in id order."""

    capped = False

    def __init__(self, config: CmlfqConfig | None = None) -> None:
        super().__init__(config)
        self._last: int = -1

    def _place(self, bucket: int, previous: int | None) -> tuple[int, int | None, Reason | None]:
        ready = sorted(i for i, instance in self._instances.items() if instance.ready)
        if not ready:
            return bucket, None, Reason.NO_INSTANCE
        self._last = next((i for i in ready if i > self._last), ready[0])
        return self._instances[self._last].bucket, self._last, None


class LengthMlfqRouter(_BaselineRouter):
    """Length-aware MLFQ: demote to the bucket whose threshold covers the tokens generated so far."""

    def _bucket_after_tool(
        self, trajectory_id: str, current: int, generated_tokens: int
    ) -> tuple[int, Reason]:
        return self._migration(current, max(current, self._bucket_for_tokens(generated_tokens)))


class OracleRouter(_BaselineRouter):
    """Routes by the true remaining tokens, from `true_output_tokens[trajectory_id]`."""

    def __init__(self, true_output_tokens: Mapping[str, int], config: CmlfqConfig | None = None) -> None:
        super().__init__(config)
        self._true_output_tokens = true_output_tokens

    def _admission_bucket(self, trajectory_id: str) -> int:
        return self._bucket_for_tokens(self._true_output_tokens[trajectory_id])

    def _bucket_after_tool(
        self, trajectory_id: str, current: int, generated_tokens: int
    ) -> tuple[int, Reason]:
        remaining = self._true_output_tokens[trajectory_id] - generated_tokens
        return self._migration(current, self._bucket_for_tokens(remaining))
