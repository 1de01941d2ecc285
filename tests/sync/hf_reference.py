"""Transformers as the reference engine of the weight-publication tests: a model on given weights,
its greedy continuation, and a tie-tolerant check of an engine's greedy tokens against it."""

from __future__ import annotations

from pathlib import Path

import torch

NUM_NEW_TOKENS = 16


def hf_model(model_dir: Path, weights: dict[str, torch.Tensor] | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    return model


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(NUM_NEW_TOKENS):
                next_id = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            out.append(ids[0, len(prompt) :].tolist())
    return out


def assert_greedy_under_hf(model, prompts: list[list[int]], generated: list[list[int]]) -> int:
    """Every token the engine chose greedily is transformers' argmax on the same prefix, or ties
    with it to within fp32 rounding (1e-4 in logits; a trained tiny model has near-ties that two
    correct fp32 engines may break differently). Returns the number of such ties."""
    ties = 0
    with torch.no_grad():
        for prompt, tokens in zip(prompts, generated, strict=True):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            for position, token in enumerate(tokens):
                best = int(logits[position].argmax())
                if best != token:
                    gap = float(logits[position, best] - logits[position, token])
                    assert gap < 1e-4, (
                        f"prompt {prompt[:4]}.. token {position}: engine {token}, hf {best} by {gap}"
                    )
                    ties += 1
    return ties
