"""Custom tools (callable, HTTP, gRPC) and the registry built from ToolsConfig."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from libra.rollout.tools.base import ToolCall
from libra.rollout.tools.config import CustomToolConfig, SandboxConfig, ToolsConfig
from libra.rollout.tools.custom import build_custom_tool
from libra.rollout.tools.registry import ToolRegistry, build_registry
from libra.trajectory import ToolStatus
from libra.v1 import tools_pb2, tools_pb2_grpc

TARGETS = "tests.tools.custom_targets"


def custom(name, **kwargs) -> CustomToolConfig:
    return CustomToolConfig(name=name, description=f"{name} tool", **kwargs)


def test_callable_tools():
    shout = build_custom_tool(custom("shout", callable=f"{TARGETS}:shout"))
    assert asyncio.run(shout({"text": "hi"})).content == "HI"
    missing = asyncio.run(shout({}))
    assert missing.status == ToolStatus.FAILURE and "KeyError" in missing.content
    slow = build_custom_tool(custom("slow", callable=f"{TARGETS}:slow_echo", timeout_s=0.2))
    assert asyncio.run(slow({"text": "ok"})).content == "ok"
    late = asyncio.run(slow({"text": "ok", "sleep_s": 2}))
    assert late.status == ToolStatus.TIMEOUT and late.latency_s < 1
    flaky = build_custom_tool(custom("flaky", callable=f"{TARGETS}:flaky"))
    assert asyncio.run(flaky({})).content == "fine"
    assert "backend unavailable" in asyncio.run(flaky({"fail": True})).content
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_custom_tool(custom("x", callable=f"{TARGETS}:nope"))
    with pytest.raises(ValueError, match="not callable"):
        build_custom_tool(custom("x", callable=f"{TARGETS}:NOT_CALLABLE"))


def test_custom_config_validation():
    with pytest.raises(ValueError, match="exactly one of callable and endpoint"):
        CustomToolConfig(name="x")
    with pytest.raises(ValueError, match="endpoint"):
        CustomToolConfig(name="x", endpoint="ftp://host")
    with pytest.raises(ValueError, match="name"):
        CustomToolConfig(name="bad name", callable="a:b")
    with pytest.raises(ValueError, match="duplicate"):
        ToolsConfig(enabled=["calculator"], custom=[CustomToolConfig(name="calculator", callable="a:b")])
    with pytest.raises(ValueError, match="retrieval_corpus"):
        ToolsConfig(enabled=["retrieve"])
    with pytest.raises(ValueError, match="num_workers"):
        SandboxConfig(num_workers=0)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        arguments = body["arguments"]
        if arguments.get("sleep_s"):
            time.sleep(arguments["sleep_s"])
        if arguments.get("plain"):
            payload, kind = b"plain text", "text/plain"
        elif arguments.get("error"):
            self.send_error(500)
            return
        else:
            payload = json.dumps(
                {
                    "content": f"{body['tool']}:{arguments['q']}",
                    "status": "failure" if arguments.get("as_failure") else "success",
                }
            ).encode()
            kind = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_http_tool():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/tool"
        tool = build_custom_tool(custom("web", endpoint=url, timeout_s=0.5))

        async def calls():
            return await asyncio.gather(
                tool({"q": "a"}),
                tool({"q": "b", "as_failure": True}),
                tool({"plain": True}),
                tool({"error": True}),
                tool({"q": "c", "sleep_s": 1.5}),
            )

        ok, failed, plain, error, late = asyncio.run(calls())
        assert (ok.status, ok.content) == (ToolStatus.SUCCESS, "web:a")
        assert (failed.status, failed.content) == (ToolStatus.FAILURE, "web:b")
        assert plain.content == "plain text"
        assert error.status == ToolStatus.FAILURE and "HTTP 500" in error.content
        assert late.status == ToolStatus.TIMEOUT
    finally:
        server.shutdown()
        server.server_close()
    dead = build_custom_tool(custom("web", endpoint=url, timeout_s=0.5))
    assert asyncio.run(dead({"q": "a"})).status == ToolStatus.FAILURE


class _ToolService(tools_pb2_grpc.ToolServiceServicer):
    async def Call(self, request, context):  # noqa: N802 - gRPC naming
        arguments = json.loads(request.arguments_json)
        if arguments.get("sleep_s"):
            await asyncio.sleep(arguments["sleep_s"])
        return tools_pb2.ToolCallResponse(
            content=f"{request.tool}:{arguments['q']}", status=tools_pb2.TOOL_CALL_STATUS_SUCCESS
        )


def test_grpc_tool():
    async def scenario():
        server = grpc.aio.server()
        tools_pb2_grpc.add_ToolServiceServicer_to_server(_ToolService(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tool = build_custom_tool(custom("remote", endpoint=f"grpc://127.0.0.1:{port}", timeout_s=0.5))
        try:
            return await tool({"q": "x"}), await tool({"q": "y", "sleep_s": 2})
        finally:
            await tool.close()
            await server.stop(0)

    ok, late = asyncio.run(scenario())
    assert (ok.status, ok.content) == (ToolStatus.SUCCESS, "remote:x")
    assert late.status == ToolStatus.TIMEOUT


def test_registry_from_config(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"id": "1", "text": "Mount Everest is the highest mountain."}) + "\n")
    config = ToolsConfig(
        enabled=["retrieve"],
        retrieval_corpus=str(corpus),
        custom=[custom("shout", callable=f"{TARGETS}:shout")],
    )
    registry = build_registry(config)
    assert registry.names == ["retrieve", "shout"]
    assert [s["function"]["name"] for s in registry.schemas()] == ["retrieve", "shout"]
    assert (
        "Everest" in asyncio.run(registry.call(ToolCall("retrieve", {"query": "highest mountain"}))).content
    )
    assert asyncio.run(registry.call(ToolCall("shout", {"text": "a"}))).content == "A"
    unknown = asyncio.run(registry.call(ToolCall("browser", {})))
    assert unknown.status == ToolStatus.FAILURE and "unknown tool 'browser'" in unknown.content
    with pytest.raises(ValueError, match="SandboxPool"):
        build_registry(ToolsConfig(enabled=["python"]))
    calculator = build_registry(ToolsConfig(enabled=["calculator"]))
    assert calculator.names == ["calculator"]
    assert asyncio.run(calculator.call(ToolCall("calculator", {}))).status == ToolStatus.FAILURE
    with pytest.raises(ValueError, match="already registered"):
        ToolRegistry([registry["shout"], registry["shout"]])
