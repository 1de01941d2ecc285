"""Paper-scale comparison tables: every baseline and ablation against full Libra, simulated.

    python benchmarks/paper_scale.py [--out DIR] [--steps N] [--only NAME] [--migration kv_move]
                                     [--policies libra,libra_no_planner,...]

Runs configs/sim_r2e_48xa800.py (the original's setting: 48 A800, Qwen3-14B, R2E-like), the same
at 160 Ascend 910B, and at 1,024 H100 GPUs; prints each markdown table with Libra's throughput
ratio (trained tokens/s) over every baseline and ablation and its step time over the ideal (no
idle device) bound, and writes report.md + PNG plots per config under --out. Before each table,
"which rollout mix wins": the planner's predicted step for a pool of one TP size only against its
free choice of mix (the planner's cost model; the simulated table then shows what the chosen pool
achieves);
and "which split wins", at the start of the drift and at its end: whether a re-plan has another
split to move to. After each table, how the planner's candidates scored when it simulated them
before adopting its initial plan, Libra against the best homogeneous pool with hindsight (every
TP size run on the planned split), and what full Libra's re-plans found.
Single-threaded; each 48-device policy takes about 10-30 s of CPU for 100 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra.planner.config import RequestRecord  # noqa: E402
from libra.planner.search import NoFeasiblePlan, enumerate_training, search_within  # noqa: E402
from libra.planner.training_cost import TrainingCostModel  # noqa: E402
from libra.sim import WorkloadGenerator, load_sim_config, run_comparison  # noqa: E402
from libra.sim.loop import PREFLIGHT_GROUP_OFFSET, preflight_history, training_layout  # noqa: E402
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
        label = "any of " + "/".join(map(str, sizes)) if len(sizes) > 1 else f"TP-{sizes[0]} only"
        try:
            plan = search_within(
                problem, config.train_factors, config.rollout_factors, rollout_tp_sizes=sizes
            )
        except NoFeasiblePlan as error:
            rows.append(f"| {label} | - | - | infeasible: {error} | - | - |")
            continue
        rows.append(f"| {label} | {plan.training.config.num_devices} | {_plan_cells(plan)} |")
    return "\n".join(rows) + "\n"


def _plan_cells(plan) -> str:
    """A plan's rollout mix and predicted step, train and rollout seconds, as table cells."""
    times = (plan.predicted_step_s, plan.predicted_train_s, plan.predicted_rollout_s)
    return " | ".join([plan.rollout_mix, *(f"{t:.1f}" for t in times)])


def drifted_history(config, progress: float):
    """A sample of the workload as it is at `progress` of the run (the preflight's prompts)."""
    generator = WorkloadGenerator(config.workload)
    groups = -(-config.history_size // config.workload.group_size)
    traces = [t for i in range(groups) for t in generator.group(PREFLIGHT_GROUP_OFFSET + i, progress)]
    return tuple(RequestRecord.from_trace(t) for t in traces[: config.history_size])


def split_table(config, max_uneven_rows: int = 6) -> str:
    """The planner's best plan for every training size its space allows, on the workload at the
    start and at the end of the drift: a re-plan can only pay if another split wins somewhere.
    The space is the elastic policies' (DP sizes that do not divide the groups allowed, replicas
    taking group-granular unequal shares); `equal shares` marks the sizes a restart-based system
    (divisor-only DP) can reach too. Of the other sizes, the `max_uneven_rows` best are shown."""
    rows = [
        f"### which split wins ({config.name}, planner's model, elastic space)",
        "",
        "| workload | train devices | training layout | equal shares | rollout | predicted step s "
        "| T_train s | T_rollout s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, progress in (("start (step 0)", 0.0), ("end of drift", 1.0)):
        history = drifted_history(config, progress)
        problem = planning_problem(config, history, config.batch.max_staleness, elastic=True)
        divisor_only = planning_problem(config, history, config.batch.max_staleness)
        cost = TrainingCostModel(
            problem.cluster, problem.model, problem.batch, problem.config, config.train_factors
        )
        even_sizes = {c.config.num_devices for c in enumerate_training(divisor_only, cost)}
        found = []
        for n in sorted({c.config.num_devices for c in enumerate_training(problem, cost)}):
            try:
                plan = search_within(
                    problem,
                    config.train_factors,
                    config.rollout_factors,
                    min_train_devices=n,
                    min_rollout_devices=config.num_devices - n,
                )
            except NoFeasiblePlan as error:
                found.append((n, math.inf, f"| {label} | {n} | infeasible: {error} | - | - | - | - | - |"))
                continue
            layout = training_layout(plan.training.config, problem.batch).split(" devices ", 1)[1]
            equal = "yes" if n in even_sizes else "no"
            cells = f"| {label} | {n} | {layout} | {equal} | {_plan_cells(plan)} |"
            found.append((n, plan.predicted_step_s, cells))
        ranked = sorted((step, n) for n, step, _ in found if n not in even_sizes)
        shown = {n for _, n in ranked[:max_uneven_rows]} | even_sizes
        rows += [cells for n, _, cells in found if n in shown]
        if len(shown) < len(found):
            rows.append(f"| {label} | ({len(found) - len(shown)} more uneven sizes, slower) | | | | | | |")
    return "\n".join(rows) + "\n"


def replan_summary(comparison) -> str:
    """What the re-planning policies' planner did: searches, and the apply rule's verdicts."""
    lines = []
    for name, r in comparison.results.items():
        if not r.planner_search_s:
            continue
        notes = [n for n in r.notes if "re-plan" in n]
        lines.append(
            f"- {name}: {len(r.planner_search_s)} searches, {r.plans_applied} applied, "
            f"{r.plans_rejected} rejected"
        )
        shown = notes if len(notes) <= 6 else [*notes[:3], "...", *notes[-3:]]
        lines += [f"  - {n}" for n in shown]
        applied = [n for n in r.notes if "applied plan" in n]  # the splits that won, in order
        lines += [f"  - {n}" for n in applied]
    return "\n".join(lines)


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
        print(split_table(config), flush=True)
        started = time.perf_counter()
        comparison = run_comparison(config, log=lambda line: print(line, flush=True))
        print(f"\n## {config.name} ({time.perf_counter() - started:.0f} s wall)\n")
        if comparison.initial_plan is not None:
            print(comparison.initial_plan.describe() + "\n")
        rescoring = comparison.initial_rescoring
        if rescoring is not None:
            print(
                f"the planner's candidates simulated for {config.planner_rescore_steps} steps each "
                f"(trained tok/s, best first; its model's optimum is kept unless another scores "
                f"{config.planner.policy.rescore_margin:.0%} more): {rescoring.describe()}\n"
            )
        print(comparison_table(comparison))
        print("\n".join(speedup_lines(comparison)), flush=True)
        print("\nre-planning:\n" + replan_summary(comparison), flush=True)
        print(f"report: {write_report(comparison, Path(args.out) / config.name)}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
