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

    def __post_init__(self) -> None:
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"backend.num_devices must be >= 1, got {self.num_devices}")

    def options(self) -> dict[str, object]:
        """Constructor options for `libra.backends.get_backend`."""
        return {"num_devices": self.num_devices} if self.name == "cpu" else {}
