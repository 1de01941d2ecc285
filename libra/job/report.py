"""The run report: `report.md` with PNG plots (reward curve, throughput, bucket occupancy over
time with reallocation / fault events), written from the run folder's JSONL files — so it can be
rebuilt for any run folder, finished or not (`write_report(run_dir)`)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from libra.job.recorder import JobEvent, read_jsonl

REALLOCATION_EVENTS = frozenset(
    {
        JobEvent.INSTANCE_LOST,
        JobEvent.INSTANCE_RESTARTED,
        JobEvent.PLAN_EXECUTED,
        JobEvent.HYBRID_ACTIVE,
        JobEvent.HYBRID_RETIRED,
        JobEvent.RESUME,
    }
)
"""Events marked on the occupancy plot (an events.jsonl row's `kind` string matches its member)."""


def write_report(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps = read_jsonl(run_dir / "metrics.jsonl")
    occupancy = read_jsonl(run_dir / "occupancy.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    evaluations = read_jsonl(run_dir / "evaluations.jsonl")
    evaluation_samples = read_jsonl(run_dir / "evaluation_samples.jsonl")
    samples = read_jsonl(run_dir / "samples.jsonl")
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)

    def save(fig, name: str) -> str:
        fig.tight_layout()
        fig.savefig(plots / name, dpi=100)
        plt.close(fig)
        return f"plots/{name}"

    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, [s["mean_reward"] for s in steps], marker="o", label="mean reward (batch)")
    ax.plot(x, _moving_mean([s["mean_reward"] for s in steps], 5), label="moving mean (5 steps)")
    ax.plot(x, [s["tool_use_rate"] for s in steps], linestyle=":", label="share calling a tool")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / share")
    ax.legend()
    reward_png = save(fig, "reward.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [o["time_s"] for o in occupancy],
        [o["tokens_per_s"] for o in occupancy],
        label="instances (1 s samples)",
    )
    ax.plot(
        [s["time_s"] for s in steps], [s["rollout_tokens_per_s"] for s in steps], marker="o", label="per step"
    )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("generated tokens / s")
    ax.legend()
    throughput_png = save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(occupancy[0]["buckets"]) if occupancy else []
    for name in names:
        ax.plot([o["time_s"] for o in occupancy], [o["buckets"].get(name, 0) for o in occupancy], label=name)
    for e in events:
        # Where the cluster changed: a fault, a restart, a plan carried out, a hybrid replica moving.
        if e["kind"] in REALLOCATION_EVENTS:
            ax.axvline(e["time_s"], color="red", linestyle="--", linewidth=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests in flight per bucket")
    ax.set_title("bucket occupancy (dashed: reallocation / fault events)")
    if names:
        ax.legend()
    occupancy_png = save(fig, "occupancy.png")

    first, last = _window_mean(steps, head=True), _window_mean(steps, head=False)
    lines = [
        f"# Libra run report — `{run_dir}`",
        "",
        f"- steps: {len(steps)}; trajectories rolled out: {len(samples)}",
        f"- mean reward, first {min(5, len(steps))} steps: {first:.3f}; "
        f"last {min(5, len(steps))} steps: {last:.3f}",
        *[
            f"- held-out {e['when']} (version {e['version']}, {e['num_tasks']} tasks x "
            f"{e['samples_per_task']}, never trained on): reward {e['mean_reward']:.3f}, "
            f"tool use {e['tool_use_rate']:.2f}{_eval_gap(e)}"
            for e in evaluations
        ],
        *_paired_gain_lines(evaluation_samples),
        f"- wall time: {steps[-1]['time_s'] if steps else 0:.0f} s",
        _trained_line(steps),
        f"- mean rollout throughput: {_mean([s['rollout_tokens_per_s'] for s in steps]):.0f} tokens/s "
        "(generated, trained on or not)",
        f"- mean step time: {_mean([s['step_time_s'] for s in steps]):.1f} s "
        f"(train {_mean([s['train_time_s'] for s in steps]):.1f} s, "
        f"publish {_mean([s['publish_time_s'] for s in steps]):.2f} s)",
        _gap_line(steps),
        *_utilisation_lines(occupancy),
        "",
        f"![reward]({reward_png})",
        f"![throughput]({throughput_png})",
        f"![occupancy]({occupancy_png})",
        "",
        "## Steps",
        "",
        "| step | reward | tool use | trained | stale-dropped | trained tok/s | rollout tok/s | step s "
        "| train s | publish s | loss | entropy | logprob gap max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in steps:
        lines.append(
            f"| {s['step']} | {s['mean_reward']:.3f} | {s['tool_use_rate']:.2f} | {s['num_trajectories']} | "
            f"{s['num_dropped_stale']} | {s.get('trained_tokens_per_s', float('nan')):.0f} | "
            f"{s['rollout_tokens_per_s']:.0f} | {s['step_time_s']:.1f} | {s['train_time_s']:.1f} | "
            f"{s['publish_time_s']:.2f} | {s['loss']:.4f} | {s['entropy']:.3f} | {_gap(s)} |"
        )
    lines += ["", "## Events", ""] + [f"- {e['time_s']:.1f} s — {e['kind']}: {e['message']}" for e in events]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _utilisation_lines(occupancy: list[dict]) -> list[str]:
    """Busy share of each stage's devices over the 1 s samples, and the migrations at the last."""
    sampled = [o for o in occupancy if "devices" in o]
    if not sampled:
        return []
    shares = []
    for stage in sampled[-1]["devices"]:
        busy = sum(o["devices"][stage][0] for o in sampled if stage in o["devices"])
        held = sum(o["devices"][stage][1] for o in sampled if stage in o["devices"])
        shares.append(f"{stage} {100 * busy / held:.0f} %" if held else f"{stage} -")
    return [
        f"- device utilisation ({len(sampled)} 1 s samples, busy / held): {', '.join(shares)}",
        f"- migrations (tool returns routed to another instance): {sampled[-1]['migrations']}",
    ]


def _gap(step: dict) -> str:
    if not step.get("num_current_tokens") or "logprob_max_abs_diff" not in step:
        return "–"
    return f"{step['logprob_max_abs_diff']:.1e}"


def _eval_gap(evaluation: dict) -> str:
    if not evaluation.get("num_compared_tokens"):
        return ""
    return (
        f", train/inference logprob gap max {evaluation['logprob_max_abs_diff']:.1e} "
        f"({evaluation['num_compared_tokens']} tokens)"
    )


def _gap_line(steps: list[dict]) -> str:
    """The train/inference logprob gap over the steps that measured it."""
    measured = [s for s in steps if s.get("num_current_tokens") and "logprob_max_abs_diff" in s]
    if not measured:
        return "- train/inference logprob gap: not measured (no trajectory sampled by the trainer's version)"
    return (
        f"- train/inference logprob gap over {len(measured)} steps "
        f"({sum(s['num_current_tokens'] for s in measured)} tokens): "
        f"mean {_mean([s['logprob_abs_diff'] for s in measured]):.1e}, "
        f"max {max(s['logprob_max_abs_diff'] for s in measured):.1e}"
    )


def _paired_gain_lines(rows: list[dict]) -> list[str]:
    """The held-out reward's gain over the samples evaluated before and after with the same seed,
    with the standard error of their mean difference: a pair drew the same random numbers, so it
    differs by what training changed rather than by the draw (a tighter error than two
    independent evaluations'). Nothing without such pairs (unseeded samples: a user agent's)."""

    def rewards(when: str) -> dict[int, float]:
        return {r["seed"]: r["reward"] for r in rows if r["when"] == when and r.get("seed") is not None}

    before, after = rewards("before"), rewards("after")
    diffs = [after[key] - before[key] for key in sorted(before.keys() & after.keys())]
    if len(diffs) < 2:
        return []
    error = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return [
        f"- held-out reward gain, paired (the same seeded samples before and after): "
        f"{statistics.fmean(diffs):+.3f} ± {error:.3f} (one standard error over {len(diffs)} samples); "
        f"{sum(d > 0 for d in diffs)} samples gained, {sum(d < 0 for d in diffs)} lost"
    ]


def _trained_line(steps: list[dict]) -> str:
    """Trained tokens/s over the run's steps and the share of finished trajectories dropped: the
    throughput a run turns into training, and the work it threw away."""
    tokens = sum(s["generated_tokens"] for s in steps)
    seconds = sum(s["step_time_s"] for s in steps)
    trained = sum(s["num_trajectories"] for s in steps)
    dropped = sum(s["num_dropped_stale"] for s in steps)
    finished = trained + dropped
    return (
        f"- trained throughput: {tokens / seconds if seconds else float('nan'):.0f} tokens/s "
        f"({tokens} model tokens trained on in {seconds:.0f} s of steps); finished trajectories dropped "
        f"as stale: {dropped} of {finished} ({100 * dropped / finished if finished else 0:.1f} %)"
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [_mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _window_mean(steps: list[dict], head: bool, window: int = 5) -> float:
    chosen = steps[:window] if head else steps[-window:]
    return _mean([s["mean_reward"] for s in chosen])
