"""Token-balanced micro-batches from variable-length trajectories.

Two decisions, both deterministic (every rank of a job computes the same plan from the same batch,
so TP and PP peers agree without talking):

1. Split the global batch over the DP ranks so each gets about the same number of tokens
   (longest-first greedy onto the least-loaded rank): attention and MLP cost scale with tokens,
   not with trajectories.
2. Within a rank, cut its share into micro-batches whose padded size (rows x longest row) stays
   within `max_tokens`; rows are sorted by length first so that padding is small. A row longer
   than the budget gets a micro-batch of its own.

Rows are right-padded (the CPU path: the local attention has no packed-sequence kernel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    indices: tuple[int, ...]
    """Positions in the global batch, longest first."""
    padded_length: int

    @property
    def num_padded_tokens(self) -> int:
        return len(self.indices) * self.padded_length


def split_across_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Indices per rank, balanced by token count (ties go to the lower rank). With fewer items
    than ranks (a mini-batch thinned by stale or no-variance drops) the last ranks get none."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    loads = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(share) for share in shares]


def make_micro_batches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[MicroBatch]:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    batches: list[MicroBatch] = []
    current: list[int] = []
    for index in ordered:
        longest = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(MicroBatch(tuple(current), longest))
            current = []
        current.append(index)
    if current:
        batches.append(MicroBatch(tuple(current), lengths[current[0]]))
    return batches


def pad_rows(
    rows: Sequence[Sequence[float]], length: int, value: float = 0, dtype=torch.long
) -> torch.Tensor:
    """[len(rows), length], row i = rows[i] then `value`."""
    out = torch.full((len(rows), length), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row) > length:
            raise ValueError(f"row {i} has {len(row)} entries, more than the padded length {length}")
        out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out
