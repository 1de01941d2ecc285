"""Layout rules of the HF <-> Megatron converter, checked on hand-made tensors (no Megatron)."""

from __future__ import annotations

import pytest
import torch

from libra.model_spec import ModelSpec
from libra.training.hf_weights import (
    fuse_qkv,
    hf_to_megatron,
    local_spec_names,
    megatron_to_hf,
    merge_gate_up,
    split_qkv,
)
from libra.training.model import ModelArchitecture, padded_vocab_size


def arch(**kw) -> ModelArchitecture:
    base = dict(
        model_type="qwen3",
        vocab_size=300,
        hidden_size=8,
        ffn_hidden_size=12,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=3,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=True,
        qk_norm=True,
    )
    return ModelArchitecture(**{**base, **kw})


def random_hf(a: ModelArchitecture) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d = a.hidden_size, a.head_dim
    t = {
        "model.embed_tokens.weight": torch.randn(a.vocab_size, h, generator=g),
        "model.norm.weight": torch.randn(h, generator=g),
    }
    if not a.tie_word_embeddings:
        t["lm_head.weight"] = torch.randn(a.vocab_size, h, generator=g)
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (a.num_attention_heads * d, h),
            "self_attn.k_proj.weight": (a.num_query_groups * d, h),
            "self_attn.v_proj.weight": (a.num_query_groups * d, h),
            "self_attn.o_proj.weight": (h, a.num_attention_heads * d),
            "mlp.gate_proj.weight": (a.ffn_hidden_size, h),
            "mlp.up_proj.weight": (a.ffn_hidden_size, h),
            "mlp.down_proj.weight": (h, a.ffn_hidden_size),
        }
        if a.qkv_bias:
            shapes |= {
                "self_attn.q_proj.bias": (a.num_attention_heads * d,),
                "self_attn.k_proj.bias": (a.num_query_groups * d,),
                "self_attn.v_proj.bias": (a.num_query_groups * d,),
            }
        if a.qk_norm:
            shapes |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        t |= {p + k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    return t


def test_qkv_is_interleaved_per_query_group():
    a = arch(num_attention_heads=6, num_query_groups=2, head_dim=2)
    # Row r of q/k/v holds the value (tag, head, dim) so positions are readable.
    q = torch.tensor([[100 + 10 * hd + k] for hd in range(6) for k in range(2)], dtype=torch.float32)
    k = torch.tensor([[200 + 10 * g + j] for g in range(2) for j in range(2)], dtype=torch.float32)
    v = torch.tensor([[300 + 10 * g + j] for g in range(2) for j in range(2)], dtype=torch.float32)
    fused = fuse_qkv(q, k, v, a)[:, 0].tolist()
    # Group 0: q heads 0-2, k0, v0; group 1: q heads 3-5, k1, v1.
    want = [100, 101, 110, 111, 120, 121, 200, 201, 300, 301] + [
        130,
        131,
        140,
        141,
        150,
        151,
        210,
        211,
        310,
        311,
    ]
    assert fused == want
    back = split_qkv(fuse_qkv(q, k, v, a), a)
    assert all(torch.equal(x, y) for x, y in zip(back, (q, k, v), strict=False))


def test_tp_chunk_of_fused_qkv_is_whole_groups():
    a = arch()
    t = random_hf(a)
    shard = hf_to_megatron(t.__getitem__, a, tp_rank=1, tp_size=2, pp_rank=0, pp_size=1)
    rows = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, qpg = a.head_dim, a.heads_per_group
    q_g1 = t["model.layers.0.self_attn.q_proj.weight"][qpg * d :]
    k_g1 = t["model.layers.0.self_attn.k_proj.weight"][d:]
    assert torch.equal(rows[: qpg * d], q_g1) and torch.equal(rows[qpg * d : (qpg + 1) * d], k_g1)


def test_gate_up_is_concatenated_per_rank():
    a = arch()
    t = random_hf(a)
    shards = [hf_to_megatron(t.__getitem__, a, tp_rank=r, tp_size=2, pp_rank=0, pp_size=1) for r in range(2)]
    fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = t["model.layers.0.mlp.gate_proj.weight"], t["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1[:6], gate[6:]) and torch.equal(fc1[6:], up[6:])
    merged = merge_gate_up([s["decoder.layers.0.mlp.linear_fc1.weight"] for s in shards])
    assert torch.equal(merged[0], gate) and torch.equal(merged[1], up)


def test_row_parallel_splits_dim1_and_vocab_is_padded():
    a = arch()
    t = random_hf(a)
    s = hf_to_megatron(t.__getitem__, a, tp_rank=1, tp_size=2, pp_rank=0, pp_size=2)
    assert torch.equal(
        s["decoder.layers.0.mlp.linear_fc2.weight"], t["model.layers.0.mlp.down_proj.weight"][:, 6:]
    )
    padded = padded_vocab_size(300, 2)
    assert padded == 512
    emb = s["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 8)
    assert (
        torch.equal(emb[: 300 - 256], t["model.embed_tokens.weight"][256:])
        and emb[300 - 256 :].abs().sum() == 0
    )


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_exact_for_any_tp_pp(tie, tp, pp):
    a = arch(tie_word_embeddings=tie)
    t = random_hf(a)
    back: dict[str, torch.Tensor] = {}
    for p in range(pp):
        shards = [
            hf_to_megatron(t.__getitem__, a, tp_rank=r, tp_size=tp, pp_rank=p, pp_size=pp) for r in range(tp)
        ]
        if tie and pp > 1 and p == pp - 1:  # last stage's copy of the tied embedding
            assert torch.equal(
                torch.cat([s["output_layer.weight"] for s in shards])[:300], t["model.embed_tokens.weight"]
            )
        back |= megatron_to_hf(shards, a, pp_rank=p, pp_size=pp)
    assert set(back) == set(t)
    assert all(torch.equal(back[k], t[k]) for k in t)


@pytest.mark.parametrize("tp", [1, 2])
def test_transformer_engine_names_publish_as_the_local_specs(tp):
    """A model built with TE's layer spec (on a GPU with TE installed) names its norms inside the
    linear layers; publication's layouts know the local spec's names. The renaming gives back the
    local spec's parameters exactly, and the TE round trip through HF is exact too."""
    a = arch()
    t = random_hf(a)
    for r in range(tp):
        te = hf_to_megatron(t.__getitem__, a, tp_rank=r, tp_size=tp, pp_rank=0, pp_size=1, te_names=True)
        local = hf_to_megatron(t.__getitem__, a, tp_rank=r, tp_size=tp, pp_rank=0, pp_size=1)
        assert set(te) != set(local)
        renamed = local_spec_names(te, te_names=True)
        assert set(renamed) == set(local) and all(torch.equal(renamed[k], local[k]) for k in local)
    assert local_spec_names(local, te_names=False) is local
    shards = [
        hf_to_megatron(t.__getitem__, a, tp_rank=r, tp_size=tp, pp_rank=0, pp_size=1, te_names=True)
        for r in range(tp)
    ]
    back = megatron_to_hf(shards, a, pp_rank=0, pp_size=1, te_names=True)
    assert set(back) == set(t) and all(torch.equal(back[k], t[k]) for k in t)


LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "intermediate_size": 8,
    "vocab_size": 10,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"max_position_embeddings": None}, "max_position_embeddings"),
    ],
)
def test_architecture_from_spec_rejects_what_megatron_cannot_build(change, match):
    with pytest.raises(ValueError, match=match):
        ModelArchitecture.from_spec(ModelSpec.from_hf_dict({**LLAMA, **change}))


def test_architecture_from_spec_rejects_scaled_rope_of_a_transformers_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    )
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        ModelArchitecture.from_spec(ModelSpec.from_hf_dict(cfg.to_dict()))
