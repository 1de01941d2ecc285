"""Where a mixed TP pool beats the best homogeneous one, simulated.

    python benchmarks/mixed_pools.py [--steps N] [--seeds K] [--only NAME]

For each setting (hardware, model, workload, staleness, batch), on the split the planner chooses:
every rollout pool of one TP size, and of two, that fills the rollout devices, routed by C-MLFQ
with thresholds fitted to the buckets' capacity (`libra.planner.routing_thresholds`), each
simulated for N steps on K workload seeds (the drift of a whole run compressed into them). Prints
the best homogeneous pool, the best mixed one, their ratio in mean trained tokens/s, and the pool
the planner adopts (with its own ratio to the best homogeneous one) when it re-scores its
candidates in the simulator (`SimConfig.planner_rescore_steps`; it sees the workload as at the
start of the run, first seed):
10 steps where the setting is asynchronous, `ON_POLICY_RESCORE_STEPS` where it is on-policy.
The settings are the paper's (R2E, Qwen3-14B, 48 x A800), on-policy and asynchronous, and the
ones where mixes should stand the best chance, on-policy: short contexts at high concurrency
(Search-R1 on a 4B model, 1,024 trajectories a step on 16 devices) and long reasoning (DAPO-Math
on a 7B model). TP sizes that cannot shard a model's heads are left out (TP-8 for the 7B).
The ratio is also printed per seed: one that changes sides across seeds is no win.
Single-threaded; about 15 minutes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra.planner.plan import format_rollout_mix, place_rollout  # noqa: E402
from libra.planner.rollout_cost import RolloutCostModel  # noqa: E402
from libra.planner.routing_thresholds import capacity_thresholds  # noqa: E402
from libra.sim import load_sim_config  # noqa: E402
from libra.sim.loop import preflight_history, simulate  # noqa: E402
from libra.sim.pools import Layout  # noqa: E402
from libra.sim.rescoring import STATIC_PLAN, rescored_initial_plan  # noqa: E402
from libra.sim.workloads import WorkloadConfig  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ON_POLICY_RESCORE_STEPS = 30
"""An on-policy step lasts as long as its slowest trajectory, so short re-scores differ by the
draw of groups: on Search-R1 below, 8-step re-scores of the same two pools on four draws ranged
0.96-1.03x, 30-step ones 1.014-1.040x."""


def model_of(config_file: str):
    """The `MODEL` (`ModelArch`, from the model's config.json) a job config file declares."""
    return runpy.run_path(str(CONFIGS / config_file))["MODEL"]


def settings():
    """(name, SimConfig) pairs: the paper's config, and variants of it."""
    paper = load_sim_config(CONFIGS / "sim_r2e_48xa800.py")

    def variant(name, staleness, **changes):
        batch = dataclasses.replace(paper.batch, max_staleness=staleness, **changes.pop("batch", {}))
        tail = paper.tail_staleness if staleness else 0
        rescore = paper.planner_rescore_steps if staleness else ON_POLICY_RESCORE_STEPS
        return name, dataclasses.replace(
            paper, name=name, batch=batch, tail_staleness=tail, planner_rescore_steps=rescore, **changes
        )

    return [
        variant("r2e-14b-48xa800-sync", 0),
        variant("r2e-14b-48xa800-async", 2),
        variant(
            "search_r1-4b-16xa800-sync-1024",
            0,
            num_nodes=2,
            model=model_of("qwen3_4b_r2e.py"),
            workload=WorkloadConfig(name="search_r1", group_size=8),
            batch=dict(global_batch=1024, group_size=8),
            history_size=512,
        ),
        variant(
            "dapo_math-7b-32xh100-sync",
            0,
            profile="h100",
            num_nodes=4,
            model=model_of("qwen25_7b_dapo.py"),
            workload=WorkloadConfig(name="dapo_math", group_size=8),
            batch=dict(global_batch=512, group_size=8),
            history_size=512,
        ),
    ]


def pools(devices: int, tp_sizes: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """Every pool of one or two TP sizes filling `devices`, as ((tp, count), ...) ascending."""
    found = [((tp, devices // tp),) for tp in tp_sizes if devices % tp == 0]
    for i, small in enumerate(tp_sizes):
        for large in tp_sizes[i + 1 :]:
            for n_large in range(1, devices // large):
                rest = devices - n_large * large
                if rest > 0 and rest % small == 0:
                    found.append(((small, rest // small), (large, n_large)))
    return found


def throughput(config, history, training, pool, steps: int, seeds: int) -> list[float]:
    """Trained tokens/s of the pool on each seed."""
    cost = RolloutCostModel(config.cluster, config.model, config.planner, config.rollout_factors)
    tps = tuple(tp for tp, _ in pool)
    thresholds = capacity_thresholds(cost, pool, history, config.cmlfq.demote)
    sizes = sorted((tp for tp, n in pool for _ in range(n)), reverse=True)
    instances = place_rollout(training.num_devices, config.num_devices, config.devices_per_node, sizes)
    layout = Layout(training.config, training.devices, instances, tps, thresholds)
    rates = []
    for seed in range(seeds):
        run = dataclasses.replace(
            config, num_steps=steps, workload=dataclasses.replace(config.workload, seed=seed)
        )
        rates.append(simulate(run, STATIC_PLAN, layout, history).trained_tokens_per_s)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="simulated steps per pool and seed")
    parser.add_argument("--seeds", type=int, default=2, help="workload seeds per pool")
    parser.add_argument("--only", help="run only the settings whose name contains this")
    args = parser.parse_args()
    print(
        "| setting | planned split (train devices) | best homogeneous | best mixed | mixed / homogeneous "
        "| per seed | planner adopts (its / homogeneous, re-scored steps) | pools tried | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, config in settings():
        if args.only and args.only not in name:
            continue
        started = time.perf_counter()
        history = preflight_history(config)
        plan, _ = rescored_initial_plan(config, history)
        rollout_devices = config.num_devices - plan.training.num_devices
        sizes = tuple(
            tp
            for tp in config.planner.search.rollout_tp_sizes
            if config.devices_per_node % tp == 0 and config.model.serves_at_tp(tp)
        )
        rates = {
            pool: throughput(config, history, plan.training, pool, args.steps, args.seeds)
            for pool in pools(rollout_devices, sizes)
        }
        mean = {pool: statistics.fmean(r) for pool, r in rates.items()}
        homogeneous = max((p for p in mean if len(p) == 1), key=mean.get)
        mixed = max((p for p in mean if len(p) > 1), key=mean.get, default=None)
        best = format_rollout_mix(homogeneous)
        if mixed is None:
            print(f"| {name} | {plan.training.num_devices} | {best} | none fits | | | | |")
            continue
        per_seed = [m / h for m, h in zip(rates[mixed], rates[homogeneous], strict=True)]
        adopted = tuple(sorted(collections.Counter(i.tp for i in plan.instances).items()))
        # The adopted pool against the best homogeneous one, on the benchmark's own runs.
        adopted_ratio = f"{mean[adopted] / mean[homogeneous]:.3f}x, " if adopted in mean else ""
        print(
            f"| {name} | {plan.training.num_devices} | {best} {mean[homogeneous]:,.0f} "
            f"| {format_rollout_mix(mixed)} {mean[mixed]:,.0f} | {mean[mixed] / mean[homogeneous]:.3f}x "
            f"| {min(per_seed):.3f}-{max(per_seed):.3f}x "
            f"| {plan.rollout_mix} ({adopted_ratio}{config.planner_rescore_steps}) | {len(rates)} "
            f"| {time.perf_counter() - started:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
