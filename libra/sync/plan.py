"""Transfer plans from a Megatron layout to a vLLM layout: a typed facade over the C++ planner.

`build_transfer_plan` hands both layouts, as block stacks (see layouts.py), to
`libra._native.reshard_build_plan`, which computes for every destination rank the contiguous copies
(source param, source offset, length -> destination offset, in elements) and zero fills that produce
its flat buffer, and splits that buffer into buckets on param boundaries. This module adds what a
receiver needs to use the buffer: each param's (offset, shape) and the buckets as typed slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra import _native
from libra.sync.layouts import DestLayout, ShardParam, SourceKey, SourceLayout


@dataclass(frozen=True)
class ParamSlot:
    """Where a destination param lives in its rank's flat buffer (offset in elements)."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class BucketSlice:
    """A piece [start, end) (elements) of a rank's flat buffer on param boundaries."""

    index: int
    start: int
    end: int
    param_names: tuple[str, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


def _block_tuples(param: ShardParam, tensor_ids: dict[str, int]) -> list[tuple[int, int, int, int, int]]:
    try:
        return [
            (tensor_ids[b.tensor], b.row_start, b.num_rows, b.col_start, b.num_cols) for b in param.blocks
        ]
    except KeyError as missing:
        raise ValueError(f"param {param.name!r} refers to unknown tensor {missing}") from None


class TransferPlan:
    """Copies that turn source shards into every destination rank's flat buffer.

    Built once per (model, source layout, destination layout, dtype); reused every publication.
    """

    def __init__(
        self,
        source: SourceLayout,
        dest: DestLayout,
        tensors: dict[str, tuple[int, int]],
        elem_size: int,
        bucket_bytes: int,
    ) -> None:
        if elem_size not in (1, 2, 4, 8):
            raise ValueError(f"elem_size must be 1, 2, 4 or 8 bytes, got {elem_size}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.source = source
        self.dest = dest
        self.elem_size = elem_size
        self.bucket_bytes = bucket_bytes
        self.source_keys: tuple[SourceKey, ...] = tuple(source.params)
        """Source params in the native plan's index order."""
        self.source_index = {key: i for i, key in enumerate(self.source_keys)}
        tensor_ids = {name: i for i, name in enumerate(tensors)}
        for rank, params in enumerate(dest.ranks):
            names = [p.name for p in params]
            if len(set(names)) != len(names):
                raise ValueError(f"destination rank {rank} lists a param twice")
        self._sources_read: dict[tuple[int, int], tuple[int, ...]] = {}
        self._native = _native.reshard_build_plan(
            tensor_shapes=list(tensors.values()),
            tensor_names=list(tensors),
            src_params=[_block_tuples(p, tensor_ids) for p in source.params.values()],
            src_readable=[not p.replicated for p in source.params.values()],
            dst_ranks=[[_block_tuples(p, tensor_ids) for p in params] for params in dest.ranks],
            elem_size=elem_size,
            bucket_bytes=bucket_bytes,
        )

    @property
    def native(self) -> _native.ReshardPlan:
        return self._native

    @property
    def num_ranks(self) -> int:
        return self.dest.tp_size

    def source_numel(self, key: SourceKey) -> int:
        return self._native.src_numels[self.source_index[key]]

    def rank_numel(self, rank: int) -> int:
        """Elements of the destination rank's flat buffer."""
        return self._native.rank_numel(rank)

    def rank_bytes(self, rank: int) -> int:
        return self.rank_numel(rank) * self.elem_size

    def params(self, rank: int) -> list[ParamSlot]:
        """The rank's params with their offsets, so a receiver can view tensors into the buffer."""
        offsets = self._native.param_offsets(rank)
        return [
            ParamSlot(p.name, off, p.shape) for p, off in zip(self.dest.ranks[rank], offsets, strict=True)
        ]

    def runs(self, rank: int) -> np.ndarray:
        """(n, 4) int64: source param index (-1: zero fill), source offset, destination offset, length."""
        return self._native.runs(rank)

    def buckets(self, rank: int) -> list[BucketSlice]:
        slots = self.params(rank)
        result = []
        for i, (start, end, _, _) in enumerate(self._native.buckets(rank).tolist()):
            names = tuple(s.name for s in slots if start <= s.offset < end)
            result.append(BucketSlice(i, start, end, names))
        return result

    def sources_read(self, rank: int, bucket: int | None = None) -> tuple[SourceKey, ...]:
        """The source params that the rank's (or one bucket's) copies read."""
        cache_key = (rank, -1 if bucket is None else bucket)
        if cache_key not in self._sources_read:
            runs = self.runs(rank)
            if bucket is not None:
                _, _, first, last = self._native.buckets(rank)[bucket]
                runs = runs[first:last]
            indices = np.unique(runs[:, 0])
            self._sources_read[cache_key] = tuple(int(i) for i in indices if i >= 0)
        return tuple(self.source_keys[i] for i in self._sources_read[cache_key])


def build_transfer_plan(
    source: SourceLayout,
    dest: DestLayout,
    tensors: dict[str, tuple[int, int]],
    elem_size: int,
    bucket_bytes: int = 512 << 20,
) -> TransferPlan:
    """Plan Megatron shards -> vLLM flat buffers; `tensors` is `layouts.logical_tensors(shape)`."""
    return TransferPlan(source, dest, tensors, elem_size, bucket_bytes)
