#!/usr/bin/env bash
# Runs `libra run CONFIG` on one or many hosts with the cuda backend (launch_ascend.sh reuses it with
# BACKEND=ascend; BACKEND=cpu runs it on CPU slots, as tests/launch does): the backend plugin sets each
# worker's environment (visible devices, NCCL/HCCL).
# The controller runs on this (the first) host and one node agent per host, started with Slurm `srun` inside
# an allocation, or over ssh for the hosts in LIBRA_HOSTS. Each agent loads CONFIG and the overrides too
# (it reads its backend and control sections: slots, heartbeat, TLS). RUN_DIR must be on a filesystem
# every host sees (the token, the controller address and the workers' address files live there), and
# this checkout at the same path on every host.
#   bash scripts/launch_cuda.sh CONFIG RUN_DIR [section.field=value ...]
#   LIBRA_HOSTS="node1 node2" bash scripts/launch_ascend.sh CONFIG RUN_DIR
#   salloc -N2 bash scripts/launch_cuda.sh CONFIG RUN_DIR
# Environment:
#   LIBRA_CONTROLLER_IP  address the controller listens at (default: this host's first `hostname -I`
#                        address, else its name's `hostname -i` address, else 127.0.0.1)
#   LIBRA_AGENT_IP       address every agent and its workers listen at (default: each host's own, found
#                        the same way); 127.0.0.1 keeps a one-host run on loopback
#   LIBRA_SSH_OPTS       extra ssh options, split on spaces (e.g. "-p 2222 -i KEY -o UserKnownHostsFile=F")
# The agents end with the launcher: srun's step is ended, and each ssh session has a terminal (-tt), so
# its agent gets SIGHUP when the connection closes (their workers die with them).
set -euo pipefail
BACKEND="${BACKEND:-cuda}"
[ $# -ge 2 ] || { echo "usage: $0 CONFIG RUN_DIR [section.field=value ...]" >&2; exit 2; }
config="$(realpath "$1")"; run_dir="$(realpath -m "$2")"; shift 2
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
# This host's address as others reach it (a container may have no `hostname -I` address); the same
# one-liner runs on each agent's host.
find_ip='ip=$(hostname -I 2>/dev/null | cut -d" " -f1);'
find_ip+=' [ -n "$ip" ] || ip=$(hostname -i 2>/dev/null | cut -d" " -f1)'
self_ip="${LIBRA_CONTROLLER_IP:-$(eval "$find_ip"; echo "${ip:-127.0.0.1}")}"

q() { printf %q "$1"; }  # quoted for the agent's shell
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
agent_overrides=""
for o in "$@"; do agent_overrides+=" $(q "$o")"; done
agent_cmd="source $(q "$root/.venv/bin/activate") && cd $(q "$root") || exit 1; \
ip=$(q "${LIBRA_AGENT_IP:-}"); [ -n \"\$ip\" ] || { $find_ip; }; LIBRA_TOKEN=\$(cat $(q "$run_dir/token")) \
exec libra agent --config $(q "$config") --controller $(q "$address") \
run_dir=$(q "$run_dir/agents")/\$(hostname)$agent_overrides \
backend.name=$(q "$BACKEND") control.host=\${ip:-127.0.0.1}"

if [ "$launcher" = slurm ]; then
  srun --nodes="$num_hosts" --ntasks-per-node=1 --output="$run_dir/logs/agent-%N.log" bash -c "$agent_cmd" &
  pids+=($!)
else
  read -r -a ssh_opts <<< "${LIBRA_SSH_OPTS:-}"
  for host in "${hosts[@]}"; do
    ssh -tt -o BatchMode=yes "${ssh_opts[@]}" "$host" "bash -c $(q "$agent_cmd")" \
      </dev/null >"$run_dir/logs/agent-$host.log" 2>&1 &
    pids+=($!)
  done
fi
echo "controller at $address, $num_hosts agent(s) via $launcher; logs in $run_dir/logs"
wait "${pids[0]}"
