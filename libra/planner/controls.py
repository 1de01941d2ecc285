"""The seams the plan executor (`libra.planner.actions`) drives, so that it depends on neither the
job's internals nor the processes behind them:

- `RolloutControl`: the rollout side (the instance pool and its router) — drain, cut, add,
  remove instances, bucket thresholds;
- `HybridControl`: hybrid joins and releases on the core's lane (`libra.training.hybrid.LaneControl`
  is the in-process one);
- `TrainingControl`: the checkpoint -> stop -> start -> load steps of a training restart;
- `WorkerLauncher`: the command lines of the workers the executor starts on node agents.

Every method is called from the executor's thread, one at a time, in the order of the plan's
actions. An asyncio job implements them by scheduling onto its loop and waiting
(`asyncio.run_coroutine_threadsafe(...).result()`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from libra.planner.diff import JoinHybridReplica, RestartTraining, StartRolloutInstance
from libra.training.elastic import HybridJoin


@dataclass(frozen=True)
class LaunchSpec:
    """How to run one worker; its devices come from the action."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    ready_file: str = ""
    """A file the worker writes (its serving address, atomically) once it serves; the executor
    waits for it. Empty: the worker counts as ready once its process runs."""

    def __post_init__(self) -> None:
        if not self.argv or not self.argv[0]:
            raise ValueError("LaunchSpec.argv must name a command")


@runtime_checkable
class RolloutControl(Protocol):
    """The rollout pool as the executor sees it. Instance ids are the plan's."""

    def drain(self, instance_id: str, timeout_s: float) -> int:
        """Stops routing new trajectories (and new turns) to the instance, then waits until its
        in-flight trajectories finished their current turn and moved away, at most `timeout_s`.
        Returns how many are still on it at the deadline (0: drained); the executor cuts those."""
        ...

    def cut(self, instance_id: str) -> int:
        """Stops routing to the instance and aborts its in-flight requests now; each displaced
        trajectory resumes on another instance from its kept tokens. Returns how many it cut."""
        ...

    def restore(self, instance_id: str) -> None:
        """Undoes `drain`/`cut` for an instance whose worker could not be stopped: it keeps
        serving and is routed to again."""
        ...

    def remove_instance(self, instance_id: str) -> None:
        """The instance's worker has stopped: forget it (no loss accounting, it was planned)."""
        ...

    def expect(self, tp_sizes: tuple[int, ...]) -> None:
        """The plan will start instances of these TP sizes (replacing what was expected; empty:
        none more): until each joins (`add_instance`), trajectories the instances left have no
        room for wait for it rather than queue on a full one."""
        ...

    def add_instance(self, instance_id: str, worker_id: str, tp: int, address: str) -> None:
        """A new instance serves at `address` (its worker `worker_id` is ready): bring it to the current
        weights and add it to the bucket of its TP size. Raising makes the start fail (the
        executor stops the worker)."""
        ...

    def set_bucket_thresholds(self, thresholds: tuple[tuple[int, int], ...]) -> None:
        """(TP size, max output tokens) per bucket, ascending."""
        ...


@runtime_checkable
class HybridControl(Protocol):
    """The core's lane to the elastic hybrid pool. Join and release are requests the lane carries
    out at its next step boundaries: the core never waits for them."""

    def request_join(self, replica: int) -> HybridJoin:
        """Opens a join of DP replica `replica` on its core lane (REQUESTED)."""
        ...

    def cancel_join(self, replica: int, generation: int, reason: str) -> None:
        """The replica's worker could not be started: roll that join back (an older generation's
        cancel is ignored)."""
        ...

    def request_release(self, replica: int) -> None:
        """Asks the core to release the replica at its next step boundary (ACTIVE -> RELEASED;
        one not yet ACTIVE is cancelled). Its worker then exits by itself."""
        ...


@runtime_checkable
class TrainingControl(Protocol):
    """A restart of training in a new layout: four blocking steps."""

    def checkpoint(self) -> str:
        """Saves the training state; returns where."""
        ...

    def stop_training(self) -> None:
        """Stops every train rank (their devices are free afterwards)."""
        ...

    def start_training(self, layout: RestartTraining) -> None:
        """Starts the train ranks of the new layout on `layout.new_devices`; returns once they serve."""
        ...

    def load_checkpoint(self, checkpoint: str) -> None: ...


@runtime_checkable
class WorkerLauncher(Protocol):
    """Command lines of the workers the executor starts."""

    def rollout_instance(self, action: StartRolloutInstance) -> LaunchSpec: ...

    def hybrid_replica(self, action: JoinHybridReplica, join: HybridJoin) -> LaunchSpec: ...
