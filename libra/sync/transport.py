"""The `WeightTransport` seam: how one destination rank's flat buffer travels from the publisher
to a rollout worker, and the manifest that lets the worker prove it arrived whole.

A publication of version v holds, per destination layout and rank ("tp2/rank1"), one flat buffer
in the transfer plan's order (`plan.params(rank)`), split into buckets on param boundaries. The
publisher asks a `WeightSender` for the memory of each buffer, fills it bucket by bucket with the
resharding executor, records a checksum per bucket in a `BufferManifest`, and `seal`s it, which
yields a small JSON-able handle. A rollout worker hands that handle and the manifest to the
matching `WeightReceiver`, which returns a *staged* copy of the buffer (or a private view of
shared memory). Nothing in the model changes until the staged buffer has the manifest's size and
every bucket's checksum matches (`verify_staged`); only then does the loader copy it into the live
parameters. So a transfer that dies halfway leaves the instance on its old version.

Checksums guard against incomplete and stale buffers (a killed writer, a short stream, a bucket
left from another version), not against adversaries: `xor64` folds the buffer into 64-bit words
at memory speed; `crc32` (zlib) is stronger against bit errors but ~4x slower here (1.3 GB/s).
"""

from __future__ import annotations

import sys
import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from libra.sync.plan import ParamSlot

if TYPE_CHECKING:
    import torch

CHECKSUMS = ("xor64", "crc32")
DTYPES = ("float32", "bfloat16", "float16")
"""The element types a manifest may name (torch's names). torch is imported only where tensors are
handled: processes that only read manifests (the controller's, an instance client's) load none."""


class TransferError(RuntimeError):
    """A weight transfer did not deliver a complete, intact buffer; the instance keeps its version."""


def checksum(data: torch.Tensor | np.ndarray, algorithm: str) -> int:
    """Checksum of a contiguous CPU buffer's bytes (`CHECKSUMS`)."""
    as_bytes = _bytes_view(data)
    if algorithm == "crc32":
        return zlib.crc32(as_bytes)
    if algorithm == "xor64":
        whole = as_bytes.size - as_bytes.size % 8
        folded = int(np.bitwise_xor.reduce(as_bytes[:whole].view(np.uint64))) if whole else 0
        tail = int.from_bytes(as_bytes[whole:].tobytes(), "little")
        # The length is mixed in so that a truncated buffer of zeros cannot match an empty one.
        return folded ^ tail ^ (as_bytes.size * 0x9E3779B97F4A7C15 & (2**64 - 1))
    raise ValueError(f"checksum algorithm must be one of {CHECKSUMS}, got {algorithm!r}")


def _bytes_view(data: torch.Tensor | np.ndarray) -> np.ndarray:
    torch_module = sys.modules.get("torch")  # a tensor implies torch is loaded
    if torch_module is not None and isinstance(data, torch_module.Tensor):
        if not data.is_contiguous() or data.device.type != "cpu":
            raise ValueError("checksum needs a contiguous CPU tensor")
        data = data.view(torch_module.uint8).reshape(-1).numpy()
    return data.reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class BucketDigest:
    """Bytes [start, end) of the buffer and their checksum."""

    start: int
    end: int
    checksum: int


@dataclass(frozen=True)
class BufferManifest:
    """What a complete flat buffer of one destination rank of one version looks like."""

    version: int
    key: str
    """The destination layout and rank, e.g. "tp2/rank1"."""
    dtype: str
    num_bytes: int
    buckets: tuple[BucketDigest, ...]
    params: tuple[ParamSlot, ...]
    checksum: str = "xor64"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"manifest {self.key}: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.checksum not in CHECKSUMS:
            raise ValueError(
                f"manifest {self.key}: checksum must be one of {CHECKSUMS}, got {self.checksum!r}"
            )
        position = 0
        for bucket in self.buckets:
            if bucket.start != position or bucket.end <= bucket.start:
                raise ValueError(f"manifest {self.key}: buckets must tile the buffer, gap at byte {position}")
            position = bucket.end
        if position != self.num_bytes:
            raise ValueError(f"manifest {self.key}: buckets cover {position} of {self.num_bytes} bytes")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and ints: what vLLM's collective_rpc serializer carries to its workers."""
        return {
            "version": self.version,
            "key": self.key,
            "dtype": self.dtype,
            "num_bytes": self.num_bytes,
            "buckets": [[b.start, b.end, b.checksum] for b in self.buckets],
            "params": [[p.name, p.offset, list(p.shape)] for p in self.params],
            "checksum": self.checksum,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BufferManifest:
        return cls(
            version=int(data["version"]),
            key=str(data["key"]),
            dtype=str(data["dtype"]),
            num_bytes=int(data["num_bytes"]),
            buckets=tuple(BucketDigest(int(s), int(e), int(c)) for s, e, c in data["buckets"]),
            params=tuple(
                ParamSlot(str(n), int(o), tuple(int(d) for d in shape)) for n, o, shape in data["params"]
            ),
            checksum=str(data.get("checksum", "xor64")),
        )


def verify_staged(staged: torch.Tensor, manifest: BufferManifest) -> None:
    """Raises TransferError unless `staged` (uint8) has the manifest's size and every bucket's
    checksum; the one gate between a transfer and the live parameters."""
    import torch

    if staged.dtype != torch.uint8 or staged.dim() != 1:
        raise TransferError(f"{manifest.key} v{manifest.version}: staged buffer must be flat uint8")
    if staged.numel() != manifest.num_bytes:
        raise TransferError(
            f"{manifest.key} v{manifest.version}: staged {staged.numel()} B, manifest {manifest.num_bytes}"
        )
    for i, bucket in enumerate(manifest.buckets):
        got = checksum(staged[bucket.start : bucket.end], manifest.checksum)
        if got != bucket.checksum:
            raise TransferError(
                f"{manifest.key} v{manifest.version}: bucket {i} (bytes {bucket.start}..{bucket.end}) "
                f"{manifest.checksum} {got:#x} != {bucket.checksum:#x}: incomplete or stale transfer"
            )


class WeightSender(ABC):
    """Publisher side of a transport. Per buffer: `allocate` the memory the executor writes into,
    then `seal` it with its manifest to get the handle receivers need. A sealed buffer is never
    written again (the next version gets new memory), so receivers may read it at any time until
    `release`."""

    kind: ClassVar[str]

    @abstractmethod
    def allocate(self, version: int, key: str, num_bytes: int) -> torch.Tensor:
        """A writable, contiguous uint8 CPU tensor of `num_bytes` for buffer `key` of `version`."""

    @abstractmethod
    def seal(self, manifest: BufferManifest) -> dict[str, Any]:
        """Marks the buffer complete; returns the JSON-able handle a receiver fetches it with."""

    @abstractmethod
    def release(self, version: int) -> None:
        """Frees every buffer of `version` (receivers that already staged it are unaffected)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most senders need nothing more
        """Frees everything and stops any serving thread."""


class WeightReceiver(ABC):
    """Rollout-worker side of a transport: turns a handle into a staged buffer."""

    kind: ClassVar[str]

    @abstractmethod
    def fetch(self, manifest: BufferManifest, handle: Mapping[str, Any]) -> torch.Tensor:
        """The buffer's bytes as a flat uint8 CPU tensor that no one else writes (a private copy or
        copy-on-write view). May return a short or wrong buffer; the caller verifies it. Raises
        TransferError when the transfer fails outright."""
