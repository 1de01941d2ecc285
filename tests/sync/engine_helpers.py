"""Reading a running vLLM engine in the weight-publication tests: its live params per TP rank and
its greedy continuation of fixed token prompts."""

from __future__ import annotations

import torch
from safetensors.torch import load

from tests.sync.hf_reference import NUM_NEW_TOKENS

PROMPTS = [[5, 17, 250, 3, 99], [42] * 7, list(range(100, 130))]


def rank_params(llm) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's params as the engine computes with them (one safetensors blob per rank)."""
    return [load(blob) for blob in llm.collective_rpc("libra_read_params")]


def engine_params(llm) -> dict[str, torch.Tensor]:
    """Rank 0's params (the whole model at TP=1)."""
    return rank_params(llm)[0]


def vllm_greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
