#!/usr/bin/env bash
# The device check (`python -m libra.checks`): prints one line per check with its measured figure
# (the backend and its devices; HF -> Megatron logits against transformers; one bf16 GRPO step with
# fp32 main weights against fp32; a vLLM instance with the backend's engine defaults, greedy against
# transformers and decode tok/s at batch 1 and 32, against eager where graphs are the default;
# publication from a train rank to it, bit for bit, and the logprob gap; a 5-step `libra run` with
# the train rank and the instance sharing device 0) and exits non-zero when any check failed.
# About 2 minutes on 2 CPU cores; a few on one GPU once installed.
#   bash scripts/check_cuda.sh --cpu [--out summary.json]   the built-in cpu backend, no Transformer
#       Engine, in the repo's .venv (scripts/setup_env.sh): what CI runs, so the check cannot rot.
#   bash scripts/check_cuda.sh [--out summary.json]         the cuda backend on a GPU machine: installs
#       Libra with its CUDA stack into .venv-cuda (created with --system-site-packages, so a preinstalled
#       CUDA torch is reused; minutes the first time, nothing later unless a pyproject.toml changed).
#       Offline machines: LIBRA_WHEELHOUSE=DIR installs from the wheels in DIR only.
# Other arguments go to `python -m libra.checks` (--out FILE, --workdir DIR).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
backend=cuda
args=()
for arg in "$@"; do
  if [ "$arg" = "--cpu" ]; then backend=cpu; else args+=("$arg"); fi
done

if [ "$backend" = cpu ]; then
  source "$root/scripts/setup_env.sh"
else
  venv="$root/.venv-cuda"
  if [ ! -x "$venv/bin/python" ]; then
    base="${PYTHON:-python3}"
    "$base" -m venv --system-site-packages "$venv"
    # A base python that is itself a venv's (a GPU image's torch often lives in one) has its
    # packages outside the system site: a .pth line makes them visible below the new venv's own.
    parent="$("$base" -c 'import site; print(site.getsitepackages()[0])')"
    own="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
    [ "$parent" = "$own" ] || echo "$parent" > "$own/_libra_base_site.pth"
  fi
  source "$venv/bin/activate"
  pip_args=(-q)
  [ -z "${LIBRA_WHEELHOUSE:-}" ] || pip_args+=(--no-index --find-links "$LIBRA_WHEELHOUSE")
  stamp="$venv/.libra-deps"
  want="$(cat "$root/pyproject.toml" "$root/backends/cuda/pyproject.toml" | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[libra] installing Libra and its CUDA stack into $venv"
    python -m pip install "${pip_args[@]}" -e "$root[cuda]" -e "$root/backends/cuda"
    # Transformer Engine often has no wheel for the installed torch and CUDA, and then needs a
    # compiler and the CUDA toolkit; without it Megatron runs its local layer spec.
    if ! python -c "import transformer_engine" 2>/dev/null; then
      python -m pip install "${pip_args[@]}" -e "$root[cuda-te]" \
        || echo "[libra] Transformer Engine did not install: the checks run Megatron's local spec" >&2
    fi
    echo "$want" > "$stamp"
  fi
fi
exec python -m libra.checks --backend "$backend" ${args[@]+"${args[@]}"}
