"""When to re-plan, and whether to apply what the search found.

`ReplanTrigger` is fed one `StepObservation` per training step and says whether to run the
search now: periodically (`plan_interval`), or early on pressure -- queue or active-rollout
pressure, growth of rejected rollouts, or a rollout/train time ratio far from 1 -- but never
during warm-up, during the cooldown after a re-plan, or with too little history. Each pressure
trigger is edge-triggered with hysteresis: once it fired it re-arms only after its signal fell
`hysteresis` (relative) below the threshold, so a signal hovering at the threshold does not
re-plan every step.

`decide_apply` is the apply rule: the gain per step, counted over the steps until the next
periodic re-plan, must beat the reconfiguration cost (the measured mean of that kind of plan --
with or without a training restart -- once there is one), and the relative gain must reach
`min_gain_ratio`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from libra.planner.config import TriggerPolicy


class TriggerReason(enum.Enum):
    NONE = "none"
    PERIODIC = "periodic"
    QUEUE_PRESSURE = "queue_pressure"
    ACTIVE_PRESSURE = "active_pressure"
    REJECTED_GROWTH = "rejected_growth"
    TIME_RATIO = "time_ratio"
    FORCED = "forced"


@dataclass(frozen=True)
class StepObservation:
    step: int
    train_s: float
    """Measured duration of the training step."""
    rollout_s: float
    """Measured time rollout took to deliver the step's batch."""
    queue_pressure: float = 0.0
    """Waiting trajectories / instance queue capacity, in [0, 1]."""
    active_pressure: float = 0.0
    """Running trajectories / instance concurrency, in [0, 1]."""
    rejected_total: int = 0
    """Rollouts rejected (staleness or capacity) since the run started."""
    history_size: int = 0

    @classmethod
    def measure(
        cls,
        step: int,
        train_s: float,
        rollout_s: float,
        *,
        running: int,
        waiting: int,
        slots: int,
        rejected_total: int = 0,
        history_size: int = 0,
    ) -> StepObservation:
        """The one definition of rollout pressure, for the job and the simulator alike:
        trajectories being decoded (`running`) and those admitted but not decoding (`waiting`: no
        instance, or queued behind a full engine batch), each over `slots`, the decode batches of
        the live instances together (instances x engine concurrency)."""
        slots = max(1, slots)
        return cls(
            step,
            train_s,
            rollout_s,
            queue_pressure=min(1.0, waiting / slots),
            active_pressure=min(1.0, running / slots),
            rejected_total=rejected_total,
            history_size=history_size,
        )


class ReplanTrigger:
    def __init__(self, policy: TriggerPolicy):
        self.policy = policy
        self._last_plan_step: int | None = None
        self._rejected_at_last_plan = 0
        self._armed = {
            r: True
            for r in (TriggerReason.QUEUE_PRESSURE, TriggerReason.ACTIVE_PRESSURE, TriggerReason.TIME_RATIO)
        }

    def observe(self, obs: StepObservation) -> TriggerReason:
        """The reason to re-plan after this step, or NONE. A returned reason counts as a re-plan
        (cooldown starts, edge triggers disarm)."""
        p = self.policy
        signals = {
            TriggerReason.QUEUE_PRESSURE: (obs.queue_pressure, p.queue_pressure),
            TriggerReason.ACTIVE_PRESSURE: (obs.active_pressure, p.active_pressure),
            TriggerReason.TIME_RATIO: (_imbalance(obs.train_s, obs.rollout_s), p.rollout_train_ratio),
        }
        for reason, (value, threshold) in signals.items():  # re-arm below the hysteresis band
            if value < threshold * (1 - p.hysteresis):
                self._armed[reason] = True
        if obs.step < p.warmup_steps or obs.history_size < p.min_history:
            return TriggerReason.NONE
        since = None if self._last_plan_step is None else obs.step - self._last_plan_step
        if since is not None and since <= p.cooldown_steps:
            return TriggerReason.NONE
        reason = TriggerReason.NONE
        for candidate, (value, threshold) in signals.items():
            if self._armed[candidate] and value >= threshold:
                reason = candidate
                break
        if reason is TriggerReason.NONE and obs.rejected_total - self._rejected_at_last_plan >= max(
            1, p.rejected_growth
        ):
            reason = TriggerReason.REJECTED_GROWTH
        if reason is TriggerReason.NONE and p.plan_interval and (since is None or since >= p.plan_interval):
            reason = TriggerReason.PERIODIC
        if reason is not TriggerReason.NONE:
            self._mark_planned(obs, reason)
        return reason

    def force(self, obs: StepObservation) -> TriggerReason:
        self._mark_planned(obs, TriggerReason.FORCED)
        return TriggerReason.FORCED

    def _mark_planned(self, obs: StepObservation, reason: TriggerReason) -> None:
        self._last_plan_step = obs.step
        self._rejected_at_last_plan = obs.rejected_total
        if reason in self._armed:
            self._armed[reason] = False


def _imbalance(train_s: float, rollout_s: float) -> float:
    """max(T_rollout / T_train, T_train / T_rollout): how far the stages are from balance."""
    if train_s <= 0 or rollout_s <= 0:
        return 0.0
    return max(rollout_s / train_s, train_s / rollout_s)


@dataclass(frozen=True)
class ApplyDecision:
    apply: bool
    gain_per_step_s: float
    relative_gain: float
    net_gain_s: float
    """Gain over the amortisation window minus the reconfiguration cost."""
    reason: str


class ReconfigurationCosts:
    """Measured seconds of applied plans, apart for plans that restart training (training waits
    for those) and the rest; each kind's mean replaces the policy's prior for that kind."""

    def __init__(self) -> None:
        self._samples: dict[bool, list[float]] = {False: [], True: []}

    def record(self, seconds: float, restart: bool = False) -> None:
        if seconds < 0:
            raise ValueError(f"reconfiguration time must be >= 0, got {seconds}")
        self._samples[restart].append(seconds)

    def estimate(self, policy: TriggerPolicy, restart: bool = False) -> float:
        samples = self._samples[restart]
        if samples:
            return sum(samples) / len(samples)
        return policy.restart_cost_s if restart else policy.reconfiguration_cost_s


def decide_apply(
    current_step_s: float, candidate_step_s: float, reconfiguration_s: float, policy: TriggerPolicy
) -> ApplyDecision:
    """Apply the candidate only if its gain, amortised, beats the cost of moving and is large enough."""
    gain = current_step_s - candidate_step_s
    relative = gain / current_step_s if current_step_s > 0 else 0.0
    window = policy.amortization_steps or policy.plan_interval or 1
    net = gain * window - reconfiguration_s
    if gain <= 0:
        return ApplyDecision(False, gain, relative, net, "the candidate is not faster")
    if net <= 0:
        return ApplyDecision(
            False,
            gain,
            relative,
            net,
            f"gain {gain:.3f} s x {window} steps does not beat the {reconfiguration_s:.1f} s reconfiguration",
        )
    if relative < policy.min_gain_ratio:
        return ApplyDecision(
            False,
            gain,
            relative,
            net,
            f"relative gain {relative:.1%} is below min_gain_ratio {policy.min_gain_ratio:.1%}",
        )
    return ApplyDecision(True, gain, relative, net, f"net gain {net:.1f} s over {window} steps")
