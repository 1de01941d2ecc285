"""Plain-torch reference for resharding, independent of libra.sync's block machinery.

Megatron shards are generated with their own shapes, un-sharded into full HF tensors by plain
slicing (cat over TP, un-interleave QKV per KV group, split gate/up, strip vocab padding), and
re-sharded by vLLM's own slicing rules (weight_loader of QKVParallelLinear, MergedColumnParallel,
RowParallel, VocabParallelEmbedding).
"""

from __future__ import annotations

import torch

from libra.sync.layouts import ModelShape


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def make_megatron_shards(
    shape: ModelShape, tp: int, pp: int, vocab_divisible_by: int, dtype: torch.dtype, seed: int
) -> dict[tuple[int, int, str], torch.Tensor]:
    """Random Megatron shards keyed (tp rank, pp stage, name); replicated params equal on all TP ranks."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    v_pad = _round_up(shape.vocab_size, vocab_divisible_by * tp)
    per_stage = shape.num_layers // pp
    shards: dict[tuple[int, int, str], torch.Tensor] = {}
    for s in range(pp):
        replicated = {}
        for i in range(per_stage):
            prefix = f"decoder.layers.{i}."
            replicated[prefix + "input_layernorm.weight"] = rand(h)
            replicated[prefix + "pre_mlp_layernorm.weight"] = rand(h)
            if shape.qk_norm:
                replicated[prefix + "self_attention.q_layernorm.weight"] = rand(d)
                replicated[prefix + "self_attention.k_layernorm.weight"] = rand(d)
        if s == pp - 1:
            replicated["decoder.final_layernorm.weight"] = rand(h)
        for r in range(tp):
            for name, value in replicated.items():
                shards[(r, s, name)] = value.clone()
            if s == 0:
                shards[(r, s, "embedding.word_embeddings.weight")] = rand(v_pad // tp, h)
            for i in range(per_stage):
                prefix = f"decoder.layers.{i}."
                shards[(r, s, prefix + "self_attention.linear_qkv.weight")] = rand(qkv // tp, h)
                if shape.qkv_bias:
                    shards[(r, s, prefix + "self_attention.linear_qkv.bias")] = rand(qkv // tp)
                shards[(r, s, prefix + "self_attention.linear_proj.weight")] = rand(
                    h, shape.num_heads * d // tp
                )
                shards[(r, s, prefix + "mlp.linear_fc1.weight")] = rand(2 * f // tp, h)
                shards[(r, s, prefix + "mlp.linear_fc2.weight")] = rand(h, f // tp)
            if s == pp - 1 and not shape.tie_embeddings:
                shards[(r, s, "output_layer.weight")] = rand(v_pad // tp, h)
    return shards


def megatron_to_hf(
    shards: dict[tuple[int, int, str], torch.Tensor], shape: ModelShape, tp: int, pp: int
) -> dict[str, torch.Tensor]:
    """Full HF-named tensors from Megatron shards."""

    def cat(stage: int, name: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[(r, stage, name)] for r in range(tp)], dim=dim)

    v, d, hq = shape.vocab_size, shape.head_dim, shape.heads_per_group
    per_stage = shape.num_layers // pp
    hf = {"model.embed_tokens.weight": cat(0, "embedding.word_embeddings.weight", 0)[:v]}
    for s in range(pp):
        for i in range(per_stage):
            mg, p = f"decoder.layers.{i}.", f"model.layers.{s * per_stage + i}."
            hf[p + "input_layernorm.weight"] = shards[(0, s, mg + "input_layernorm.weight")]
            hf[p + "post_attention_layernorm.weight"] = shards[(0, s, mg + "pre_mlp_layernorm.weight")]
            for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
                fused = cat(s, mg + f"self_attention.linear_qkv.{suffix}", 0)
                grouped = fused.reshape(shape.num_kv_heads, (hq + 2) * d, *fused.shape[1:])
                q, k, val = grouped.split([hq * d, d, d], dim=1)
                hf[p + f"self_attn.q_proj.{suffix}"] = q.reshape(shape.num_heads * d, *fused.shape[1:])
                hf[p + f"self_attn.k_proj.{suffix}"] = k.reshape(shape.num_kv_heads * d, *fused.shape[1:])
                hf[p + f"self_attn.v_proj.{suffix}"] = val.reshape(shape.num_kv_heads * d, *fused.shape[1:])
            if shape.qk_norm:
                hf[p + "self_attn.q_norm.weight"] = shards[(0, s, mg + "self_attention.q_layernorm.weight")]
                hf[p + "self_attn.k_norm.weight"] = shards[(0, s, mg + "self_attention.k_layernorm.weight")]
            hf[p + "self_attn.o_proj.weight"] = cat(s, mg + "self_attention.linear_proj.weight", 1)
            gate_up = [shards[(r, s, mg + "mlp.linear_fc1.weight")].chunk(2, dim=0) for r in range(tp)]
            hf[p + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up], dim=0)
            hf[p + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up], dim=0)
            hf[p + "mlp.down_proj.weight"] = cat(s, mg + "mlp.linear_fc2.weight", 1)
    hf["model.norm.weight"] = shards[(0, pp - 1, "decoder.final_layernorm.weight")]
    if not shape.tie_embeddings:
        hf["lm_head.weight"] = cat(pp - 1, "output_layer.weight", 0)[:v]
    return hf


def hf_to_vllm(hf: dict[str, torch.Tensor], shape: ModelShape, tp: int) -> list[dict[str, torch.Tensor]]:
    """Per vLLM TP rank, its params by vLLM's slicing rules."""
    v, h, d = shape.vocab_size, shape.hidden_size, shape.head_dim
    v_pad = _round_up(v, 64)
    q_size = shape.num_heads // tp * d
    if tp >= shape.num_kv_heads:
        kv_heads, kv_replicas = 1, tp // shape.num_kv_heads
    else:
        kv_heads, kv_replicas = shape.num_kv_heads // tp, 1
    f_local = shape.ffn_hidden_size // tp

    def vocab_shard(full: torch.Tensor, rank: int) -> torch.Tensor:
        per = v_pad // tp
        start, end = min(rank * per, v), min((rank + 1) * per, v)
        out = torch.zeros(per, h, dtype=full.dtype)
        out[: end - start] = full[start:end]
        return out

    ranks = []
    for j in range(tp):
        out = {"model.embed_tokens.weight": vocab_shard(hf["model.embed_tokens.weight"], j)}
        kv_start = (j // kv_replicas) * kv_heads * d
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
            out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
            for suffix in ("weight", "bias") if shape.qkv_bias else ("weight",):
                out[p + f"self_attn.qkv_proj.{suffix}"] = torch.cat(
                    [
                        hf[p + f"self_attn.q_proj.{suffix}"][j * q_size : (j + 1) * q_size],
                        hf[p + f"self_attn.k_proj.{suffix}"][kv_start : kv_start + kv_heads * d],
                        hf[p + f"self_attn.v_proj.{suffix}"][kv_start : kv_start + kv_heads * d],
                    ]
                )
            if shape.qk_norm:
                out[p + "self_attn.q_norm.weight"] = hf[p + "self_attn.q_norm.weight"]
                out[p + "self_attn.k_norm.weight"] = hf[p + "self_attn.k_norm.weight"]
            out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"][
                :, j * q_size : (j + 1) * q_size
            ]
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [
                    hf[p + "mlp.gate_proj.weight"][j * f_local : (j + 1) * f_local],
                    hf[p + "mlp.up_proj.weight"][j * f_local : (j + 1) * f_local],
                ]
            )
            out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"][
                :, j * f_local : (j + 1) * f_local
            ]
        out["model.norm.weight"] = hf["model.norm.weight"]
        if not shape.tie_embeddings:
            out["lm_head.weight"] = vocab_shard(hf["lm_head.weight"], j)
        ranks.append(out)
    return ranks
