"""The executor: buffer validation, buffer kinds, threads and bucket-sized destinations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libra.sync import ModelShape, execute
from tests.sync.helpers import assert_matches_reference, plan_for, run_rank, run_rank_by_buckets
from tests.sync.reference_reshard import hf_to_vllm, make_megatron_shards, megatron_to_hf

SHAPE = ModelShape(
    hidden_size=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    ffn_hidden_size=8,
    vocab_size=100,
    qkv_bias=True,
)
# Big enough (~6 MB per rank in fp32) that the executor really splits the copies over threads.
WIDE = ModelShape(
    hidden_size=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    ffn_hidden_size=512,
    vocab_size=5003,
    qk_norm=True,
)


@pytest.fixture(scope="module")
def small():
    shards = make_megatron_shards(SHAPE, 2, 1, 128, torch.float32, seed=3)
    return plan_for(SHAPE, 2, 1, 1, torch.float32), shards


@pytest.mark.parametrize(("tp", "dst_tp"), [(2, 1), (1, 2), (2, 4)])
def test_threads_give_identical_results(tp, dst_tp):
    shards = make_megatron_shards(WIDE, tp, 1, 128, torch.float32, seed=tp)
    expected = hf_to_vllm(megatron_to_hf(shards, WIDE, tp, 1), WIDE, dst_tp)
    plan = plan_for(WIDE, tp, 1, dst_tp, torch.float32, bucket_bytes=1 << 20)
    for rank in range(dst_tp):
        single = run_rank(plan, rank, shards, torch.float32, num_threads=1)
        assert_matches_reference(plan, rank, single, expected[rank])
        for threads in (2, 3, 4):
            assert torch.equal(run_rank(plan, rank, shards, torch.float32, num_threads=threads), single)
        assert torch.equal(run_rank_by_buckets(plan, rank, shards, torch.float32), single)


def test_numpy_and_buffer_protocol_sources(small):
    plan, shards = small
    expected = run_rank(plan, 0, shards, torch.float32)
    as_numpy = {k: v.numpy() for k, v in shards.items()}
    as_bytes = {k: v.numpy().tobytes() for k, v in shards.items()}  # read-only buffer protocol objects
    dst_numpy = np.zeros(plan.rank_numel(0), dtype=np.float32)
    execute(plan, 0, as_numpy, dst_numpy)
    dst_bytes = bytearray(plan.rank_bytes(0))
    execute(plan, 0, as_bytes, dst_bytes, num_threads=2)
    assert np.array_equal(dst_numpy, expected.numpy())
    assert bytes(dst_bytes) == expected.numpy().tobytes()


def test_missing_source_is_named(small):
    plan, shards = small
    key = next(k for k in shards if k[2].endswith("linear_fc2.weight") and k[0] == 1)
    partial = {k: v for k, v in shards.items() if k != key}
    with pytest.raises(
        ValueError, match=r"source \(tp=1, pp=0\) 'decoder.layers.\d.mlp.linear_fc2.weight' is missing"
    ):
        execute(plan, 0, partial, torch.empty(plan.rank_numel(0)))


def test_wrong_source_size_names_param_and_expected_size(small):
    plan, shards = small
    key = (0, 0, "decoder.layers.1.self_attention.linear_qkv.bias")
    bad = dict(shards)
    bad[key] = torch.zeros(shards[key].numel() + 1)
    expected = shards[key].numel() * 4
    with pytest.raises(ValueError, match=rf"linear_qkv.bias.*{expected + 4} bytes, expected {expected}"):
        execute(plan, 0, bad, torch.empty(plan.rank_numel(0)))


@pytest.mark.parametrize(
    ("make_dst", "match"),
    [
        (lambda n: torch.empty(n + 1), "destination buffer of rank 0"),
        (lambda n: torch.empty(n, dtype=torch.bfloat16), "element size 2 bytes"),
        (lambda n: torch.empty(2 * n)[::2], "not contiguous"),
        (lambda n: bytes(4 * n), "read-only"),
        (lambda n: np.empty(n, dtype=np.float64), "element size 8 bytes"),
    ],
)
def test_bad_destination_buffers(small, make_dst, match):
    plan, shards = small
    with pytest.raises(ValueError, match=match):
        execute(plan, 0, shards, make_dst(plan.rank_numel(0)))


def test_bad_source_dtype_and_indices(small):
    plan, shards = small
    dst = torch.empty(plan.rank_numel(0))
    with pytest.raises(ValueError, match="element size 2 bytes, the plan uses 4"):
        execute(plan, 0, {k: v.to(torch.bfloat16) for k, v in shards.items()}, dst)
    with pytest.raises(ValueError, match="dst_rank=1"):
        execute(plan, 1, shards, dst)
    with pytest.raises(ValueError, match="bucket=99"):
        execute(plan, 0, shards, dst, bucket=99)
    with pytest.raises(ValueError, match="num_threads"):
        execute(plan, 0, shards, dst, num_threads=0)


def test_bucket_destination_must_be_bucket_sized(small):
    _, shards = small
    plan = plan_for(SHAPE, 2, 1, 1, torch.float32, bucket_bytes=256)
    assert len(plan.buckets(0)) > 1
    with pytest.raises(ValueError, match="destination bucket 0 of rank 0"):
        execute(plan, 0, shards, torch.empty(plan.rank_numel(0)), bucket=0)
