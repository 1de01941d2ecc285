"""C-MLFQ configuration: the TP buckets and the knobs of the causal model.

Defaults are those of the original's 48-GPU R2E configuration (`reference/libra-notes.md` §4):
buckets TP1/TP2/TP4 at 4,000/12,000/30,000 remaining tokens, payload classes split at 1,000 and
12,000 tokens, a P90 over the last 200 samples, rebuilds from the last 5,000 trajectories and at
most 3 trajectories per instance before its bucket counts as saturated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise


@dataclass(frozen=True)
class BucketConfig:
    """All rollout instances of one TP size."""

    name: str
    tp_size: int
    """Tensor-parallel size of every instance in the bucket."""
    max_remaining_tokens: int
    """Threshold: trajectories predicted to have at most this many output tokens left belong here
    (or in a smaller bucket). The last bucket also takes everything above its threshold."""


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
    max_queue_length: int = 3
    """Live trajectories per instance beyond which it takes no more while another bucket has
    room (placement then falls back; see `Reason`)."""
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
        for name in ("p90_window", "rebuild_window", "max_queue_length"):
            if not 1 <= getattr(self, name) <= _MAX_TOKENS:
                raise ValueError(f"cmlfq.{name} must be in 1..{_MAX_TOKENS}, got {getattr(self, name)}")
        if not 0 < self.kv_full_fraction <= 1:
            raise ValueError(f"cmlfq.kv_full_fraction must be in (0, 1], got {self.kv_full_fraction}")
        if not 0 <= self.rebuild_interval <= _MAX_TOKENS:
            raise ValueError(
                f"cmlfq.rebuild_interval must be in 0..{_MAX_TOKENS}, got {self.rebuild_interval}"
            )

    @property
    def thresholds(self) -> list[int]:
        return [b.max_remaining_tokens for b in self.buckets]
