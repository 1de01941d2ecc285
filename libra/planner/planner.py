"""The planner as the controller holds it: the current plan, a pending candidate, the policy, the
triggers, and the events it emits. Pure and thread-safe; `service.py` puts gRPC in front of it.

The controller calls `observe(step)` after every training step (with a fresh history when it
has one); on a trigger it searches, and either applies the candidate (auto_apply and the apply
rule agree) or leaves it pending for an external controller (`propose` / `accept_candidate` /
`veto_candidate`). Every adoption returns the actions that move the cluster to the new plan and
emits a `PlannerEvent`.

The apply rule weighs model against model: the running plan and the candidate are both priced by
the cost model, on the same history, with its factors scaled per stage by how the running plan's
measured steps compared with its predictions (`StepCalibration`). A measured step against a
prediction would count the model's own error as gain or loss: with an uncalibrated model every
candidate looks faster (or none does), and near-equal plans would replace each other.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from libra.planner.calibration import StageScales, StepCalibration, scaled_factors
from libra.planner.config import PlanningProblem, RequestRecord, TriggerPolicy
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.diff import Action, RestartTraining, diff_plans
from libra.planner.evaluate import evaluate_plan
from libra.planner.plan import Plan
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS, DEFAULT_TRAIN_FACTORS, search
from libra.planner.triggers import (
    ApplyDecision,
    ReconfigurationCosts,
    ReplanTrigger,
    StepObservation,
    TriggerReason,
    decide_apply,
)


@dataclass(frozen=True)
class PlannerEvent:
    kind: str
    """`applied`, `proposed` (a candidate awaits a decision), `rejected` (apply rule said no), `vetoed`."""
    version: int
    message: str


@dataclass(frozen=True)
class Adoption:
    plan: Plan
    version: int
    actions: tuple[Action, ...]
    reason: str
    """What its `applied` event says: why the planner adopted it and the predicted step."""


class Planner:
    def __init__(
        self,
        problem: PlanningProblem,
        train_factors: EfficiencyFactors = DEFAULT_TRAIN_FACTORS,
        rollout_factors: EfficiencyFactors = DEFAULT_ROLLOUT_FACTORS,
        on_event: Callable[[PlannerEvent], None] | None = None,
    ):
        self._lock = threading.Lock()
        self._problem = problem
        self._factors = (train_factors, rollout_factors)
        self._on_event = on_event or (lambda event: None)
        self._trigger = ReplanTrigger(problem.config.policy)
        self._costs = ReconfigurationCosts()
        self._calibration = StepCalibration()
        self.current: Plan | None = None
        self.version = 0
        self.candidate: Plan | None = None

    @property
    def policy(self) -> TriggerPolicy:
        return self._problem.config.policy

    def set_policy(self, policy: TriggerPolicy) -> None:
        with self._lock:
            config = dataclasses.replace(self._problem.config, policy=policy)
            self._problem = dataclasses.replace(self._problem, config=config)
            self._trigger.policy = policy

    def update_history(self, history: tuple[RequestRecord, ...]) -> None:
        """Replaces the workload history (the newest `max_history` records are kept)."""
        with self._lock:
            kept = tuple(history)[-self.policy.max_history :]
            self._problem = dataclasses.replace(self._problem, history=kept)

    def record_reconfiguration(self, seconds: float, restart: bool = False) -> None:
        """The measured time an applied plan took (`restart`: it restarted training); the apply
        rule uses the mean of that kind from now on."""
        self._costs.record(seconds, restart)

    @property
    def scales(self) -> StageScales:
        """Measured over predicted step time per stage, as of the last re-plan."""
        return self._calibration.scales

    def initial_plan(self) -> Adoption:
        """Chooses the split before launch."""
        with self._lock:
            plan = search(self._problem, *self._calibrated())
            return self._adopt(plan, "initial plan")

    def observe(self, obs: StepObservation) -> Adoption | None:
        """Feeds one step's measurements; returns the adoption when a re-plan was applied."""
        with self._lock:
            obs = dataclasses.replace(obs, history_size=max(obs.history_size, len(self._problem.history)))
            if self.current is not None:
                self._calibration.record(obs.train_s, obs.rollout_s)
            reason = self._trigger.observe(obs)
            if reason is TriggerReason.NONE:
                return None
            return self._replan(reason)

    def _calibrated(self) -> tuple[EfficiencyFactors, EfficiencyFactors]:
        train, rollout = self._factors
        scales = self._calibration.scales
        return scaled_factors(train, scales.train), scaled_factors(rollout, scales.rollout)

    def _price_current(self) -> float:
        """The running plan's step under the current history, by the calibrated model (after
        updating the calibration from the steps it took); inf when it no longer fits."""
        train, rollout = self._factors

        def price_at(scales: StageScales) -> tuple[float, float]:
            factors = scaled_factors(train, scales.train), scaled_factors(rollout, scales.rollout)
            priced = evaluate_plan(self._problem, self.current, *factors)
            return priced.predicted_train_s, priced.predicted_rollout_s

        try:
            self._calibration.update(price_at)
        except ValueError:  # e.g. the grown sequences no longer fit its training memory
            return math.inf
        return evaluate_plan(self._problem, self.current, *self._calibrated()).predicted_step_s

    def _replan(self, reason: TriggerReason) -> Adoption | None:
        if self.current is None:
            return self._adopt(search(self._problem, *self._calibrated()), f"initial plan ({reason.value})")
        current_s = self._price_current()
        candidate = search(self._problem, *self._calibrated())
        _, actions = diff_plans(self.current, candidate, pool=self._problem.config.hybrid_pool)
        restart = any(isinstance(a, RestartTraining) for a in actions)
        # A gain within the calibration's own spread across layouts is no evidence of one.
        policy = dataclasses.replace(
            self.policy, min_gain_ratio=max(self.policy.min_gain_ratio, self._calibration.spread)
        )
        decision = decide_apply(
            current_s, candidate.predicted_step_s, self._costs.estimate(policy, restart), policy
        )
        if not decision.apply:
            self._emit("rejected", f"{reason.value}: {decision.reason}; {self._describe_scales()}")
            return None
        if not self.policy.auto_apply:
            self.candidate = candidate
            self._emit("proposed", f"{reason.value}: {self._why(decision)}; awaiting ProposePlan")
            return None
        return self._adopt(candidate, f"{reason.value}: {self._why(decision)}")

    def propose(self, plan: Plan, reason: str = "") -> Adoption:
        """Adopts an externally supplied plan after validating and re-pricing it (ValueError if invalid)."""
        with self._lock:
            priced = evaluate_plan(self._problem, plan, *self._calibrated())
            self.candidate = None
            return self._adopt(priced, f"external plan{': ' + reason if reason else ''}")

    def accept_candidate(self, reason: str = "") -> Adoption:
        with self._lock:
            if self.candidate is None:
                raise RuntimeError("no candidate plan is pending")
            candidate, self.candidate = self.candidate, None
            return self._adopt(candidate, f"candidate accepted{': ' + reason if reason else ''}")

    def veto_candidate(self, reason: str = "") -> None:
        with self._lock:
            if self.candidate is None:
                raise RuntimeError("no candidate plan is pending")
            self.candidate = None
            self._emit("vetoed", reason or "candidate vetoed")

    def _adopt(self, plan: Plan, why: str) -> Adoption:
        plan, actions = diff_plans(
            self.current, plan, cut_inflight=self.policy.cut_inflight, pool=self._problem.config.hybrid_pool
        )
        self.current = plan
        self._calibration.restart()
        self.version += 1
        reason = f"v{self.version}: {why}; step {plan.predicted_step_s:.3f} s, {len(actions)} actions"
        self._emit("applied", reason)
        return Adoption(plan, self.version, tuple(actions), reason)

    def _why(self, decision: ApplyDecision) -> str:
        return (
            f"gain {decision.gain_per_step_s:.3f} s/step ({decision.relative_gain:.1%}), {decision.reason}, "
            f"{self._describe_scales()}"
        )

    def _describe_scales(self) -> str:
        scales, spread = self._calibration.scales, self._calibration.spread
        apart = f" (fits {spread:.0%} apart across plans)" if spread else ""
        return f"model calibrated x{scales.train:.2f} train, x{scales.rollout:.2f} rollout{apart}"

    def _emit(self, kind: str, message: str) -> None:
        self._on_event(PlannerEvent(kind, self.version, message))
