"""The controller's record of weight versions: which versions are published, which version each
rollout instance runs (and since when), which loads failed and when to retry them, and which
versions no instance needs any more (so the publisher can free their buffers).

Pure bookkeeping, no I/O: the controller feeds it the results of `apply_version` and the times.
Per-token attribution lives with the tokens: every generated chunk carries the version of the
engine that produced it (`libra.rollout` tags chunks; `Trajectory.policy_versions`); this ledger
answers the instance-level questions and cross-checks them (`version_at`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Instance:
    version: int
    history: list[tuple[float, int]] = field(default_factory=list)
    """(time, version) at every switch, in order."""
    attempts: int = 0
    """Failed loads of the latest version so far."""
    retry_at: float = 0.0
    last_error: str = ""


@dataclass(frozen=True)
class LoadTask:
    instance: str
    version: int
    attempt: int
    """1 for the first try."""


class VersionLedger:
    def __init__(self, initial_version: int = 0, max_attempts: int = 5, backoff_s: float = 1.0) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.initial_version = initial_version
        self.latest = initial_version
        self.published: list[int] = [initial_version]
        self._instances: dict[str, _Instance] = {}

    def add_instance(self, instance: str, version: int | None = None, now: float = 0.0) -> None:
        """An instance starts, on `version` (default: the checkpoint's initial version)."""
        start = self.initial_version if version is None else version
        self._instances[instance] = _Instance(start, [(now, start)])

    def remove_instance(self, instance: str) -> None:
        self._instances.pop(instance, None)

    def publish(self, version: int) -> None:
        """A new version is published; every instance owes a load of it (older owed loads lapse)."""
        if version <= self.latest:
            raise ValueError(f"published version {version} must be greater than the latest {self.latest}")
        self.latest = version
        self.published.append(version)
        for state in self._instances.values():
            state.attempts, state.retry_at, state.last_error = 0, 0.0, ""

    def due(self, now: float) -> list[LoadTask]:
        """Instances behind the latest version whose next attempt is due (and not given up on)."""
        tasks = []
        for name, state in self._instances.items():
            if state.version < self.latest and state.attempts < self.max_attempts and state.retry_at <= now:
                tasks.append(LoadTask(name, self.latest, state.attempts + 1))
        return tasks

    def loaded(self, instance: str, version: int, now: float) -> None:
        """The instance reports it runs `version` (from `LoadResult.version` or its stats)."""
        state = self._state(instance)
        if version < state.version:
            raise ValueError(f"instance {instance} went back from version {state.version} to {version}")
        if version not in self.published:
            raise ValueError(f"instance {instance} reports version {version}, which was never published")
        if version != state.version:
            state.version = version
            state.history.append((now, version))
        if version == self.latest:
            state.attempts, state.retry_at, state.last_error = 0, 0.0, ""

    def failed(self, instance: str, version: int, error: str, now: float) -> None:
        """A load of `version` failed; the instance stays on its old version. The next attempt is
        due after an exponential backoff; after `max_attempts` the instance is `given_up`."""
        state = self._state(instance)
        if version != self.latest:
            return  # a newer version superseded it; that one is owed instead
        state.attempts += 1
        state.last_error = error
        state.retry_at = now + self.backoff_s * 2 ** (state.attempts - 1)

    def given_up(self) -> dict[str, str]:
        """Instances whose loads of the latest version failed `max_attempts` times: last errors."""
        return {
            name: s.last_error
            for name, s in self._instances.items()
            if s.version < self.latest and s.attempts >= self.max_attempts
        }

    def version_of(self, instance: str) -> int:
        return self._state(instance).version

    def version_at(self, instance: str, time: float) -> int:
        """The version the instance ran at `time` (tokens it produced then came from it)."""
        state = self._state(instance)
        current = state.history[0][1]
        for since, version in state.history:
            if since > time:
                break
            current = version
        return current

    def releasable(self) -> list[int]:
        """Published versions older than the latest that no instance runs: free their buffers.
        (A version an instance runs stays: its loader may restore from it.)"""
        in_use = {s.version for s in self._instances.values()} | {self.latest}
        return [v for v in self.published if v not in in_use and v != self.initial_version]

    def forget(self, versions: list[int]) -> None:
        self.published = [v for v in self.published if v not in versions]

    def _state(self, instance: str) -> _Instance:
        if instance not in self._instances:
            raise LookupError(f"unknown rollout instance {instance!r}")
        return self._instances[instance]
