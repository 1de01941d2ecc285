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
TIE_TOLERANCE = 1e-3
"""A greedy token whose transformers logit is this close to the argmax's counts as a near-tie, not
an error: fp32 on other kernels moves logits by ~1e-5; a wrong model or wrong weights by ~1."""


def run(ctx: CheckContext) -> CheckResult:
    rng = random.Random(0)
    vocab = _vocab_size(ctx)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 12))] for _ in range(NUM_PROMPTS)]
    greedy, rates = asyncio.run(_exercise(ctx.instance(), prompts))
    exact, ties, off = _judge_greedy(ctx, prompts, greedy)
    defaults = ctx.backend.engine_defaults
    values: dict[str, float | int | str] = {
        "greedy_exact": exact,
        "greedy_near_ties": ties,
        "greedy_off": len(off),
        "prompts": NUM_PROMPTS,
    }
    values.update({f"decode_tok_s_batch_{b}": rate for b, rate in rates.items()})
    decode = ", ".join(f"batch {b} {rate:,.0f} tok/s" for b, rate in rates.items())
    mode = "eager" if defaults.enforce_eager else "graphs"
    if not defaults.enforce_eager:
        eager_config = check_instance_config(ctx.tiny_model(), ctx.backend, enforce_eager=True)
        with CheckInstance(eager_config, ctx.backend_name, ctx.workdir, "eager-instance") as eager:
            _, eager_rates = asyncio.run(_exercise(eager, prompts))
        values.update({f"eager_decode_tok_s_batch_{b}": rate for b, rate in eager_rates.items()})
        decode += "; eager " + ", ".join(
            f"batch {b} {rate:,.0f} tok/s ({rates[b] / rate:.2f}x)" for b, rate in eager_rates.items()
        )
    figure = (
        f"greedy equals transformers' on {exact}/{NUM_PROMPTS} prompts ({GREEDY_TOKENS} tokens each, "
        f"{ties} near-ties); {mode}: {decode}"
    )
    if off:
        figure += "; off: " + "; ".join(off[:3])
    return CheckResult(NAME, not off, figure, values)


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

    return ModelSpec.from_hf_dir(ctx.tiny_model()).vocab_size


def _judge_greedy(
    ctx: CheckContext, prompts: list[list[int]], greedy: list[list[int]]
) -> tuple[int, int, list[str]]:
    """vLLM's greedy tokens under transformers (fp32, teacher-forced: an independent reference,
    not a second engine): the prompts continued exactly by transformers' argmax, the tokens that
    are not its argmax but within `TIE_TOLERANCE` of it (kernels that sum in another order may
    pick either), and a description of each token further off."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx.tiny_model(), dtype=torch.float32).to(ctx.device).eval()
    exact, ties, off = 0, 0, []
    with torch.no_grad():
        for i, (prompt, tokens) in enumerate(zip(prompts, greedy, strict=True)):
            logits = model(torch.tensor([prompt + tokens], device=ctx.device)).logits[0].float()
            steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
            best = steps.max(dim=-1).values
            chosen = steps[torch.arange(len(tokens)), torch.tensor(tokens, device=ctx.device)]
            gaps = (best - chosen).tolist()
            exact += all(gap == 0 for gap in gaps)
            ties += sum(0 < gap <= TIE_TOLERANCE for gap in gaps)
            off += [
                f"prompt {i} token {j}: {gap:.1e} below the argmax"
                for j, gap in enumerate(gaps)
                if gap > TIE_TOLERANCE
            ]
    return exact, ties, off
