"""`ModelSpec` from an HF `config.json`, checked against transformers' own reading of the same
folder, and the planner's, trainer's and resharder's views derived from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from libra.model_spec import ModelSpec
from libra.planner.config import ModelArch
from libra.sync.layouts import ModelShape
from libra.training.model import ModelArchitecture

COMMON = {
    "num_hidden_layers": 3,
    "hidden_size": 96,
    "num_attention_heads": 4,
    "intermediate_size": 160,
    "vocab_size": 301,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
}

HAND_WRITTEN = {
    # An older transformers' Qwen2: top-level rope_theta, torch_dtype, tied embeddings.
    "qwen2-tied": {
        **COMMON,
        "model_type": "qwen2",
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
    },
    # No tie_word_embeddings (untied), an explicit head_dim other than hidden / heads.
    "qwen2-head-dim": {**COMMON, "model_type": "qwen2", "num_key_value_heads": 4, "head_dim": 32},
    # Neither head_dim nor num_key_value_heads nor tie_word_embeddings: MHA, hidden / heads.
    "llama-bare": {**COMMON, "model_type": "llama"},
    "llama-gqa": {
        **COMMON,
        "model_type": "llama",
        "num_key_value_heads": 1,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "dtype": "float32",
    },
    # transformers 5's layout: RoPE in rope_parameters; Qwen3's per-head QK norm.
    "qwen3": {
        **COMMON,
        "model_type": "qwen3",
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "dtype": "bfloat16",
    },
}


def write(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def saved_by_transformers(model_type: str, folder: Path, tie: bool) -> Path:
    """A complete config.json as transformers writes it for a real checkpoint."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    extra = {"head_dim": 48} if model_type == "qwen3" else {}
    config_cls(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **extra,
    ).save_pretrained(folder)
    return folder


def assert_matches_transformers(spec: ModelSpec, folder: Path, raw: dict) -> None:
    """The fields both read agree. Keys the file leaves out are compared only where transformers
    defaults them as every family does (its per-family defaults, e.g. Qwen2's 32 KV heads, are
    not what the file says)."""
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(folder)
    assert spec.model_type == ref.model_type
    assert spec.num_layers == ref.num_hidden_layers
    assert spec.hidden_size == ref.hidden_size
    assert spec.num_attention_heads == ref.num_attention_heads
    assert spec.ffn_hidden_size == ref.intermediate_size
    assert spec.vocab_size == ref.vocab_size
    assert spec.max_position_embeddings == ref.max_position_embeddings
    assert spec.rms_norm_eps == ref.rms_norm_eps
    assert spec.tie_word_embeddings == ref.tie_word_embeddings
    assert spec.rope_theta == ref.rope_parameters["rope_theta"]
    assert spec.rope_type == ref.rope_parameters["rope_type"]
    if "num_key_value_heads" in raw or ref.model_type == "llama":
        assert spec.num_kv_heads == ref.num_key_value_heads
    if "head_dim" in raw or ref.model_type != "qwen3":
        assert spec.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    if ref.dtype is not None:
        assert f"torch.{spec.dtype}" == str(ref.dtype)


def assert_views_match(spec: ModelSpec, raw: dict) -> None:
    """The planner's, trainer's and resharder's views against the raw dict."""
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim", raw["hidden_size"] // heads)
    qwen2 = raw["model_type"] == "qwen2"
    assert ModelArch.from_spec(spec, 2) == ModelArch(
        num_layers=raw["num_hidden_layers"],
        hidden_size=raw["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        head_dim=head_dim,
        bytes_per_param=2,
    )
    rope = raw.get("rope_parameters", {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    assert ModelArchitecture.from_spec(spec) == ModelArchitecture(
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        ffn_hidden_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=rope,
        max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        qkv_bias=qwen2,
        qk_norm=raw["model_type"] == "qwen3",
    )
    assert ModelShape.from_spec(spec) == ModelShape(
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        tie_embeddings=raw.get("tie_word_embeddings", False),
        qkv_bias=qwen2,
        qk_norm=raw["model_type"] == "qwen3",
    )


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_hand_written_config(name, tmp_path):
    raw = HAND_WRITTEN[name]
    spec = ModelSpec.from_hf_dir(write(tmp_path, raw))
    assert spec == ModelSpec.from_hf_dict(raw)
    assert spec.dtype == raw.get("dtype", raw.get("torch_dtype"))
    assert_matches_transformers(spec, tmp_path, raw)
    assert_views_match(spec, raw)


@pytest.mark.parametrize(("model_type", "tie"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_config_saved_by_transformers(model_type, tie, tmp_path):
    folder = saved_by_transformers(model_type, tmp_path, tie)
    raw = json.loads((folder / "config.json").read_text())
    spec = ModelSpec.from_hf_dir(folder)
    assert_matches_transformers(spec, folder, raw)
    assert_views_match(spec, raw)
    assert (spec.qkv_bias, spec.qk_norm, spec.tie_word_embeddings) == (
        model_type == "qwen2",
        model_type == "qwen3",
        tie,
    )


def test_planner_counts_parameters_from_the_spec():
    spec = ModelSpec.from_hf_dict(HAND_WRITTEN["llama-gqa"])
    arch = ModelArch.from_spec(spec, 4)
    h, q, kv, f = 96, 4 * 16, 1 * 16, 160
    per_layer = h * (2 * q + 2 * kv) + 3 * h * f
    assert arch.num_params == 3 * per_layer + 2 * 301 * h
    assert arch.weight_bytes == 4 * arch.num_params


@pytest.mark.parametrize(
    "key",
    ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"],
)
def test_a_missing_key_is_named_with_the_file(key, tmp_path):
    raw = {k: v for k, v in HAND_WRITTEN["llama-bare"].items() if k != key}
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/config.json lacks '{key}'")):
        ModelSpec.from_hf_dir(write(tmp_path, raw))
    with pytest.raises(ValueError, match=f"'{key}'"):
        ModelSpec.from_hf_dir(write(tmp_path, {**raw, key: None}))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_size": "96"}, "hidden_size must be a positive integer, got '96'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
        ({"vocab_size": 30.5}, "vocab_size must be a positive integer"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be a positive integer"),
        ({"num_key_value_heads": 3}, r"ModelSpec.num_kv_heads \(3\) must divide num_attention_heads \(4\)"),
        ({"num_attention_heads": 5}, "lacks 'head_dim'"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number"),
        ({"rms_norm_eps": 0}, "ModelSpec.rms_norm_eps must be > 0"),
        ({"rope_scaling": [1]}, "rope_scaling must be a JSON object"),
        ({"rope_parameters": {"rope_theta": "big"}}, "rope_theta must be a number"),
        ({"model_type": 7}, "model_type must be a string"),
    ],
)
def test_bad_values_are_named_with_the_file(change, match, tmp_path):
    folder = write(tmp_path, {**HAND_WRITTEN["llama-bare"], **change})
    with pytest.raises(ValueError, match=match) as error:
        ModelSpec.from_hf_dir(folder)
    assert str(folder / "config.json") in str(error.value)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match="config.json does not exist"):
        ModelSpec.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelSpec.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json must hold a JSON object"):
        ModelSpec.from_hf_dir(tmp_path)


def test_direct_construction_names_the_field():
    with pytest.raises(ValueError, match="ModelSpec.vocab_size must be >= 1, got 0"):
        ModelSpec(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            num_kv_heads=2,
            head_dim=4,
            ffn_hidden_size=8,
            vocab_size=0,
        )
