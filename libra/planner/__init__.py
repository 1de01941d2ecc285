"""The global resource planner: how many devices train and how many roll out, with which
parallelism on each side.

Owns the cost models (rollout: KV capacity, bandwidth-bound decode, prefill, per-bucket makespan;
training: per-layer compute, TP/PP/DP communication, 1F1B, memory), their least-squares
calibration (offline from measured steps, and online per stage against the running plan), the
exact two-level search, re-plan triggers and the apply rule (calibrated model against calibrated
model), plan diffs as typed actions for node agents, and the PlannerService gRPC servicer
(`service.serve_planner`: the job hands it to the controller, which knows no planner) — all pure:
no devices, no processes. The one exception is `actions.ActionExecutor`, which carries a diff out
on node agents through the controller's cluster API, with the rollout and training sides behind
the protocols of `controls` (import it from `libra.planner.actions`; it is not re-exported here,
so that importing the planner does not import the control plane). What the elastic hybrid pool
can pair and answers to a join come from `libra.training.elastic`.
"""

from libra.planner.config import (
    ClusterSpec,
    ModelArch,
    PlannerConfig,
    PlanningProblem,
    RequestRecord,
    SearchConfig,
    TrainingBatch,
    TriggerPolicy,
)
from libra.planner.cost_model import EfficiencyFactors, TimeBreakdown
from libra.planner.plan import BucketPlan, Plan, RolloutInstance, TrainingPlacement
from libra.planner.planner import Adoption, Planner, PlannerEvent
from libra.planner.search import NoFeasiblePlan, search
from libra.planner.training_cost import TrainingConfig

__all__ = [
    "Adoption",
    "BucketPlan",
    "ClusterSpec",
    "EfficiencyFactors",
    "ModelArch",
    "NoFeasiblePlan",
    "Plan",
    "Planner",
    "PlannerConfig",
    "PlannerEvent",
    "PlanningProblem",
    "RequestRecord",
    "RolloutInstance",
    "SearchConfig",
    "TimeBreakdown",
    "TrainingBatch",
    "TrainingConfig",
    "TrainingPlacement",
    "TriggerPolicy",
    "search",
]
