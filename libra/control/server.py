"""Building a Libra gRPC server: auth interceptor, health checking, reflection, TLS, and the
translation of `InvalidArgument` into the INVALID_ARGUMENT status."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from libra.config import ControlConfig
from libra.control.auth import TokenAuthInterceptor, server_credentials
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


def rpc_errors(method):
    """Servicer-method decorator: `InvalidArgument` → INVALID_ARGUMENT, `LookupError` → NOT_FOUND,
    `RuntimeError` → FAILED_PRECONDITION, each with the exception's message."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except InvalidArgument as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LookupError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else str(e))
        except RuntimeError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    return wrapper
