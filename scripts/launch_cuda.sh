#!/usr/bin/env bash
# Runs `libra run CONFIG` on one or many hosts with the cuda backend (launch_ascend.sh reuses it with
# BACKEND=ascend): the backend plugin sets each worker's environment (visible devices, NCCL/HCCL).
# The controller runs on this (the first) host and one node agent per host, started with Slurm `srun` inside
# an allocation, or over ssh for the hosts in LIBRA_HOSTS. RUN_DIR must be on a filesystem every
# host sees (the token, the controller address and the workers' address files live there).
#   bash scripts/launch_cuda.sh CONFIG RUN_DIR [section.field=value ...]
#   LIBRA_HOSTS="node1 node2" bash scripts/launch_ascend.sh CONFIG RUN_DIR
set -euo pipefail
BACKEND="${BACKEND:-cuda}"
[ $# -ge 2 ] || { echo "usage: $0 CONFIG RUN_DIR [section.field=value ...]" >&2; exit 2; }
config="$1"; run_dir="$(realpath -m "$2")"; shift 2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/.venv/bin/activate"
mkdir -p "$run_dir/logs"

if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  launcher=slurm
else
  read -r -a hosts <<< "${LIBRA_HOSTS:-$(hostname)}"
  launcher=ssh
fi
num_hosts=${#hosts[@]}
# The address other hosts reach this one at (the controller listens there).
self_ip="${LIBRA_CONTROLLER_IP:-$(hostname -I | awk '{print $1}')}"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

rm -f "$run_dir/controller.addr"
libra run "$config" run_dir="$run_dir" backend.name="$BACKEND" control.host="$self_ip" control.port=0 \
  job.spawn_agent=false job.num_agents="$num_hosts" "$@" >"$run_dir/logs/controller.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do [ -s "$run_dir/controller.addr" ] && break; sleep 0.2; done
[ -s "$run_dir/controller.addr" ] || { tail -50 "$run_dir/logs/controller.log"; exit 1; }
address="$(cat "$run_dir/controller.addr")"
agent_cmd="source '$root/.venv/bin/activate' && cd '$root' && LIBRA_TOKEN=\$(cat '$run_dir/token') \
libra agent --controller $address run_dir='$run_dir/agents/'\$(hostname) backend.name=$BACKEND"

if [ "$launcher" = slurm ]; then
  srun --nodes="$num_hosts" --ntasks-per-node=1 --output="$run_dir/logs/agent-%N.log" bash -c "$agent_cmd" &
  pids+=($!)
else
  for host in "${hosts[@]}"; do
    ssh -o BatchMode=yes "$host" "bash -c \"$agent_cmd\"" >"$run_dir/logs/agent-$host.log" 2>&1 &
    pids+=($!)
  done
fi
echo "controller at $address, $num_hosts agent(s) via $launcher; logs in $run_dir/logs"
wait "${pids[0]}"
