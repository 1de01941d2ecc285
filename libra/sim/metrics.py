"""What a simulated run measures: the device-time ledger, per-step records, and the result.

Every device is in exactly one role at every instant -- `train`, `rollout`, `loading`
(reconfiguring: weights loading, a replica joining, a restart, a colocated stage switch) or
`unassigned` -- so role times add up to devices x makespan. Busy time inside a role comes from the
work done (decode and prefill seconds of instances, training steps), and idle = role - busy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ROLES = ("train", "rollout", "loading", "unassigned")


class DeviceLedger:
    def __init__(self, num_devices: int):
        self._role = ["unassigned"] * num_devices
        self._since = [0.0] * num_devices
        self.seconds = dict.fromkeys(ROLES, 0.0)

    def set_role(self, devices, role: str, now: float) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown device role {role!r}")
        for d in devices:
            self.seconds[self._role[d]] += now - self._since[d]
            self._role[d], self._since[d] = role, now

    def role_of(self, device: int) -> str:
        return self._role[device]

    def close(self, now: float) -> dict[str, float]:
        self.set_role(range(len(self._role)), "unassigned", now)
        return dict(self.seconds)


@dataclass(frozen=True)
class StepRecord:
    step: int
    started_at: float
    ended_at: float
    train_s: float
    """The training step itself (incl. weight publication)."""
    wait_s: float
    """Time the trainer waited for the batch (async) or rollout took (sync)."""
    stall_s: float
    """Stage switches (colocated) or restarts (planner without the elastic pool)."""
    tail_share: float
    """Of the batch's rollout span (first start to last finish), the share after 90% had finished."""
    num_train_devices: int
    tokens: int
    """Output tokens of the trajectories this step trained on."""


@dataclass
class SimResult:
    policy: str
    config_name: str
    num_devices: int
    num_steps: int
    makespan_s: float
    trajectories: int
    output_tokens: int
    device_seconds: dict[str, float]
    """Role seconds (`ROLES`) plus `train_busy` and `rollout_busy`."""
    staleness: list[int]
    steps: list[StepRecord]
    migrations: int = 0
    migration_s: float = 0.0
    """Seconds of KV transfers (`kv_move`); re-prefills count as rollout busy time instead."""
    prefix_evictions: int = 0
    """Prefix-cache entries rollout instances evicted to make room."""
    evicted_prefill_tokens: float = 0.0
    """Tokens prefilled again because a trajectory's cached prefix was gone when its turn was
    admitted: evicted, or emptied with the rest of the cache by new weights (most of it on the
    paper-scale runs: a publish every step)."""
    busy_by_tp: dict[int, float] = field(default_factory=dict)
    """Rollout busy device-seconds per instance TP size."""
    tokens_by_tp: dict[int, float] = field(default_factory=dict)
    """Output tokens decoded per instance TP size."""
    turns: int = 0
    dropped: int = 0
    aborted: int = 0
    plans_applied: int = 0
    plans_rejected: int = 0
    planner_search_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    started: int = 0
    finished: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def trajectories_per_s(self) -> float:
        return self.trajectories / self.makespan_s

    @property
    def trained_tokens_per_s(self) -> float:
        """Model tokens of the trajectories trained on per second: the throughput a run turns
        into training (a dropped trajectory's tokens count for nothing)."""
        return self.output_tokens / self.makespan_s

    def steady_trained_tokens_per_s(self, warmup_steps: int) -> float:
        """Trained tokens/s over the steps after the first `warmup_steps`: from the end of the
        last warm-up step (0: from the start) to the end of the last step. A run that starts
        empty first waits for a whole batch to roll out and then trains on the shortest
        trajectories; a running job has neither, so this is the rate to compare plans for it by.
        A run that stalled within its warm-up trained nothing past it: 0."""
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        after = self.steps[warmup_steps:]
        if not after:
            return 0.0
        began = self.steps[warmup_steps - 1].ended_at if warmup_steps else 0.0
        span = after[-1].ended_at - began
        return sum(s.tokens for s in after) / span if span > 0 else 0.0

    @property
    def dropped_share(self) -> float:
        """Finished trajectories dropped (too stale), out of those finished and taken or dropped."""
        return self.dropped / max(self.trajectories + self.dropped, 1)

    @property
    def step_s(self) -> float:
        return self.makespan_s / self.num_steps

    @property
    def ideal_step_s(self) -> float:
        """Lower bound: this run's busy device-seconds spread over every device, no idle."""
        busy = self.device_seconds["train_busy"] + self.device_seconds["rollout_busy"]
        return busy / self.num_devices / self.num_steps

    def idle_share(self, stage: str) -> float:
        """Idle share of the devices of `stage` (`train` or `rollout`) over their time in it."""
        held = self.device_seconds[stage]
        return 0.0 if held <= 0 else 1.0 - self.device_seconds[f"{stage}_busy"] / held

    @property
    def tail_share(self) -> float:
        return float(np.mean([s.tail_share for s in self.steps])) if self.steps else 0.0

    def breakdown(self) -> dict[str, float]:
        """Mean seconds per step: training, waiting for rollout, stalls."""
        return {
            "train_s": float(np.mean([s.train_s for s in self.steps])),
            "wait_s": float(np.mean([s.wait_s for s in self.steps])),
            "stall_s": float(np.mean([s.stall_s for s in self.steps])),
        }

    def staleness_histogram(self) -> dict[int, int]:
        values, counts = np.unique(np.array(self.staleness, dtype=int), return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts, strict=True)}


def tail_share(started: list[float], finished: list[float]) -> float:
    if len(finished) < 2:
        return 0.0
    ends = np.sort(np.array(finished))
    span = ends[-1] - min(started)
    if span <= 0:
        return 0.0
    p90 = ends[int(np.ceil(0.9 * len(ends))) - 1]
    return float((ends[-1] - p90) / span)
