"""The Tool interface: what the agent loop calls when the model emits a tool call.

A tool is async (the agent loop runs thousands of trajectories on one event loop) and never
raises for a bad call or a failed execution: it returns a `ToolResult` whose status says what
happened, because the model must see the error and the scheduler needs the status as part of the
tool-return state. Only a bug in the tool itself may raise; the agent loop records that as a
FAILURE result too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from libra.trajectory import ToolStatus


@dataclass(frozen=True)
class ToolCall:
    """A parsed call from the model's output."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResult:
    content: str
    """Text shown to the model (already truncated to the tool's output cap)."""
    status: ToolStatus = ToolStatus.SUCCESS
    latency_s: float = 0.0


@runtime_checkable
class Tool(Protocol):
    name: str
    """The name the model calls it by."""
    description: str
    """One or two sentences for the system prompt."""
    parameters: dict[str, Any]
    """JSON schema of the arguments (OpenAI function-calling style), rendered into the chat
    template's tool list."""

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        """Runs the tool. Invalid arguments → a FAILURE result naming the bad argument."""
        ...
