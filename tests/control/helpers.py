"""Shared constants and waiting helper of the control-plane tests."""

from __future__ import annotations

import time
from collections.abc import Callable

TOKEN = "test-token-0123456789"
HEARTBEAT_S = 0.2


def wait_for(predicate: Callable[[], object], timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
