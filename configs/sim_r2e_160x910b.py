"""Qwen3-14B on 20 nodes x 8 Ascend 910B, R2E-like workload with drift."""

from libra.planner.config import PlannerConfig, TrainingBatch, TriggerPolicy
from libra.sim.config import SimConfig
from libra.sim.workloads import WorkloadConfig


def sim_config() -> SimConfig:
    return SimConfig(
        name="r2e-160x910b",
        profile="ascend910b",
        num_nodes=20,
        batch=TrainingBatch(global_batch=512, group_size=4, recompute="full", max_staleness=2),
        # Groups launched at most 2 versions ahead; the long trajectories that outlive their turn may
        # be 3 versions older still (5 at most) instead of being dropped (`training.tail_staleness`).
        tail_staleness=3,
        # Those still running when a step would leave them too stale are dropped only while the
        # dropped share stays within 2 % (`training.staleness_mode=budget`, the default); past
        # it, waited for.
        workload=WorkloadConfig(name="r2e", group_size=4, num_prompts=4000),
        planner=PlannerConfig(policy=TriggerPolicy(plan_interval=5)),
        num_steps=50,
        # The planner simulates its candidate plans for 8 steps each before adopting one.
        planner_rescore_steps=8,
    )
