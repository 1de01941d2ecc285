"""The planner's candidate plans re-scored by simulating each (`Planner`'s rescorer).

The cost model prices a plan by its work and its slowest request; the simulator runs it: chunked
prefill, the prefix cache and its evictions, KV pressure, the router, the staleness gate, the
tail. Where the model finds a mixed pool and a homogeneous one within a percent or two of each
other, only the simulation can tell which is faster, so the planner simulates its candidates
(the optimum and the best pool of each TP size, `libra.planner.candidates.candidate_plans`) for
`SimConfig.planner_rescore_steps` steps and keeps the one with the most trained tokens/s past
the steps that fill its empty pipeline (`rescore_warmup_steps`).

Each candidate runs as a static plan under C-MLFQ (its own buckets and thresholds), from the same
history, on the same groups, with the workload held where the run is now (no drift during the
short run), so the scores differ only in the plans. The groups are drawn from indices the run
itself never uses: the planner does not see the run's own future. The job re-scores the same
way on the groups it has finished (`score_plans` with a `ReplayedGroups`, `libra.job.rescoring`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from libra.planner.config import RequestRecord
from libra.planner.plan import Plan
from libra.planner.planner import Planner, PlanRescorer, Rescoring
from libra.scheduler.factory import RouterKind
from libra.sim.config import Mode, PolicySpec, Pool, SimConfig
from libra.sim.loop import WorkloadWindow, simulate
from libra.sim.pools import build_layout, planning_problem
from libra.sim.workloads import GroupSource

RESCORE_GROUP_OFFSET = 20_000_000
"""Re-scoring runs draw their groups from here on (the runs and their preflight use others)."""

STATIC_PLAN = PolicySpec(
    "rescored_plan",
    Mode.DISAGGREGATED_ASYNC,
    Pool.PLANNED,
    RouterKind.CMLFQ,
    description="one candidate plan kept static under C-MLFQ, for the planner's re-scoring",
)


def simulated_rescorer(
    config: SimConfig,
    history: Callable[[], tuple[RequestRecord, ...]],
    progress: Callable[[], float],
) -> PlanRescorer:
    """A rescorer that simulates each plan for `config.planner_rescore_steps` steps on the
    history and workload progress read when it is called (the run's, at that moment)."""
    if config.planner_rescore_steps < 1:
        raise ValueError(
            f"sim.planner_rescore_steps must be >= 1 to re-score, got {config.planner_rescore_steps}"
        )
    short = replace(config, num_steps=config.planner_rescore_steps)

    def rescore(plans: Sequence[Plan]) -> list[float]:
        window = WorkloadWindow(first_group=RESCORE_GROUP_OFFSET, held_progress=progress())
        return score_plans(short, plans, history(), window)

    return rescore


def score_plans(
    config: SimConfig,
    plans: Sequence[Plan],
    history: tuple[RequestRecord, ...],
    window: WorkloadWindow,
    policy: PolicySpec = STATIC_PLAN,
    groups: GroupSource | None = None,
) -> list[float]:
    """Each plan's trained tokens/s, run static (`policy`: under C-MLFQ unless it names another
    router) for `config.num_steps` steps on the same groups (`groups`, else the config's workload,
    from `window`), past the steps that fill its pipeline (`rescore_warmup_steps`)."""
    warmup = rescore_warmup_steps(config.num_steps, config.batch.max_staleness)
    return [
        simulate(
            config, policy, build_layout(config, policy, history, plan), history, window, groups=groups
        ).steady_trained_tokens_per_s(warmup)
        for plan in plans
    ]


def rescore_warmup_steps(num_steps: int, max_staleness: int) -> int:
    """The simulated steps a re-scoring leaves out: one per version the launch runs ahead
    (`max_staleness`; none on-policy, where every step starts from nothing), at most half. Each
    candidate starts from an empty pipeline -- its first steps wait for whole batches and train
    on the shortest trajectories -- while the running job it is compared for is past that."""
    if num_steps < 1 or max_staleness < 0:
        raise ValueError(f"need num_steps >= 1 and max_staleness >= 0, got {num_steps} and {max_staleness}")
    return min(max_staleness, num_steps // 2)


def rescored_initial_plan(config: SimConfig, history: tuple[RequestRecord, ...]) -> tuple[Plan, Rescoring]:
    """The launch plan as the planner chooses it with the simulated rescorer (the workload at the
    start of the run), and the scores it chose by."""
    planner = Planner(
        planning_problem(config, history, config.batch.max_staleness),
        config.train_factors,
        config.rollout_factors,
        rescorer=simulated_rescorer(config, lambda: history, lambda: 0.0),
    )
    return planner.initial_plan().plan, planner.rescorings[-1]
