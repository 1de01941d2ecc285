"""Transfer plans on hand-checked layouts: run counts, coalescing, fills, buckets and errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from libra.sync import ModelShape, SyncConfig, build_transfer_plan, logical_tensors
from libra.sync.layouts import megatron_layout, megatron_vocab_size, vllm_layout, vllm_vocab_size
from tests.sync.helpers import plan_for

SHAPE = ModelShape(
    hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, ffn_hidden_size=8, vocab_size=100
)


def runs_of(plan, rank, name):
    slot = next(s for s in plan.params(rank) if s.name == name)
    runs = plan.runs(rank)
    inside = (runs[:, 2] >= slot.offset) & (runs[:, 2] < slot.offset + slot.numel)
    return runs[inside], slot


def test_vocab_padding_rules():
    assert megatron_vocab_size(100, tp_size=2, make_vocab_size_divisible_by=128) == 256
    assert megatron_vocab_size(151936, tp_size=1) == 151936
    assert vllm_vocab_size(100) == 128
    assert vllm_vocab_size(151936) == 151936


def test_same_layout_copies_each_param_in_few_runs():
    plan = plan_for(SHAPE, 1, 1, 1, torch.float32)
    runs, slot = runs_of(plan, 0, "model.layers.0.mlp.down_proj.weight")
    assert runs.tolist() == [[runs[0, 0], 0, slot.offset, slot.numel]]  # one contiguous copy
    # embed: the real rows in one copy, vLLM's padding rows (100 -> 128) as one zero fill.
    runs, slot = runs_of(plan, 0, "model.embed_tokens.weight")
    assert runs[:, 3].tolist() == [100 * 16, 28 * 16] and runs[1, 0] == -1
    # qkv: groups [q0 k0 v0 | q1 k1 v1] become [q0 q1 | k0 k1 | v0 v1]: 6 blocks, none adjacent in both.
    runs, _ = runs_of(plan, 0, "model.layers.0.self_attn.qkv_proj.weight")
    assert len(runs) == 6


def test_row_parallel_merge_produces_one_run_per_row_per_source():
    plan = plan_for(SHAPE, 2, 1, 1, torch.float32)
    runs, _ = runs_of(plan, 0, "model.layers.1.self_attn.o_proj.weight")
    assert len(runs) == 2 * SHAPE.hidden_size and set(runs[:, 3].tolist()) == {8}
    runs, _ = runs_of(plan, 0, "model.layers.1.mlp.gate_up_proj.weight")
    assert len(runs) == 4  # gate of rank 0, gate of rank 1, up of rank 0, up of rank 1


def test_row_parallel_split_reads_strided_rows():
    plan = plan_for(SHAPE, 1, 1, 2, torch.float32)
    runs, slot = runs_of(plan, 1, "model.layers.0.mlp.down_proj.weight")
    assert len(runs) == SHAPE.hidden_size
    assert runs[:, 1].tolist() == [row * 8 + 4 for row in range(16)]  # columns 4..7 of each source row
    assert runs[:, 2].tolist() == [slot.offset + row * 4 for row in range(16)]


def test_fills_cover_exactly_the_vocab_padding():
    shape = dataclasses.replace(SHAPE, vocab_size=70)  # vLLM pads to 128: rank 1 of 2 has 6 real rows
    plan = plan_for(shape, 2, 2, 2, torch.bfloat16)
    for rank, real_rows in ((0, 64), (1, 6)):
        runs, _ = runs_of(plan, rank, "lm_head.weight")
        fills = runs[runs[:, 0] == -1]
        assert fills[:, 3].sum() == (64 - real_rows) * 16


def test_buckets_split_on_param_boundaries():
    plan = plan_for(SHAPE, 2, 2, 2, torch.float32, bucket_bytes=600)
    for rank in range(2):
        slots = plan.params(rank)
        starts = {s.offset for s in slots}
        buckets = plan.buckets(rank)
        assert buckets[0].start == 0 and buckets[-1].end == plan.rank_numel(rank)
        native = plan.native.buckets(rank)
        for bucket, (_, _, first, last), following in zip(
            buckets, native, list(native[1:]) + [None], strict=True
        ):
            assert bucket.start in starts and (bucket.end in starts or bucket.end == plan.rank_numel(rank))
            assert bucket.numel * 4 <= 600 or len(bucket.param_names) == 1  # only a lone param may exceed
            runs = plan.runs(rank)[first:last]
            assert runs[:, 3].sum() == bucket.numel and runs[0, 2] == bucket.start
            if following is not None:
                assert following[2] == last
        merged = [b for b in buckets if len(b.param_names) > 1]
        assert merged, "small params should share buckets"


def test_tied_embeddings_have_no_lm_head_and_read_embed_tokens():
    shape = dataclasses.replace(SHAPE, tie_embeddings=True)
    plan = plan_for(shape, 2, 2, 1, torch.float32)
    names = [s.name for s in plan.params(0)]
    assert "lm_head.weight" not in names
    assert all(key.name != "output_layer.weight" for key in plan.source_keys)


def test_replicated_params_are_read_from_tp_rank_zero():
    plan = plan_for(SHAPE, 4, 1, 2, torch.float32)
    read = {key for rank in range(2) for key in plan.sources_read(rank)}
    norms = {key for key in read if "layernorm" in key.name}
    assert norms and all(key.tp_rank == 0 for key in norms)


def test_missing_source_shard_is_named():
    source = megatron_layout(SHAPE, 2, 1)
    del source.params[next(k for k in source.params if k.tp_rank == 1 and "linear_fc2" in k.name)]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight.*missing or overlapping"):
        build_transfer_plan(source, vllm_layout(SHAPE, 1), logical_tensors(SHAPE), 4)


def test_overlapping_sources_are_rejected():
    source = megatron_layout(SHAPE, 2, 1)
    for key, param in list(source.params.items()):
        source.params[key] = dataclasses.replace(param, replicated=False)  # both replicas readable
    with pytest.raises(ValueError, match="input_layernorm.*missing or overlapping"):
        build_transfer_plan(source, vllm_layout(SHAPE, 2), logical_tensors(SHAPE), 4)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: megatron_layout(SHAPE, 8, 1), "num_heads over Megatron TP"),
        (lambda: megatron_layout(SHAPE, 2, 3), "num_layers over Megatron PP"),
        (
            lambda: vllm_layout(dataclasses.replace(SHAPE, ffn_hidden_size=6), 4),
            "ffn_hidden_size over vLLM TP",
        ),
        (lambda: ModelShape(16, 2, 4, 3, 4, 8, 100), "num_kv_heads"),
        (lambda: ModelShape(16, 2, 4, 2, 4, 8, 0), "vocab_size"),
        (lambda: SyncConfig(bucket_bytes=0), "sync.bucket_bytes"),
        (lambda: SyncConfig(num_copy_threads=0), "sync.num_copy_threads"),
        (
            lambda: build_transfer_plan(
                megatron_layout(SHAPE, 1, 1), vllm_layout(SHAPE, 1), logical_tensors(SHAPE), 3
            ),
            "elem_size",
        ),
    ],
)
def test_invalid_inputs_raise_naming_the_field(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_plan_offsets_are_elements_and_bytes_scale_with_elem_size():
    fp32, bf16 = plan_for(SHAPE, 2, 1, 2, torch.float32), plan_for(SHAPE, 2, 1, 2, torch.bfloat16)
    assert np.array_equal(fp32.runs(1), bf16.runs(1))
    assert fp32.rank_bytes(1) == 2 * bf16.rank_bytes(1)
