"""Tool-return states: status inference from what tools return, size classes, stable keys."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest

from libra.scheduler import CmlfqConfig, SizeClass, ToolReturnState, infer_status
from libra.scheduler.tool_state import encode_state, size_class_of
from libra.trajectory import ToolStatus

PYTHON_TRACEBACK = """Traceback (most recent call last):
  File "main.py", line 3, in <module>
    solve()
ZeroDivisionError: division by zero
"""
TIMEOUT_TRACEBACK = """Traceback (most recent call last):
  File "runner.py", line 9, in run
    raise TimeoutError("took longer than 30 s")
TimeoutError: took longer than 30 s
"""


@dataclass
class SandboxResult:
    stdout: str
    returncode: int


@pytest.mark.parametrize(
    ("result", "status"),
    [
        (None, ToolStatus.SUCCESS),
        ("42\n", ToolStatus.SUCCESS),
        (b"ok", ToolStatus.SUCCESS),
        (PYTHON_TRACEBACK, ToolStatus.FAILURE),
        ("partial output\n" + TIMEOUT_TRACEBACK, ToolStatus.TIMEOUT),
        ("Error: file not found", ToolStatus.FAILURE),
        ("Timed out after 30 s", ToolStatus.TIMEOUT),
        (ValueError("bad input"), ToolStatus.FAILURE),
        (TimeoutError(), ToolStatus.TIMEOUT),
        (subprocess.TimeoutExpired("python", 30), ToolStatus.TIMEOUT),
        ({"status": "success", "output": "done"}, ToolStatus.SUCCESS),
        ({"status": "FAILED"}, ToolStatus.FAILURE),
        ({"status": "timeout"}, ToolStatus.TIMEOUT),
        ({"timed_out": True, "stdout": ""}, ToolStatus.TIMEOUT),
        ({"timeout": 30, "stdout": "fine"}, ToolStatus.SUCCESS),  # a configured limit, not an outcome
        ({"success": False}, ToolStatus.FAILURE),
        ({"returncode": 0, "stdout": "fine"}, ToolStatus.SUCCESS),
        ({"returncode": 1, "stderr": "oops"}, ToolStatus.FAILURE),
        ({"exit_code": 124}, ToolStatus.TIMEOUT),
        ({"error": "KeyError: 'x'"}, ToolStatus.FAILURE),
        ({"error": "deadline exceeded"}, ToolStatus.TIMEOUT),
        ({"error": None, "result": "fine"}, ToolStatus.SUCCESS),
        ({"exception": TimeoutError()}, ToolStatus.TIMEOUT),
        ({"traceback": PYTHON_TRACEBACK}, ToolStatus.FAILURE),
        ({"stdout": PYTHON_TRACEBACK}, ToolStatus.FAILURE),
        (SandboxResult(stdout="fine", returncode=0), ToolStatus.SUCCESS),
        (SandboxResult(stdout=PYTHON_TRACEBACK, returncode=1), ToolStatus.FAILURE),
    ],
)
def test_infer_status(result: object, status: ToolStatus) -> None:
    assert infer_status(result) == status


def test_size_classes_follow_the_configured_bounds() -> None:
    config = CmlfqConfig(small_payload_max_tokens=10, medium_payload_max_tokens=100)
    assert [size_class_of(n, config) for n in (0, 10, 11, 100, 101)] == [
        SizeClass.SMALL,
        SizeClass.SMALL,
        SizeClass.MEDIUM,
        SizeClass.MEDIUM,
        SizeClass.LARGE,
    ]
    state = ToolReturnState.of("python", ToolStatus.FAILURE, 5000, config)
    assert state == ToolReturnState("python", SizeClass.LARGE, ToolStatus.FAILURE)


def test_keys_are_stable_and_distinct() -> None:
    # Fixed across processes and machines: checkpoints and merges between controllers rely on it.
    assert encode_state("python", SizeClass.LARGE, ToolStatus.TIMEOUT) == 0x68E4502C8F35EA22
    keys = {
        ToolReturnState(tool, size, status).key
        for tool in ("python", "search", "validator")
        for size in SizeClass
        for status in ToolStatus
    }
    assert len(keys) == 27
    assert all(0 <= key < 2**64 for key in keys)
