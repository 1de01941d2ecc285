"""The Python code interpreter tool: runs model-written code in the sandbox pool."""

from __future__ import annotations

import ast
import time
from typing import Any

from libra.rollout.tools.base import ToolResult
from libra.rollout.tools.sandbox import SandboxPool
from libra.trajectory import ToolStatus


def truncate(text: str, max_chars: int) -> str:
    """Cuts `text` to `max_chars`, keeping head and tail (errors are usually at the end)."""
    if len(text) <= max_chars:
        return text
    marker = f"\n...[{len(text) - max_chars} characters cut]...\n"
    keep = max(max_chars - len(marker), 0)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def print_last_expression(code: str) -> str:
    """Like a notebook cell: a trailing bare expression is printed (unless it already prints).
    Raises SyntaxError for code that does not parse."""
    tree = ast.parse(code)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    value = tree.body[-1].value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
        return code
    last = tree.body[-1]
    lines = code.splitlines(keepends=True)
    # Replace the expression's source span; keeps line numbers of tracebacks unchanged.
    prefix = "".join(lines[: last.lineno - 1]) + lines[last.lineno - 1][: last.col_offset]
    expression = ast.get_source_segment(code, last)
    suffix = "".join(lines[last.end_lineno :])
    printed = "if __libra_value is not None: print(repr(__libra_value))"
    return f"{prefix}__libra_value = ({expression})\n{printed}\n{suffix}"


class PythonInterpreterTool:
    """`python`: executes code in a fresh sandboxed process and returns what it printed.

    stdout comes back on success; on failure or timeout the tail of stderr (the traceback, or
    the sandbox's note on which limit stopped it) follows the output.
    """

    name = "python"
    description = (
        "Run Python 3 code in a sandbox without network access and return its printed output. "
        "The value of a final bare expression is printed too. State is not kept between calls."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run."}},
        "required": ["code"],
    }

    def __init__(
        self, pool: SandboxPool, max_result_chars: int = 4000, timeout_s: float | None = None
    ) -> None:
        self.pool = pool
        self.max_result_chars = max_result_chars
        self.timeout_s = timeout_s

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResult("error: argument 'code' must be a non-empty string", ToolStatus.FAILURE)
        try:
            code = print_last_expression(code)
        except SyntaxError as exc:
            # Refused here: a syntax error needs no sandbox trip.
            message = f"SyntaxError: {exc.msg} (line {exc.lineno})"
            return ToolResult(message, ToolStatus.FAILURE, time.monotonic() - start)
        result = await self.pool.run(code, self.timeout_s)
        text = result.stdout
        if result.status != ToolStatus.SUCCESS and result.stderr:
            text = f"{text}\n{result.stderr}" if text else result.stderr
        return ToolResult(truncate(text, self.max_result_chars), result.status, time.monotonic() - start)
