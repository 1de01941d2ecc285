"""What an instance needs to switch to one published version: per destination TP rank, the
manifest of its flat buffer and the transport handle to fetch it with (`LoadRequest`).

The publisher makes one per TP size (`Publication.load_request`); the controller carries it to the
instance (as `libra.v1.VersionLoad`, see `wire`); the instance hands `to_dict()` to its workers
through vLLM's `collective_rpc` (plain lists and ints travel to worker processes; dataclasses of
this module need not be importable there in any particular version).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from libra.sync.transport import BufferManifest

HANDLE_KINDS = ("shm", "grpc", "collective")


@dataclass(frozen=True)
class RankLoad:
    manifest: BufferManifest
    handle: Mapping[str, Any]
    """The transport handle as the sender sealed it: {"kind": "shm", "path": ...},
    {"kind": "grpc", "address", "chunk_bytes"[, "token"]} or {"kind": "collective"}."""

    def __post_init__(self) -> None:
        if self.handle.get("kind") not in HANDLE_KINDS:
            raise ValueError(
                f"{self.manifest.key}: handle kind must be one of {HANDLE_KINDS}, "
                f"got {self.handle.get('kind')!r}"
            )


@dataclass(frozen=True)
class LoadRequest:
    version: int
    ranks: tuple[RankLoad, ...]
    """One per destination TP rank, in rank order."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError(f"load request of version {self.version}: ranks must not be empty")
        for rank, load in enumerate(self.ranks):
            if load.manifest.version != self.version:
                raise ValueError(
                    f"load request of version {self.version}: ranks[{rank}] manifest is of version "
                    f"{load.manifest.version}"
                )

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """The plain form `LibraWeightLoader.libra_stage` takes."""
        return {
            "version": self.version,
            "ranks": [{"manifest": r.manifest.to_dict(), "handle": dict(r.handle)} for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadRequest:
        return cls(
            version=int(data["version"]),
            ranks=tuple(
                RankLoad(BufferManifest.from_dict(r["manifest"]), dict(r["handle"])) for r in data["ranks"]
            ),
        )
