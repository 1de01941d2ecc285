"""Re-plan time and plan quality: the exact search against a truncated enumerator like the original's.

Setting (as the original's measurement in reference/libra-notes.md §11): Qwen3-14B on A800 nodes
of 8, global batch 128 in groups of 4, 256 requests of a long-tailed agentic history, rollout TP
sizes {1, 2, 4, 8}. Both planners use the same cost models; they differ only in the search.

The truncated enumerator: training configurations in TP, PP, DP, micro-batch loop order, skipping
a configuration whose T_train already reaches the best objective (early stop); for each, integer
partitions of the remaining devices into TP sizes with at most 32 instances, largest parts first,
truncated to 500; each partition priced with its best bucket thresholds. Its plan quality is the
predicted step time of what it finds.

Usage: python benchmarks/planner.py [--sizes 48,160,1024,4096] [--repeats 3]
Run with OMP_NUM_THREADS=1; say what else ran on the machine when quoting the numbers ("cpu ms",
the process's own CPU time, is less sensitive to a loaded machine than the wall-clock "exact ms").
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from libra.backends.profiles import A800_SXM4_80GB
from libra.planner.config import ClusterSpec, PlanningProblem, TrainingBatch
from libra.planner.search import (
    DEFAULT_ROLLOUT_FACTORS,
    DEFAULT_TRAIN_FACTORS,
    build_rollout_space,
    enumerate_training,
    search,
)
from libra.planner.training_cost import TrainingCostModel
from libra.planner.workload import synthetic_history

MAX_INSTANCES = 32
MAX_PARTITIONS = 500


def problem_for(num_devices: int) -> PlanningProblem:
    from libra.config import load_definitions

    sample = load_definitions("configs/planner_qwen3_14b_48xa800.py")
    return PlanningProblem(
        cluster=ClusterSpec(num_devices // 8, 8, A800_SXM4_80GB),
        model=sample["QWEN3_14B"],
        batch=TrainingBatch(global_batch=128, group_size=4, recompute="full", max_staleness=2),
        history=synthetic_history(256, seed=0, median_output_tokens=1500, sigma=0.8),
    )


def partitions(total: int, sizes: list[int], max_parts: int):
    """Partitions of `total` into `sizes` (descending parts), at most `max_parts` parts."""

    def rec(remaining: int, allowed: list[int], parts: int, prefix: list[int]):
        if remaining == 0:
            yield list(prefix)
            return
        if parts == max_parts or remaining > (max_parts - parts) * allowed[0]:
            return  # cannot reach the total with the parts left
        for i, k in enumerate(allowed):
            if k <= remaining:
                prefix.append(k)
                yield from rec(remaining - k, allowed[i:], parts + 1, prefix)
                prefix.pop()

    yield from rec(total, sorted(sizes, reverse=True), 0, [])


def best_thresholds_makespan(space, counts: dict[int, int]) -> float:
    """The least rollout makespan of a fixed multiset over all bucket thresholds (min-max DP)."""
    q = len(space.boundaries)
    best = np.full(q, np.inf)
    best[0] = 0.0
    for k in space.tp_sizes:
        m = counts.get(k, 0)
        if m == 0:
            continue
        with np.errstate(invalid="ignore"):
            span = np.maximum(space._range_work[k] / m, space._range_latency[k])
        span[np.tril(np.ones((q, q), dtype=bool), k=-1)] = np.inf
        span[np.eye(q, dtype=bool)] = 0.0
        best = np.min(np.maximum(best[:, None], span), axis=0)
    return float(best[-1])


def truncated_enumerator(problem: PlanningProblem) -> tuple[float, int]:
    """(best predicted step, rollout candidates evaluated) of the original-style search."""
    train_cost = TrainingCostModel(
        problem.cluster, problem.model, problem.batch, problem.config, DEFAULT_TRAIN_FACTORS
    )
    candidates = enumerate_training(problem, train_cost)
    candidates.sort(key=lambda c: (c.config.tp, c.config.pp, c.config.dp, c.config.micro_batch))  # loop order
    space = build_rollout_space(problem, DEFAULT_ROLLOUT_FACTORS)
    best, evaluated = math.inf, 0
    for cand in candidates:
        if cand.step_s >= best:
            continue  # early stop
        n_roll = problem.cluster.num_devices - cand.config.num_devices
        for i, parts in enumerate(partitions(n_roll, space.tp_sizes, MAX_INSTANCES)):
            if i == MAX_PARTITIONS:
                break
            evaluated += 1
            counts = {k: parts.count(k) for k in set(parts)}
            best = min(best, max(cand.step_s, best_thresholds_makespan(space, counts)))
    return best, evaluated


def fixed_pattern(problem: PlanningProblem, pattern: tuple[int, ...] = (1, 1, 2, 4)) -> float:
    """The original's fast mode: every rollout node runs the same instances (here 2xTP1+TP2+TP4)."""
    train_cost = TrainingCostModel(
        problem.cluster, problem.model, problem.batch, problem.config, DEFAULT_TRAIN_FACTORS
    )
    space = build_rollout_space(problem, DEFAULT_ROLLOUT_FACTORS)
    dpn, best = problem.cluster.devices_per_node, math.inf
    for cand in enumerate_training(problem, train_cost):
        n_roll = problem.cluster.num_devices - cand.config.num_devices
        if n_roll % dpn or cand.step_s >= best:
            continue
        nodes = n_roll // dpn
        counts = {k: pattern.count(k) * nodes for k in set(pattern)}
        best = min(best, max(cand.step_s, best_thresholds_makespan(space, counts)))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="48,160,1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    targets = {48: 0.05, 1024: 1.0, 4096: 5.0}
    print(
        f"{'devices':>8} {'exact ms':>9} {'cpu ms':>7} {'target':>7} {'exact step s':>12} "
        f"{'trunc ms':>9} {'trunc step s':>12} "
        f"{'evaluated':>9} {'gap':>6} {'pattern step s':>14} {'gap':>6}"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        problem = problem_for(n)
        times, cpu_times = [], []
        for _ in range(args.repeats):
            started, cpu_started = time.perf_counter(), time.process_time()
            plan = search(problem)
            times.append(time.perf_counter() - started)
            cpu_times.append(time.process_time() - cpu_started)
        started = time.perf_counter()
        trunc_step, evaluated = truncated_enumerator(problem)
        trunc_s = time.perf_counter() - started
        gap = trunc_step / plan.predicted_step_s if math.isfinite(trunc_step) else math.inf
        pattern_step = fixed_pattern(problem)
        target = f"{targets[n] * 1e3:.0f}" if n in targets else "-"
        trunc_text = f"{trunc_step:12.3f}" if math.isfinite(trunc_step) else f"{'no plan':>12}"
        print(
            f"{n:>8} {statistics.median(times) * 1e3:>9.1f} {statistics.median(cpu_times) * 1e3:>7.1f} "
            f"{target:>7} {plan.predicted_step_s:>12.3f} "
            f"{trunc_s * 1e3:>9.0f} {trunc_text} {evaluated:>9} {gap:>5.2f}x {pattern_step:>14.3f} "
            f"{pattern_step / plan.predicted_step_s:>5.2f}x"
        )


if __name__ == "__main__":
    main()
