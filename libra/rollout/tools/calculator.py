"""A calculator tool: evaluates an arithmetic expression safely (no `eval`), to drive multi-turn
tests and the tiny tasks."""

from __future__ import annotations

import ast
import operator
import time
from typing import Any

from libra.rollout.tools.base import ToolResult
from libra.trajectory import ToolStatus

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
"""Bounds `**` so that an expression cannot ask for a number with millions of digits."""
_MAX_EXPRESSION_CHARS = 256


class Calculator:
    name = "calculator"
    description = "Evaluates an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*2"}},
        "required": ["expression"],
    }

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        start = time.perf_counter()
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return ToolResult('error: argument "expression" must be a string', ToolStatus.FAILURE)
        try:
            value = evaluate(expression)
        except (ValueError, ArithmeticError) as e:
            return ToolResult(f"error: {e}", ToolStatus.FAILURE, time.perf_counter() - start)
        return ToolResult(_format(value), ToolStatus.SUCCESS, time.perf_counter() - start)


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything but numbers and operators."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse expression {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported element {type(node).__name__} in expression")


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"
