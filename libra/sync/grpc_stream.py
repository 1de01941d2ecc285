"""Chunked gRPC streaming: the fallback transport for rollout hosts that share neither memory nor
a collective group with the trainer.

The publisher keeps each sealed buffer in its own memory and serves it through the
`libra.v1.WeightStream` service (protos/libra/v1/sync.proto) on a server with the control plane's
bearer-token auth. A rollout worker pulls its rank's buffer in order into a staging tensor it
allocates once per version; a stream that breaks or ends short raises or leaves the buffer short,
and the loader's verification rejects it before the model is touched.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import numpy as np
import torch

from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from libra.control.server import RunningServer, rpc_errors, start_server
from libra.sync.transport import BufferManifest, TransferError, WeightReceiver, WeightSender
from libra.v1 import sync_pb2, sync_pb2_grpc

DEFAULT_CHUNK_BYTES = 4 << 20


class _WeightStreamServicer(sync_pb2_grpc.WeightStreamServicer):
    def __init__(self, sender: GrpcSender) -> None:
        self._sender = sender

    @rpc_errors
    def Pull(self, request, context):  # noqa: N802 - gRPC method name
        # Look up before returning the generator, so that a missing buffer is NOT_FOUND.
        buffer = self._sender.sealed_buffer(request.version, request.buffer)
        chunk_bytes = request.chunk_bytes if request.chunk_bytes > 0 else self._sender.chunk_bytes
        return self._sender.iter_chunks(buffer, min(chunk_bytes, 64 << 20))


class GrpcSender(WeightSender):
    kind = "grpc"

    def __init__(
        self,
        token: str,
        control: ControlConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        advertise_token: bool = False,
    ) -> None:
        """Serves on host:port (0: a free port). Receivers authenticate with LIBRA_TOKEN from their
        environment, or with the token put into each handle when `advertise_token` (only where the
        handle travels over an authenticated channel, as through the controller)."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._token = token
        self._advertise_token = advertise_token
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._sealed: set[tuple[int, str]] = set()
        self._server: RunningServer = start_server(
            control or ControlConfig(),
            token,
            lambda server: self._add(server),
            host=host,
            port=port,
        )
        self.address = f"{host}:{self._server.port}"

    def _add(self, server: grpc.Server) -> list[str]:
        sync_pb2_grpc.add_WeightStreamServicer_to_server(_WeightStreamServicer(self), server)
        return [sync_pb2.DESCRIPTOR.services_by_name["WeightStream"].full_name]

    def allocate(self, version: int, key: str, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"buffer {key}: num_bytes must be positive, got {num_bytes}")
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        self._buffers[(version, key)] = buffer
        return buffer

    def seal(self, manifest: BufferManifest) -> dict[str, Any]:
        if (manifest.version, manifest.key) not in self._buffers:
            raise ValueError(f"buffer {manifest.key} of version {manifest.version} was never allocated")
        self._sealed.add((manifest.version, manifest.key))
        handle = {"kind": self.kind, "address": self.address, "chunk_bytes": self.chunk_bytes}
        if self._advertise_token:
            handle["token"] = self._token
        return handle

    def sealed_buffer(self, version: int, key: str) -> torch.Tensor:
        if (version, key) not in self._sealed:
            raise LookupError(f"weight buffer {key!r} of version {version} is not published here")
        return self._buffers[(version, key)]

    def iter_chunks(self, buffer: torch.Tensor, chunk_bytes: int) -> Iterator[sync_pb2.WeightChunk]:
        total = buffer.numel()
        data = buffer.numpy()
        for offset in range(0, total, chunk_bytes):
            yield sync_pb2.WeightChunk(
                offset=offset, data=data[offset : offset + chunk_bytes].tobytes(), total_bytes=total
            )

    def release(self, version: int) -> None:
        for version_key in [k for k in self._buffers if k[0] == version]:
            self._sealed.discard(version_key)
            del self._buffers[version_key]

    def close(self) -> None:
        self._server.server.stop(grace=None)
        self._buffers.clear()
        self._sealed.clear()


class GrpcReceiver(WeightReceiver):
    kind = "grpc"

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s

    def fetch(self, manifest: BufferManifest, handle: Mapping[str, Any]) -> torch.Tensor:
        token = handle.get("token") or os.environ.get("LIBRA_TOKEN")
        if not token:
            raise TransferError("grpc weight transport: no token (set LIBRA_TOKEN in the rollout worker)")
        staged = torch.empty(manifest.num_bytes, dtype=torch.uint8)
        view = staged.numpy()
        received = 0
        channel = open_channel(str(handle["address"]), str(token))
        try:
            stub = sync_pb2_grpc.WeightStreamStub(channel)
            request = sync_pb2.PullRequest(
                version=manifest.version, buffer=manifest.key, chunk_bytes=int(handle.get("chunk_bytes", 0))
            )
            for chunk in stub.Pull(request, timeout=self.timeout_s):
                if chunk.total_bytes != manifest.num_bytes or chunk.offset != received:
                    raise TransferError(
                        f"{manifest.key} v{manifest.version}: chunk {chunk.offset} of {chunk.total_bytes}, "
                        f"expected offset {received} of {manifest.num_bytes}"
                    )
                end = received + len(chunk.data)
                if end > manifest.num_bytes:
                    raise TransferError(
                        f"{manifest.key} v{manifest.version}: stream runs past {manifest.num_bytes} bytes"
                    )
                view[received:end] = np.frombuffer(chunk.data, dtype=np.uint8)
                received = end
        except grpc.RpcError as error:
            raise TransferError(
                f"{manifest.key} v{manifest.version}: stream from {handle['address']} broke after {received} "
                f"of {manifest.num_bytes} bytes: {error.code().name} {error.details()}"
            ) from None
        finally:
            channel.close()
        if received != manifest.num_bytes:
            raise TransferError(
                f"{manifest.key} v{manifest.version}: stream ended after {received} of {manifest.num_bytes} B"
            )
        return staged
