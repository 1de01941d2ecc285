"""Bearer-token authentication and TLS credentials for every Libra gRPC server and client.

Every call carries `authorization: Bearer <token>`; a server interceptor refuses anything else
with UNAUTHENTICATED before a handler runs. Only the standard health service is exempt, so that
stock probes (grpc_health_probe, load balancers) work without the secret.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc

from libra.config import ControlConfig

TOKEN_ENV = "LIBRA_TOKEN"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


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


def open_channel(address: str, token: str | None, config: ControlConfig | None = None) -> grpc.Channel:
    """A client channel to a Libra server that sends `token` on every call (TLS when configured).
    `token=None` opens an unauthenticated channel (only the health service will answer)."""
    options = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
    if config is not None and config.tls_cert_file:
        root = Path(config.tls_ca_file or config.tls_cert_file).read_bytes()
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
        if token is not None:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.metadata_call_credentials(_BearerToken(token))
            )
        return grpc.secure_channel(address, credentials, options=options)
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _BearerInterceptor(token)) if token is not None else channel
