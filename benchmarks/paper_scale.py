"""Paper-scale comparison tables: every baseline and ablation against full Libra, simulated.

    python benchmarks/paper_scale.py [--out DIR] [--steps N] [--only NAME] [--migration kv_move]
                                     [--policies libra,libra_no_planner,...]

Runs configs/sim_r2e_48xa800.py (the original's setting: 48 A800, Qwen3-14B, R2E-like), the same
at 160 Ascend 910B, and at 1,024 H100 GPUs; prints each markdown table with Libra's throughput
ratio over every baseline and ablation and its step time over the ideal (no idle device) bound,
and writes report.md + PNG plots per config under --out. Before each table, "which rollout mix
wins": the planner's predicted step for a pool of one TP size only against its free choice of
mix (the planner's cost model; the simulated table then shows what the chosen pool achieves).
Single-threaded; each 48-device policy takes about 10-30 s of CPU for 100 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra.planner.search import NoFeasiblePlan, search  # noqa: E402
from libra.sim import load_sim_config, run_comparison  # noqa: E402
from libra.sim.loop import preflight_history  # noqa: E402
from libra.sim.pools import planning_problem  # noqa: E402
from libra.sim.report import comparison_table, speedup_lines, write_report  # noqa: E402

CONFIGS = ("sim_r2e_48xa800.py", "sim_r2e_160x910b.py", "sim_r2e_1024xh100.py")


def mix_table(config) -> str:
    """The planner's predicted step with every rollout instance of one TP size, and with its free
    choice of mix, on the config's preflight history (training searched jointly in each case)."""
    problem = planning_problem(config, preflight_history(config), config.batch.max_staleness)
    search_space = problem.config.search
    rows = [
        f"### which rollout mix wins ({config.name}, planner's model)",
        "",
        "| rollout TP sizes | train devices | rollout instances | predicted step s | T_train s "
        "| T_rollout s |",
        "|---|---|---|---|---|---|",
    ]
    for sizes in [(k,) for k in search_space.rollout_tp_sizes] + [search_space.rollout_tp_sizes]:
        restricted = dataclasses.replace(
            problem,
            config=dataclasses.replace(
                problem.config, search=dataclasses.replace(search_space, rollout_tp_sizes=sizes)
            ),
        )
        label = "any of " + "/".join(map(str, sizes)) if len(sizes) > 1 else f"TP-{sizes[0]} only"
        try:
            plan = search(restricted, config.train_factors, config.rollout_factors)
        except NoFeasiblePlan as error:
            rows.append(f"| {label} | - | - | infeasible: {error} | - | - |")
            continue
        mix = " + ".join(f"{b.num_instances}xTP{b.tp}" for b in plan.buckets if b.num_instances)
        rows.append(
            f"| {label} | {plan.training.config.num_devices} | {mix} | {plan.predicted_step_s:.1f} | "
            f"{plan.predicted_train_s:.1f} | {plan.predicted_rollout_s:.1f} |"
        )
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sim_reports", help="folder for one sub-folder per config")
    parser.add_argument("--steps", type=int, default=0, help="override num_steps of every config")
    parser.add_argument("--only", help="run only the config whose file name contains this")
    parser.add_argument(
        "--migration",
        choices=("reprefill", "kv_move"),
        help="override sim.costs.migration: how a migrated trajectory's context reaches its new instance",
    )
    parser.add_argument("--policies", help="comma-separated subset of the policies to run")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1] / "configs"
    for name in CONFIGS:
        if args.only and args.only not in name:
            continue
        config = load_sim_config(root / name)
        if args.steps:
            config = dataclasses.replace(config, num_steps=args.steps)
        if args.migration:
            config = dataclasses.replace(
                config, costs=dataclasses.replace(config.costs, migration=args.migration)
            )
        if args.policies:
            config = dataclasses.replace(config, policies=tuple(args.policies.split(",")))
        print(f"# {config.name}: migration={config.costs.migration}, {config.num_steps} steps\n")
        print(mix_table(config), flush=True)
        started = time.perf_counter()
        comparison = run_comparison(config, log=lambda line: print(line, flush=True))
        print(f"\n## {config.name} ({time.perf_counter() - started:.0f} s wall)\n")
        if comparison.initial_plan is not None:
            print(comparison.initial_plan.describe() + "\n")
        print(comparison_table(comparison))
        print("\n".join(speedup_lines(comparison)), flush=True)
        print(f"report: {write_report(comparison, Path(args.out) / config.name)}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
