"""Property test: for random shapes and (t, p) -> k, the C++ plan reproduces the reference exactly."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra.sync import ModelShape
from tests.sync.helpers import assert_matches_reference, plan_for, run_rank, run_rank_by_buckets
from tests.sync.reference_reshard import hf_to_vllm, make_megatron_shards, megatron_to_hf

TP_SIZES = [1, 2, 4, 8]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def cases(draw):
    tp, dst_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    pp = draw(st.sampled_from([1, 2, 3]))
    both = math.lcm(tp, dst_tp)
    num_kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    # nq must split over both TP sizes; heads_per_group 1 (MHA, nkv = nq) is reached when nkv >= both.
    heads_per_group = draw(st.sampled_from([1, 2, 3])) * max(1, both // num_kv_heads)
    # Megatron splits the fused QKV rows evenly; with t > nkv that needs head_dim to be even enough.
    head_dim = draw(st.sampled_from([2, 4, 8])) * max(1, tp // num_kv_heads)
    shape = ModelShape(
        hidden_size=draw(st.integers(2, 24)),
        num_layers=pp * draw(st.integers(1, 2)),
        num_heads=num_kv_heads * heads_per_group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=both * draw(st.integers(1, 5)),
        vocab_size=draw(st.integers(1, 400)),
        tie_embeddings=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
    )
    return dict(
        shape=shape,
        tp=tp,
        pp=pp,
        dst_tp=dst_tp,
        dtype=draw(st.sampled_from(DTYPES)),
        vocab_divisible_by=draw(st.sampled_from([1, 8, 128])),
        bucket_bytes=draw(st.sampled_from([64, 1000, 1 << 30])),
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_reproduces_reference_slicing(case):
    shape, tp, pp, dst_tp, dtype = case["shape"], case["tp"], case["pp"], case["dst_tp"], case["dtype"]
    shards = make_megatron_shards(shape, tp, pp, case["vocab_divisible_by"], dtype, case["seed"])
    expected = hf_to_vllm(megatron_to_hf(shards, shape, tp, pp), shape, dst_tp)
    plan = plan_for(shape, tp, pp, dst_tp, dtype, case["bucket_bytes"], case["vocab_divisible_by"])
    for rank in range(dst_tp):
        flat = run_rank(plan, rank, shards, dtype)
        assert_matches_reference(plan, rank, flat, expected[rank])
        assert torch.equal(run_rank_by_buckets(plan, rank, shards, dtype), flat)
