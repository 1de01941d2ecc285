"""Shared helpers for the resharding tests: run a plan into torch buffers and compare bitwise."""

from __future__ import annotations

import torch

from libra.sync import ModelShape, TransferPlan, build_transfer_plan, execute, logical_tensors
from libra.sync.layouts import megatron_layout, vllm_layout

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SENTINEL = 123.0  # fills buffers before a run, so an element the plan never writes shows up


def plan_for(
    shape: ModelShape,
    tp: int,
    pp: int,
    dst_tp: int,
    dtype: torch.dtype,
    bucket_bytes: int = 1 << 30,
    vocab_divisible_by: int = 128,
) -> TransferPlan:
    return build_transfer_plan(
        megatron_layout(shape, tp, pp, vocab_divisible_by),
        vllm_layout(shape, dst_tp),
        logical_tensors(shape),
        torch.empty((), dtype=dtype).element_size(),
        bucket_bytes,
    )


def run_rank(
    plan: TransferPlan, rank: int, shards: dict, dtype: torch.dtype, num_threads: int = 1
) -> torch.Tensor:
    flat = torch.full((plan.rank_numel(rank),), SENTINEL, dtype=dtype)
    execute(plan, rank, shards, flat, num_threads=num_threads)
    return flat


def run_rank_by_buckets(plan: TransferPlan, rank: int, shards: dict, dtype: torch.dtype) -> torch.Tensor:
    """The rank's buffer assembled from bucket-sized pieces, each executed into its own buffer."""
    pieces = []
    for bucket in plan.buckets(rank):
        piece = torch.full((bucket.numel,), SENTINEL, dtype=dtype)
        execute(
            plan,
            rank,
            {k: shards[k] for k in plan.sources_read(rank, bucket.index)},
            piece,
            bucket=bucket.index,
        )
        pieces.append(piece)
    return torch.cat(pieces)


def assert_matches_reference(
    plan: TransferPlan, rank: int, flat: torch.Tensor, expected: dict[str, torch.Tensor]
) -> None:
    """Every param viewed out of the flat buffer equals the reference bit for bit."""
    slots = plan.params(rank)
    assert {s.name for s in slots} == set(expected), "destination params differ from vLLM's"
    assert slots[-1].offset + slots[-1].numel == flat.numel(), "params do not tile the flat buffer"
    as_int = INT_VIEW[flat.element_size()]
    for slot in slots:
        got = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        want = expected[slot.name]
        assert got.shape == want.shape, f"{slot.name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got.view(as_int), want.contiguous().view(as_int)), f"{slot.name} differs"
