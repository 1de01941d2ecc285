"""The rollout instance through its gRPC service: exact greedy decoding, logprobs, pause/resume
with requests in flight, abort, stats, auth and request validation."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from libra.rollout import FinishReason, InstanceClient, PauseMode, SamplingSpec
from tests.rollout.conftest import MAX_MODEL_LEN, TOKEN, run

pytestmark = pytest.mark.multiprocess

PROMPTS = (
    "What is 40+2?",
    "the answer is a number of the sum",
    "Please compute the product of 17 and 23 with the tool.",
    "hello",
)


def _prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _encode_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(_prompt_ids(tokenizer, p), add_special_tokens=False) for p in PROMPTS]


def _hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, eos_id: int):
    """Transformers' greedy continuation of each prompt and the logprob of each chosen token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_id,
                pad_token_id=eos_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)
            ]
            results.append((tokens, logprobs))
    return results


def test_greedy_equals_transformers_token_for_token(instances, model_dirs, tokenizer):
    prompts = _encode_prompts(tokenizer)
    eos = tokenizer.eos_token_id
    sampling = SamplingSpec(temperature=0.0, max_tokens=48, stop_token_ids=(eos,))

    async def generate_all():
        client = InstanceClient(instances[0].address, TOKEN)
        try:  # concurrently, so the engine batches them as in rollout
            return await asyncio.gather(
                *(client.generate(f"greedy-{i}", p, sampling, chunk_tokens=7) for i, p in enumerate(prompts))
            )
        finally:
            await client.close()

    segments = run(generate_all())
    reference = _hf_greedy(model_dirs.scripted, prompts, 48, eos)
    for segment, (tokens, logprobs) in zip(segments, reference, strict=True):
        assert segment.token_ids == tokens
        assert segment.finish_reason == (FinishReason.STOP if tokens[-1] == eos else FinishReason.LENGTH)
        got = [lp for chunk in segment.chunks for lp in chunk.logprobs]
        assert got == pytest.approx(logprobs, abs=1e-3)


def _long_sampling(max_tokens: int = 160) -> SamplingSpec:
    return SamplingSpec(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_pause_keep_resumes_in_flight_requests_under_the_new_version(instances, tokenizer):
    prompt = _encode_prompts(tokenizer)[1]

    async def scenario():
        client = InstanceClient(instances[1].address, TOKEN)
        try:
            uninterrupted = await client.generate("keep-ref", prompt, _long_sampling())
            version = (await client.stats()).weight_version
            chunks = []
            async for chunk in client.stream("keep", prompt, _long_sampling(), chunk_tokens=4):
                chunks.append(chunk)
                if len(chunks) == 1:
                    assert await client.pause(PauseMode.KEEP) == 1
                    await asyncio.sleep(0.2)
                    assert (await client.stats()).paused
                    assert await client.resume(weight_version=version + 1) == version + 1
            return uninterrupted, version, chunks
        finally:
            await client.close()

    uninterrupted, version, chunks = run(scenario())
    versions = [c.weight_version for c in chunks]
    assert versions[0] == version and versions[-1] == version + 1
    assert versions == sorted(versions)
    assert [t for c in chunks for t in c.token_ids] == uninterrupted.token_ids
    assert chunks[-1].finish_reason == FinishReason.LENGTH


def test_pause_abort_preempts_and_abort_ends_requests(instances, tokenizer):
    prompt = _encode_prompts(tokenizer)[2]

    async def scenario():
        client = InstanceClient(instances[1].address, TOKEN)
        try:
            task = asyncio.create_task(
                client.generate("preempt", prompt, _long_sampling(400), chunk_tokens=1)
            )
            while (await client.stats()).num_active_requests == 0:
                await asyncio.sleep(0.005)
            assert await client.pause(PauseMode.ABORT) == 1
            preempted = await task
            await client.resume()
            task = asyncio.create_task(client.generate("aborted", prompt, _long_sampling(400)))
            while (await client.stats()).num_active_requests == 0:
                await asyncio.sleep(0.005)
            assert await client.abort(["aborted", "no-such-request"]) == 1
            return preempted, await task, await client.stats()
        finally:
            await client.close()

    preempted, aborted, stats = run(scenario())
    assert preempted.finish_reason == FinishReason.PREEMPTED and len(preempted.token_ids) < 400
    assert aborted.finish_reason == FinishReason.ABORT and len(aborted.token_ids) < 400
    assert stats.num_active_requests == 0 and not stats.paused
    assert stats.max_model_len == MAX_MODEL_LEN and stats.tensor_parallel_size == 1
    assert stats.num_generated_tokens >= len(preempted.token_ids) + len(aborted.token_ids)


def test_refuses_bad_requests_and_missing_tokens(instances):
    async def scenario():
        client = InstanceClient(instances[0].address, TOKEN)
        stranger = InstanceClient(instances[0].address, "wrong-token")
        try:
            with pytest.raises(ValueError, match="must not be empty"):
                await client.generate("empty", [], SamplingSpec(max_tokens=4))
            with pytest.raises(ValueError, match="max_model_len"):
                await client.generate("long", [5] * MAX_MODEL_LEN, SamplingSpec(max_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stranger.stats()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await stranger.is_serving()  # health checks need no token
        finally:
            await client.close()
            await stranger.close()

    run(scenario())
