#!/usr/bin/env bash
# Sets up .venv if missing (CPU builds of torch / vLLM / Megatron-core, build tools), builds Libra
# (C++ extension and gRPC stubs) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python -m pytest -q "$@"
