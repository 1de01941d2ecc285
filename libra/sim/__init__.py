"""The discrete-event cluster simulator: drives the real C-MLFQ router, staleness gate and
planner with simulated rollout instances and training steps.

Owns workload generators with long tails and drift (`workloads`; they emit the trace format of
`libra.trace`, which real runs record and the simulator replays: `ReplayedGroups`), the simulated instance
(`instance`: continuous batching with vLLM-style chunked prefill under a per-step token budget,
over the planner's rollout cost model), the event engine (`engine`), the RL loop of each compared
policy (`loop`, `pools`; a re-plan that changes the buckets updates the router's at run time),
metrics, the markdown/PNG report, the calibration path (`calibration`) and the validation
against real runs (`validation`: calibrate on a `libra run` folder, replay its trajectories,
compare step times). `libra simulate CONFIG` runs `configs/sim_*.py`.
"""

from libra.sim.config import (
    ABLATIONS,
    BASELINES,
    POLICIES,
    MovementCosts,
    PolicySpec,
    SimConfig,
    load_sim_config,
)
from libra.sim.metrics import SimResult
from libra.sim.runner import Comparison, run_comparison
from libra.sim.workloads import WORKLOADS, WorkloadConfig, WorkloadGenerator

__all__ = [
    "ABLATIONS",
    "BASELINES",
    "POLICIES",
    "WORKLOADS",
    "Comparison",
    "MovementCosts",
    "PolicySpec",
    "SimConfig",
    "SimResult",
    "WorkloadConfig",
    "WorkloadGenerator",
    "load_sim_config",
    "run_comparison",
]
