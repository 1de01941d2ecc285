"""Run every policy of a `SimConfig` on the same workload and collect the results.

Every policy starts from the same preflight history, and every policy that starts from the
planner's initial plan starts from the same plan (searched once, and re-scored in the simulator
when `SimConfig.planner_rescore_steps` says so), so the comparison differs only in the mechanisms
the policies differ in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

from libra.planner.plan import Plan
from libra.planner.planner import Rescoring
from libra.sim.config import HINDSIGHT_POLICIES, POLICIES, Mode, Pool, SimConfig
from libra.sim.loop import preflight_history, simulate
from libra.sim.metrics import SimResult
from libra.sim.pools import build_layout, initial_plan
from libra.sim.rescoring import rescored_initial_plan, simulated_rescorer


@dataclass
class Comparison:
    config: SimConfig
    initial_plan: Plan | None
    initial_plan_search_s: float
    initial_rescoring: Rescoring | None = None
    """How the planner's candidates scored in the simulator when it chose the initial plan."""
    results: dict[str, SimResult] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Hindsight pools that cannot serve the workload, and why (a TP size too small for it)."""

    def best_hindsight(self) -> str | None:
        """The homogeneous pool that did best (`HINDSIGHT_POLICIES` run here), or None."""
        ran = [name for name in HINDSIGHT_POLICIES if name in self.results]
        return max(ran, key=lambda n: self.results[n].trained_tokens_per_s, default=None)

    def speedup(self, policy: str, over: str) -> float:
        """`policy`'s trained tokens/s over `over`'s."""
        return self.results[policy].trained_tokens_per_s / self.results[over].trained_tokens_per_s


def run_comparison(config: SimConfig, log=print) -> Comparison:
    history = preflight_history(config)
    needs_plan = any(
        POLICIES[p].mode is Mode.DISAGGREGATED_ASYNC and POLICIES[p].pool is not Pool.FIXED_PATTERN
        for p in config.policies
    )
    plan, search_s, rescoring = None, 0.0, None
    if needs_plan:
        started = time.perf_counter()
        if config.planner_rescore_steps:
            plan, rescoring = rescored_initial_plan(config, history)
        else:
            plan = initial_plan(config, history, config.batch.max_staleness)
        search_s = time.perf_counter() - started
    comparison = Comparison(config, plan, search_s, rescoring)
    for name in config.policies:
        policy = POLICIES[name]
        try:
            layout = build_layout(config, policy, history, plan)
        except ValueError as error:
            if name not in HINDSIGHT_POLICIES:
                raise
            comparison.skipped[name] = str(error)
            log(f"{config.name}: {name}: skipped: {error}")
            continue
        rescorer = (
            partial(simulated_rescorer, config) if config.planner_rescore_steps and policy.replan else None
        )
        result = simulate(config, policy, layout, history, rescorer=rescorer)
        comparison.results[name] = result
        log(
            f"{config.name}: {name}: {result.trained_tokens_per_s:.0f} trained tok/s "
            f"({result.trajectories_per_s:.3f} traj/s, {result.dropped_share:.1%} dropped), "
            f"step {result.step_s:.1f} s "
            f"(simulated in {result.wall_s:.1f} s)"
        )
    return comparison
