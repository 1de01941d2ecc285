"""The facts of an HF model folder (Llama / Qwen2 / Qwen3 layout) that Libra reads: `ModelSpec`.

`config.json` is parsed here and nowhere else; the planner's `ModelArch`, the trainer's
`ModelArchitecture` and the resharder's `ModelShape` are derived from a `ModelSpec`. The file is
read as JSON, not through `transformers.AutoConfig`, so that the planner and the simulator need
no transformers. A key the file leaves out (or sets to null) takes Llama's default, or None where
the planner can do without it and the trainer refuses it (`max_position_embeddings`,
`rms_norm_eps`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per weight of the dtypes `config.json` names."""

_POSITIVE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_hidden_size",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer as its `config.json` describes it (GQA, gated MLP, RoPE)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    model_type: str | None = None
    max_position_embeddings: int | None = None
    dtype: str | None = None
    """The checkpoint's dtype (`dtype`, or `torch_dtype` of older transformers)."""
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Biases on q/k/v: always for Qwen2, `attention_bias` otherwise."""
    output_bias: bool = False
    """A bias on o_proj: `attention_bias` outside Qwen2 (whose o_proj has none)."""
    qk_norm: bool = False
    """Qwen3: per-head RMSNorm of queries and keys."""
    rms_norm_eps: float | None = None
    rope_theta: float = 10000.0
    rope_type: str = "default"
    hidden_act: str = "silu"
    mlp_bias: bool = False
    use_sliding_window: bool = False

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_kv_heads ({self.num_kv_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(
                f"ModelSpec.max_position_embeddings must be >= 1, got {self.max_position_embeddings}"
            )
        if self.rms_norm_eps is not None and self.rms_norm_eps <= 0:
            raise ValueError(f"ModelSpec.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"ModelSpec.rope_theta must be > 0, got {self.rope_theta}")

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelSpec:
        """Reads `model_dir/config.json`; ValueError naming the file and the bad key."""
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path} does not exist: {model_dir} is not an HF model folder") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(raw, source=str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelSpec:
        """From a parsed `config.json` (or a transformers config's `to_dict()`); errors name `source`."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source} must hold a JSON object, got {type(raw).__name__}")
        read = _Reader(raw, source)
        heads = read.required_int("num_attention_heads")
        hidden = read.required_int("hidden_size")
        head_dim = read.optional_int("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"{source} lacks 'head_dim', which it needs when num_attention_heads ({heads}) "
                    f"does not divide hidden_size ({hidden})"
                )
            head_dim = hidden // heads
        model_type = read.string("model_type")
        attention_bias = read.boolean("attention_bias")
        # transformers 5 writes RoPE into `rope_parameters`; older configs keep a top-level
        # `rope_theta` and `rope_scaling`.
        rope, scaling = read.mapping("rope_parameters"), read.mapping("rope_scaling")
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        rope_theta = rope.get("rope_theta")
        if rope_theta is None:
            rope_theta = read.number("rope_theta") or 10000.0
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, int | float):
            raise ValueError(f"{source}: rope_parameters.rope_theta must be a number, got {rope_theta!r}")
        fields = dict(
            num_layers=read.required_int("num_hidden_layers"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=read.optional_int("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn_hidden_size=read.required_int("intermediate_size"),
            vocab_size=read.required_int("vocab_size"),
            model_type=model_type,
            max_position_embeddings=read.optional_int("max_position_embeddings"),
            dtype=read.string("dtype") or read.string("torch_dtype"),
            tie_word_embeddings=read.boolean("tie_word_embeddings"),
            qkv_bias=model_type == "qwen2" or attention_bias,
            output_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            rms_norm_eps=read.number("rms_norm_eps"),
            rope_theta=float(rope_theta),
            rope_type=str(rope_type),
            hidden_act=read.string("hidden_act") or "silu",
            mlp_bias=read.boolean("mlp_bias"),
            use_sliding_window=read.boolean("use_sliding_window"),
        )
        try:
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


class _Reader:
    """Typed look-ups in one config dict, raising ValueError naming the file and the key. A key
    present as null counts as absent, as transformers treats it."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def _check(self, key: str, value: Any, ok: bool, kind: str) -> Any:
        if not ok:
            raise ValueError(f"{self.source}: {key} must be {kind}, got {value!r}")
        return value

    def required_int(self, key: str) -> int:
        if self.raw.get(key) is None:
            raise ValueError(f"{self.source} lacks {key!r}, which Libra's model spec needs")
        return self.optional_int(key)  # type: ignore[return-value]

    def optional_int(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is None:
            return None
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return self._check(key, value, ok, "a positive integer")

    def number(self, key: str) -> float | None:
        value = self.raw.get(key)
        if value is None:
            return None
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(self._check(key, value, ok, "a number"))

    def string(self, key: str) -> str | None:
        value = self.raw.get(key)
        return None if value is None else self._check(key, value, isinstance(value, str), "a string")

    def boolean(self, key: str) -> bool:
        value = self.raw.get(key)
        return False if value is None else self._check(key, value, isinstance(value, bool), "true or false")

    def mapping(self, key: str) -> dict[str, Any]:
        value = self.raw.get(key)
        return {} if value is None else self._check(key, value, isinstance(value, dict), "a JSON object")
