"""The tool registry: the tools offered to the model, built from `ToolsConfig`, called by name."""

from __future__ import annotations

import time
from typing import Any

from libra.rollout.tools.base import Tool, ToolCall, ToolResult
from libra.rollout.tools.calculator import Calculator
from libra.rollout.tools.config import ToolsConfig
from libra.rollout.tools.custom import build_custom_tool
from libra.rollout.tools.interpreter import PythonInterpreterTool
from libra.rollout.tools.retrieval import RetrievalTool, load_index
from libra.rollout.tools.sandbox import SandboxPool
from libra.trajectory import ToolStatus


class ToolRegistry:
    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools or []:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if not isinstance(tool, Tool):
            raise TypeError(f"{tool!r} does not implement libra.rollout.tools.base.Tool")
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function-calling descriptions, for the chat template's tool list."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in self._tools.values()
        ]

    async def call(self, call: ToolCall) -> ToolResult:
        """Runs `call`; an unknown tool or a tool that raises gives a FAILURE result, never an error."""
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(
                f"error: unknown tool {call.name!r}; available: {', '.join(self._tools)}", ToolStatus.FAILURE
            )
        start = time.monotonic()
        try:
            return await tool(call.arguments)
        except Exception as exc:  # noqa: BLE001 - a tool bug is recorded as a failed call
            return ToolResult(
                f"error: tool {call.name!r} failed: {type(exc).__name__}: {exc}",
                ToolStatus.FAILURE,
                time.monotonic() - start,
            )


def build_registry(config: ToolsConfig, pool: SandboxPool | None = None) -> ToolRegistry:
    """The registry of `config.enabled` plus `config.custom`. `python` needs a started `pool`."""
    registry = ToolRegistry()
    for name in config.enabled:
        if name == "python":
            if pool is None:
                raise ValueError("tools.enabled has 'python' but no SandboxPool was given to build_registry")
            registry.register(PythonInterpreterTool(pool, config.max_result_chars))
        elif name == "calculator":
            registry.register(Calculator())
        elif name == "retrieve":
            index = load_index(config.retrieval_corpus)
            registry.register(RetrievalTool(index, config.retrieval_top_k, config.max_result_chars))
    for custom in config.custom:
        registry.register(build_custom_tool(custom, config.max_result_chars))
    return registry
