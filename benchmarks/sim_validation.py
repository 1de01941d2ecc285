"""Simulator validation: does the simulator, calibrated on a real CPU run, predict its step time?

    python benchmarks/sim_validation.py RUN_DIR [RUN_DIR ...] [--staleness N] [--skip-steps N]

For each folder written by `libra run` (e.g. `libra run configs/tiny_cpu.py run_dir=/tmp/run
job.num_steps=6`): fits the simulator's CPU efficiency factors to the run's own decode samples
(occupancy.jsonl) and training steps (metrics.jsonl), replays the run's trajectories
(trajectories.jsonl) through the simulated job loop with the same workers and staleness bound,
and prints predicted against measured step times and the error of the mean. Takes well under a
second per run; nothing else needs to be idle.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra.sim.validation import validate_run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="folders written by `libra run`")
    parser.add_argument("--staleness", type=int, default=1, help="the run's training.max_staleness")
    parser.add_argument("--skip-steps", type=int, default=1, help="leading steps left out (start-up)")
    args = parser.parse_args()
    columns = ("run", "steps", "measured mean s", "predicted mean s", "error", "train hold-out error")
    print("| " + " | ".join((*columns, "rollout factors")) + " |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for run_dir in args.run_dirs:
        try:
            report = validate_run(run_dir, max_staleness=args.staleness, skip_steps=args.skip_steps)
        except ValueError as error:
            print(f"| {run_dir} | - | - | - | - | - | {error} |")
            continue
        holdout = report.calibration.train_errors
        holdout_text = (
            f"{sum(abs(e.relative_error) for e in holdout) / len(holdout):.1%} mean abs" if holdout else "-"
        )
        rollout = report.calibration.rollout
        print(
            f"| {run_dir} | {len(report.measured_step_s)} | {report.measured_mean_s:.2f} | "
            f"{report.predicted_mean_s:.2f} | {report.relative_error:+.1%} | {holdout_text} | "
            f"memory {rollout.memory:.3g}, overhead {rollout.overhead_s * 1e3:.2f} ms |"
        )
        errors.append(report.relative_error)
        print(
            f"  measured  {[round(x, 1) for x in report.measured_step_s]}\n"
            f"  predicted {[round(x, 1) for x in report.predicted_step_s]}\n  {'; '.join(report.notes)}",
            file=sys.stderr,
        )
    if errors:
        print(
            f"\nmean absolute error of the mean step time over {len(errors)} run(s): "
            f"{sum(abs(e) for e in errors) / len(errors):.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
