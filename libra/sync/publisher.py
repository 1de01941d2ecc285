"""The trainer side of weight publication: Megatron shards -> every destination layout's flat
buffers, written bucket by bucket straight into the transport's memory, with a manifest each.

One `WeightPublisher` serves all rollout buckets: it holds one transfer plan per vLLM TP size
(built once) and one sender. `publish(version, shards)` produces a `Publication`, whose
`load_request(tp_size)` is what an instance of that TP size passes to its loader. Instances of the
same TP size share the same buffers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from libra.sync.executor import execute
from libra.sync.layouts import SourceKey
from libra.sync.load_request import LoadRequest, RankLoad
from libra.sync.plan import TransferPlan
from libra.sync.transport import (
    CHECKSUMS,
    BucketDigest,
    BufferManifest,
    WeightSender,
    checksum,
)

if TYPE_CHECKING:
    import torch


def buffer_key(tp_size: int, rank: int) -> str:
    return f"tp{tp_size}/rank{rank}"


@dataclass(frozen=True)
class Publication:
    """One published version: per buffer key its manifest and transport handle."""

    version: int
    manifests: dict[str, BufferManifest]
    handles: dict[str, dict[str, Any]]
    seconds: float = 0.0
    """Wall time of `publish` (resharding, checksums, transport hand-off)."""
    tp_sizes: tuple[int, ...] = field(default=())

    def load_request(self, tp_size: int) -> LoadRequest:
        """What an instance with TP = `tp_size` loads this version from."""
        if tp_size not in self.tp_sizes:
            raise ValueError(
                f"version {self.version} was not published for TP={tp_size} (has {self.tp_sizes})"
            )
        keys = [buffer_key(tp_size, rank) for rank in range(tp_size)]
        return LoadRequest(self.version, tuple(RankLoad(self.manifests[k], self.handles[k]) for k in keys))


class WeightPublisher:
    def __init__(
        self,
        plans: Mapping[int, TransferPlan],
        sender: WeightSender,
        dtype: torch.dtype,
        num_threads: int = 1,
        checksum_algorithm: str = "xor64",
    ) -> None:
        self.dtype_name = _dtype_name(dtype)
        if checksum_algorithm not in CHECKSUMS:
            raise ValueError(f"checksum_algorithm must be one of {CHECKSUMS}, got {checksum_algorithm!r}")
        for tp_size, plan in plans.items():
            _check_plan(tp_size, plan, dtype)
        self.plans = dict(plans)
        self.sender = sender
        self.dtype = dtype
        self.num_threads = num_threads
        self.checksum_algorithm = checksum_algorithm
        self.last_version = -1

    def add_plan(self, tp_size: int, plan: TransferPlan) -> None:
        """Publishes for one more TP size from the next version on (a bucket of a new size)."""
        _check_plan(tp_size, plan, self.dtype)
        self.plans[tp_size] = plan

    def publish(self, version: int, shards: Mapping[SourceKey, torch.Tensor]) -> Publication:
        """Writes every destination rank's buffer of `version` from the trainer's Megatron shards
        (keyed (tp rank, pp stage, Megatron name), all of the source layout's readable params).
        Versions must increase."""
        if version <= self.last_version:
            raise ValueError(f"version {version} must be greater than the last published {self.last_version}")
        start = time.perf_counter()
        manifests, handles = {}, {}
        for tp_size, plan in self.plans.items():
            for rank in range(tp_size):
                manifest = self._write_buffer(version, plan, rank, shards)
                manifests[manifest.key] = manifest
                handles[manifest.key] = self.sender.seal(manifest)
        self.last_version = version
        return Publication(version, manifests, handles, time.perf_counter() - start, tuple(self.plans))

    def _write_buffer(
        self, version: int, plan: TransferPlan, rank: int, shards: Mapping[SourceKey, torch.Tensor]
    ) -> BufferManifest:
        key = buffer_key(plan.num_ranks, rank)
        raw = self.sender.allocate(version, key, plan.rank_bytes(rank))
        flat = raw.view(self.dtype)
        size = plan.elem_size
        digests = []
        for bucket in plan.buckets(rank):
            execute(
                plan, rank, shards, flat[bucket.start : bucket.end], self.num_threads, bucket=bucket.index
            )
            piece = raw[bucket.start * size : bucket.end * size]
            digests.append(
                BucketDigest(bucket.start * size, bucket.end * size, checksum(piece, self.checksum_algorithm))
            )
        return BufferManifest(
            version=version,
            key=key,
            dtype=self.dtype_name,
            num_bytes=plan.rank_bytes(rank),
            buckets=tuple(digests),
            params=tuple(plan.params(rank)),
            checksum=self.checksum_algorithm,
        )

    def release(self, version: int) -> None:
        self.sender.release(version)


def _dtype_name(dtype: torch.dtype) -> str:
    # torch is imported here, not at the top: `libra.sync` is imported by processes that only read
    # manifests (the controller's, through the root config), and they need no torch.
    import torch

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {list(names)}, got {dtype}")
    return names[dtype]


def _check_plan(tp_size: int, plan: TransferPlan, dtype: torch.dtype) -> None:
    if plan.num_ranks != tp_size:
        raise ValueError(f"plan for TP={tp_size} has {plan.num_ranks} destination ranks")
    if plan.elem_size != dtype.itemsize:
        raise ValueError(
            f"plan for TP={tp_size} has {plan.elem_size}-byte elements, {dtype} has {dtype.itemsize}"
        )
