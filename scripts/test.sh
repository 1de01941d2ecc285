#!/usr/bin/env bash
# Sets up .venv if missing (CPU builds of torch / vLLM / Megatron-core, build tools), builds Libra
# (C++ extension and gRPC stubs), installs Slurm, munge and an ssh server for the launcher tests
# when root with apt-get (scripts/install_test_deps.sh; they skip without them), and runs the test
# suite. Extra arguments go to pytest: `-m "not slow"` is the fast development tier.
# The warm-started tiny policy the job tests train is built once per machine (cached in
# ~/.cache/libra or $LIBRA_CACHE_DIR; 5-15 min cold on 2 cores) before the first test that needs
# it, outside any test's timeout, with progress lines (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
bash scripts/install_test_deps.sh || true
python -m pytest -q "$@"
