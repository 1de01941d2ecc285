"""Custom tools registered from the config: a Python callable, or a remote HTTP / gRPC endpoint.

Each wraps its target so the Tool contract holds: a bad call, an exception or an unreachable
endpoint becomes a FAILURE result, an exceeded `timeout_s` a TIMEOUT result; nothing raises.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import urllib.error
import urllib.request
from typing import Any

from libra.plugins import load_callable
from libra.rollout.tools.base import ToolResult
from libra.rollout.tools.config import CustomToolConfig
from libra.rollout.tools.interpreter import truncate
from libra.trajectory import ToolStatus

_STATUS_NAMES = {"success": ToolStatus.SUCCESS, "failure": ToolStatus.FAILURE, "timeout": ToolStatus.TIMEOUT}


class _CustomTool:
    def __init__(self, config: CustomToolConfig, max_result_chars: int) -> None:
        self.name = config.name
        self.description = config.description
        self.parameters = config.parameters
        self.timeout_s = config.timeout_s
        self.max_result_chars = max_result_chars

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()
        try:
            content, status = await asyncio.wait_for(self._invoke(arguments), self.timeout_s)
        except TimeoutError:
            content, status = (
                f"error: tool '{self.name}' timed out after {self.timeout_s} s",
                ToolStatus.TIMEOUT,
            )
        except Exception as exc:  # noqa: BLE001 - the model sees the error, the loop goes on
            content, status = (
                f"error: tool '{self.name}' failed: {type(exc).__name__}: {exc}",
                ToolStatus.FAILURE,
            )
        return ToolResult(truncate(content, self.max_result_chars), status, time.monotonic() - start)

    async def _invoke(self, arguments: dict[str, Any]) -> tuple[str, ToolStatus]:
        raise NotImplementedError


class CallableTool(_CustomTool):
    """Calls a Python function (sync functions run in a thread so the event loop keeps going;
    such a thread cannot be stopped at the timeout, only abandoned)."""

    def __init__(self, config: CustomToolConfig, max_result_chars: int = 4000, function=None) -> None:
        super().__init__(config, max_result_chars)
        self.function = function or load_callable(config.callable, f"tools.custom[{config.name!r}].callable")

    async def _invoke(self, arguments: dict[str, Any]) -> tuple[str, ToolStatus]:
        if inspect.iscoroutinefunction(self.function):
            value = await self.function(arguments)
        else:
            value = await asyncio.to_thread(self.function, arguments)
        if isinstance(value, ToolResult):
            return value.content, value.status
        return str(value), ToolStatus.SUCCESS


class HttpTool(_CustomTool):
    """POSTs the arguments as JSON; a JSON reply `{"content", "status"}` or plain text comes back."""

    def __init__(self, config: CustomToolConfig, max_result_chars: int = 4000) -> None:
        super().__init__(config, max_result_chars)
        self.url = config.endpoint

    async def _invoke(self, arguments: dict[str, Any]) -> tuple[str, ToolStatus]:
        return await asyncio.to_thread(self._post, arguments)

    def _post(self, arguments: dict[str, Any]) -> tuple[str, ToolStatus]:
        body = json.dumps({"tool": self.name, "arguments": arguments}).encode("utf-8")
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8", "replace")
                is_json = response.headers.get_content_type() == "application/json"
        except urllib.error.HTTPError as exc:
            return f"error: HTTP {exc.code} from {self.url}", ToolStatus.FAILURE
        except TimeoutError:
            return f"error: {self.url} timed out after {self.timeout_s} s", ToolStatus.TIMEOUT
        if not is_json:
            return text, ToolStatus.SUCCESS
        reply = json.loads(text)
        status = _STATUS_NAMES.get(str(reply.get("status", "success")).lower())
        if status is None or not isinstance(reply.get("content"), str):
            return f"error: malformed reply from {self.url}: {text[:200]}", ToolStatus.FAILURE
        return reply["content"], status


class GrpcTool(_CustomTool):
    """Calls `libra.v1.ToolService/Call` on `grpc://host:port` (plaintext; put TLS in front of
    endpoints outside the cluster network)."""

    def __init__(self, config: CustomToolConfig, max_result_chars: int = 4000) -> None:
        super().__init__(config, max_result_chars)
        self.target = config.endpoint.removeprefix("grpc://")
        self._channel = None

    async def _invoke(self, arguments: dict[str, Any]) -> tuple[str, ToolStatus]:
        import grpc

        from libra.v1 import tools_pb2, tools_pb2_grpc

        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.target)
        stub = tools_pb2_grpc.ToolServiceStub(self._channel)
        request = tools_pb2.ToolCallRequest(tool=self.name, arguments_json=json.dumps(arguments))
        try:
            reply = await stub.Call(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"error: {self.target} timed out after {self.timeout_s} s", ToolStatus.TIMEOUT
            return f"error: {self.target}: {exc.code().name}: {exc.details()}", ToolStatus.FAILURE
        return reply.content, ToolStatus(int(reply.status))

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def build_custom_tool(config: CustomToolConfig, max_result_chars: int = 4000) -> _CustomTool:
    if config.callable is not None:
        return CallableTool(config, max_result_chars)
    if config.endpoint.startswith("grpc://"):
        return GrpcTool(config, max_result_chars)
    return HttpTool(config, max_result_chars)
