"""Tools the agent loop calls: the `Tool` protocol (`base`) and built-in tools (`calculator`)."""

from libra.rollout.tools.base import Tool, ToolCall, ToolResult
from libra.rollout.tools.calculator import Calculator

__all__ = ["Calculator", "Tool", "ToolCall", "ToolResult"]
