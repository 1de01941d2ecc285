"""Functions that tests register as custom tools by dotted path."""

from __future__ import annotations

import asyncio

from libra.rollout.tools.base import ToolResult
from libra.trajectory import ToolStatus


def shout(arguments: dict) -> str:
    return str(arguments["text"]).upper()


async def slow_echo(arguments: dict) -> str:
    await asyncio.sleep(arguments.get("sleep_s", 0))
    return arguments.get("text", "")


def flaky(arguments: dict) -> ToolResult:
    if arguments.get("fail"):
        raise RuntimeError("backend unavailable")
    return ToolResult("fine", ToolStatus.SUCCESS)


NOT_CALLABLE = 3
