"""Random tiny HF models (fp32 safetensors) and fixed trajectory batches for the training tests.

Vocab sizes are deliberately not multiples of 128 x TP, so Megatron pads the vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

from libra.trajectory import Trajectory

VOCAB = 300


def make_hf_model(
    model_type: str,
    directory: Path,
    tie: bool,
    seed: int = 0,
    vocab: int = VOCAB,
    hidden: int = 64,
    layers: int = 2,
) -> Path:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).float()
    # Random init is near-degenerate (std 0.02): widen it so logits and tests are not trivial; norms
    # get non-unit weights so a norm mix-up shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_batch(seed: int, num_groups: int = 3, group_size: int = 4, vocab: int = VOCAB) -> list[Trajectory]:
    """Variable-length multi-turn trajectories: model turns (masked in), tool results (masked out),
    policy versions 0, rewards in groups."""
    rng = random.Random(seed)
    batch = []
    for g in range(num_groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 10))]
        for k in range(group_size):
            t = Trajectory(
                trajectory_id=f"t{g}-{k}", prompt_id=f"p{g}", group_id=f"g{g}", prompt_token_ids=list(prompt)
            )
            for turn in range(rng.randint(1, 3)):
                n = rng.randint(2, 12)
                t.append(
                    [rng.randrange(vocab) for _ in range(n)],
                    [-rng.uniform(0.5, 6.0) for _ in range(n)],
                    policy_version=0,
                )
                if turn < 2 and rng.random() < 0.6:
                    t.append([rng.randrange(vocab) for _ in range(rng.randint(1, 6))], None, policy_version=0)
            t.reward = float(rng.choice([0.0, 0.0, 1.0, 0.5]))
            batch.append(t)
    return batch
