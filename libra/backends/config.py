"""The `backend` section of a run's config: which hardware backend node agents use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BackendConfig:
    """Which hardware backend node agents use, and its options."""

    name: str = "cpu"
    """`cpu`, `cuda`, `ascend` or a plugin's name (entry-point group `libra.backends`)."""
    num_devices: int | None = None
    """cpu backend: number of CPU slots (default: one per core). Ignored by other backends."""
    slots_per_device: int = 1
    """cuda and ascend: workers that may share one device (e.g. 2: a train rank and a rollout
    instance on a single GPU, the instance given `rollout.instance.gpu_memory_utilization` of at
    most 1/2). For workers of one device each: a worker of several ranks on one device is refused,
    and NCCL refuses two ranks of one group on one GPU. Not for the cpu backend (`num_devices`)."""

    def __post_init__(self) -> None:
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"backend.num_devices must be >= 1, got {self.num_devices}")
        if self.slots_per_device < 1:
            raise ValueError(f"backend.slots_per_device must be >= 1, got {self.slots_per_device}")
        if self.name == "cpu" and self.slots_per_device != 1:
            raise ValueError(
                "backend.slots_per_device does not apply to the cpu backend, whose slots are "
                "backend.num_devices"
            )

    def options(self) -> dict[str, object]:
        """Constructor options for `libra.backends.get_backend`."""
        if self.name == "cpu":
            return {"num_devices": self.num_devices}
        return {"slots_per_device": self.slots_per_device} if self.slots_per_device != 1 else {}
