"""The trainer side of weight publication, run inside every train rank.

Each rank holds its Megatron shard of the model, keyed (tp rank, pp stage, name). One publishing
rank (global rank 0) owns the `WeightPublisher`: when the model is split (TP or PP > 1) the other
ranks of the first data-parallel replica send it their shards over the trainer's existing
torch.distributed group (every rank takes part in the gather, so the collective lines up; ranks of
other DP replicas send nothing); at TP = PP = 1 rank 0 already holds everything and nothing moves.
The publisher reshards straight from the shards into each rollout TP size's flat buffers in
shared memory (plans built once per TP size, on first use) and returns what instances load.

Shared memory reaches instances on the trainer's host only; see `libra.sync.grpc_stream` and
`collective` for the others (not wired into the job yet).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from libra.sync.config import SyncConfig
from libra.sync.layouts import ModelShape, SourceKey, logical_tensors, megatron_layout, vllm_layout
from libra.sync.load_request import LoadRequest
from libra.sync.plan import build_transfer_plan
from libra.sync.publisher import WeightPublisher
from libra.sync.shm import ShmSender
from libra.sync.transport import WeightSender


@dataclass(frozen=True)
class SourceRank:
    """Where this train rank sits in the trainer's parallel layout."""

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int

    @property
    def is_publisher(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class PublishedWeights:
    version: int
    loads: dict[int, LoadRequest]
    """Per rollout TP size; empty on ranks that do not publish."""
    gather_seconds: float
    publish_seconds: float


class TrainerPublisher:
    def __init__(
        self,
        shape: ModelShape,
        source: SourceRank,
        sync: SyncConfig,
        megatron_vocab_divisible_by: int,
        sender: WeightSender | None = None,
    ) -> None:
        self.shape = shape
        self.source = source
        self.sync = sync
        self.vocab_divisible_by = megatron_vocab_divisible_by
        self._sender = sender
        self._publisher: WeightPublisher | None = None
        self._source_layout = megatron_layout(
            shape, source.tp_size, source.pp_size, megatron_vocab_divisible_by
        )

    def publish(
        self,
        version: int,
        tp_sizes: Iterable[int],
        params: Mapping[str, torch.Tensor],
        release_versions: Iterable[int] = (),
    ) -> PublishedWeights:
        """Publishes this rank's `params` (Megatron names) as `version` for every TP size in
        `tp_sizes`, after freeing the buffers of `release_versions`. Call on every rank."""
        tp_sizes = sorted(set(tp_sizes))
        if not tp_sizes or any(k < 1 for k in tp_sizes):
            raise ValueError(f"tp_sizes must list rollout TP sizes >= 1, got {tp_sizes}")
        started = time.perf_counter()
        shards = self._gather(params)
        gathered = time.perf_counter()
        if shards is None:
            return PublishedWeights(version, {}, gathered - started, 0.0)
        publisher = self._publisher_for(tp_sizes, next(iter(shards.values())).dtype)
        for old in release_versions:
            publisher.release(old)
        publication = publisher.publish(version, shards)
        loads = {k: publication.load_request(k) for k in tp_sizes}
        return PublishedWeights(version, loads, gathered - started, time.perf_counter() - gathered)

    def _gather(self, params: Mapping[str, torch.Tensor]) -> dict[SourceKey, torch.Tensor] | None:
        """Every shard of the model on the publishing rank (None elsewhere)."""
        s = self.source
        # The executor copies CPU memory; on a GPU this is the device-to-host copy (a no-op on CPU).
        local = {name: p.detach().to("cpu").contiguous() for name, p in params.items()}
        if s.tp_size * s.pp_size == 1:
            if not s.is_publisher:
                return None
            return {SourceKey(0, 0, name): tensor for name, tensor in local.items()}
        import torch.distributed as dist

        # One data-parallel replica holds the whole model; the others would only send copies.
        mine = (s.tp_rank, s.pp_rank, local) if s.dp_rank == 0 else None
        gathered: list | None = [None] * dist.get_world_size() if s.is_publisher else None
        dist.gather_object(mine, gathered, dst=0)
        if not s.is_publisher:
            return None
        return {
            SourceKey(tp_rank, pp_rank, name): tensor
            for part in gathered
            if part is not None
            for tp_rank, pp_rank, tensors in [part]
            for name, tensor in tensors.items()
        }

    def _publisher_for(self, tp_sizes: list[int], dtype: torch.dtype) -> WeightPublisher:
        if self._publisher is None:
            self._publisher = WeightPublisher(
                {},
                self._sender or ShmSender(),
                dtype,
                num_threads=self.sync.num_copy_threads,
            )
        if dtype != self._publisher.dtype:
            raise ValueError(f"trainer params are {dtype}, earlier versions were {self._publisher.dtype}")
        for k in tp_sizes:
            if k not in self._publisher.plans:
                plan = build_transfer_plan(
                    self._source_layout,
                    vllm_layout(self.shape, k),
                    logical_tensors(self.shape),
                    dtype.itemsize,
                    self.sync.bucket_bytes,
                )
                self._publisher.add_plan(k, plan)
        return self._publisher

    def close(self) -> None:
        """Frees every published buffer (the shm files)."""
        if self._publisher is not None:
            self._publisher.sender.close()
