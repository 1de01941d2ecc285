"""The python tool on top of the sandbox: output, error and status mapping, truncation."""

from __future__ import annotations

import os

import pytest

from libra.rollout.tools.base import Tool
from libra.rollout.tools.interpreter import PythonInterpreterTool, print_last_expression, truncate
from libra.trajectory import ToolStatus

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the session pool needs root")


def test_print_last_expression():
    assert print_last_expression("x = 2\nx * 21") == (
        "x = 2\n__libra_value = (x * 21)\nif __libra_value is not None: print(repr(__libra_value))\n"
    )
    assert print_last_expression("print(1)") == "print(1)"
    assert print_last_expression("x = 1") == "x = 1"
    with pytest.raises(SyntaxError):
        print_last_expression("def (")


def test_truncate_keeps_head_and_tail():
    text = "A" * 50 + "B" * 50
    cut = truncate(text, 60)
    assert len(cut) == 60 and cut.startswith("A") and cut.endswith("B") and "characters cut" in cut
    assert truncate("short", 60) == "short"


@needs_root
def test_interpreter_results(loop, pool):
    tool = PythonInterpreterTool(pool, max_result_chars=200)
    assert isinstance(tool, Tool)
    call = lambda args: loop.run_until_complete(tool(args))  # noqa: E731

    ok = call({"code": "import math\nmath.factorial(10)"})
    assert (ok.status, ok.content) == (ToolStatus.SUCCESS, "3628800\n")
    error = call({"code": "print('before')\nraise ValueError('bad input')"})
    assert error.status == ToolStatus.FAILURE
    assert error.content.startswith("before\n") and "ValueError: bad input" in error.content
    syntax = call({"code": "print((1"})
    assert syntax.status == ToolStatus.FAILURE and syntax.content.startswith("SyntaxError")
    missing = call({"cmd": "print(1)"})
    assert missing.status == ToolStatus.FAILURE and "'code'" in missing.content
    long = call({"code": "print('y' * 5000)"})
    assert long.status == ToolStatus.SUCCESS and len(long.content) == 200
    slow = PythonInterpreterTool(pool, timeout_s=0.3)
    timeout = loop.run_until_complete(slow({"code": "import time; time.sleep(5)"}))
    assert timeout.status == ToolStatus.TIMEOUT and "wall time limit" in timeout.content
