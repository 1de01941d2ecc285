#!/usr/bin/env bash
# The embedded CPU default: sets up .venv if missing, starts the controller and one node agent on
# loopback with CPU slots as devices, and shows the cluster they form.
#   bash scripts/launch_cpu.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

run_dir="${1:-runs/cpu-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$run_dir/logs"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

libra controller run_dir="$run_dir" control.port=0 >"$run_dir/logs/controller.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$run_dir/controller.addr" ] && break; sleep 0.1; done
[ -s "$run_dir/controller.addr" ] || { cat "$run_dir/logs/controller.log"; exit 1; }

libra agent run_dir="$run_dir" >"$run_dir/logs/agent.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "serving on" "$run_dir/logs/agent.log" && break; sleep 0.1; done
grep -q "serving on" "$run_dir/logs/agent.log" || { cat "$run_dir/logs/agent.log"; exit 1; }

libra status run_dir="$run_dir"
echo "Run folder: $run_dir (token, controller address, logs)."
echo "The agentic GRPO job is not wired in yet (issue 10); the control plane above is live until you press Ctrl-C."
if [ -t 0 ]; then wait; fi
