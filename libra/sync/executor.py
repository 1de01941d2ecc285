"""Runs a transfer plan for one destination rank: validation here, the copies in C++.

The native executor trusts raw addresses, so every buffer is checked first: each source param the
rank (or bucket) reads must be present, C-contiguous, on the CPU, of the plan's element size and of
exactly the param's size; the destination must be writable and exactly the rank's (or bucket's)
size. Errors name the param and the expected size. The copies run on `num_threads` std::threads
with the GIL released.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from libra import _native
from libra.sync.layouts import SourceKey
from libra.sync.plan import TransferPlan


def _address(buffer: Any, what: str, expected_bytes: int, elem_size: int, writable: bool) -> int:
    """The data address of a torch tensor, numpy array or buffer-protocol object, after checks."""
    if hasattr(buffer, "data_ptr") and hasattr(
        buffer, "element_size"
    ):  # torch.Tensor, without importing torch
        if buffer.device.type != "cpu":
            raise ValueError(f"{what}: tensor is on {buffer.device}, the executor copies CPU memory")
        if not buffer.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous")
        if buffer.element_size() != elem_size:
            raise ValueError(f"{what}: element size {buffer.element_size()} bytes, the plan uses {elem_size}")
        size, address = buffer.numel() * elem_size, buffer.data_ptr()
    else:
        array = (
            buffer if isinstance(buffer, np.ndarray) else np.frombuffer(memoryview(buffer), dtype=np.uint8)
        )
        if not array.flags.c_contiguous:
            raise ValueError(f"{what}: array is not C-contiguous")
        if isinstance(buffer, np.ndarray) and array.itemsize != elem_size:
            raise ValueError(f"{what}: element size {array.itemsize} bytes, the plan uses {elem_size}")
        if writable and not array.flags.writeable:
            raise ValueError(f"{what}: buffer is read-only")
        size, address = array.nbytes, array.ctypes.data
    if size != expected_bytes:
        raise ValueError(
            f"{what}: {size} bytes, expected {expected_bytes} "
            f"({expected_bytes // elem_size} elements of {elem_size} bytes)"
        )
    return address


def execute(
    plan: TransferPlan,
    dst_rank: int,
    src_buffers: Mapping[SourceKey | tuple[int, int, str], Any],
    dst: Any,
    num_threads: int = 1,
    bucket: int | None = None,
) -> None:
    """Fill `dst` with destination rank `dst_rank`'s flat buffer (or one bucket of it).

    src_buffers maps (tp rank, pp stage, Megatron param name) to that shard; only the shards the
    rank (bucket) reads are needed. dst is the rank's whole flat buffer, or, with `bucket`, a buffer
    of exactly that bucket's size.
    """
    if not 0 <= dst_rank < plan.num_ranks:
        raise ValueError(f"dst_rank={dst_rank} is outside the plan's {plan.num_ranks} destination ranks")
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    buckets = plan.native.buckets(dst_rank)
    if bucket is not None and not 0 <= bucket < len(buckets):
        raise ValueError(f"bucket={bucket} is outside rank {dst_rank}'s {len(buckets)} buckets")

    es = plan.elem_size
    src_ptrs = [0] * len(plan.source_keys)
    for key in plan.sources_read(dst_rank, bucket):
        label = f"source (tp={key.tp_rank}, pp={key.pp_rank}) {key.name!r}"
        if key not in src_buffers:
            raise ValueError(f"{label} is missing from src_buffers")
        src_ptrs[plan.source_index[key]] = _address(
            src_buffers[key], label, plan.source_numel(key) * es, es, writable=False
        )
    if bucket is None:
        dst_bytes, label = plan.rank_bytes(dst_rank), f"destination buffer of rank {dst_rank}"
    else:
        start, end = int(buckets[bucket][0]), int(buckets[bucket][1])
        dst_bytes, label = (end - start) * es, f"destination bucket {bucket} of rank {dst_rank}"
    dst_ptr = _address(dst, label, dst_bytes, es, writable=True)
    _native.reshard_execute(
        plan.native,
        dst_rank,
        src_ptrs,
        dst_ptr,
        num_threads,
        -1 if bucket is None else bucket,
        bucket is not None,
    )
