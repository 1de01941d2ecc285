"""Bearer-token authentication and TLS credentials for every Libra gRPC server and client.

Every call carries `authorization: Bearer <token>`; a server interceptor refuses anything else
with UNAUTHENTICATED before a handler runs (on the asyncio servers, before the request body is
even read). Only the standard health service is exempt, so that stock probes (grpc_health_probe,
load balancers) work without the secret. The run's token is one such bearer; the controller
issues each node agent its own (`libra.control.cluster`), which an `Authorizer` scopes to methods.
"""

from __future__ import annotations

import enum
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import grpc

from libra.control.config import ControlConfig

TOKEN_ENV = "LIBRA_TOKEN"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class Verdict(enum.Enum):
    ALLOW = "allow"
    UNKNOWN = "unknown"
    """No such bearer: UNAUTHENTICATED."""
    FORBIDDEN = "forbidden"
    """A known bearer that may not call this method: PERMISSION_DENIED."""


Authorizer = Callable[[str, str], Verdict]
"""(full method name, presented bearer) -> verdict; called before any handler or body parsing."""


def token_authorizer(token: str) -> Authorizer:
    """Allows every method to exactly `token` (constant-time comparison)."""
    if not token:
        raise ValueError("the bearer token must not be empty")
    expected = token.encode()

    def authorize(_method: str, bearer: str) -> Verdict:
        return Verdict.ALLOW if hmac.compare_digest(bearer.encode(), expected) else Verdict.UNKNOWN

    return authorize


def bearer_of(metadata) -> str:
    """The bearer in an `authorization: Bearer <x>` header, or "" when there is none."""
    for key, value in metadata or ():
        if key == "authorization":
            return value[len("Bearer ") :] if value.startswith("Bearer ") else ""
    return ""


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses unauthorised calls on a `grpc.aio` server as soon as their headers arrive. The
    refusal handler reads no body, so an undecodable or never-sent body changes nothing, and an
    unknown method is refused like any other (its name tells an anonymous caller nothing)."""

    def __init__(self, authorize: Authorizer):
        self._authorize = authorize

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        bearer = bearer_of(handler_call_details.invocation_metadata)
        verdict = self._authorize(method, bearer) if bearer else Verdict.UNKNOWN
        if verdict == Verdict.ALLOW:
            return await continuation(handler_call_details)
        if verdict == Verdict.FORBIDDEN:
            return _refusal(grpc.StatusCode.PERMISSION_DENIED, f"this credential may not call {method}")
        return _refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or invalid bearer token" if bearer else "missing bearer token",
        )


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    # A streaming-request handler runs without waiting for a request message; without a
    # deserializer it never parses one either.
    async def refuse(_request_iterator, context):
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(refuse)


def resolve_token(config: ControlConfig, run_dir: str | Path, create: bool) -> str:
    """The run's token: from the config, else LIBRA_TOKEN, else the run folder's token file, else
    (with `create`, the controller) a fresh one written there with mode 0600, so that agents and
    `libra status` on this host find it."""
    if config.token:
        return config.token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    token_path = Path(run_dir) / "token"
    if token_path.is_file():
        return read_token_file(token_path)
    if not create:
        raise ValueError(
            f"no token: set control.token, {TOKEN_ENV}, or run where the controller wrote {token_path}"
        )
    token_path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_token_file(path: str | Path) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the run's bearer token (constant-time comparison)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _refusing_handler(
            handler, "missing or invalid bearer token" if presented else "missing bearer token"
        )


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as `handler` that aborts with UNAUTHENTICATED."""

    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class _BearerToken(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._metadata = (("authorization", f"Bearer {token}"),)

    def __call__(self, context, callback):
        callback(self._metadata, None)


class _BearerInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token on plaintext channels (gRPC sends call credentials over TLS only)."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        metadata = list(details.metadata or []) + [self._header]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def server_credentials(config: ControlConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for a server, or None for plaintext (loopback development)."""
    if not config.tls_cert_file:
        return None
    key = Path(config.tls_key_file).read_bytes()
    cert = Path(config.tls_cert_file).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    # Pings find a dead peer of a long stream (a heartbeat, an event watch) within a minute; the
    # servers permit pings this often (`libra.control.aio_server`).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


def _root_certificates(config: ControlConfig) -> bytes:
    return Path(config.tls_ca_file or config.tls_cert_file).read_bytes()


def open_channel(address: str, token: str | None, config: ControlConfig | None = None) -> grpc.Channel:
    """A client channel to a Libra server that sends `token` on every call (TLS when configured).
    `token=None` opens an unauthenticated channel (only the health service will answer)."""
    if config is not None and config.tls_cert_file:
        credentials = grpc.ssl_channel_credentials(root_certificates=_root_certificates(config))
        if token is not None:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.metadata_call_credentials(_BearerToken(token))
            )
        return grpc.secure_channel(address, credentials, options=_CHANNEL_OPTIONS)
    channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    return grpc.intercept_channel(channel, _BearerInterceptor(token)) if token is not None else channel


def open_aio_channel(address: str, config: ControlConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a Libra server (TLS when configured) that carries no bearer: each
    call sends its own as `bearer_metadata(...)`, so one channel serves several identities."""
    if config is not None and config.tls_cert_file:
        credentials = grpc.ssl_channel_credentials(root_certificates=_root_certificates(config))
        return grpc.aio.secure_channel(address, credentials, options=_CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)


def bearer_metadata(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)
