"""The planner as the controller holds it: the current plan, a pending candidate, the policy, the
triggers, and the events it emits. Pure and thread-safe; `service.py` puts gRPC in front of it.

The controller calls `observe(step)` after every training step (with a fresh history when it
has one); on a trigger it searches, and either applies the candidate (auto_apply and the apply
rule agree) or leaves it pending for an external controller (`propose` / `accept_candidate` /
`veto_candidate`). Every adoption returns the actions that move the cluster to the new plan and
emits a `PlannerEvent`.

With a rescorer (`PlanRescorer`, e.g. the simulator's `libra.sim.rescoring.simulated_rescorer`)
the plan chosen is not the model's optimum alone: the optimum and the best homogeneous pool of
each TP size (`candidate_plans`) are scored, and another candidate replaces the optimum when it
scores `rescore_margin` (2 %) higher -- at the initial plan, and at a re-plan the model's rule
would apply, where the running plan is scored beside them and must be beaten by the apply rule's
gain on the rescorer's ratio. The model is least trustworthy where it finds a mix and a
homogeneous pool within a percent of each other; a short simulation's ranking within a percent
or two is noise too, hence the margin.

The apply rule weighs model against model: the running plan and the candidate are both priced by
the cost model, on the same history, with its factors scaled per stage by how the running plan's
measured steps compared with its predictions (`StepCalibration`). A measured step against a
prediction would count the model's own error as gain or loss: with an uncalibrated model every
candidate looks faster (or none does), and near-equal plans would replace each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libra.planner.calibration import StageScales, StepCalibration, scaled_factors
from libra.planner.candidates import candidate_plans
from libra.planner.config import PlanningProblem, RequestRecord, TriggerPolicy
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.diff import Action, RestartTraining, diff_plans
from libra.planner.evaluate import evaluate_plan
from libra.planner.plan import Plan
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_speeds import with_speeds
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS, DEFAULT_TRAIN_FACTORS, search
from libra.planner.triggers import (
    ApplyDecision,
    ReconfigurationCosts,
    ReplanTrigger,
    StepObservation,
    TriggerReason,
    decide_apply,
)
from libra.scheduler.config import BucketConfig


@dataclass(frozen=True)
class PlannerEvent:
    kind: str
    """`applied`, `proposed` (a candidate awaits a decision), `rejected` (apply rule said no), `vetoed`."""
    version: int
    message: str


@dataclass(frozen=True)
class PlannerState:
    """What callers read together: the running plan, its version and the pending candidate.
    Replaced whole, so a reader on another thread never sees a plan with another's version."""

    current: Plan | None = None
    version: int = 0
    candidate: Plan | None = None


class PlannerBusy(TimeoutError):
    """An operator's call waited longer than it would for the planner to finish a search or a
    re-scoring (at a large cluster's size, minutes of simulation)."""


PlanRescorer = Callable[[Sequence[Plan]], Sequence[float]]
"""Scores plans on the workload as it is now: a rate, >= 0, higher is better (e.g. simulated
trained tokens/s); one score per plan, in order. It runs under the planner's lock, so it must not
call the planner back."""


@dataclass(frozen=True)
class Rescoring:
    """One re-scoring: each plan's rollout mix, training devices and score, best first."""

    scored: tuple[tuple[Plan, float], ...]
    seconds: float = 0.0
    """What the rescorer took (the planner holds its lock meanwhile)."""

    def score_of(self, plan: Plan) -> float:
        return next(score for p, score in self.scored if p is plan)

    def choice(self, optimum: Plan, margin: float, excluding: Plan | None = None) -> Plan:
        """The best-scored plan (other than `excluding`) if it beats the model's `optimum` by
        `margin`, else the optimum."""
        best = next(p for p, _ in self.scored if p is not excluding)
        return best if self.score_of(best) > self.score_of(optimum) * (1 + margin) else optimum

    def describe(self) -> str:
        scores = "; ".join(
            f"{p.rollout_mix} (train {p.training.config.num_devices}) {score:,.0f}"
            for p, score in self.scored
        )
        return f"{scores} (scored in {self.seconds:.1f} s)"


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
        rescorer: PlanRescorer | None = None,
    ):
        self._lock = threading.Lock()
        self._activity: tuple[str, float] = ("idle", time.monotonic())
        """What the lock's holder is doing and since when, for `PlannerBusy`'s message."""
        self._rescorer = rescorer
        self.rescorings: deque[Rescoring] = deque(maxlen=64)
        """The latest re-scorings, in order (for reports)."""
        self._problem = problem
        self._factors = (train_factors, rollout_factors)
        self._on_event = on_event or (lambda event: None)
        self._trigger = ReplanTrigger(problem.config.policy)
        self._costs = ReconfigurationCosts()
        self._calibration = StepCalibration()
        self.state = PlannerState()

    @property
    def current(self) -> Plan | None:
        return self.state.current

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def candidate(self) -> Plan | None:
        return self.state.candidate

    def _set_candidate(self, candidate: Plan | None) -> None:
        self.state = dataclasses.replace(self.state, candidate=candidate)

    @contextlib.contextmanager
    def _locked(self, wait_s: float | None = None, doing: str = "deciding"):
        """The planner's lock, waited for at most `wait_s` (None: as long as it takes), else
        `PlannerBusy` saying what holds it; `doing` is what this holder will be doing."""
        if not self._lock.acquire(timeout=-1 if wait_s is None else wait_s) and not self._lock.acquire(False):
            what, since = self._activity
            raise PlannerBusy(
                f"the planner has been busy {what} for {time.monotonic() - since:.0f} s; retry later"
            )
        try:
            self._activity = (doing, time.monotonic())
            yield
        finally:
            self._activity = ("idle", time.monotonic())
            self._lock.release()

    @property
    def policy(self) -> TriggerPolicy:
        return self._problem.config.policy

    def set_policy(self, policy: TriggerPolicy, wait_s: float | None = None) -> None:
        """Replaces the trigger and apply policy (waiting at most `wait_s` for a re-plan in progress)."""
        with self._locked(wait_s, "setting its policy"):
            self._set_policy(policy)

    def update_policy(self, wait_s: float | None = None, **changes) -> TriggerPolicy:
        """Changes the named fields of the policy in force, under the lock (two callers changing
        different fields both keep theirs); returns the new policy. ValueError for a policy the
        planner refuses."""
        with self._locked(wait_s, "setting its policy"):
            policy = dataclasses.replace(self.policy, **changes)
            self._set_policy(policy)
            return policy

    def _set_policy(self, policy: TriggerPolicy) -> None:
        config = dataclasses.replace(self._problem.config, policy=policy)
        self._problem = dataclasses.replace(self._problem, config=config)
        self._trigger.policy = policy

    @property
    def history(self) -> tuple[RequestRecord, ...]:
        """The workload history it plans from."""
        return self._problem.history

    def update_history(self, history: tuple[RequestRecord, ...]) -> None:
        """Replaces the workload history (the newest `max_history` records are kept)."""
        with self._locked(doing="taking a new history"):
            kept = tuple(history)[-self.policy.max_history :]
            self._problem = dataclasses.replace(self._problem, history=kept)

    def priced_buckets(self, buckets: Sequence[BucketConfig]) -> tuple[BucketConfig, ...]:
        """`buckets` with their instances' speeds (`libra.planner.routing_speeds`) by the
        calibrated rollout model on the current history, so that C-MLFQ promotes a trajectory only
        where the move pays. Takes no lock: the rollout pool's event loop calls it, and must not
        wait for a search; the problem and the scales are replaced whole, never changed in place."""
        problem, (_, rollout) = self._problem, self.calibrated_factors()
        cost = RolloutCostModel(problem.cluster, problem.model, problem.config, rollout)
        return with_speeds(buckets, cost, problem.history)

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
        with self._locked(doing="choosing the initial plan"):
            return self._choose_initial("initial plan")

    def _choose_initial(self, why: str) -> Adoption:
        plan = search(self._problem, *self.calibrated_factors())
        if self._rescorer is None:
            return self._adopt(plan, why)
        rescoring = self._rescore(plan)
        chosen = rescoring.choice(plan, self.policy.rescore_margin)
        return self._adopt(chosen, f"{why}, re-scored: {rescoring.describe()}")

    def observe(self, obs: StepObservation) -> Adoption | None:
        """Feeds one step's measurements; returns the adoption when a re-plan was applied."""
        with self._locked(doing=f"re-planning after step {obs.step}"):
            obs = dataclasses.replace(obs, history_size=max(obs.history_size, len(self._problem.history)))
            if self.current is not None:
                self._calibration.record(obs.train_s, obs.rollout_s)
            reason = self._trigger.observe(obs)
            if reason is TriggerReason.NONE:
                return None
            return self._replan(reason)

    def calibrated_factors(self) -> tuple[EfficiencyFactors, EfficiencyFactors]:
        """(training, rollout) factors scaled by how the running plan's measured steps compared with
        its predictions: the planner's best knowledge of the hardware. Takes no lock (the scales are
        replaced whole), so a rescorer running under the planner's lock may read them."""
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
        return evaluate_plan(self._problem, self.current, *self.calibrated_factors()).predicted_step_s

    def _replan(self, reason: TriggerReason) -> Adoption | None:
        if self.current is None:
            return self._choose_initial(f"initial plan ({reason.value})")
        current_s = self._price_current()
        candidate = search(self._problem, *self.calibrated_factors())
        # A gain within the calibration's own spread across layouts is no evidence of one.
        policy = dataclasses.replace(
            self.policy, min_gain_ratio=max(self.policy.min_gain_ratio, self._calibration.spread)
        )
        decision = self._decide(current_s, candidate, candidate.predicted_step_s, policy)
        if not decision.apply:
            self._emit("rejected", f"{reason.value}: {decision.reason}; {self._describe_scales()}")
            return None
        # Re-scoring chooses between layouts: a candidate on the running one (new thresholds,
        # the same instances) is the model's call alone.
        rescored = ""
        if self._rescorer is not None and candidate.layout_key != self.current.layout_key:
            # A running plan that no longer fits (priced inf) is not among those scored.
            fits = math.isfinite(current_s)
            rescoring = self._rescore(candidate, current=self.current if fits else None)
            best = rescoring.choice(candidate, self.policy.rescore_margin, excluding=self.current)
            if fits:
                # The rescorer's ratio, on the model's scale of the running plan's step.
                best_score = rescoring.score_of(best)
                current_score = rescoring.score_of(self.current)
                best_s = current_s * current_score / best_score if best_score > 0 else math.inf
                decision = self._decide(current_s, best, best_s, policy)
                if best_score <= current_score or not decision.apply:
                    self._emit(
                        "rejected",
                        f"{reason.value}: the model's candidate would apply, but re-scored: "
                        f"{rescoring.describe()} ({decision.reason})",
                    )
                    return None
            candidate, rescored = best, f"; re-scored: {rescoring.describe()}"
        if not self.policy.auto_apply:
            self._set_candidate(candidate)
            self._emit("proposed", f"{reason.value}: {self._why(decision)}{rescored}; awaiting ProposePlan")
            return None
        return self._adopt(candidate, f"{reason.value}: {self._why(decision)}{rescored}")

    def _decide(
        self, current_s: float, candidate: Plan, candidate_s: float, policy: TriggerPolicy
    ) -> ApplyDecision:
        _, actions = diff_plans(self.current, candidate, pool=self._problem.config.hybrid_pool)
        restart = any(isinstance(a, RestartTraining) for a in actions)
        return decide_apply(current_s, candidate_s, self._costs.estimate(policy, restart), policy)

    def _rescore(self, optimum: Plan, current: Plan | None = None) -> Rescoring:
        """The candidates (and `current`, first) scored by the rescorer, best first; ties keep
        the running plan, then the model's order."""
        plans = candidate_plans(self._problem, *self.calibrated_factors(), optimum=optimum)
        if current is not None:
            plans = [current, *(p for p in plans if p.layout_key != current.layout_key)]
        self._activity = (f"re-scoring {len(plans)} plans in simulation", time.monotonic())
        started = time.perf_counter()
        scores = list(self._rescorer(plans))
        seconds = time.perf_counter() - started
        if len(scores) != len(plans) or not all(math.isfinite(s) and s >= 0 for s in scores):
            raise ValueError(
                f"the rescorer must give one finite score >= 0 per plan, got {scores} for {len(plans)}"
            )
        order = sorted(range(len(plans)), key=lambda i: (-scores[i], i))
        rescoring = Rescoring(tuple((plans[i], scores[i]) for i in order), seconds)
        self.rescorings.append(rescoring)
        return rescoring

    def propose(self, plan: Plan, reason: str = "", wait_s: float | None = None) -> Adoption:
        """Adopts an externally supplied plan after validating and re-pricing it (ValueError if
        invalid; `PlannerBusy` if a re-plan holds the planner for longer than `wait_s`)."""
        with self._locked(wait_s, "adopting an external plan"):
            priced = evaluate_plan(self._problem, plan, *self.calibrated_factors())
            return self._adopt(priced, f"external plan{': ' + reason if reason else ''}")

    def accept_candidate(self, reason: str = "", wait_s: float | None = None) -> Adoption:
        with self._locked(wait_s, "adopting its candidate"):
            candidate = self.candidate
            if candidate is None:
                raise RuntimeError("no candidate plan is pending")
            return self._adopt(candidate, f"candidate accepted{': ' + reason if reason else ''}")

    def veto_candidate(self, reason: str = "", wait_s: float | None = None) -> None:
        with self._locked(wait_s, "vetoing its candidate"):
            if self.candidate is None:
                raise RuntimeError("no candidate plan is pending")
            self._set_candidate(None)
            self._emit("vetoed", reason or "candidate vetoed")

    def _adopt(self, plan: Plan, why: str) -> Adoption:
        plan, actions = diff_plans(
            self.current, plan, cut_inflight=self.policy.cut_inflight, pool=self._problem.config.hybrid_pool
        )
        # One replacement: a reader sees the plan, its version and no stale candidate together.
        self.state = PlannerState(current=plan, version=self.version + 1, candidate=None)
        self._calibration.restart()
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
