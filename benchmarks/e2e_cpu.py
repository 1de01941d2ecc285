"""The embedded job end to end, Libra mode against a baseline mode, in one invocation.

    python benchmarks/e2e_cpu.py [--steps 10] [--out runs/e2e-bench] [override ...]

- Libra mode: configs/tiny_cpu.py as is: the planner lays out the rollout instances on the devices
  training leaves (`job.rollout_tp_sizes` empty; the layout it chose is printed), C-MLFQ routes
  over the TP buckets, the planner stays in the loop (re-splits, the elastic pool).
- Baseline mode: the same job with least-load routing over a homogeneous pool of TP-1 instances
  on the same rollout devices and a static split of devices (planner and elastic pool off).
- `--libra-layout 2,1`: Libra mode on a stated layout instead (TP-2 + TP-1 was the default's
  before the planner laid the launch out: 0.80x the baseline's tokens/s).

Prints, per mode: trained throughput (model tokens of the trajectories trained on, per second of
the steps), the share of finished trajectories dropped as stale, wall time
per step, the time-to-reward (seconds until the 3-step moving mean of the batch reward first
reaches --target), the held-out reward before and after, then the Libra / baseline ratios. The
two runs are sequential on the same machine; the load average is printed because the machine is
shared.

Honest limits: on a loaded 2-core box a step's time swings 3-12 s for the same work (the train
rank shares the cores with three engines), so one 10-step run per mode resolves differences of
about 10 %, no finer (two runs of the same baseline gave 669 and 644 trained tokens/s); the ratio
of median step times is steadier. Four CPU slots share two cores, so a TP-2 instance is no faster
than a TP-1 one here (PLATFORM.md); what the CPU run can show is the whole mechanism against the
baseline on equal devices, not the GPU's speed-up of long trajectories on a larger TP size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra.config import load_config  # noqa: E402
from libra.job.recorder import read_jsonl  # noqa: E402
from libra.job.run import run_job  # noqa: E402


def time_to_reward(steps: list[dict], target: float, window: int = 3) -> float | None:
    rewards = [s["mean_reward"] for s in steps]
    for i in range(len(steps)):
        chunk = rewards[max(0, i - window + 1) : i + 1]
        if sum(chunk) / len(chunk) >= target:
            return steps[i]["time_s"] - steps[0]["time_s"] + steps[0]["step_time_s"]
    return None


def _dropped_share(steps: list[dict]) -> float:
    dropped = sum(s["num_dropped_stale"] for s in steps)
    return dropped / max(dropped + sum(s["num_trajectories"] for s in steps), 1)


def run_mode(name: str, out: Path, overrides: list[str]) -> dict:
    run_dir = out / name
    run_job(load_config("configs/tiny_cpu.py", [f"run_dir={run_dir}", *overrides]))
    steps = read_jsonl(run_dir / "metrics.jsonl")
    samples = read_jsonl(run_dir / "samples.jsonl")
    rollout_s = sum(s["step_time_s"] for s in steps)
    return {
        "name": name,
        "steps": steps,
        "tokens_per_s": sum(s["generated_tokens"] for s in steps) / rollout_s,
        "dropped": _dropped_share(steps),
        "trajectories_per_s": len(samples) / rollout_s,
        "step_s": rollout_s / len(steps),
        "median_step_s": statistics.median(s["step_time_s"] for s in steps),
        "final_reward": sum(s["mean_reward"] for s in steps[-3:]) / min(3, len(steps)),
        "held_out": " -> ".join(f"{e['mean_reward']:.3f}" for e in read_jsonl(run_dir / "evaluations.jsonl")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="runs/e2e-bench")
    parser.add_argument("--target", type=float, default=0.15, help="reward level for time-to-reward")
    parser.add_argument(
        "--libra-layout", default="", help="Libra mode's job.rollout_tp_sizes (default: empty, planned)"
    )
    parser.add_argument("overrides", nargs="*", help="section.field=value for both modes")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    common = [f"job.num_steps={args.steps}", "job.live_progress=false", *args.overrides]
    config = load_config("configs/tiny_cpu.py", common)
    slots = config.backend.num_devices or len(os.sched_getaffinity(0))  # the cpu backend's default
    homogeneous = ",".join("1" for _ in range(slots - config.training.world_size))
    libra = run_mode("libra", out, [*common, f"job.rollout_tp_sizes={args.libra_layout}"])
    planned = [e for e in read_jsonl(out / "libra" / "events.jsonl") if e["kind"] == "launch_planned"]
    layout = planned[0]["tp_sizes"] if planned else args.libra_layout
    baseline = run_mode(
        "baseline",
        out,
        [*common, "job.router=least_load", f"job.rollout_tp_sizes={homogeneous}", "job.planner=false"],
    )
    print(
        f"\nload average: {os.getloadavg()}; "
        f"pools: libra TP {layout}{' (planned)' if planned else ''}, baseline TP {homogeneous}"
    )
    print(
        f"{'mode':10} {'trained tok/s':>13} {'dropped':>8} {'traj/s':>8} {'s/step':>8} {'median':>7} "
        f"{'reward(last3)':>14} "
        f"{'time-to-reward':>15} held-out reward"
    )
    for m in (libra, baseline):
        ttr = time_to_reward(m["steps"], args.target)
        print(
            f"{m['name']:10} {m['tokens_per_s']:13.0f} {m['dropped']:8.1%} {m['trajectories_per_s']:8.2f} "
            f"{m['step_s']:8.1f} {m['median_step_s']:7.1f} "
            f"{m['final_reward']:14.3f} {f'{ttr:.0f} s' if ttr is not None else 'not reached':>15} "
            f"{m['held_out']}"
        )
    print(
        "throughput ratio libra/baseline: "
        f"{libra['tokens_per_s'] / baseline['tokens_per_s']:.2f} (trained tokens/s), "
        f"{libra['trajectories_per_s'] / baseline['trajectories_per_s']:.2f} (trajectories/s), "
        f"{baseline['median_step_s'] / libra['median_step_s']:.2f} (median step: a step that a busy "
        "machine slowed counts once, not by its length)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
