"""Building a Libra gRPC server: auth interceptor, health checking, reflection, TLS, and the
translation of `InvalidArgument` into the INVALID_ARGUMENT status."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from libra.control.auth import TokenAuthInterceptor, server_credentials
from libra.control.config import ControlConfig
from libra.control.convert import InvalidArgument


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_server(
    config: ControlConfig,
    token: str,
    add_servicers: Callable[[grpc.Server], Iterable[str]],
    host: str | None = None,
    port: int | None = None,
) -> RunningServer:
    """Starts a server on `host:port` (default: the config's) with the services that
    `add_servicers` registers; it returns their full names for health and reflection."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_rpc_threads, thread_name_prefix="libra-rpc"),
        interceptors=[TokenAuthInterceptor(token)],
        options=[("grpc.so_reuseport", 0)],
    )
    service_names = list(add_servicers(server))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in [""] + service_names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    enable_reflection(server, service_names)
    bound = bind(server, config, host, port)
    server.start()
    return RunningServer(server=server, port=bound, health=health_servicer)


def enable_reflection(server: grpc.Server | grpc.aio.Server, service_names: list[str]) -> None:
    """Reflection over the server's services, health and reflection itself."""
    reflection.enable_server_reflection(
        service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )


def bind(
    server: grpc.Server | grpc.aio.Server, config: ControlConfig, host: str | None, port: int | None
) -> int:
    """Listens on `host:port` (default: the config's), with TLS when the config has a
    certificate; returns the bound port."""
    address = f"{host or config.host}:{config.port if port is None else port}"
    credentials = server_credentials(config)
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot listen on {address}")
    return bound


def _status_of(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(error, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, LookupError):
        return grpc.StatusCode.NOT_FOUND, str(error.args[0]) if error.args else str(error)
    if isinstance(error, PermissionError):
        return grpc.StatusCode.PERMISSION_DENIED, str(error)
    if isinstance(error, OverflowError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, RuntimeError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    return None


def rpc_errors(method):
    """Servicer-method decorator (plain, async, or async-generator methods): `InvalidArgument` →
    INVALID_ARGUMENT, `LookupError` → NOT_FOUND, `PermissionError` → PERMISSION_DENIED,
    `OverflowError` → RESOURCE_EXHAUSTED, `TimeoutError` (busy: retry) → UNAVAILABLE,
    `RuntimeError` → FAILED_PRECONDITION, each with the exception's message."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for reply in method(self, request, context):
                    yield reply
            except Exception as e:
                await context.abort(*_status_or_raise(e))

        return stream_wrapper

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def async_wrapper(self, request, context):
            try:
                return await method(self, request, context)
            except Exception as e:
                await context.abort(*_status_or_raise(e))

        return async_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:
            context.abort(*_status_or_raise(e))

    return wrapper


def _status_or_raise(error: Exception) -> tuple[grpc.StatusCode, str]:
    status = _status_of(error)
    if status is None:
        raise error
    return status
