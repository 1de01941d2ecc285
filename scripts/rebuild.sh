#!/usr/bin/env bash
# Rebuilds the C++ extension and gRPC stubs into the existing .venv (after editing csrc/ or
# protos/, or adding a new top-level package). A lock keeps concurrent rebuilds from sharing the
# CMake build folder at the same time.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/libra-build.lock .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
