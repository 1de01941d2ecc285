"""C-MLFQ configuration: the TP buckets and the knobs of the causal model.

Defaults are those of the original's 48-GPU R2E configuration (`reference/libra-notes.md` §4):
buckets TP1/TP2/TP4 at 4,000/12,000/30,000 remaining tokens, payload classes split at 1,000 and
12,000 tokens, a P90 over the last 200 samples, rebuilds from the last 5,000 trajectories and at
most 3 trajectories per instance before its bucket counts as saturated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass(frozen=True)
class BucketSpeed:
    """How fast one instance of a bucket runs, from the planner's cost model
    (`libra.planner.routing_speeds`): a decode step with n live trajectories on it takes
    `step_s + per_sequence_s * n`, and moving a trajectory whose context holds c tokens there
    costs `move_linear_s * c + move_quadratic_s * c**2` (its re-prefill; less, or nothing, where
    the KV is transferred during the tool call)."""

    step_s: float
    per_sequence_s: float
    move_linear_s: float = 0.0
    move_quadratic_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_s", "per_sequence_s", "move_linear_s", "move_quadratic_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, int | float) and math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"BucketSpeed.{name} must be a finite number >= 0, got {value!r}")

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.step_s, self.per_sequence_s, self.move_linear_s, self.move_quadratic_s)


@dataclass(frozen=True)
class BucketConfig:
    """All rollout instances of one TP size."""

    name: str
    tp_size: int
    """Tensor-parallel size of every instance in the bucket."""
    max_remaining_tokens: int
    """Threshold: trajectories predicted to have at most this many output tokens left belong here
    (or in a smaller bucket). The last bucket also takes everything above its threshold."""
    speed: BucketSpeed | None = None
    """Its instances' speed. When every bucket has one, a trajectory moves to a larger bucket only
    if the move pays: its predicted remaining tokens, decoded at the target's step with the
    target's load, must save more time than the move costs (`Reason.MOVE_NOT_WORTH_IT`)."""


def _default_buckets() -> tuple[BucketConfig, ...]:
    return (
        BucketConfig("short", tp_size=1, max_remaining_tokens=4000),
        BucketConfig("medium", tp_size=2, max_remaining_tokens=12000),
        BucketConfig("long", tp_size=4, max_remaining_tokens=30000),
    )


_MAX_TOKENS = 2**31 - 1
"""Token counts are int32 in the C++ core."""


@dataclass(frozen=True)
class CmlfqConfig:
    """The C-MLFQ scheduler (`libra.scheduler.CmlfqRouter`)."""

    buckets: tuple[BucketConfig, ...] = field(default_factory=_default_buckets)
    """Ordered from the smallest to the largest remaining-token threshold (strictly increasing)."""
    small_payload_max_tokens: int = 1000
    """Tool payloads of at most this many tokens are `SizeClass.SMALL`."""
    medium_payload_max_tokens: int = 12000
    """... at most this many `SizeClass.MEDIUM`; longer ones `SizeClass.LARGE`."""
    p90_window: int = 200
    """Recent samples per prefix-tree node that the P90 of remaining tokens is taken over. The P90
    is the nearest-rank one, the ceil(0.9 n)-th smallest of the n samples: always a count some
    trajectory really had (an interpolated quantile between a short and a very long trajectory
    names neither), exact in integers, and the same in the C++ core and its Python reference."""
    rebuild_window: int = 5000
    """Completed trajectories kept; a rebuild relearns the trees from exactly these."""
    rebuild_interval: int = 2000
    """Completed trajectories between automatic rebuilds (which track policy drift); 0 leaves
    rebuilds to explicit `CmlfqRouter.rebuild()` calls. A rebuild runs inside the `on_finish`
    that triggers it (about 10 ms for 5,000 trajectories) and holds up concurrent callers."""
    max_queue_length: int = 0
    """Live trajectories per unit of instance weight beyond which an instance takes no more while
    another bucket has room (placement then falls back; see `Reason`); it also sets when the pool
    drains (`draining_fraction`). 0 (the default): derived where the pool is known
    (`fair_queue_length`), by the job and the simulator at launch and again whenever the pool
    changes (`FairQueueLength`). Not the original's 3: with hundreds of trajectories in flight
    every instance is then full until a step's tail, so C-MLFQ moves nobody before it
    (`Reason.TARGET_FULL_STAY`) and admission is least-load's. A router that caps its placements
    needs it resolved (ValueError)."""
    kv_full_fraction: float = 0.85
    """An instance whose engine reports its KV (`Router.set_instance_kv`) also has no room once
    that share of its KV tokens is in use, whatever its trajectory count: on long contexts a small
    instance's KV fills, and its queue grows, below `max_queue_length`. In (0, 1]; the choice of
    0.85 is measured in `docs/scheduling.md`."""
    demote: bool = False
    """Whether a trajectory whose predicted remaining work fell moves to a smaller bucket (the
    original's rule). Off by default: a demoted trajectory is near its end with its longest
    context, which the move re-prefills (or transfers) into the bucket with the least KV per
    instance to save a little decoding; on the paper-scale R2E pools it crowded the small
    instances' KV and cost 15 % of trained tokens/s against least-load (`docs/scheduling.md`).
    Off, the trajectory stays (`Reason.DEMOTION_HELD`)."""
    draining_fraction: float = 0.25
    """With the buckets' speeds known (`BucketConfig.speed`): while the ready instances' live
    trajectories are at most this share of their caps, the pool is draining -- a synchronous step
    waiting for its tail, the end of a run -- and a trajectory whose prediction keeps it in its
    bucket moves to a larger bucket with room whenever that decodes its predicted remaining tokens
    sooner, the move included (`Reason.MIGRATE_FASTER`). Above it, the larger instances' room belongs to
    the trajectories of their band: moving others there whenever it paid cost 4-11 % of trained
    tokens/s in the asynchronous paper-scale runs. In [0, 1]; 0 moves nobody outside its band."""
    fair_share_headroom: float = 1.2
    """Unless the pool drains (`draining_fraction`), an instance also has no room once it holds
    this multiple of its fair share, by weight, of the trajectories the ready instances hold (the
    one being placed counted): admission to the smallest bucket otherwise fills the small instances
    to `max_queue_length` while the large ones take what is left, and a static cap cannot know
    how many trajectories the pool will hold. 0 (off), or >= 1; 1.2 is measured in
    `docs/scheduling.md`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(self.buckets))
        if not self.buckets:
            raise ValueError("cmlfq.buckets must name at least one bucket")
        if len({b.name for b in self.buckets}) != len(self.buckets):
            raise ValueError(f"cmlfq.buckets names must be unique, got {[b.name for b in self.buckets]}")
        for b in self.buckets:
            if b.tp_size < 1:
                raise ValueError(f"cmlfq.buckets[{b.name!r}].tp_size must be >= 1, got {b.tp_size}")
            if not 0 < b.max_remaining_tokens <= _MAX_TOKENS:
                raise ValueError(
                    f"cmlfq.buckets[{b.name!r}].max_remaining_tokens must be in 1..{_MAX_TOKENS}, "
                    f"got {b.max_remaining_tokens}"
                )
        with_speed = [b.name for b in self.buckets if b.speed is not None]
        if with_speed and len(with_speed) != len(self.buckets):
            raise ValueError(
                f"cmlfq.buckets: either every bucket has a speed or none does, got speeds for {with_speed} "
                f"of {[b.name for b in self.buckets]}"
            )
        thresholds = [b.max_remaining_tokens for b in self.buckets]
        if any(lo >= hi for lo, hi in pairwise(thresholds)):
            raise ValueError(f"cmlfq.buckets max_remaining_tokens must strictly increase, got {thresholds}")
        if self.small_payload_max_tokens < 0:
            raise ValueError(
                f"cmlfq.small_payload_max_tokens must be >= 0, got {self.small_payload_max_tokens}"
            )
        if self.medium_payload_max_tokens <= self.small_payload_max_tokens:
            raise ValueError(
                f"cmlfq.medium_payload_max_tokens must exceed small_payload_max_tokens "
                f"({self.small_payload_max_tokens}), got {self.medium_payload_max_tokens}"
            )
        for name in ("p90_window", "rebuild_window"):
            if not 1 <= getattr(self, name) <= _MAX_TOKENS:
                raise ValueError(f"cmlfq.{name} must be in 1..{_MAX_TOKENS}, got {getattr(self, name)}")
        if not 0 <= self.max_queue_length <= _MAX_TOKENS:
            raise ValueError(
                f"cmlfq.max_queue_length must be in 0..{_MAX_TOKENS} (0: derived), "
                f"got {self.max_queue_length}"
            )
        if not 0 <= self.draining_fraction <= 1:
            raise ValueError(f"cmlfq.draining_fraction must be in [0, 1], got {self.draining_fraction}")
        if self.fair_share_headroom != 0 and not 1 <= self.fair_share_headroom < math.inf:
            raise ValueError(
                f"cmlfq.fair_share_headroom must be 0 or a finite value >= 1, got {self.fair_share_headroom}"
            )
        if not 0 < self.kv_full_fraction <= 1:
            raise ValueError(f"cmlfq.kv_full_fraction must be in (0, 1], got {self.kv_full_fraction}")
        if not 0 <= self.rebuild_interval <= _MAX_TOKENS:
            raise ValueError(
                f"cmlfq.rebuild_interval must be in 0..{_MAX_TOKENS}, got {self.rebuild_interval}"
            )

    @property
    def thresholds(self) -> list[int]:
        return [b.max_remaining_tokens for b in self.buckets]

    @property
    def speeds(self) -> list[tuple[float, float, float, float]]:
        """Each bucket's speed as the core takes it; empty when the buckets have none."""
        return [b.speed.as_tuple() for b in self.buckets if b.speed is not None]


def bucket_of(bucket_tps: Sequence[int], tp: int) -> int:
    """The bucket of an instance of size `tp` among buckets of ascending TP sizes: its own, else
    the largest not above it, else the first (the simulator's layouts, and where the job's pool
    holds an instance a plan is starting whose bucket may come with the plan's thresholds)."""
    fitting = [i for i, b in enumerate(bucket_tps) if b <= tp]
    return fitting[-1] if fitting else 0


def fair_queue_length(in_flight: int, total_weight: int) -> int:
    """`CmlfqConfig.max_queue_length` derived (the config's 0): the fair share of the trajectories
    that can be in flight at once, per unit of the pool's instance weight, and at least the
    original's 3. Not lower: admission to the smallest bucket would then starve the others; not
    one cap for every instance size: admission would flood the small instances' KV while large
    ones idle (weights scale it). `CmlfqConfig.fair_share_headroom` bounds each instance by what
    the pool holds now, below this."""
    return max(3, math.ceil(in_flight / max(1, total_weight)))


def check_resolved(config: CmlfqConfig, router: str) -> None:
    """ValueError for a router that caps its placements built on a cap left 0 (derived): the
    owner of the pool resolves it first."""
    if config.max_queue_length == 0:
        raise ValueError(
            f"{router}: cmlfq.max_queue_length is 0 (derived): resolve it for the pool first "
            "(`libra.scheduler.fair_queue_length`, as the job and the simulator do)"
        )


def check_queue_length(max_queue_length: int) -> None:
    """ValueError unless a cap set at run time (`Router.set_max_queue_length`) is in 1..2**31-1
    (0, "derived", is for configs: a router runs with a resolved cap)."""
    if not 1 <= max_queue_length <= _MAX_TOKENS:
        raise ValueError(f"max_queue_length must be in 1..{_MAX_TOKENS}, got {max_queue_length}")
