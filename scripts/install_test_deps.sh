#!/usr/bin/env bash
# Installs what the launcher tests (tests/launch) drive for real: Slurm and munge for the one-node
# cluster, an ssh server and client for the ssh path. Only as root with apt-get, only what is
# missing, quietly; never fails (without them those tests skip and say why).
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || exit 0
PATH="$PATH:/usr/sbin:/sbin"
pkgs=()
for c in slurmctld slurmd salloc srun sinfo; do
  command -v $c >/dev/null || { pkgs+=(slurm-wlm); break; }
done
command -v munged >/dev/null || pkgs+=(munge)
[ -x /usr/sbin/sshd ] || pkgs+=(openssh-server)
command -v ssh >/dev/null && command -v ssh-keygen >/dev/null || pkgs+=(openssh-client)
[ ${#pkgs[@]} -gt 0 ] || exit 0
echo "[libra] installing ${pkgs[*]} for the launcher tests"
export DEBIAN_FRONTEND=noninteractive
{ timeout 600 apt-get update -qq \
  && timeout 900 apt-get install -y -qq --no-install-recommends "${pkgs[@]}"; } \
  >/tmp/libra-apt.log 2>&1 \
  || echo "[libra] could not install ${pkgs[*]} (/tmp/libra-apt.log); the launcher tests will skip"
exit 0
