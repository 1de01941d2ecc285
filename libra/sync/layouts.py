"""Per-rank parameter layouts of Megatron-core (TP=t, PP=p) and vLLM (TP=k), as stacks of blocks.

Every parameter of either engine is described as a vertical stack of `Block`s: rectangles
[row_start, row_start + num_rows) x [col_start, col_start + num_cols) of one *logical* tensor, the
HF-shaped full tensor (`q_proj`, `gate_proj`, `embed_tokens`, ...). 1-D params (biases, norms) are
logical tensors with one column. The C++ planner (csrc/reshard/) intersects these blocks; this
module only states the rules, checked against megatron-core 0.16.1 and vLLM 0.32:

Megatron GPTModel, local layer spec, on TP rank r of t and PP stage s of p
  (V_m = vocab padded to a multiple of make_vocab_size_divisible_by * t; R = (nq + 2 nkv) d;
   layers split evenly, stage s holds layers [s L/p, (s+1) L/p) under local indices):
  embedding.word_embeddings.weight        [V_m/t, H]  rows [r V_m/t, ...) of embed (stage 0);
                                                      rows >= V are padding and never read
  decoder.layers.{i}.input_layernorm.weight     [H]   replicated
  ...self_attention.linear_qkv.weight       [R/t, H]  rows [r R/t, (r+1) R/t) of the grouped
      stack: for g in 0..nkv-1: [q rows of heads g*nq/nkv ..; k rows of head g; v rows of head g]
      (ColumnParallelLinear splits that stack evenly, also when t > nkv: attention.py
      get_query_key_value_tensors); linear_qkv.bias [R/t] the same (Qwen2)
  ...self_attention.q_layernorm.weight, k_layernorm.weight  [d]  replicated (Qwen3)
  ...self_attention.linear_proj.weight   [H, nq d/t]  columns [r nq d/t, ...) of o_proj
  ...pre_mlp_layernorm.weight                   [H]   replicated
  ...mlp.linear_fc1.weight                 [2F/t, H]  [gate rows r F/t ..; up rows r F/t ..]
  ...mlp.linear_fc2.weight                 [H, F/t]  columns [r F/t, ...) of down_proj
  decoder.final_layernorm.weight                [H]   replicated (last stage)
  output_layer.weight                     [V_m/t, H]  like the embedding (last stage, untied only;
                                                      tied models read embed_tokens)

vLLM (llama.py / qwen2.py / qwen3.py, layers/linear.py, vocab_parallel_embedding.py) on rank j of k
  (V_v = V padded to a multiple of 64; nkv_l = max(1, nkv/k); KV heads are replicated when k > nkv,
   rank j then holds KV head j // (k/nkv)):
  model.embed_tokens.weight, lm_head.weight  [V_v/k, H]  rows [j V_v/k, ...); rows >= V are zeros
  model.layers.{i}.input_layernorm.weight, post_attention_layernorm.weight  [H]
  ...self_attn.qkv_proj.weight  [(nq/k + 2 nkv_l) d, H]  [q rows j nq d/k ..; k rows of the local
      KV heads; v rows of them]; qkv_proj.bias the same
  ...self_attn.q_norm.weight, k_norm.weight  [d]
  ...self_attn.o_proj.weight  [H, nq d/k]   columns [j nq d/k, ...)
  ...mlp.gate_up_proj.weight  [2F/k, H]     [gate rows j F/k ..; up rows j F/k ..]
  ...mlp.down_proj.weight     [H, F/k]      columns [j F/k, ...)
  model.norm.weight  [H]; lm_head.weight only when the embeddings are untied.

Replicated Megatron params are read from TP rank 0 of their stage (the others are marked
`replicated=True`), so every destination element has exactly one source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from libra.model_spec import ModelSpec

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen2/Qwen3-style decoder that decide every layout."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    """Qwen2: the fused QKV projection has a bias."""
    qk_norm: bool = False
    """Qwen3: per-head RMSNorm of queries and keys."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_hidden_size",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelShape.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelShape:
        return cls(
            hidden_size=spec.hidden_size,
            num_layers=spec.num_layers,
            num_heads=spec.num_attention_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            ffn_hidden_size=spec.ffn_hidden_size,
            vocab_size=spec.vocab_size,
            tie_embeddings=spec.tie_word_embeddings,
            qkv_bias=spec.qkv_bias,
            qk_norm=spec.qk_norm,
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Block:
    """Rows [row_start, row_start + num_rows) x cols [col_start, col_start + num_cols) of `tensor`."""

    tensor: str
    row_start: int
    num_rows: int
    col_start: int
    num_cols: int


@dataclass(frozen=True)
class ShardParam:
    """One parameter of one rank: its name, shape and the blocks stacked in it (row-major)."""

    name: str
    shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    replicated: bool = False
    """A TP replica that the plan does not read (the same data is read from TP rank 0)."""

    @property
    def numel(self) -> int:
        return sum(b.num_rows * b.num_cols for b in self.blocks)


class SourceKey(NamedTuple):
    """Where a source param lives: (tp rank, pp stage, Megatron param name)."""

    tp_rank: int
    pp_rank: int
    name: str


@dataclass(frozen=True)
class SourceLayout:
    tp_size: int
    pp_size: int
    params: dict[SourceKey, ShardParam]


@dataclass(frozen=True)
class DestLayout:
    tp_size: int
    ranks: tuple[tuple[ShardParam, ...], ...]
    """Per destination rank, its params in flat-buffer order."""


def logical_tensors(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Every HF-named full tensor as (real rows, cols); 1-D tensors have one column."""
    h, d, f, v = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size, shape.vocab_size
    tensors = {"model.embed_tokens.weight": (v, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = (h, 1)
        for kind, heads in (("q", shape.num_heads), ("k", shape.num_kv_heads), ("v", shape.num_kv_heads)):
            tensors[p + f"self_attn.{kind}_proj.weight"] = (heads * d, h)
            if shape.qkv_bias:
                tensors[p + f"self_attn.{kind}_proj.bias"] = (heads * d, 1)
        if shape.qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = (d, 1)
            tensors[p + "self_attn.k_norm.weight"] = (d, 1)
        tensors[p + "self_attn.o_proj.weight"] = (h, shape.num_heads * d)
        tensors[p + "post_attention_layernorm.weight"] = (h, 1)
        tensors[p + "mlp.gate_proj.weight"] = (f, h)
        tensors[p + "mlp.up_proj.weight"] = (f, h)
        tensors[p + "mlp.down_proj.weight"] = (h, f)
    tensors["model.norm.weight"] = (h, 1)
    if not shape.tie_embeddings:
        tensors["lm_head.weight"] = (v, h)
    return tensors


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _clip_stack(blocks: list[Block], start: int, count: int) -> tuple[Block, ...]:
    """The rows [start, start + count) of a vertical stack of full-width blocks."""
    clipped, row = [], 0
    for b in blocks:
        lo, hi = max(start, row), min(start + count, row + b.num_rows)
        if lo < hi:
            clipped.append(Block(b.tensor, b.row_start + lo - row, hi - lo, b.col_start, b.num_cols))
        row += b.num_rows
    return tuple(clipped)


def _rows(tensor: str, start: int, count: int, cols: int) -> Block:
    return Block(tensor, start, count, 0, cols)


def _vector(name: str, tensor: str, size: int, replicated: bool = False) -> ShardParam:
    return ShardParam(name, (size,), (_rows(tensor, 0, size, 1),), replicated)


def _matrix(name: str, blocks: tuple[Block, ...]) -> ShardParam:
    return ShardParam(name, (sum(b.num_rows for b in blocks), blocks[0].num_cols), blocks)


def megatron_vocab_size(vocab_size: int, tp_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary (megatron.training's _vocab_size_with_padding)."""
    return _round_up(vocab_size, make_vocab_size_divisible_by * tp_size)


def vllm_vocab_size(vocab_size: int) -> int:
    """vLLM's padded vocabulary without LoRA extra tokens (VocabParallelEmbedding)."""
    return _round_up(vocab_size, VLLM_VOCAB_PADDING)


def megatron_layout(
    shape: ModelShape, tp_size: int, pp_size: int, make_vocab_size_divisible_by: int = 128
) -> SourceLayout:
    """The params of every (TP rank, PP stage) of a Megatron GPTModel with the local layer spec."""
    t, h, d, f = tp_size, shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    nq, nkv = shape.num_heads, shape.num_kv_heads
    _divide(nq, t, "num_heads over Megatron TP")
    if nkv % t and t % nkv:
        raise ValueError(f"num_kv_heads={nkv} and Megatron TP={t}: one must divide the other")
    layers_per_stage = _divide(shape.num_layers, pp_size, "num_layers over Megatron PP")
    qkv_rows = _divide((nq + 2 * nkv) * d, t, "fused QKV rows over Megatron TP")
    f_local = _divide(f, t, "ffn_hidden_size over Megatron TP")
    v_local = megatron_vocab_size(shape.vocab_size, t, make_vocab_size_divisible_by) // t
    q_local = nq * d // t

    params: dict[SourceKey, ShardParam] = {}
    for s in range(pp_size):
        for r in range(t):

            def add(param: ShardParam, r: int = r, s: int = s) -> None:
                params[SourceKey(r, s, param.name)] = param

            replica = r != 0
            if s == 0:
                add(
                    _matrix(
                        "embedding.word_embeddings.weight",
                        (_rows("model.embed_tokens.weight", r * v_local, v_local, h),),
                    )
                )
            for local in range(layers_per_stage):
                hf = f"model.layers.{s * layers_per_stage + local}."
                mg = f"decoder.layers.{local}."
                add(_vector(mg + "input_layernorm.weight", hf + "input_layernorm.weight", h, replica))
                for suffix, cols in (("weight", h), ("bias", 1)):
                    if suffix == "bias" and not shape.qkv_bias:
                        continue
                    grouped = []
                    for g in range(nkv):
                        hq = shape.heads_per_group
                        grouped.append(_rows(hf + f"self_attn.q_proj.{suffix}", g * hq * d, hq * d, cols))
                        grouped.append(_rows(hf + f"self_attn.k_proj.{suffix}", g * d, d, cols))
                        grouped.append(_rows(hf + f"self_attn.v_proj.{suffix}", g * d, d, cols))
                    blocks = _clip_stack(grouped, r * qkv_rows, qkv_rows)
                    name = mg + f"self_attention.linear_qkv.{suffix}"
                    add(_matrix(name, blocks) if cols > 1 else ShardParam(name, (qkv_rows,), blocks))
                if shape.qk_norm:
                    add(
                        _vector(
                            mg + "self_attention.q_layernorm.weight",
                            hf + "self_attn.q_norm.weight",
                            d,
                            replica,
                        )
                    )
                    add(
                        _vector(
                            mg + "self_attention.k_layernorm.weight",
                            hf + "self_attn.k_norm.weight",
                            d,
                            replica,
                        )
                    )
                add(
                    _matrix(
                        mg + "self_attention.linear_proj.weight",
                        (Block(hf + "self_attn.o_proj.weight", 0, h, r * q_local, q_local),),
                    )
                )
                add(
                    _vector(
                        mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", h, replica
                    )
                )
                add(
                    _matrix(
                        mg + "mlp.linear_fc1.weight",
                        (
                            _rows(hf + "mlp.gate_proj.weight", r * f_local, f_local, h),
                            _rows(hf + "mlp.up_proj.weight", r * f_local, f_local, h),
                        ),
                    )
                )
                add(
                    _matrix(
                        mg + "mlp.linear_fc2.weight",
                        (Block(hf + "mlp.down_proj.weight", 0, h, r * f_local, f_local),),
                    )
                )
            if s == pp_size - 1:
                add(_vector("decoder.final_layernorm.weight", "model.norm.weight", h, replica))
                if not shape.tie_embeddings:
                    add(_matrix("output_layer.weight", (_rows("lm_head.weight", r * v_local, v_local, h),)))
    return SourceLayout(tp_size, pp_size, params)


def vllm_layout(shape: ModelShape, tp_size: int) -> DestLayout:
    """The params of every TP rank of a vLLM Llama/Qwen2/Qwen3 model, in flat-buffer order."""
    k, h, d, f = tp_size, shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    nq, nkv = shape.num_heads, shape.num_kv_heads
    q_local = _divide(nq, k, "num_heads over vLLM TP") * d
    if nkv % k and k % nkv:
        raise ValueError(f"num_kv_heads={nkv} and vLLM TP={k}: one must divide the other")
    kv_heads_local = max(1, nkv // k)
    kv_replicas = max(1, k // nkv)
    f_local = _divide(f, k, "ffn_hidden_size over vLLM TP")
    v_local = _divide(vllm_vocab_size(shape.vocab_size), k, "padded vocab over vLLM TP")

    ranks = []
    for j in range(k):
        kv_start = (j // kv_replicas) * kv_heads_local * d
        params = [
            _matrix(
                "model.embed_tokens.weight", (_rows("model.embed_tokens.weight", j * v_local, v_local, h),)
            )
        ]
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            params.append(_vector(p + "input_layernorm.weight", p + "input_layernorm.weight", h))
            for suffix, cols in (("weight", h), ("bias", 1)):
                if suffix == "bias" and not shape.qkv_bias:
                    continue
                blocks = (
                    _rows(p + f"self_attn.q_proj.{suffix}", j * q_local, q_local, cols),
                    _rows(p + f"self_attn.k_proj.{suffix}", kv_start, kv_heads_local * d, cols),
                    _rows(p + f"self_attn.v_proj.{suffix}", kv_start, kv_heads_local * d, cols),
                )
                name = p + f"self_attn.qkv_proj.{suffix}"
                params.append(
                    _matrix(name, blocks)
                    if cols > 1
                    else ShardParam(name, (q_local + 2 * kv_heads_local * d,), blocks)
                )
            if shape.qk_norm:
                params.append(_vector(p + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight", d))
                params.append(_vector(p + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight", d))
            params.append(
                _matrix(
                    p + "self_attn.o_proj.weight",
                    (Block(p + "self_attn.o_proj.weight", 0, h, j * q_local, q_local),),
                )
            )
            params.append(
                _vector(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", h)
            )
            params.append(
                _matrix(
                    p + "mlp.gate_up_proj.weight",
                    (
                        _rows(p + "mlp.gate_proj.weight", j * f_local, f_local, h),
                        _rows(p + "mlp.up_proj.weight", j * f_local, f_local, h),
                    ),
                )
            )
            params.append(
                _matrix(
                    p + "mlp.down_proj.weight",
                    (Block(p + "mlp.down_proj.weight", 0, h, j * f_local, f_local),),
                )
            )
        params.append(_vector("model.norm.weight", "model.norm.weight", h))
        if not shape.tie_embeddings:
            params.append(_matrix("lm_head.weight", (_rows("lm_head.weight", j * v_local, v_local, h),)))
        ranks.append(tuple(params))
    return DestLayout(k, tuple(ranks))
