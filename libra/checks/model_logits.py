"""Check 2: an HF checkpoint loaded through Libra's HF -> Megatron mapping into Megatron's GPT
model (the layer spec training uses on this device) gives transformers' logits."""

from __future__ import annotations

import random

from libra.checks.context import TINY_VOCAB, CheckContext
from libra.checks.result import CheckResult

NAME = "model logits"
FP32_TOL = 1e-4
"""Absolute, fp32 on the CPU: measured 1.5e-6 (summation order only), logits of up to ~3; a
wrong mapping is off by the order of the logits themselves."""
BF16_REL_TOL = 0.1
"""Relative to the largest |logit|, bf16 on accelerators: bf16 keeps 8 significant bits (0.4 %
per rounding) and the error grows through the layers and the vocabulary matmul; the same model in
bf16 on the CPU (local spec) measured 3.9e-2, 1.4 % of the logit scale. A wrong mapping is off by
the order of the scale itself."""
SEQUENCE_LENGTHS = (5, 17, 40)


def run(ctx: CheckContext) -> CheckResult:
    import torch
    from transformers import AutoModelForCausalLM

    from libra.model_spec import ModelSpec
    from libra.training.hf_weights import hf_tensor_reader, hf_to_megatron
    from libra.training.model import ModelArchitecture, build_gpt_model, transformer_engine_usable

    ctx.world()
    model_dir = ctx.tiny_model()
    device = ctx.device
    # fp32 on the CPU checks the mapping exactly; accelerators train in bf16.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    te = transformer_engine_usable(device)
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(model_dir))
    model = build_gpt_model(arch, 1, 1, pre_process=True, post_process=True, dtype=dtype, device=device)
    shards = hf_to_megatron(
        hf_tensor_reader(str(model_dir)), arch, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, te_names=te
    )
    params = dict(model.named_parameters())
    if set(shards) != set(params):
        return CheckResult(
            NAME,
            False,
            f"HF -> Megatron names do not match the model: missing {sorted(set(params) - set(shards))}, "
            f"unexpected {sorted(set(shards) - set(params))}",
        )
    with torch.no_grad():
        for name, tensor in shards.items():
            params[name].copy_(tensor)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.eval()
    rng = random.Random(0)
    max_diff = scale = 0.0
    with torch.no_grad():
        for length in SEQUENCE_LENGTHS:
            tokens = torch.tensor([[rng.randrange(TINY_VOCAB) for _ in range(length)]], device=device)
            positions = torch.arange(length, device=device)[None, :]
            got = model(tokens, positions, None)[..., :TINY_VOCAB].float()
            want = reference(tokens).logits.float()
            max_diff = max(max_diff, (got - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
    spec = "transformer-engine" if te else "local"
    tolerance = FP32_TOL if dtype == torch.float32 else BF16_REL_TOL * scale
    dtype_name = str(dtype).removeprefix("torch.")
    figure = (
        f"max |logit diff| {max_diff:.2e} (tolerance {tolerance:.1e}, max |logit| {scale:.2f}), "
        f"{spec} spec, {dtype_name}, {len(SEQUENCE_LENGTHS)} sequences"
    )
    values = {"max_logit_diff": max_diff, "tolerance": tolerance, "spec": spec, "dtype": dtype_name}
    return CheckResult(NAME, max_diff <= tolerance, figure, values)
