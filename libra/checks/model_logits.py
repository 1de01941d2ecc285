"""Check 2: an HF checkpoint loaded through Libra's HF -> Megatron mapping into Megatron's GPT
model gives transformers' logits: in the layer spec training uses on this device and, where that
is Transformer Engine's, in the local spec too (and the two agree with each other)."""

from __future__ import annotations

import random

from libra.checks.context import TINY_VOCAB, CheckContext
from libra.checks.result import CheckResult

NAME = "model logits"
FP32_TOL = 1e-4
"""Absolute, fp32 on the CPU: measured 5.1e-6 (summation order only), logits of up to ~4.4; a
wrong mapping is off by the order of the logits themselves."""
BF16_REL_TOL = 0.1
"""Relative to the largest |logit|, bf16 on accelerators: bf16 keeps 8 significant bits (0.4 %
per rounding) and the error grows through the layers and the vocabulary matmul; a tiny model like
this one in bf16 on the CPU (local spec) measured 1.4 % of the logit scale. A wrong mapping is off
by the order of the scale itself."""
SEQUENCE_LENGTHS = (5, 17, 40)


def run(ctx: CheckContext) -> CheckResult:
    import torch
    from transformers import AutoModelForCausalLM

    from libra.training.model import transformer_engine_usable

    ctx.world()
    model_dir = ctx.tiny_model()
    device = ctx.device
    # fp32 on the CPU checks the mapping exactly; accelerators train in bf16.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rng = random.Random(0)
    sequences = [
        torch.tensor([[rng.randrange(TINY_VOCAB) for _ in range(n)]], device=device) for n in SEQUENCE_LENGTHS
    ]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        want = [reference(tokens).logits.float() for tokens in sequences]
    scale = max(w.abs().max().item() for w in want)
    tolerance = FP32_TOL if dtype == torch.float32 else BF16_REL_TOL * scale
    # The spec training uses here, and the local one beside it where that is Transformer Engine's.
    specs = [True, False] if transformer_engine_usable(device) else [False]
    got: dict[str, list] = {}
    for te in specs:
        logits = _megatron_logits(model_dir, te, dtype, device, sequences)
        if isinstance(logits, str):
            return CheckResult(NAME, False, logits)
        got["transformer-engine" if te else "local"] = logits
    diffs = {
        spec: max((g - w).abs().max().item() for g, w in zip(logits, want, strict=True))
        for spec, logits in got.items()
    }
    if len(got) == 2:
        diffs["transformer-engine vs local"] = max(
            (a - b).abs().max().item() for a, b in zip(*got.values(), strict=True)
        )
    dtype_name = str(dtype).removeprefix("torch.")
    compared = ", ".join(f"{name} {diff:.2e}" for name, diff in diffs.items())
    figure = (
        f"max |logit diff| against transformers: {compared} (tolerance {tolerance:.1e}, max |logit| "
        f"{scale:.2f}), {dtype_name}, {len(SEQUENCE_LENGTHS)} sequences"
    )
    values: dict[str, float | int | str] = {
        "max_logit_diff": max(diffs.values()),
        "tolerance": tolerance,
        "spec": next(iter(got)),
        "dtype": dtype_name,
    }
    return CheckResult(NAME, max(diffs.values()) <= tolerance, figure, values)


def _megatron_logits(model_dir, te: bool, dtype, device, sequences) -> list | str:
    """Megatron's logits of `sequences` with the HF weights loaded through Libra's mapping, in
    the layer spec `te` names; a string saying why when the mapping does not fit the model."""
    import torch

    from libra.model_spec import ModelSpec
    from libra.training.hf_weights import hf_tensor_reader, hf_to_megatron
    from libra.training.model import ModelArchitecture, build_gpt_model

    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(model_dir))
    model = build_gpt_model(
        arch, 1, 1, pre_process=True, post_process=True, dtype=dtype, device=device, transformer_engine=te
    )
    shards = hf_to_megatron(
        hf_tensor_reader(str(model_dir)), arch, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, te_names=te
    )
    params = dict(model.named_parameters())
    if set(shards) != set(params):
        return (
            f"HF -> Megatron names do not match the model: missing {sorted(set(params) - set(shards))}, "
            f"unexpected {sorted(set(shards) - set(params))}"
        )
    with torch.no_grad():
        for name, tensor in shards.items():
            params[name].copy_(tensor)
    model.eval()
    out = []
    with torch.no_grad():
        for tokens in sequences:
            positions = torch.arange(tokens.shape[1], device=device)[None, :]
            out.append(model(tokens, positions, None)[..., :TINY_VOCAB].float())
    return out
