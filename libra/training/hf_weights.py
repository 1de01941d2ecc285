"""Hugging Face <-> Megatron-core weights, for any TP/PP (Llama, Qwen2, Qwen3).

Layout rules (local spec; each checked in tests/training/test_hf_weights.py):

- QKV: Megatron fuses q, k, v into `linear_qkv`, interleaved **per query group**: viewed as
  `[groups, heads_per_group + 2, head_dim, hidden]`, group g holds its q heads, then k_g, then v_g.
  A contiguous dim-0 chunk per TP rank is therefore a set of whole groups. Biases likewise.
- Gate/up: `linear_fc1` is `[gate; up]` **per TP rank**: rank r holds `[gate_r; up_r]`, so the
  full fc1 is not a plain concatenation of the rank shards.
- Column-parallel (qkv, fc1) split dim 0; row-parallel (`linear_proj`, `linear_fc2`) split dim 1;
  norms are replicated.
- Vocab-parallel (`word_embeddings`, `output_layer`) split dim 0 of the vocabulary padded to a
  multiple of 128 x TP; padding rows are zero on import and stripped on export.
- Tied embeddings: without PP the output layer reuses the embedding; with PP the last stage holds
  its own copy (`output_layer.weight`) of the embedding shard.
- Layers: stage p holds HF layers [p * L/PP, (p+1) * L/PP) as local indices 0..L/PP-1.
- Transformer-Engine spec names the norms `linear_qkv.layer_norm_weight` and
  `linear_fc1.layer_norm_weight` instead of `input_layernorm` / `pre_mlp_layernorm`.

Shape legend in names: `_H` hidden, `_V` vocabulary, `_F` ffn, `_QKV` fused attention rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from libra.training.model import ModelArchitecture, padded_vocab_size

HF_EMBED = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"


def _layer_names(te_names: bool) -> dict[str, str]:
    if te_names:
        return {
            "input_norm": "self_attention.linear_qkv.layer_norm_weight",
            "mlp_norm": "mlp.linear_fc1.layer_norm_weight",
        }
    return {"input_norm": "input_layernorm.weight", "mlp_norm": "pre_mlp_layernorm.weight"}


def local_spec_names(params: dict[str, torch.Tensor], te_names: bool) -> dict[str, torch.Tensor]:
    """`params` keyed by the local layer spec's names, which weight publication's layouts
    (`libra.sync.layouts.megatron_layout`) use: Transformer Engine's spec fuses each norm into the
    linear layer after it and names it there; the tensors themselves are the same."""
    if not te_names:
        return params
    te, local = _layer_names(True), _layer_names(False)
    suffixes = {"." + te[key]: "." + local[key] for key in te}
    return {_renamed(name, suffixes): tensor for name, tensor in params.items()}


def _renamed(name: str, suffixes: dict[str, str]) -> str:
    for old, new in suffixes.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


# -- layout rules (pure) ------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArchitecture) -> torch.Tensor:
    """HF q [heads*d, ...], k and v [groups*d, ...] -> Megatron's group-interleaved fused qkv
    (works for weights [rows, hidden] and biases [rows])."""
    groups, per_group, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    tail = q.shape[1:]
    q_G = q.reshape(groups, per_group * d, *tail)
    k_G = k.reshape(groups, d, *tail)
    v_G = v.reshape(groups, d, *tail)
    return torch.cat([q_G, k_G, v_G], dim=1).reshape(groups * (per_group + 2) * d, *tail)


def split_qkv(qkv: torch.Tensor, arch: ModelArchitecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv` for the full (all-TP) fused tensor."""
    groups, per_group, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    tail = qkv.shape[1:]
    qkv_G = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(qkv_G, [per_group * d, d, d], dim=1)
    return (
        q.reshape(groups * per_group * d, *tail),
        k.reshape(groups * d, *tail),
        v.reshape(groups * d, *tail),
    )


def shard_gate_up(gate_FH: torch.Tensor, up_FH: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank r's `linear_fc1` shard: [gate_r; up_r]."""
    return torch.cat([gate_FH.chunk(tp_size, dim=0)[tp_rank], up_FH.chunk(tp_size, dim=0)[tp_rank]], dim=0)


def merge_gate_up(fc1_shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' `linear_fc1` shards -> full (gate, up)."""
    halves = [shard.chunk(2, dim=0) for shard in fc1_shards]
    return torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)


def pad_vocab(weight_VH: torch.Tensor, padded_size: int) -> torch.Tensor:
    extra = padded_size - weight_VH.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {weight_VH.shape[0]} rows does not fit padded size {padded_size}")
    return torch.cat([weight_VH, weight_VH.new_zeros(extra, *weight_VH.shape[1:])], dim=0)


# -- HF -> one Megatron rank --------------------------------------------------------------------


def hf_to_megatron(
    get_hf: Callable[[str], torch.Tensor],
    arch: ModelArchitecture,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    te_names: bool = False,
) -> dict[str, torch.Tensor]:
    """The Megatron parameters of rank (tp_rank, pp_rank), named as in `model.named_parameters()`.

    `get_hf(name)` returns one full HF tensor; it is called only for the names this rank needs,
    so a lazy safetensors reader keeps memory at one stage's worth."""
    names = _layer_names(te_names)
    vocab = padded_vocab_size(arch.vocab_size, tp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}

    def vocab_shard(name: str) -> torch.Tensor:
        return pad_vocab(get_hf(name), vocab).chunk(tp_size, dim=0)[tp_rank]

    if first:
        out["embedding.word_embeddings.weight"] = vocab_shard(HF_EMBED)
    layers_per_stage = arch.num_layers // pp_size
    for local in range(layers_per_stage):
        hf = f"model.layers.{pp_rank * layers_per_stage + local}."
        mg = f"decoder.layers.{local}."
        attn = hf + "self_attn."
        out[mg + names["input_norm"]] = get_hf(hf + "input_layernorm.weight")
        qkv = fuse_qkv(
            get_hf(attn + "q_proj.weight"),
            get_hf(attn + "k_proj.weight"),
            get_hf(attn + "v_proj.weight"),
            arch,
        )
        out[mg + "self_attention.linear_qkv.weight"] = qkv.chunk(tp_size, dim=0)[tp_rank]
        if arch.qkv_bias:
            qkv_bias = fuse_qkv(
                get_hf(attn + "q_proj.bias"), get_hf(attn + "k_proj.bias"), get_hf(attn + "v_proj.bias"), arch
            )
            out[mg + "self_attention.linear_qkv.bias"] = qkv_bias.chunk(tp_size, dim=0)[tp_rank]
        if arch.qk_norm:
            out[mg + "self_attention.q_layernorm.weight"] = get_hf(attn + "q_norm.weight")
            out[mg + "self_attention.k_layernorm.weight"] = get_hf(attn + "k_norm.weight")
        out[mg + "self_attention.linear_proj.weight"] = get_hf(attn + "o_proj.weight").chunk(tp_size, dim=1)[
            tp_rank
        ]
        out[mg + names["mlp_norm"]] = get_hf(hf + "post_attention_layernorm.weight")
        out[mg + "mlp.linear_fc1.weight"] = shard_gate_up(
            get_hf(hf + "mlp.gate_proj.weight"), get_hf(hf + "mlp.up_proj.weight"), tp_rank, tp_size
        )
        out[mg + "mlp.linear_fc2.weight"] = get_hf(hf + "mlp.down_proj.weight").chunk(tp_size, dim=1)[tp_rank]
    if last:
        out["decoder.final_layernorm.weight"] = get_hf(HF_FINAL_NORM)
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = vocab_shard(HF_LM_HEAD)
        elif not first:
            out["output_layer.weight"] = vocab_shard(HF_EMBED)
    return {name: tensor.contiguous() for name, tensor in out.items()}


# -- all TP ranks of one stage -> HF ------------------------------------------------------------


def megatron_to_hf(
    tp_shards: list[Mapping[str, torch.Tensor]],
    arch: ModelArchitecture,
    *,
    pp_rank: int,
    pp_size: int,
    te_names: bool = False,
) -> dict[str, torch.Tensor]:
    """HF tensors of one pipeline stage from the parameters of all its TP ranks (index = tp rank).

    A tied last stage yields no `lm_head` (HF ties it to the embedding)."""
    names = _layer_names(te_names)
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([shard[name] for shard in tp_shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    if first:
        out[HF_EMBED] = cat("embedding.word_embeddings.weight", 0)[: arch.vocab_size]
    layers_per_stage = arch.num_layers // pp_size
    for local in range(layers_per_stage):
        hf = f"model.layers.{pp_rank * layers_per_stage + local}."
        mg = f"decoder.layers.{local}."
        attn = hf + "self_attn."
        out[hf + "input_layernorm.weight"] = tp_shards[0][mg + names["input_norm"]]
        q, k, v = split_qkv(cat(mg + "self_attention.linear_qkv.weight", 0), arch)
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = q, k, v
        if arch.qkv_bias:
            qb, kb, vb = split_qkv(cat(mg + "self_attention.linear_qkv.bias", 0), arch)
            out[attn + "q_proj.bias"], out[attn + "k_proj.bias"], out[attn + "v_proj.bias"] = qb, kb, vb
        if arch.qk_norm:
            out[attn + "q_norm.weight"] = tp_shards[0][mg + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = tp_shards[0][mg + "self_attention.k_layernorm.weight"]
        out[attn + "o_proj.weight"] = cat(mg + "self_attention.linear_proj.weight", 1)
        out[hf + "post_attention_layernorm.weight"] = tp_shards[0][mg + names["mlp_norm"]]
        gate, up = merge_gate_up([shard[mg + "mlp.linear_fc1.weight"] for shard in tp_shards])
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = cat(mg + "mlp.linear_fc2.weight", 1)
    if last:
        out[HF_FINAL_NORM] = tp_shards[0]["decoder.final_layernorm.weight"]
        if not arch.tie_word_embeddings:
            out[HF_LM_HEAD] = cat("output_layer.weight", 0)[: arch.vocab_size]
    return {name: tensor.contiguous() for name, tensor in out.items()}


# -- files --------------------------------------------------------------------------------------


def hf_tensor_reader(model_dir: str) -> Callable[[str], torch.Tensor]:
    """A lazy `get_hf(name)` over all `*.safetensors` files of an HF model folder."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    index: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            index.update({name: path for name in f.keys()})

    def get_hf(name: str) -> torch.Tensor:
        if name not in index:
            raise KeyError(f"{name} not found in the safetensors of {model_dir}")
        with safe_open(str(index[name]), framework="pt") as f:
            return f.get_tensor(name)

    return get_hf
