"""Qwen3-14B on 6 nodes x 8 A800, R2E-like workload with drift: the original's main setting
(`reference/libra-notes.md` §7). Run with `libra simulate configs/sim_r2e_48xa800.py`."""

from libra.planner.config import PlannerConfig, TrainingBatch, TriggerPolicy
from libra.sim.config import SimConfig
from libra.sim.workloads import WorkloadConfig


def sim_config() -> SimConfig:
    return SimConfig(
        name="r2e-48xa800",
        profile="a800",
        num_nodes=6,
        batch=TrainingBatch(global_batch=128, group_size=4, recompute="full", max_staleness=2),
        # Groups launched at most 2 versions ahead; the long trajectories that outlive their turn may
        # be 3 versions older still (5 at most) instead of being dropped (`training.tail_staleness`).
        tail_staleness=3,
        # Those still running when a step would leave them too stale are dropped only while the
        # dropped share stays within 2 % (`training.staleness_mode=budget`, the default); past
        # it, waited for.
        workload=WorkloadConfig(name="r2e", group_size=4),
        # The original's 48-GPU experiment re-plans every 5 steps.
        planner=PlannerConfig(policy=TriggerPolicy(plan_interval=5)),
        num_steps=100,
        # The planner simulates its candidate plans for 10 steps each before adopting one.
        planner_rescore_steps=10,
    )
