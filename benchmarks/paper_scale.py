"""Paper-scale comparison tables: every baseline and ablation against full Libra, simulated.

    python benchmarks/paper_scale.py [--out DIR] [--steps N] [--only NAME]

Runs configs/sim_r2e_48xa800.py (the original's setting: 48 A800, Qwen3-14B, R2E-like), the same
at 160 Ascend 910B, and at 1,024 H100 GPUs; prints each markdown table with Libra's throughput
ratio over every baseline and ablation and its step time over the ideal (no idle device) bound,
and writes report.md + PNG plots per config under --out. Single-threaded; each 48-device policy
takes about 10-15 s of CPU for 100 steps.
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

from libra.sim import load_sim_config, run_comparison  # noqa: E402
from libra.sim.report import comparison_table, speedup_lines, write_report  # noqa: E402

CONFIGS = ("sim_r2e_48xa800.py", "sim_r2e_160x910b.py", "sim_r2e_1024xh100.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sim_reports", help="folder for one sub-folder per config")
    parser.add_argument("--steps", type=int, default=0, help="override num_steps of every config")
    parser.add_argument("--only", help="run only the config whose file name contains this")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1] / "configs"
    for name in CONFIGS:
        if args.only and args.only not in name:
            continue
        config = load_sim_config(root / name)
        if args.steps:
            config = dataclasses.replace(config, num_steps=args.steps)
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
