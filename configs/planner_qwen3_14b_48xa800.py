"""Qwen3-14B on 6 nodes x 8 A800 with an R2E-like long-tailed agentic history: the setting of the
original paper's main experiment (`reference/libra-notes.md` §7). Run `libra plan` on this file."""

from libra.backends.profiles import A800_SXM4_80GB
from libra.planner.config import QWEN3_14B, ClusterSpec, PlannerConfig, PlanningProblem, TrainingBatch
from libra.planner.workload import synthetic_history


def planning_problem() -> PlanningProblem:
    return PlanningProblem(
        cluster=ClusterSpec(num_nodes=6, devices_per_node=8, profile=A800_SXM4_80GB),
        model=QWEN3_14B,
        batch=TrainingBatch(global_batch=128, group_size=4, recompute="full", max_staleness=2),
        history=synthetic_history(256, seed=0, median_output_tokens=1500, sigma=0.8),
        config=PlannerConfig(),
    )
