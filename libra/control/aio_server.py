"""Building a Libra `grpc.aio` server: auth before any handler, health checking, reflection, TLS,
connection limits, bounded concurrency per method, and a thread that runs the server's loop for
components that are otherwise synchronous (the controller, the node agent).

A stream costs a coroutine here, not a thread: a thousand heartbeat streams and a few hundred
event watchers leave every unary call answered. A caller that stalls (headers without a body, a
watcher that stops reading) holds memory bounded by the limits below and delays nobody.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from libra.control.auth import AioAuthInterceptor, Authorizer, token_authorizer
from libra.control.config import ControlConfig
from libra.control.server import bind, enable_reflection

_SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    # Clients ping every 30 s on long streams (`libra.control.auth._CHANNEL_OPTIONS`); the server
    # pings too, so a peer that vanished without a FIN frees its streams within a minute.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 3),
    # A connection with no call for 5 minutes is closed: idle sockets of vanished callers do not
    # accumulate. Long streams are calls, so heartbeats and watches are unaffected.
    ("grpc.max_connection_idle_ms", 300_000),
    # One connection cannot open more streams than this; others are unaffected by it.
    ("grpc.max_concurrent_streams", 4096),
    # Calls that arrived but that the loop has not picked up yet. gRPC's defaults (1,000, then
    # 3,000) cancel part of a 2,000-call burst before any handler sees it.
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 40_000),
]


def connection_age_options(max_age_s: float) -> list[tuple[str, int]]:
    """A connection gets GOAWAY after `max_age_s` (new calls reconnect) and its calls a grace of
    a third of that, then it closes: no caller, stalled or not, keeps a connection for longer."""
    age_ms = int(max_age_s * 1000)
    return [("grpc.max_connection_age_ms", age_ms), ("grpc.max_connection_age_grace_ms", age_ms // 3)]


def stream_lifetime_s(max_age_s: float) -> float:
    """How long a server may keep one long stream (a heartbeat) before ending it cleanly for the
    client to reopen: half the grace, so that it always ends before its connection closes."""
    return max_age_s / 6


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
    auth: str | Authorizer,
    add_servicers: Callable[[grpc.aio.Server], Iterable[str]],
    host: str | None = None,
    port: int | None = None,
    max_message_bytes: int = 256 << 20,
    max_reply_bytes: int | None = None,
    sync_handler_threads: int = 0,
) -> RunningAioServer:
    """Starts a server on `host:port` (default: the config's) with the services that
    `add_servicers` registers; it returns their full names for health and reflection. `auth` is
    the run's token or an `Authorizer`. Requests may be `max_message_bytes` long, replies
    `max_reply_bytes` (default: the same). Non-async servicer methods run on `sync_handler_threads`
    threads (0: the server must have none)."""
    authorize = token_authorizer(auth) if isinstance(auth, str) else auth
    server = grpc.aio.server(
        migration_thread_pool=futures.ThreadPoolExecutor(sync_handler_threads, "libra-rpc")
        if sync_handler_threads
        else None,
        interceptors=[AioAuthInterceptor(authorize)],
        options=[
            *_SERVER_OPTIONS,
            *connection_age_options(config.max_connection_age_s),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_reply_bytes or max_message_bytes),
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


def add_service(server: grpc.aio.Server, service, servicer, encoded_replies: Iterable[str] = ()) -> str:
    """Registers `servicer`'s methods for the proto `service` descriptor; returns its full name.
    A method named in `encoded_replies` returns its reply already serialised (bytes), which lets
    a reply that is mostly unchanged between calls be assembled from cached parts."""
    encoded = set(encoded_replies)
    handlers = {}
    for method in service.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        reply_type = message_factory.GetMessageClass(method.output_type)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=request_type.FromString,
            response_serializer=bytes if method.name in encoded else reply_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    return service.full_name


def concurrency_limit(limit: int, wait_s: float = 30.0):
    """Servicer-method decorator: at most `limit` calls of this method run at once (per servicer);
    the rest wait their turn for up to `wait_s` (or their own deadline), then get
    RESOURCE_EXHAUSTED. A streaming method counts its open streams and does not wait."""

    def decorate(method):
        key = f"_concurrency_{method.__name__}"

        def semaphore(servicer) -> asyncio.Semaphore:
            if key not in servicer.__dict__:
                servicer.__dict__[key] = asyncio.Semaphore(limit)
            return servicer.__dict__[key]

        async def acquire(servicer, context, wait: bool) -> None:
            slots = semaphore(servicer)
            if not slots.locked():
                await slots.acquire()  # returns at once: no timer, no task on the common path
                return
            remaining = context.time_remaining()
            timeout = min(wait_s, remaining) if wait and remaining is not None else (wait_s if wait else 0)
            try:
                await asyncio.wait_for(slots.acquire(), max(timeout, 1e-3))
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method.__name__}: {limit} calls in progress, try again later",
                )

        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def stream_wrapper(self, request, context):
                await acquire(self, context, wait=False)
                try:
                    async for reply in method(self, request, context):
                        yield reply
                finally:
                    semaphore(self).release()

            return stream_wrapper

        @functools.wraps(method)
        async def wrapper(self, request, context):
            await acquire(self, context, wait=True)
            try:
                return await method(self, request, context)
            finally:
                semaphore(self).release()

        return wrapper

    return decorate


class ServerThread:
    """An asyncio loop in a daemon thread serving one `grpc.aio` server, for a component whose
    own code is synchronous. `run()` executes a coroutine on that loop from any other thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._server: RunningAioServer | None = None

    def start(self, build: Callable[[], Awaitable[RunningAioServer]]) -> RunningAioServer:
        self._thread.start()
        self._server = self.run(build())
        return self._server

    def run(self, coroutine: Awaitable, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self, grace_s: float = 1.0, then: Callable[[], Awaitable] | None = None) -> None:
        """Stops the server (calls in flight get `grace_s`), runs `then()` on the loop, ends it."""
        if not self._thread.is_alive():
            return
        if self._server is not None:
            self.run(self._server.stop(grace_s), timeout_s=grace_s + 10.0)
        if then is not None:
            self.run(then(), timeout_s=10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self.loop.close()
