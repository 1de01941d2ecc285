"""Qwen3-14B on 128 nodes x 8 H100, R2E-like workload with drift: scale-out, where the
planner's search time matters (it runs inside the loop at every re-plan)."""

from libra.planner.config import PlannerConfig, TrainingBatch, TriggerPolicy
from libra.sim.config import SimConfig
from libra.sim.workloads import WorkloadConfig


def sim_config() -> SimConfig:
    return SimConfig(
        name="r2e-1024xh100",
        profile="h100",
        num_nodes=128,
        batch=TrainingBatch(global_batch=2048, group_size=8, recompute="full", max_staleness=2),
        # Groups launched at most 2 versions ahead; the long trajectories that outlive their turn may
        # be 3 versions older still (5 at most) instead of being dropped (`training.tail_staleness`).
        tail_staleness=3,
        # Those still running when a step would leave them too stale are dropped only while the
        # dropped share stays within 2 % (`training.staleness_mode=budget`, the default); past
        # it, waited for.
        workload=WorkloadConfig(name="r2e", group_size=8, num_prompts=20000),
        planner=PlannerConfig(policy=TriggerPolicy(plan_interval=5)),
        num_steps=20,
        # The planner simulates its candidate plans for 5 steps each before adopting one.
        planner_rescore_steps=5,
    )
