"""The `Router` protocol: what the agent loop and the planner ask of a trajectory scheduler.

The agent loop calls a router from its asyncio loop, once per event of a trajectory:

    decision = router.admit(trajectory_id, prompt_id)          # before the first turn
    ...generate on decision.instance_id until a tool call...
    decision = router.on_tool_return(trajectory_id, state, generated_tokens, context_tokens)  # after a tool
    ...next turn on decision.instance_id (re-prefill there when decision.migrated)...
    router.on_finish(trajectory_id, total_output_tokens)       # learn from it, free its slot

The planner and the control plane change the pool with `add_instance`, `remove_instance`,
`set_instance_ready` and `on_instance_lost`; trajectories displaced from a removed or lost
instance are returned, never dropped, and go back in with `reroute`. When a new plan changes the
buckets themselves (their TP sizes or thresholds), `update_buckets` replaces them at run time.
Engines report how full their KV is with `set_instance_kv`, whenever it changes or periodically.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from libra.scheduler.config import BucketConfig, CmlfqConfig, fair_queue_length
from libra.scheduler.tool_state import ToolReturnState


class Reason(enum.IntEnum):
    """Why a decision came out as it did; the values are those of the C++ core."""

    ADMITTED = 0
    """A new trajectory, placed in the smallest bucket."""
    NO_HISTORY = 1
    """No completed trajectory has been learned from yet: stay."""
    MEAN_P90_DISAGREE = 2
    """The predicted mean and P90 remaining tokens map to different buckets: stay."""
    STAY_SAME_BUCKET = 3
    """Mean and P90 agree on the current bucket."""
    MIGRATE_UP = 4
    """Mean and P90 agree on a larger bucket."""
    MIGRATE_DOWN = 5
    """Mean and P90 agree on a smaller bucket."""
    BUCKET_SATURATED_FALLBACK = 6
    """The wanted bucket had no ready instance with room: placed in the nearest bucket that had."""
    ANY_INSTANCE_FALLBACK = 7
    """No bucket had room and no instance is loading: the least-loaded ready instance anywhere."""
    NO_INSTANCE = 8
    """No instance is ready, or none has room and one is loading: the trajectory waits unplaced
    (`instance_id` None) until rerouted."""
    REROUTED = 9
    """Placed again by `reroute`, in its bucket."""
    DEMOTION_HELD = 10
    """Mean and P90 agree on a smaller bucket, but demotion is off (`CmlfqConfig.demote`): stay."""
    TARGET_FULL_STAY = 11
    """Mean and P90 agree on another bucket, which has no room: stay on the current instance
    (a fallback placement would pay the move and gain nothing)."""
    MOVE_NOT_WORTH_IT = 12
    """Mean and P90 agree on a larger bucket, but by the buckets' speeds (`BucketConfig.speed`)
    the decoding the move would save on the loaded target is less than re-prefilling (or
    transferring) the context there costs: stay."""
    MIGRATE_FASTER = 13
    """By the buckets' speeds, a larger bucket with room decodes the predicted remaining tokens
    sooner than the current instance, the move included (e.g. the large instances idle while a
    synchronous step waits for its tail): moved there."""


@dataclass(slots=True)
class Decision:
    """Where the next turn of a trajectory runs. (Not frozen: a frozen dataclass takes four times
    longer to build, more than the C++ decision itself.)"""

    trajectory_id: str
    bucket: int
    """Index into the configured buckets (0 = smallest)."""
    instance_id: int | None
    """None only with `Reason.NO_INSTANCE`."""
    reason: Reason
    migrated: bool
    """The trajectory moved from one instance to another: the next turn re-prefills there."""


@runtime_checkable
class Router(Protocol):
    """Routes trajectories to rollout instances. Ids: `Trajectory.trajectory_id` and `prompt_id`;
    instance ids are the control plane's integers. Unknown trajectory or instance ids raise
    KeyError. Token counts are output (policy) tokens only, never tool-result tokens."""

    def admit(self, trajectory_id: str, prompt_id: str) -> Decision:
        """A new trajectory of `prompt_id`, before its first turn."""
        ...

    def on_tool_return(
        self, trajectory_id: str, state: ToolReturnState, generated_tokens: int, context_tokens: int = 0
    ) -> Decision:
        """After each tool call: `state` is the tool's return, `generated_tokens` the output tokens
        the trajectory has generated so far, `context_tokens` its context up to the end of its
        last turn (prompt, turns and earlier tool returns: what its instance holds, and what a
        move to another re-prefills beyond the return itself, which either prefills; 0 if
        unknown, which prices a move as free). Says where the next turn runs."""
        ...

    def on_finish(self, trajectory_id: str, total_output_tokens: int) -> None:
        """The trajectory ended having generated `total_output_tokens`: learn and free its slot."""
        ...

    def on_abort(self, trajectory_id: str) -> None:
        """The trajectory was cancelled (e.g. over-provisioned): free its slot, learn nothing."""
        ...

    def reroute(self, trajectory_id: str) -> Decision:
        """Place a live trajectory again in its bucket (after `on_instance_lost` displaced it)."""
        ...

    def add_instance(self, instance_id: int, bucket: int, ready: bool = True, weight: int = 1) -> None:
        """A rollout instance of bucket `bucket` joins the pool. `weight` (>= 1): how many
        sequences it holds relative to the smallest instance (in the job and the simulator, of
        the smallest TP size that holds the model: `RolloutCostModel.router_weight`); placement
        compares live trajectories per unit of weight and caps an instance at max_queue_length x
        weight (C-MLFQ also at its share by weight of what the pool holds,
        `CmlfqConfig.fair_share_headroom`), so a heterogeneous pool is loaded by capacity.
        Added not `ready`, it is loading until set ready: while any instance is, a trajectory no
        ready instance has room for waits for it (`Reason.NO_INSTANCE`) rather than overflow
        onto a full one, where it would stay queued after the new instance serves."""
        ...

    def remove_instance(self, instance_id: int) -> list[str]:
        """The planner takes an instance away. Returns the trajectories that ran there (sorted);
        they stay live, unplaced, until `reroute`d."""
        ...

    def on_instance_lost(self, instance_id: int) -> list[str]:
        """An instance died (missed heartbeats). Same contract as `remove_instance`."""
        ...

    def set_instance_ready(self, instance_id: int, ready: bool) -> None:
        """A not-ready instance (loading weights, draining) takes no new trajectories; those it
        has move elsewhere at their next tool return. One set not ready after it served is
        leaving, not loading: nobody waits for it."""
        ...

    def set_instance_kv(self, instance_id: int, used_tokens: int, capacity_tokens: int) -> None:
        """What the instance's engine reports of its KV cache: `used_tokens` held or reserved by
        its running and queued sequences (not the evictable prefix cache, which gives way to
        them), out of `capacity_tokens` (both >= 0; an engine that knows only a usage fraction
        reports it in parts per 10,000 of 10,000). C-MLFQ counts the instance full, like one at
        its trajectory cap, from `CmlfqConfig.kv_full_fraction` of its capacity on; an instance
        that never reported (or reported capacity 0) is judged by its trajectory cap only. The
        baselines record it and place as before."""
        ...

    def update_buckets(
        self, buckets: Sequence[BucketConfig], instance_buckets: Mapping[int, int]
    ) -> list[Decision]:
        """A new plan's buckets replace the current ones: `buckets` (validated as
        `CmlfqConfig.buckets`) and, for every instance of the pool, the index of its new bucket.
        Live trajectories are decided again under the new thresholds; those moved to another
        instance are returned (their next turn runs there), the rest stay where they are.
        ValueError, changing nothing, if `instance_buckets` does not name each instance once
        with a valid bucket."""
        ...

    def set_max_queue_length(self, max_queue_length: int) -> None:
        """A new cap of live trajectories per unit of instance weight (`CmlfqConfig.max_queue_length`,
        1..2**31-1, else ValueError), e.g. derived again for a pool a plan changed
        (`FairQueueLength`): nobody is decided again, it applies from the next placement."""
        ...


_MAX_KV_TOKENS = 2**53
"""KV token counts the core compares exactly with a fraction of them (a double holds every
integer up to 2**53; no engine comes near it)."""


def check_kv(instance_id: int, used_tokens: int, capacity_tokens: int) -> None:
    """ValueError unless both counts of a `set_instance_kv` report are in 0..2**53."""
    if 0 <= used_tokens <= _MAX_KV_TOKENS and 0 <= capacity_tokens <= _MAX_KV_TOKENS:
        return  # the simulator reports on most of its events: the common case is one comparison
    raise ValueError(
        f"instance {instance_id}: KV tokens must be in 0..{_MAX_KV_TOKENS}, "
        f"got used {used_tokens}, capacity {capacity_tokens}"
    )


class FairQueueLength:
    """A derived cap (`CmlfqConfig.max_queue_length` left 0) kept derived as the pool changes: the
    fair share (`fair_queue_length`) of the `in_flight` trajectories per unit of the weight of
    the instances the router serves. The owner of the pool (the job's `InstancePool`, the
    simulator's `RolloutCluster`) calls `follow` after every change of it: a cap derived for the
    launch pool and kept leaves every instance full after a plan shrinks the pool (C-MLFQ then
    moves nobody), and the pool always draining after one grows it (the fair-share bound off)."""

    def __init__(self, router: Router, in_flight: int, max_queue_length: int) -> None:
        """`max_queue_length`: the router's cap now (its config's); from then on only `follow`
        sets it."""
        if in_flight < 1:
            raise ValueError(f"trajectories in flight must be >= 1, got {in_flight}")
        self.router = router
        self.in_flight = in_flight
        self.max_queue_length = max_queue_length
        """The router's cap now."""

    def follow(self, pool_weight: int) -> int | None:
        """Sets the cap for a pool of `pool_weight`; returns it where it changed, else None. A
        pool of no weight (every instance gone) keeps the cap: nothing is placed meanwhile."""
        cap = fair_queue_length(self.in_flight, pool_weight)
        if pool_weight < 1 or cap == self.max_queue_length:
            return None
        self.router.set_max_queue_length(cap)
        self.max_queue_length = cap
        return cap


def reprice(
    router: Router,
    config: CmlfqConfig,
    price: Callable[[tuple[BucketConfig, ...]], Sequence[BucketConfig]],
) -> CmlfqConfig:
    """Sets the speeds `price` gives `config`'s buckets now on `router`
    (`CmlfqRouter.set_bucket_speeds`: nobody is decided again) and returns `config` with the
    priced buckets. A router without speeds (the baselines) is left alone and `config` returned
    as it is, unpriced."""
    set_speeds = getattr(router, "set_bucket_speeds", None)
    if set_speeds is None:
        return config
    priced = price(config.buckets)
    set_speeds(priced)
    return replace(config, buckets=tuple(priced))
