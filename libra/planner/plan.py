"""The planner's output: who does what on which device, and what the cost models predict.

Devices are numbered node-major across the cluster (device d is local device d % devices_per_node
of node d // devices_per_node). Training holds the first `num_devices` devices as DP replicas of
TP x PP contiguous devices; rollout instances take the rest, each on a block of its TP size
aligned to that size (so inside one node).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from libra.planner.training_cost import TrainingConfig


@dataclass(frozen=True)
class TrainingPlacement:
    config: TrainingConfig
    first_device: int = 0
    hybrid_replicas: tuple[int, ...] = ()
    """DP replicas in the elastic hybrid pool (they joined from rollout through the side
    channel, so they can be released without rebuilding the core process groups)."""

    @property
    def num_devices(self) -> int:
        return self.config.num_devices

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(range(self.first_device, self.first_device + self.num_devices))

    def replica_devices(self, replica: int) -> tuple[int, ...]:
        if not 0 <= replica < self.config.dp:
            raise ValueError(f"replica must be in 0..{self.config.dp - 1}, got {replica}")
        start = self.first_device + replica * self.config.replica_size
        return tuple(range(start, start + self.config.replica_size))

    @property
    def core_replicas(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.config.dp) if r not in self.hybrid_replicas)


@dataclass(frozen=True)
class RolloutInstance:
    instance_id: str
    tp: int
    devices: tuple[int, ...]
    node: int


@dataclass(frozen=True)
class BucketPlan:
    """All instances of one TP size and the requests the plan routes to them."""

    tp: int
    num_instances: int
    max_output_tokens: int
    """Routing threshold: requests with at most this many output tokens (and more than the
    previous bucket's) go here; the last bucket also takes everything longer."""
    num_requests: int
    predicted_makespan_s: float


@dataclass(frozen=True)
class Plan:
    num_devices: int
    training: TrainingPlacement
    instances: tuple[RolloutInstance, ...]
    buckets: tuple[BucketPlan, ...]
    predicted_train_s: float
    predicted_rollout_s: float
    search_time_s: float = 0.0

    @property
    def rollout_mix(self) -> str:
        """E.g. `2xTP4 + 1xTP8`: the rollout instances per TP size."""
        return format_rollout_mix((b.tp, b.num_instances) for b in self.buckets)

    @property
    def layout_key(self) -> tuple:
        """What two plans share when they run the same layout: the training configuration and
        the rollout instances' TP sizes (thresholds and device numbering aside)."""
        return self.training.config, tuple(sorted(i.tp for i in self.instances))

    @property
    def predicted_step_s(self) -> float:
        """The objective: in the asynchronous loop a step takes as long as the slower stage."""
        return max(self.predicted_train_s, self.predicted_rollout_s)

    @property
    def idle_devices(self) -> tuple[int, ...]:
        used = set(self.training.devices)
        for instance in self.instances:
            used.update(instance.devices)
        return tuple(d for d in range(self.num_devices) if d not in used)

    def layout(self) -> str:
        """One line: who holds which devices (the job's progress line)."""
        cfg = self.training.config
        hybrid = f" (+{len(self.training.hybrid_replicas)} hybrid)" if self.training.hybrid_replicas else ""
        rollout = " + ".join(f"TP-{b.tp} x{b.num_instances}" for b in self.buckets if b.num_instances)
        return f"train {_span(self.training.devices)} DP {cfg.dp}{hybrid}, rollout {rollout or 'none'}"

    def describe(self) -> str:
        """A human-readable summary (what `libra plan` prints)."""
        cfg = self.training.config
        lines = [
            f"devices: {self.num_devices} (idle {len(self.idle_devices)})",
            f"training: {cfg.num_devices} devices {_span(self.training.devices)}  TP={cfg.tp} PP={cfg.pp} "
            f"DP={cfg.dp} micro-batch={cfg.micro_batch}  "
            f"hybrid replicas={list(self.training.hybrid_replicas)}",
            f"rollout: {len(self.instances)} instances on {sum(i.tp for i in self.instances)} devices",
        ]
        for bucket in self.buckets:
            lines.append(
                f"  TP-{bucket.tp}: {bucket.num_instances} instances, "
                f"<= {bucket.max_output_tokens} output tokens, "
                f"{bucket.num_requests} requests, makespan {bucket.predicted_makespan_s:.3f} s"
            )
        lines.append(
            f"predicted: T_train {self.predicted_train_s:.3f} s, T_rollout {self.predicted_rollout_s:.3f} s, "
            f"step {self.predicted_step_s:.3f} s  (searched in {self.search_time_s * 1e3:.1f} ms)"
        )
        return "\n".join(lines)


def _span(devices: tuple[int, ...]) -> str:
    return f"[{devices[0]}..{devices[-1]}]" if devices else "[]"


def place_rollout(
    first_device: int, num_devices: int, devices_per_node: int, tp_sizes: list[int]
) -> tuple[RolloutInstance, ...]:
    """Places instances of the given TP sizes on [first_device, num_devices), largest first, each
    on the lowest free block aligned to its size. With power-of-two sizes that divide the node and
    a cluster of whole nodes, every set of sizes that fits in the range's device count is placed
    (training may end mid-block: with 1 train device of 4, a TP-2 instance takes devices 2-3 and a
    TP-1 device 1), and no instance straddles a node."""
    free = [True] * num_devices
    instances = []
    for tp in sorted(tp_sizes, reverse=True):
        start = _first_aligned_block(free, max(first_device, 0), tp)
        if start is None or (start // devices_per_node != (start + tp - 1) // devices_per_node):
            raise ValueError(
                f"cannot place a TP-{tp} instance on devices {first_device}..{num_devices - 1} "
                f"(sizes {sorted(tp_sizes, reverse=True)})"
            )
        free[start : start + tp] = [False] * tp
        instances.append(
            RolloutInstance(
                f"rollout-tp{tp}-d{start}", tp, tuple(range(start, start + tp)), start // devices_per_node
            )
        )
    return tuple(instances)


def _first_aligned_block(free: list[bool], first: int, size: int) -> int | None:
    start = -(-first // size) * size
    while start + size <= len(free):
        if all(free[start : start + size]):
            return start
        start += size
    return None


def format_rollout_mix(counts: Iterable[tuple[int, int]]) -> str:
    """`(tp, instances)` pairs as `2xTP4 + 1xTP8` (pairs without instances left out; `none` if all are)."""
    return " + ".join(f"{n}xTP{tp}" for tp, n in counts if n) or "none"
