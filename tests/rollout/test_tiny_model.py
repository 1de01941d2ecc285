"""The tiny-model factory: a Qwen2-style build through `libra make-tiny-model` (the session
fixture builds the Llama one, which vLLM serves in the other tests) loads offline in transformers
with its chat template and special tokens; specs are validated."""

from __future__ import annotations

import json

import pytest

from libra.cli import main
from libra.tasks.tiny_model import TinyModelSpec


def test_cli_builds_a_qwen2_model_that_loads_offline(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "qwen2"
    assert (
        main(
            [
                "make-tiny-model",
                str(out),
                "--random",
                "--arch",
                "qwen2",
                "--vocab-size",
                "512",
                "--num-layers",
                "1",
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32 and model.config.vocab_size == len(tokenizer) <= 512
    for marker in (
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    assert (
        model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is 1+1?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "1+1"}}}],
            },
            {"role": "tool", "content": "2"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert text.endswith("<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), model.config.vocab_size)


def test_a_qwen3_with_tied_embeddings_and_norms_away_from_1(tmp_path):
    """The device check's model (`libra.checks.context.TINY_QWEN3`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from libra.tasks.tiny_model import make_tiny_model

    spec = TinyModelSpec(arch="qwen3", vocab_size=300, norm_std=0.2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", spec))
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 300
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    norms = torch.cat([p.flatten() for name, p in model.named_parameters() if "norm" in name])
    assert 0.15 < (norms - 1).std().item() < 0.25


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch must be"),
        ({"vocab_size": 100}, "vocab_size must be >= 300"),
        ({"hidden_size": 64, "num_heads": 4}, "multiple of 32"),
        ({"num_heads": 4, "num_kv_heads": 3}, "divisible by num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be >= 1"),
    ],
)
def test_spec_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TinyModelSpec(**kwargs)
