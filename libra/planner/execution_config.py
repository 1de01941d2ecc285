"""The plan executor's settings (`libra.planner.actions`), apart from the executor so that the
run's config can hold them without importing the control plane."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorConfig:
    """Timeouts of plan execution, in seconds (`planner.execution` in a run's config)."""

    drain_timeout_s: float = 60.0
    """How long a drained instance may keep finishing its in-flight trajectories; the rest are cut."""
    start_timeout_s: float = 300.0
    """From StartWorker until the worker's ready file appears."""
    stop_grace_s: float = 10.0
    """SIGTERM -> SIGKILL grace of a stopped worker."""
    release_timeout_s: float = 60.0
    """How long a released hybrid replica's worker may take to exit by itself."""
    poll_interval_s: float = 0.05

    def __post_init__(self) -> None:
        for name in (
            "drain_timeout_s",
            "start_timeout_s",
            "stop_grace_s",
            "release_timeout_s",
            "poll_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"planner.execution.{name} must be > 0, got {getattr(self, name)}")
