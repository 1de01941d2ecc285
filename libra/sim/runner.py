"""Run every policy of a `SimConfig` on the same workload and collect the results.

Every policy starts from the same preflight history, and every policy that starts from the
planner's initial plan starts from the same plan (searched once), so the comparison differs only
in the mechanisms the policies differ in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from libra.planner.plan import Plan
from libra.sim.config import POLICIES, Mode, Pool, SimConfig
from libra.sim.loop import preflight_history, simulate
from libra.sim.metrics import SimResult
from libra.sim.pools import build_layout, initial_plan


@dataclass
class Comparison:
    config: SimConfig
    initial_plan: Plan | None
    initial_plan_search_s: float
    results: dict[str, SimResult] = field(default_factory=dict)

    def speedup(self, policy: str, over: str) -> float:
        """`policy`'s trained tokens/s over `over`'s."""
        return self.results[policy].trained_tokens_per_s / self.results[over].trained_tokens_per_s


def run_comparison(config: SimConfig, log=print) -> Comparison:
    history = preflight_history(config)
    needs_plan = any(
        POLICIES[p].mode is Mode.DISAGGREGATED_ASYNC and POLICIES[p].pool is not Pool.FIXED_PATTERN
        for p in config.policies
    )
    plan, search_s = None, 0.0
    if needs_plan:
        started = time.perf_counter()
        plan = initial_plan(config, history, config.batch.max_staleness)
        search_s = time.perf_counter() - started
    comparison = Comparison(config, plan, search_s)
    for name in config.policies:
        policy = POLICIES[name]
        result = simulate(config, policy, build_layout(config, policy, history, plan), history)
        comparison.results[name] = result
        log(
            f"{config.name}: {name}: {result.trained_tokens_per_s:.0f} trained tok/s "
            f"({result.trajectories_per_s:.3f} traj/s, {result.dropped_share:.1%} dropped), "
            f"step {result.step_s:.1f} s "
            f"(simulated in {result.wall_s:.1f} s)"
        )
    return comparison
