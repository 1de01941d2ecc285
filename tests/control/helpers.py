"""Shared constants and helpers of the control-plane tests (and of tests that fake a cluster)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from libra.backends.base import DeviceInfo
from libra.control.types import AgentState, AgentStatus

TOKEN = "test-token-0123456789"
HEARTBEAT_S = 1.0
"""Short enough that a silent agent is lost within seconds; long enough that an agent on a
loaded 2-core CI host (the README job beside the suite) does not miss three beats in a row."""


def wait_for(predicate: Callable[[], object], timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def cpu_agent(name: str, indices: Sequence[int], state: AgentState = AgentState.ALIVE) -> AgentStatus:
    """A node agent's status as the controller holds it: CPU slots `indices` of 1 GiB each."""
    devices = tuple(DeviceInfo(i, "cpu-slot", 2**30) for i in indices)
    return AgentStatus(name, "localhost", f"{name}:1", "cpu", devices, state, 0.0, 0.0)
