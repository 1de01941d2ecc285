"""The comparison as a markdown report and PNG plots (matplotlib, imported only here)."""

from __future__ import annotations

from pathlib import Path

from libra.sim.config import (
    ABLATIONS,
    BASELINES,
    HETEROGENEOUS_ABLATION,
    HINDSIGHT_POLICIES,
    POLICIES,
    ROUTER_COMPARISONS,
)
from libra.sim.runner import Comparison


def comparison_table(comparison: Comparison) -> str:
    """One row per policy: throughput, step time and its breakdown, idle shares, tail, staleness,
    movement (migrations, prefixes evicted from the instances' caches, and the tokens prefilled
    again because a turn's cached prefix was gone: evicted, or emptied by new weights)."""
    rows = [
        "| policy | trained tok/s | traj/s | step s | train s | wait s | stall s | ideal s | step/ideal "
        "| idle train | idle rollout | tail share | staleness mean/max | dropped (share) | migrations/turn "
        "| prefix evictions (tok re-prefilled on a miss) | plans applied |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in comparison.results.items():
        b = r.breakdown()
        mean_stale = sum(r.staleness) / len(r.staleness) if r.staleness else 0.0
        rows.append(
            f"| {name} | {r.trained_tokens_per_s:.0f} | {r.trajectories_per_s:.3f} | {r.step_s:.1f} "
            f"| {b['train_s']:.1f} | {b['wait_s']:.1f} | {b['stall_s']:.1f} | {r.ideal_step_s:.1f} "
            f"| {r.step_s / r.ideal_step_s:.2f} "
            f"| {r.idle_share('train'):.0%} | {r.idle_share('rollout'):.0%} | {r.tail_share:.0%} "
            f"| {mean_stale:.2f}/{max(r.staleness, default=0)} | {r.dropped} ({r.dropped_share:.1%}) "
            f"| {r.migrations / max(r.turns, 1):.1%} "
            f"| {r.prefix_evictions} ({r.evicted_prefill_tokens:.0f}) | {r.plans_applied} |"
        )
    return "\n".join(rows)


def speedup_lines(comparison: Comparison, reference: str = "libra") -> list[str]:
    if reference not in comparison.results:
        return []
    lines = []
    for other in (*BASELINES, *ABLATIONS):
        if other in comparison.results:
            lines.append(
                f"- {reference} / {other}: {comparison.speedup(reference, other):.2f}x trained tokens/s"
            )
    least_load = HETEROGENEOUS_ABLATION[1]
    if least_load in comparison.results:  # the other policy in the table; it can beat full Libra
        lines.append(
            f"- {reference} / {least_load}: {comparison.speedup(reference, least_load):.2f}x trained tokens/s"
        )
    best = comparison.best_hindsight()
    if best is not None:
        tried = ", ".join(
            n.removeprefix("homogeneous_") for n in HINDSIGHT_POLICIES if n in comparison.results
        )
        lines.append(
            f"- {reference} / the best homogeneous static pool with hindsight ({best}; of {tried} "
            f"on the planned split): {comparison.speedup(reference, best):.2f}x trained tokens/s"
        )
    for policy, baseline, label in ROUTER_COMPARISONS:
        if policy in comparison.results and baseline in comparison.results:
            lines.append(
                f"- {label} ({policy} / {baseline}): "
                f"{comparison.speedup(policy, baseline):.2f}x trained tokens/s"
            )
    r = comparison.results[reference]
    lines.append(
        f"- {reference} step time / ideal lower bound (no idle device): {r.step_s / r.ideal_step_s:.2f}"
    )
    return lines


def markdown_report(comparison: Comparison, plots: list[str] | None = None) -> str:
    c = comparison.config
    profile = c.hardware.name if c.hardware else c.profile
    parts = [
        f"# Simulation: {c.name}",
        "",
        f"{c.num_devices} x {profile} ({c.num_nodes} nodes), model {c.model.num_params / 1e9:.1f}B params, "
        f"workload {c.workload.name} (drift: lengths +{c.workload.length_drift:.0%}, "
        f"problems +{c.workload.difficulty_drift:.0%}), global batch {c.batch.global_batch} "
        f"(groups of {c.batch.group_size}), max staleness {c.batch.max_staleness}, {c.num_steps} steps, "
        f"migrations by {c.costs.migration}.",
        "",
    ]
    if comparison.initial_plan is not None:
        parts += [
            f"Initial plan (chosen in {comparison.initial_plan_search_s * 1e3:.0f} ms, its re-scoring "
            "included):",
            "```",
            comparison.initial_plan.describe(),
            "```",
            "",
        ]
    if comparison.initial_rescoring is not None:
        parts += [
            f"The planner's candidates simulated for {c.planner_rescore_steps} steps each, trained "
            f"tokens/s, best first (its model's optimum is kept unless another scores "
            f"{c.planner.policy.rescore_margin:.0%} more): {comparison.initial_rescoring.describe()}.",
            "",
        ]
    parts += ["## Throughput and step time", "", comparison_table(comparison), ""]
    parts += speedup_lines(comparison)
    parts += ["", "## Policies", ""]
    parts += [f"- **{name}**: {POLICIES[name].description}" for name in comparison.results]
    parts += [f"- **{name}**: not run: {why}" for name, why in comparison.skipped.items()]
    parts += ["", "## Staleness distribution (trajectories per versions behind)", ""]
    for name, r in comparison.results.items():
        parts.append(f"- {name}: {r.staleness_histogram()}")
    searches = [s for r in comparison.results.values() for s in r.planner_search_s]
    if searches:
        parts += [
            "",
            f"Planner re-plans: {len(searches)}, mean {1e3 * sum(searches) / len(searches):.1f} ms, "
            f"max {1e3 * max(searches):.1f} ms.",
        ]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(parts) + "\n"


def write_plots(comparison: Comparison, out_dir: Path) -> list[str]:
    """Throughput, step-time breakdown and idle shares as PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(comparison.results)
    results = [comparison.results[n] for n in names]
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(names, [r.trained_tokens_per_s for r in results], color="tab:blue")
    ax.set_ylabel("trained tokens / s")
    ax.set_title(f"{comparison.config.name}: throughput")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    bottom = [0.0] * len(names)
    for key, color in (("train_s", "tab:green"), ("wait_s", "tab:orange"), ("stall_s", "tab:red")):
        values = [r.breakdown()[key] for r in results]
        ax.bar(names, values, bottom=bottom, label=key, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(names, [r.ideal_step_s for r in results], "k_", markersize=20, label="ideal (no idle)")
    ax.set_ylabel("seconds per step")
    ax.set_title("step time breakdown")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "step_breakdown.png"))

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    xs = range(len(names))
    ax.bar([x - width / 2 for x in xs], [r.idle_share("train") for r in results], width, label="training")
    ax.bar([x + width / 2 for x in xs], [r.idle_share("rollout") for r in results], width, label="rollout")
    ax.set_xticks(list(xs), names, rotation=30)
    ax.set_ylabel("idle share of the stage's device time")
    ax.legend()
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "idle_share.png"))
    plt.close("all")
    return paths


def _save(fig, path: Path) -> str:
    fig.savefig(path, dpi=100)
    return str(path)


def write_report(comparison: Comparison, out_dir: str | Path, plots: bool = True) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_paths = write_plots(comparison, out) if plots else []
    path = out / "report.md"
    path.write_text(markdown_report(comparison, plot_paths))
    return path
