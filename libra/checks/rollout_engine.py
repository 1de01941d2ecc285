"""Check 4: a vLLM instance through `libra.rollout`, with the backend's engine defaults: greedy
tokens equal transformers' for a few prompts, and decode tokens/s at batch 1 and 32 — on an
accelerator also with an eager instance beside it, to show what the default graphs buy."""

from __future__ import annotations

import asyncio
import random
import time

from libra.checks.context import CheckContext
from libra.checks.instance import CheckInstance, check_instance_config
from libra.checks.result import CheckResult
from libra.rollout.types import SamplingSpec

NAME = "rollout engine"
NUM_PROMPTS = 4
GREEDY_TOKENS = 24
DECODE_TOKENS = 64
BATCH_SIZES = (1, 32)


def run(ctx: CheckContext) -> CheckResult:
    rng = random.Random(0)
    vocab = _vocab_size(ctx)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 12))] for _ in range(NUM_PROMPTS)]
    instance = ctx.instance()
    greedy, rates = asyncio.run(_exercise(instance, prompts))
    expected = _transformers_greedy(ctx, prompts)
    matching = sum(g == e for g, e in zip(greedy, expected, strict=True))
    defaults = ctx.backend.engine_defaults
    values: dict[str, float | int | str] = {"greedy_matching": matching, "prompts": NUM_PROMPTS}
    values.update({f"decode_tok_s_batch_{b}": rate for b, rate in rates.items()})
    decode = ", ".join(f"batch {b} {rate:,.0f} tok/s" for b, rate in rates.items())
    mode = "eager" if defaults.enforce_eager else "graphs"
    if not defaults.enforce_eager:
        eager_config = check_instance_config(ctx.policy(), ctx.backend, enforce_eager=True)
        with CheckInstance(eager_config, ctx.backend_name, ctx.workdir, "eager-instance") as eager:
            _, eager_rates = asyncio.run(_exercise(eager, prompts))
        values.update({f"eager_decode_tok_s_batch_{b}": rate for b, rate in eager_rates.items()})
        decode += "; eager " + ", ".join(
            f"batch {b} {rate:,.0f} tok/s ({rates[b] / rate:.2f}x)" for b, rate in eager_rates.items()
        )
    process = "in-process engine" if defaults.in_process else "engine process"
    figure = (
        f"greedy {matching}/{NUM_PROMPTS} prompts equal transformers' ({GREEDY_TOKENS} tokens each); "
        f"{process}, {mode}: {decode}"
    )
    if matching < NUM_PROMPTS:
        first = next(i for i, (g, e) in enumerate(zip(greedy, expected, strict=True)) if g != e)
        figure += f"; prompt {first}: vLLM {greedy[first]} vs transformers {expected[first]}"
    return CheckResult(NAME, matching == NUM_PROMPTS, figure, values)


async def _exercise(instance: CheckInstance, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """Greedy tokens for each prompt, then decode tokens/s at each batch size (sampled, fixed
    lengths: `ignore_eos`)."""
    client = instance.client()
    try:
        greedy_spec = SamplingSpec(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        greedy = [
            (await client.generate(f"greedy-{i}", prompt, greedy_spec)).token_ids
            for i, prompt in enumerate(prompts)
        ]
        decode_spec = SamplingSpec(temperature=1.0, max_tokens=DECODE_TOKENS, ignore_eos=True, seed=0)
        await client.generate("warm-up", prompts[0], decode_spec)
        rates = {}
        for batch in BATCH_SIZES:
            started = time.perf_counter()
            segments = await asyncio.gather(
                *(
                    client.generate(f"decode-{batch}-{i}", prompts[i % len(prompts)], decode_spec)
                    for i in range(batch)
                )
            )
            rates[batch] = sum(len(s.token_ids) for s in segments) / (time.perf_counter() - started)
        return [list(g) for g in greedy], rates
    finally:
        await client.close()


def _vocab_size(ctx: CheckContext) -> int:
    from libra.model_spec import ModelSpec

    return ModelSpec.from_hf_dir(ctx.policy()).vocab_size


def _transformers_greedy(ctx: CheckContext, prompts: list[list[int]]) -> list[list[int]]:
    """The argmax continuation of each prompt under transformers (fp32, no cache: an independent
    reference, not a second engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx.policy(), dtype=torch.float32).to(ctx.device).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(GREEDY_TOKENS):
                logits = model(torch.tensor([tokens], device=ctx.device)).logits[0, -1]
                tokens.append(int(logits.argmax()))
            out.append(tokens[len(prompt) :])
    return out
