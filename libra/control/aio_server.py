"""An asyncio gRPC server with the control plane's guarantees: bearer-token auth (health exempt),
health checking, reflection and TLS, as `libra.control.server.start_server` gives sync servers.
The token check mirrors `libra.control.auth.TokenAuthInterceptor` (a sync `grpc.ServerInterceptor`
cannot serve a `grpc.aio` server)."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from libra.config import ControlConfig
from libra.control.auth import HEALTH_PREFIX
from libra.control.server import bind, enable_reflection


class AioTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the run's bearer token (constant-time comparison)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return _refusing_handler(
            handler, "missing or invalid bearer token" if presented else "missing bearer token"
        )


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


@dataclass
class RunningAioServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_aio_server(
    config: ControlConfig,
    token: str,
    add_servicers: Callable[[grpc.aio.Server], Iterable[str]],
    host: str | None = None,
    port: int | None = None,
) -> RunningAioServer:
    """Starts a server on `host:port` (default: the config's) with the services that
    `add_servicers` registers; it returns their full names for health and reflection."""
    server = grpc.aio.server(
        interceptors=[AioTokenAuthInterceptor(token)],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
        ],
    )
    service_names = list(add_servicers(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in [""] + service_names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    enable_reflection(server, service_names)
    bound = bind(server, config, host, port)
    await server.start()
    return RunningAioServer(server=server, port=bound, health=health_servicer)
