"""Collective-group transport: torch.distributed point-to-point transfers of buckets between the
publisher (group rank 0) and rollout workers on other hosts (ranks 1..n), over gloo on the CPU
(nccl / hccl where the backend provides them: same calls, device buffers).

The group is separate from vLLM's and Megatron's own process groups: a `ProcessGroupGloo` built
directly on a TCPStore, never the default group. Each worker joins once
(`libra_join_collective` on the loader, with a group rank the controller assigns) while the
publisher's serving thread forms the group. Transfers are pulled, as with gRPC: a worker sends a
request (version, TP size, rank) and the publisher answers with a header (status, bytes) and then
the buffer's buckets, one message each, so a worker that skipped versions or retries after a
failure never desynchronizes the stream. A publisher that dies mid-transfer makes the worker's
receive time out; its staged buffer is then discarded and the engine keeps its version.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from libra.sync.transport import BufferManifest, TransferError, WeightReceiver, WeightSender

_KEY = re.compile(r"^tp(\d+)/rank(\d+)$")
_REQUEST, _HEADER, _BUCKET = 1, 2, 3  # message tags


def _make_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, is_master: bool):
    store = dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore("libra-weights", store)
    return store, dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s))


class CollectiveSender(WeightSender):
    kind = "collective"

    def __init__(self, host: str, port: int, num_receivers: int, timeout_s: float = 600.0) -> None:
        """Forms the group in a background thread (it completes when all receivers joined) and
        serves every receiver's requests from then on."""
        if num_receivers < 1:
            raise ValueError(f"num_receivers must be >= 1, got {num_receivers}")
        self.host, self.port, self.num_receivers, self.timeout_s = host, port, num_receivers, timeout_s
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._manifests: dict[tuple[int, str], BufferManifest] = {}
        self._lock = threading.Lock()
        self._group = None
        self._ready = threading.Event()
        threading.Thread(target=self._serve, name="libra-collective-sender", daemon=True).start()

    def _serve(self) -> None:
        self._store, self._group = _make_group(
            self.host, self.port, 0, self.num_receivers + 1, self.timeout_s, True
        )
        self._ready.set()
        for peer in range(1, self.num_receivers + 1):
            threading.Thread(target=self._serve_peer, args=(peer,), daemon=True).start()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self._ready.wait(timeout_s)

    def _serve_peer(self, peer: int) -> None:
        request = torch.zeros(3, dtype=torch.int64)
        while True:
            try:
                self._group.recv([request], peer, _REQUEST).wait()
            except RuntimeError:
                return  # the peer left or the group closed
            version, tp_size, rank = (int(x) for x in request)
            if version < 0:
                return  # the peer left (`CollectiveReceiver.leave`)
            key = f"tp{tp_size}/rank{rank}"
            with self._lock:
                buffer = self._buffers.get((version, key))
                manifest = self._manifests.get((version, key))
            if buffer is None or manifest is None:
                self._group.send([torch.tensor([-1, 0], dtype=torch.int64)], peer, _HEADER).wait()
                continue
            self._group.send([torch.tensor([0, buffer.numel()], dtype=torch.int64)], peer, _HEADER).wait()
            for bucket in manifest.buckets:
                self.send_bucket(buffer[bucket.start : bucket.end], peer)

    def send_bucket(self, piece: torch.Tensor, peer: int) -> None:
        self._group.send([piece], peer, _BUCKET).wait()

    def allocate(self, version: int, key: str, num_bytes: int) -> torch.Tensor:
        if not _KEY.match(key):
            raise ValueError(f"collective transport needs keys like 'tp2/rank1', got {key!r}")
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        with self._lock:
            self._buffers[(version, key)] = buffer
        return buffer

    def seal(self, manifest: BufferManifest) -> dict[str, Any]:
        with self._lock:
            if (manifest.version, manifest.key) not in self._buffers:
                raise ValueError(f"buffer {manifest.key} of version {manifest.version} was never allocated")
            self._manifests[(manifest.version, manifest.key)] = manifest
        return {"kind": self.kind}

    def release(self, version: int) -> None:
        with self._lock:
            for version_key in [k for k in self._buffers if k[0] == version]:
                self._buffers.pop(version_key)
                self._manifests.pop(version_key, None)


class CollectiveReceiver(WeightReceiver):
    kind: ClassVar[str] = "collective"
    _joined: ClassVar[CollectiveReceiver | None] = None
    """The process's membership (one per rollout worker process)."""

    def __init__(
        self, host: str, port: int, group_rank: int, world_size: int, timeout_s: float = 600.0
    ) -> None:
        if not 1 <= group_rank < world_size:
            raise ValueError(
                f"group_rank must be in 1..{world_size - 1} (0 is the publisher), got {group_rank}"
            )
        self._store, self._group = _make_group(host, port, group_rank, world_size, timeout_s, False)

    @classmethod
    def join(cls, host: str, port: int, group_rank: int, world_size: int, timeout_s: float = 600.0) -> None:
        cls._joined = cls(host, port, group_rank, world_size, timeout_s)

    @classmethod
    def leave(cls) -> None:
        """Tells the publisher this worker is gone, so its serving thread ends (a thread blocked in
        a gloo receive at interpreter exit aborts the process)."""
        if cls._joined is not None:
            cls._joined._group.send([torch.tensor([-1, 0, 0], dtype=torch.int64)], 0, _REQUEST).wait()
            cls._joined = None

    @classmethod
    def for_handle(cls, handle: Mapping[str, Any]) -> CollectiveReceiver:
        if cls._joined is None:
            raise TransferError("collective weight transport: this worker has not joined a group")
        return cls._joined

    def fetch(self, manifest: BufferManifest, handle: Mapping[str, Any]) -> torch.Tensor:
        match = _KEY.match(manifest.key)
        if match is None:
            raise TransferError(f"collective transport needs keys like 'tp2/rank1', got {manifest.key!r}")
        try:
            request = torch.tensor([manifest.version, int(match[1]), int(match[2])], dtype=torch.int64)
            self._group.send([request], 0, _REQUEST).wait()
            header = torch.zeros(2, dtype=torch.int64)
            self._group.recv([header], 0, _HEADER).wait()
            if int(header[0]) != 0:
                raise TransferError(f"{manifest.key} v{manifest.version}: the publisher does not have it")
            if int(header[1]) != manifest.num_bytes:
                raise TransferError(
                    f"{manifest.key} v{manifest.version}: publisher has {int(header[1])} bytes"
                )
            staged = torch.empty(manifest.num_bytes, dtype=torch.uint8)
            for bucket in manifest.buckets:
                self._group.recv([staged[bucket.start : bucket.end]], 0, _BUCKET).wait()
        except RuntimeError as error:  # gloo timeouts and closed connections
            if isinstance(error, TransferError):
                raise
            raise TransferError(
                f"{manifest.key} v{manifest.version}: collective transfer failed: {error}"
            ) from None
        return staged
