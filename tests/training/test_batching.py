"""Token-balanced DP shares and micro-batches (pure)."""

from __future__ import annotations

import random

import pytest

from libra.training.batching import make_micro_batches, pad_rows, split_across_ranks


def test_split_balances_tokens_and_covers_every_index():
    rng = random.Random(0)
    lengths = [rng.randint(5, 400) for _ in range(37)]
    shares = split_across_ranks(lengths, 4)
    assert sorted(i for s in shares for i in s) == list(range(37))
    loads = [sum(lengths[i] for i in s) for s in shares]
    # Longest-first greedy is within one longest item of perfect balance.
    assert max(loads) - min(loads) <= max(lengths)
    assert split_across_ranks(lengths, 4) == shares  # deterministic: every rank agrees


def test_split_leaves_the_last_ranks_empty_when_items_run_out():
    assert split_across_ranks([3, 9], 4) == [[1], [0], [], []]
    with pytest.raises(ValueError, match="num_ranks"):
        split_across_ranks([3], 0)


def test_micro_batches_respect_the_token_budget():
    rng = random.Random(1)
    lengths = [rng.randint(1, 60) for _ in range(50)]
    batches = make_micro_batches(range(50), lengths, max_tokens=128)
    assert sorted(i for b in batches for i in b.indices) == list(range(50))
    for b in batches:
        assert b.padded_length == max(lengths[i] for i in b.indices)
        assert b.num_padded_tokens <= 128
    # Sorting by length keeps padding small: under 25 % of the padded tokens here.
    padding = sum(b.num_padded_tokens for b in batches) - sum(lengths)
    assert padding < 0.25 * sum(b.num_padded_tokens for b in batches)


def test_row_longer_than_budget_gets_its_own_micro_batch():
    batches = make_micro_batches([0, 1, 2], [300, 10, 10], max_tokens=64)
    assert [b.indices for b in batches] == [(0,), (1, 2)]


def test_pad_rows():
    out = pad_rows([[1, 2, 3], [4]], 4, value=0)
    assert out.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    with pytest.raises(ValueError, match="row 0"):
        pad_rows([[1, 2, 3]], 2)
