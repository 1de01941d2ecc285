#!/usr/bin/env bash
# The embedded CPU default: sets up .venv if missing, then runs the agentic GRPO job of
# configs/tiny_cpu.py — the controller and one node agent on loopback with CPU slots as devices,
# the warm-started tiny policy (built once, cached under ~/.cache/libra), a TP-1 and a TP-2 rollout
# instance under C-MLFQ, a Megatron train rank, weights published every step, the planner and the
# elastic hybrid pool in the loop. About 10 minutes and 9 GB on 2 cores.
#   bash scripts/launch_cpu.sh [RUN_DIR] [section.field=value ...]     (e.g. job.num_steps=3)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

run_dir="${1:-runs/cpu-$(date +%Y%m%d-%H%M%S)}"
shift || true
mkdir -p "$run_dir/logs"
# One thread per process: the controller, the engines, a train rank and tool sandboxes share
# the cores (PLATFORM.md: more threads than cores stall).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
libra run configs/tiny_cpu.py run_dir="$run_dir" "$@" 2> >(tee "$run_dir/logs/controller.log" >&2)
echo "Run folder: $run_dir (report.md, plots/, metrics.jsonl, trajectories.jsonl, tensorboard/, checkpoints/)."
