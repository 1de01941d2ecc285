"""The planner's output: who does what on which device, and what the cost models predict.

Devices are numbered node-major across the cluster (device d is local device d % devices_per_node
of node d // devices_per_node). Training holds the first `num_devices` devices as DP replicas of
TP x PP contiguous devices; rollout instances follow, each on an aligned block of its TP size
inside one node.
"""

from __future__ import annotations

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
    def predicted_step_s(self) -> float:
        """The objective: in the asynchronous loop a step takes as long as the slower stage."""
        return max(self.predicted_train_s, self.predicted_rollout_s)

    @property
    def idle_devices(self) -> tuple[int, ...]:
        used = set(self.training.devices)
        for instance in self.instances:
            used.update(instance.devices)
        return tuple(d for d in range(self.num_devices) if d not in used)

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
    on the next block aligned to its size. With power-of-two sizes that divide the node and a
    start aligned to every size, this packs without gaps and no instance straddles a node."""
    instances = []
    offset = first_device
    for tp in sorted(tp_sizes, reverse=True):
        if (
            offset % tp
            or offset + tp > num_devices
            or offset // devices_per_node != (offset + tp - 1) // devices_per_node
        ):
            raise ValueError(f"cannot place a TP-{tp} instance at device {offset} (of {num_devices})")
        instances.append(
            RolloutInstance(
                f"rollout-tp{tp}-d{offset}", tp, tuple(range(offset, offset + tp)), offset // devices_per_node
            )
        )
        offset += tp
    return tuple(instances)
