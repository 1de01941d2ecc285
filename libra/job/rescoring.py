"""The planner's candidate plans re-scored in the simulator on the job's own trajectories.

The planner's cost model prices a plan by its work and its slowest request; it knows nothing of
the router, the staleness gate, KV pressure or the tail. Where the job re-plans, `JobRescorer`
(the planner's `PlanRescorer`) runs each candidate -- the running plan, the model's optimum, the
best pool of each TP size -- as a static plan in the simulator (`libra.sim.rescoring.score_plans`)
for `job.planner_rescore_steps` steps and scores it by trained tokens/s past the steps that fill
its pipeline (which the running job did long ago). The simulated cluster is
the job's (its backend's hardware profile, its devices), priced with the planner's calibrated
factors (`Planner.calibrated_factors`: the model scaled to the steps the job measured), with the
job's batch, staleness rule and router settings; its groups are the job's latest finished groups,
replayed as they ran (`ReplayedGroups`: their turns, tool returns and tool latencies).

The planner then adopts another plan than its model's only when the simulation scores it
`planner.policy.rescore_margin` better, and leaves the running plan only when the simulation
says the move gains (`libra.planner.planner`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence

from libra.config import LibraConfig
from libra.planner.config import PlanningProblem, RequestRecord
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.plan import Plan
from libra.scheduler.factory import RouterKind
from libra.sim.config import SimConfig
from libra.sim.loop import WorkloadWindow
from libra.sim.rescoring import STATIC_PLAN, score_plans
from libra.sim.workloads import ReplayedGroups, WorkloadConfig
from libra.trace import TrajectoryTrace

Factors = tuple[EfficiencyFactors, EfficiencyFactors]


class JobRescorer:
    """Holds the job's latest finished groups (`record`) and scores plans on them (`__call__`)."""

    def __init__(self, config: LibraConfig, problem: PlanningProblem, factors: Callable[[], Factors]):
        steps = config.job.planner_rescore_steps
        if steps < 1:
            raise ValueError(f"job.planner_rescore_steps must be >= 1 to re-score, got {steps}")
        self.factors = factors
        """(training, rollout) efficiency factors, read at each re-scoring: the planner's calibrated."""
        history_size = problem.config.policy.max_history
        # Enough groups for the planner's history: the simulated runs draw them in turn.
        self.groups: collections.deque[tuple[TrajectoryTrace, ...]] = collections.deque(
            maxlen=max(1, math.ceil(history_size / problem.batch.group_size))
        )
        # The job's loop records, the planner's thread re-scores.
        self._lock = threading.Lock()
        self.policy = dataclasses.replace(STATIC_PLAN, router=RouterKind(config.job.router))
        cluster, training = problem.cluster, config.training
        self.config = SimConfig(
            name="job re-scoring",
            hardware=cluster.profile,
            num_nodes=cluster.num_nodes,
            devices_per_node=cluster.devices_per_node,
            model=problem.model,
            batch=problem.batch,
            workload=WorkloadConfig(group_size=problem.batch.group_size),
            planner=problem.config,  # with the engines' batch and KV sizes (`libra.job.problem`)
            num_steps=steps,
            history_size=history_size,
            cmlfq=config.scheduler,
            cmlfq_price_moves=config.job.price_moves and config.job.router == "cmlfq",
            fixed_node_pattern=(cluster.devices_per_node,),
            seed=config.job.seed,
            staleness_mode=training.staleness_mode,
            drop_budget=training.drop_budget,
            tail_staleness=training.tail_staleness,
        )

    def record(self, traces: Sequence[TrajectoryTrace]) -> None:
        """A finished group, as it ran."""
        if traces:
            with self._lock:
                self.groups.append(tuple(traces))

    def __call__(self, plans: Sequence[Plan]) -> list[float]:
        """Each plan's simulated trained tokens/s on the recorded groups (`PlanRescorer`)."""
        with self._lock:
            replay = ReplayedGroups(list(self.groups))
        train, rollout = self.factors()
        config = dataclasses.replace(self.config, train_factors=train, rollout_factors=rollout)
        history = tuple(RequestRecord.from_trace(t) for group in replay.groups for t in group)
        return score_plans(
            config, plans, history[-config.history_size :], WorkloadWindow(), self.policy, groups=replay
        )
