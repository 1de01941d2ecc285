"""A Megatron-core `GPTModel` from a Hugging Face config (Llama, Qwen2, Qwen3).

`ModelArchitecture` is the part of an HF config (`libra.model_spec.ModelSpec`) that decides
Megatron's layout; it is what the weight converter (`hf_weights`) needs too. All three families
are pre-norm decoders with RMSNorm, SwiGLU, RoPE (rotate-half, i.e. Megatron's non-interleaved
rotary) and GQA; they differ in QKV bias (Qwen2), per-head QK RMSNorm (Qwen3), an explicit
head_dim (Qwen3) and tied embeddings.

Transformer-Engine specs are used when TE is importable and the model lives on a GPU; the local
spec otherwise (the CPU). The two name the norms differently (see `hf_weights`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Any

import torch

from libra.model_spec import ModelSpec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
VOCAB_DIVISIBLE_BY = 128
"""Megatron's `make_vocab_size_divisible_by` default: the padded vocab is a multiple of this x TP."""


@dataclass(frozen=True)
class ModelArchitecture:
    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_query_groups}"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelArchitecture:
        """Megatron's layout of an HF model; ValueError naming the HF setting it cannot convert."""
        if spec.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {spec.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        if spec.hidden_act != "silu":
            raise ValueError(f"hidden_act {spec.hidden_act!r} is not supported (only 'silu')")
        if spec.mlp_bias:
            raise ValueError("mlp_bias=True is not supported")
        if spec.use_sliding_window:
            raise ValueError("use_sliding_window=True is not supported")
        if spec.rope_type != "default":
            raise ValueError(
                f"rope_parameters.rope_type {spec.rope_type!r} is not supported (only 'default')"
            )
        if spec.output_bias:
            raise ValueError("attention_bias=True (with an o_proj bias) is not supported")
        if spec.rms_norm_eps is None:
            raise ValueError("the model's config lacks rms_norm_eps, which Megatron's RMSNorm needs")
        if spec.max_position_embeddings is None:
            raise ValueError("the model's config lacks max_position_embeddings, which Megatron's model needs")
        return cls(
            model_type=spec.model_type,
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            ffn_hidden_size=spec.ffn_hidden_size,
            num_layers=spec.num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=spec.rms_norm_eps,
            rope_theta=spec.rope_theta,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=spec.tie_word_embeddings,
            qkv_bias=spec.qkv_bias,
            qk_norm=spec.qk_norm,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """Megatron pads the vocabulary so that every TP rank holds an equal, aligned slice."""
    multiple = VOCAB_DIVISIBLE_BY * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def check_parallelism(arch: ModelArchitecture, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Raises ValueError naming the option when the model cannot be split this way."""
    if arch.num_query_groups % tensor_parallel:
        raise ValueError(
            f"training.tensor_parallel={tensor_parallel} must divide "
            f"num_key_value_heads={arch.num_query_groups}"
        )
    if arch.ffn_hidden_size % tensor_parallel:
        raise ValueError(
            f"training.tensor_parallel={tensor_parallel} must divide intermediate_size={arch.ffn_hidden_size}"
        )
    if arch.num_layers % pipeline_parallel:
        raise ValueError(
            f"training.pipeline_parallel={pipeline_parallel} must divide num_hidden_layers={arch.num_layers}"
        )


def transformer_engine_usable(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None


_RECOMPUTE_FIELDS: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
"""Megatron's fields for each `training.recompute` mode (`libra.training.config.RECOMPUTE_MODES`)."""


def build_transformer_config(
    arch: ModelArchitecture,
    tensor_parallel: int,
    pipeline_parallel: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    recompute: str = "none",
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_parallelism(arch, tensor_parallel, pipeline_parallel)
    device = device or torch.device("cpu")
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Full weights are built on every rank from the same seed and sliced: TP=1 and TP=k
        # start bit-identical (reference/megatron-cpu.md).
        use_cpu_initialization=True,
        # Fused kernels are CUDA-only; their unfused versions are what HF computes.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Megatron's default softmax runs in the params dtype; fp32 keeps bf16 logprobs stable.
        attention_softmax_in_fp32=True,
        # The GRPO loss is already normalised over the whole mini-batch (`libra.training.grpo`):
        # the schedules must neither divide it by the micro-batch count nor DDP average over DP.
        calculate_per_token_loss=True,
        # Micro-batches are padded to their own longest row: pipeline stages exchange shapes.
        variable_seq_lengths=True,
        # Megatron refuses variable lengths with its default token dispatcher even for a dense
        # model (no experts: the dispatcher is never built).
        moe_token_dispatcher_type="alltoall",
        # Batched p2p needs a device stream to synchronise; gloo sends one by one.
        batch_p2p_comm=device.type != "cpu",
        **_RECOMPUTE_FIELDS[recompute],
    )


def build_gpt_model(
    arch: ModelArchitecture,
    tensor_parallel: int,
    pipeline_parallel: int,
    pre_process: bool,
    post_process: bool,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    recompute: str = "none",
    transformer_engine: bool | None = None,
):
    """One pipeline stage of the model on this rank. Needs `parallel.initialize` first.
    `transformer_engine`: build with TE's layer spec (None: where it is usable on `device`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    device = device or torch.device("cpu")
    config = build_transformer_config(arch, tensor_parallel, pipeline_parallel, dtype, device, recompute)
    if transformer_engine is None:
        transformer_engine = transformer_engine_usable(device)
    if transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    # On the CPU, tied embeddings with PP > 1 rely on the cpu backend's patch 5
    # (`libra.backends.cpu_megatron_patches`), applied by `prepare_worker`.
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tensor_parallel),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    return model.to(device)
