"""The bounded-staleness gate: which trajectories training may use, and how many rollouts may run.

Pure bookkeeping (no tensors, no clocks) with a serialisable state that is saved with every
checkpoint.

- Admission: a trajectory is admitted at trainer version v when every model token in it came from
  a policy version >= v - (max_staleness + tail_staleness) (its *oldest* version counts: a
  trajectory resumed across a weight update carries several).
- Capacity: rollouts may be started only while
      started - dropped < (version + max_staleness + 1) * batch_size,
  i.e. no rollout is begun that would be too stale by the time the trainer reaches it if it
  finished in its turn.
- The tail: `tail_staleness` extra versions are allowed to the trajectories that finish late (the
  long ones), not to the launch depth. With 0 a long trajectory that outlives its turn is dropped
  (or waited for); a few versions of tail keep nearly all of them at the same launch depth, so
  the rollout side runs no further ahead, and the bound on any token's age stays
  max_staleness + tail_staleness (AReaL bounds the same age, without a separate launch depth).
- Waiting for the tail (`waits_for_due`): a rollout still running when the next step would leave
  it too stale is dropped when it finishes (`drop`), always waited for (`wait`: nothing dropped,
  steps stall), or waited for only when dropping it would take the run's dropped share past a
  budget (`budget`: the long tail is kept at, say, 98 % with as little stall as that takes).
- Restart: the counters and the version are persisted. Rollouts in flight at the checkpoint do
  not survive a restart, so `load_state_dict` releases their slots by default; forgetting the
  counters instead (the usual bug) lets the first post-restart round over-commit the rollout side
  by version x batch_size trajectories, which then all arrive too stale and are wasted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StalenessState:
    version: int = 0
    """The trainer's policy version: the number of train steps taken."""
    num_started: int = 0
    """Rollouts started (slots acquired)."""
    num_consumed: int = 0
    """Trajectories trained on."""
    num_dropped: int = 0
    """Trajectories dropped: too stale, filtered, or lost in flight."""
    num_dropped_stale: int = 0
    """Of those, dropped as too stale (what `StalenessGate.waits_for_due` holds to its budget)."""

    @property
    def num_in_flight(self) -> int:
        return self.num_started - self.num_consumed - self.num_dropped


class StalenessGate:
    def __init__(
        self,
        max_staleness: int,
        batch_size: int,
        state: StalenessState | None = None,
        tail_staleness: int = 0,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if tail_staleness < 0:
            raise ValueError(f"tail_staleness must be >= 0, got {tail_staleness}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.max_staleness = max_staleness
        self.tail_staleness = tail_staleness
        self.batch_size = batch_size
        self.state = state or StalenessState()

    @property
    def bound(self) -> int:
        """The most versions any trained token may lag the trainer."""
        return self.max_staleness + self.tail_staleness

    @property
    def version(self) -> int:
        return self.state.version

    def capacity(self) -> int:
        """How many more rollouts may be started now."""
        limit = (self.state.version + self.max_staleness + 1) * self.batch_size
        return max(0, limit - (self.state.num_started - self.state.num_dropped))

    def try_start(self, count: int = 1) -> int:
        """Acquires up to `count` rollout slots; returns how many were granted."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        granted = min(count, self.capacity())
        self.state.num_started += granted
        return granted

    def is_fresh(self, oldest_policy_version: int | None) -> bool:
        """Within `bound` versions of the trainer. A trajectory with no model tokens (None) is
        fresh: nothing in it was sampled by an old policy."""
        if oldest_policy_version is None:
            return True
        if oldest_policy_version > self.state.version:
            raise ValueError(
                f"trajectory policy version {oldest_policy_version} is ahead of the trainer's "
                f"{self.state.version}"
            )
        return self.state.version - oldest_policy_version <= self.bound

    def admit(self, oldest_versions: list[int | None]) -> list[bool]:
        """Decides each finished trajectory; rejected ones free their slots (counted dropped).
        Trajectories beyond those in flight were started without a slot (outside the gate): they
        are counted as started on arrival, so the counters stay consistent."""
        self._arrive(len(oldest_versions))
        decisions = [self.is_fresh(v) for v in oldest_versions]
        self.state.num_dropped += decisions.count(False)
        self.state.num_dropped_stale += decisions.count(False)
        return decisions

    def admit_group(self, oldest_versions: list[int | None], slots: int) -> bool:
        """Admits a group's trajectories together, or drops them together (freeing the `slots`
        it was started with, whatever number of trajectories it brought back): GRPO normalises
        rewards within a group, and the part of a group left after its stale members were
        dropped would bias its advantages. An admitted group's slots are consumed by the train
        step (`on_train_step`)."""
        self._arrive(slots)
        fresh = all(self.is_fresh(v) for v in oldest_versions)
        if not fresh:
            self.state.num_dropped += slots
            self.state.num_dropped_stale += slots
        return fresh

    def _arrive(self, count: int) -> None:
        unaccounted = count - self.state.num_in_flight
        if unaccounted > 0:
            self.state.num_started += unaccounted

    def must_train(self, started_version: int) -> bool:
        """Whether a group launched when the trainer was at `started_version` must be in the next
        step's batch: after that step its tokens (none older than that version) would be past
        the `bound`."""
        return started_version <= self.state.version - self.bound

    def waits_for_due(self, due_slots: int, mode: str, drop_budget: float = 0.0) -> bool:
        """Whether the trainer waits, before its next step, for the `due_slots` rollouts still
        running that the step would leave too stale (`must_train`): always in `wait` mode, never
        in `drop` (they are dropped if they finish), and in `budget` mode when dropping them all
        would take the share of slots dropped as too stale, out of all that were trained or so
        dropped, past `drop_budget` -- so a run drops its long tail only while the drops stay
        that rare. Asked again as they finish, it stops waiting once those left fit the budget;
        early in a run, with few slots trained, it waits as `wait` does. Slots freed for other
        reasons (a restart, a group with nothing to train on) do not count."""
        if due_slots <= 0 or mode == "drop":
            return False
        if mode == "wait":
            return True
        if mode != "budget":
            raise ValueError(f"staleness mode must be wait, drop or budget, got {mode!r}")
        dropped = self.state.num_dropped_stale + due_slots
        return dropped > drop_budget * (self.state.num_consumed + dropped)

    def drop(self, count: int) -> None:
        """Frees slots of trajectories discarded for another reason (e.g. dynamic sampling)."""
        self.state.num_dropped += count

    def on_train_step(self, num_consumed: int) -> int:
        """Records a train step over `num_consumed` admitted trajectories; returns the new version."""
        self.state.num_consumed += num_consumed
        self.state.version += 1
        return self.state.version

    def state_dict(self) -> dict[str, int]:
        return {
            **asdict(self.state),
            "max_staleness": self.max_staleness,
            "tail_staleness": self.tail_staleness,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, saved: dict[str, int], release_in_flight: bool = True) -> None:
        """Restores the counters and version. `release_in_flight`: rollouts in flight when the state
        was saved are gone after a restart; count them dropped so their slots return."""
        state = StalenessState(
            version=saved["version"],
            num_started=saved["num_started"],
            num_consumed=saved["num_consumed"],
            num_dropped=saved["num_dropped"],
            num_dropped_stale=saved.get("num_dropped_stale", 0),  # absent before the budget mode
        )
        if state.num_in_flight < 0:
            raise ValueError(f"inconsistent staleness state {saved}: more finished than started")
        if release_in_flight:
            state.num_dropped += state.num_in_flight
        self.state = state
