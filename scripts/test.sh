#!/usr/bin/env bash
# Sets up .venv if missing (CPU builds of torch / vLLM / Megatron-core, build tools), builds Libra
# (C++ extension and gRPC stubs), builds the warm-started tiny policy the job tests train once per
# machine (cached in ~/.cache/libra, several minutes on a fresh machine: outside any test's
# timeout), installs Slurm, munge and an ssh server for the launcher tests when root with apt-get
# (scripts/install_test_deps.sh; they skip without them), and runs the test suite. Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -c "from libra.tasks.warm_start import cached_warm_start; print('[libra] tiny policy:', cached_warm_start())"
bash scripts/install_test_deps.sh || true
python -m pytest -q "$@"
