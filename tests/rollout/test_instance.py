"""The rollout instance through its gRPC service: exact greedy decoding, logprobs, pause/resume
with requests in flight, abort, stats, auth and request validation."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from libra.rollout import FinishReason, InstanceClient, PauseMode, SamplingSpec
from tests.rollout.conftest import MAX_MODEL_LEN, TOKEN, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

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
            results.append((tokens, logprobs, [s[0] for s in out.scores]))
    return results


def _num_agreeing(engine: list[int], tokens: list[int], logits) -> int:
    """How many leading tokens the engine and transformers share: all of them, or those before a
    near-tie (1e-4 in logits, as in tests/sync/hf_reference.py) that two correct fp32 engines may
    break differently, on any machine: the paths part there."""
    for position, (mine, theirs) in enumerate(zip(engine, tokens, strict=False)):
        if mine != theirs:
            gap = float(logits[position][theirs] - logits[position][mine])
            assert gap < 1e-4, f"token {position}: engine {mine}, transformers {theirs} by {gap}"
            return position
    assert len(engine) == len(tokens), (engine, tokens)
    return len(tokens)


def test_greedy_equals_transformers_token_for_token(instances, model_dirs, tokenizer):
    prompts = _encode_prompts(tokenizer)
    eos = tokenizer.eos_token_id
    sampling = SamplingSpec(temperature=0.0, max_tokens=48, stop_token_ids=(eos,))

    async def generate_all():
        client = InstanceClient(instances[0].address, TOKEN)
        try:  # concurrently, so the engine batches them as in rollout
            before = await client.stats()
            segments = await asyncio.gather(
                *(client.generate(f"greedy-{i}", p, sampling, chunk_tokens=7) for i, p in enumerate(prompts))
            )
            return segments, before, await client.stats()
        finally:
            await client.close()

    segments, before, after = run(generate_all())
    # Stats count the engine's steps and the prompt tokens it computed (not those the prefix
    # cache held; vLLM always computes a prompt's last token).
    lengths = [len(s.token_ids) for s in segments]
    assert after.num_generated_tokens - before.num_generated_tokens == sum(lengths)
    assert max(lengths) <= after.num_engine_steps - before.num_engine_steps <= sum(lengths) + len(prompts)
    assert len(prompts) <= after.num_prompt_tokens - before.num_prompt_tokens <= sum(map(len, prompts))
    reference = _hf_greedy(model_dirs.scripted, prompts, 48, eos)
    for segment, (tokens, logprobs, logits) in zip(segments, reference, strict=True):
        agreeing = _num_agreeing(segment.token_ids, tokens, logits)
        if agreeing == len(tokens):
            assert segment.finish_reason == (FinishReason.STOP if tokens[-1] == eos else FinishReason.LENGTH)
        got = [lp for chunk in segment.chunks for lp in chunk.logprobs]
        assert got[:agreeing] == pytest.approx(logprobs[:agreeing], abs=1e-3)


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
            # Streamed, like the preempted call: an unstreamed call runs so much faster that under
            # load it can reach its 400 tokens before the Abort lands (its own test waits less).
            task = asyncio.create_task(
                client.generate("aborted", prompt, _long_sampling(400), chunk_tokens=1)
            )
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


def _assert_prefix_of(segment, reference, min_tokens: int) -> None:
    """`segment` holds the first tokens of `reference` (greedy, same prompt) and their logprobs."""
    tokens = segment.token_ids
    assert min_tokens <= len(tokens) < len(reference.token_ids)
    assert tokens == reference.token_ids[: len(tokens)]
    logprobs = [lp for chunk in segment.chunks for lp in chunk.logprobs]
    expected = [lp for chunk in reference.chunks for lp in chunk.logprobs][: len(tokens)]
    assert logprobs == pytest.approx(expected, abs=1e-4)


def test_unstreamed_calls_keep_their_tokens_when_preempted_or_aborted(instances, tokenizer):
    """chunk_tokens=0 runs on vLLM's FINAL_ONLY outputs (no wake-up per token): a call cut by a
    Pause in ABORT mode or an Abort still returns every token it produced, with its logprobs."""
    prompt = _encode_prompts(tokenizer)[0]

    async def scenario():
        client = InstanceClient(instances[1].address, TOKEN)
        try:
            reference = await client.generate("final-ref", prompt, _long_sampling(400))
            version = (await client.stats()).weight_version
            interrupts = {
                "final-preempt": lambda: client.pause(PauseMode.ABORT),
                "final-abort": lambda: client.abort(["final-abort"]),
            }
            cut = {}
            for request_id, interrupt in interrupts.items():
                generated = (await client.stats()).num_generated_tokens
                task = asyncio.create_task(client.generate(request_id, prompt, _long_sampling(400)))
                while (await client.stats()).num_generated_tokens < generated + 8:
                    await asyncio.sleep(0.005)
                assert await interrupt() == 1
                cut[request_id] = await task
                await client.resume()
            return reference, version, cut
        finally:
            await client.close()

    reference, version, cut = run(scenario())
    assert cut["final-preempt"].finish_reason == FinishReason.PREEMPTED
    assert cut["final-abort"].finish_reason == FinishReason.ABORT
    for segment in cut.values():
        _assert_prefix_of(segment, reference, min_tokens=8)
        assert {c.weight_version for c in segment.chunks} == {version}


def test_unstreamed_call_across_a_version_change_tags_each_token(instances, tokenizer):
    """A call paused in KEEP mode and resumed under a new version comes back as one reply whose
    chunks split its tokens where the version changed (vLLM labels each step's tokens)."""
    prompt = _encode_prompts(tokenizer)[3]

    async def scenario():
        client = InstanceClient(instances[1].address, TOKEN)
        try:
            reference = await client.generate("final-keep-ref", prompt, _long_sampling(400))
            stats = await client.stats()
            task = asyncio.create_task(client.generate("final-keep", prompt, _long_sampling(400)))
            while (await client.stats()).num_generated_tokens < stats.num_generated_tokens + 8:
                await asyncio.sleep(0.005)
            assert await client.pause(PauseMode.KEEP) == 1
            await asyncio.sleep(0.1)
            frozen = (await client.stats()).num_generated_tokens
            await asyncio.sleep(0.2)
            assert (await client.stats()).num_generated_tokens == frozen  # paused: nothing sampled
            assert await client.resume(weight_version=stats.weight_version + 1) == stats.weight_version + 1
            return reference, stats.weight_version, await task
        finally:
            await client.close()

    reference, version, segment = run(scenario())
    assert segment.finish_reason == FinishReason.LENGTH
    assert [c.weight_version for c in segment.chunks] == [version, version + 1]
    assert len(segment.chunks[0].token_ids) >= 8
    assert segment.token_ids == reference.token_ids
    logprobs = [lp for chunk in segment.chunks for lp in chunk.logprobs]
    assert logprobs == pytest.approx([lp for c in reference.chunks for lp in c.logprobs], abs=1e-4)


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


# -- weight versions (libra.sync through LoadWeights) ------------------------------------------


def _publisher_and_weights(model_dir):
    """A TP=PP=1 trainer-side publisher over shared memory, and the model's HF weights perturbed
    (known weights that greedy decoding can tell apart from the checkpoint's)."""
    import torch
    from safetensors.torch import load_file

    from libra.model_spec import ModelSpec
    from libra.sync import SyncConfig
    from libra.sync.layouts import ModelShape
    from libra.sync.trainer_publisher import SourceRank, TrainerPublisher
    from libra.training.model import VOCAB_DIVISIBLE_BY, ModelArchitecture

    model = ModelSpec.from_hf_dir(model_dir)
    arch = ModelArchitecture.from_spec(model)
    original = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    perturbed = {
        name: tensor * (1 + 0.3 * torch.randn(tensor.shape, generator=generator))
        for name, tensor in original.items()
    }
    # Small buckets, so that a manifest has several.
    publisher = TrainerPublisher(
        ModelShape.from_spec(model),
        SourceRank(0, 0, 1, 0, 1, 0),
        SyncConfig(bucket_bytes=64 << 10),
        VOCAB_DIVISIBLE_BY,
    )
    return arch, publisher, original, perturbed


def _megatron_params(hf, arch):
    from libra.training.hf_weights import hf_to_megatron

    return hf_to_megatron(hf.__getitem__, arch, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


def _assert_engine_holds(got, hf, shape):
    """The engine computes with exactly `hf` as vLLM shards it (an independent reference slicing),
    including the packed copies that CPU GEMMs compute with."""
    import torch

    from tests.sync.reference_reshard import hf_to_vllm

    expected = hf_to_vllm(hf, shape, 1)[0]
    for name in [n for n in got if n.endswith("@packed")]:
        # A tied LM head computes with a packed copy of the embedding.
        expected[name] = expected.get(name.removesuffix("@packed"), expected["model.embed_tokens.weight"])
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name].view(torch.int32), tensor.contiguous().view(torch.int32)), name


def test_load_weights_switches_versions_never_half_loaded(instances, model_dirs):
    """A published version over shared memory: corrupted handles and manifests are refused (the
    instance stays on its version and keeps generating), the retry loads it bit for bit, greedy
    output follows transformers on those weights, and a request in flight is preempted with its
    tokens tagged by the old version. Then the original weights go back (the session instance
    serves later tests)."""
    import dataclasses

    from libra.sync.load_request import RankLoad
    from libra.sync.transport import BucketDigest
    from tests.sync.hf_reference import NUM_NEW_TOKENS, assert_greedy_under_hf, hf_model

    arch, publisher, original, perturbed = _publisher_and_weights(model_dirs.scripted)
    prompts = [[5, 17, 250, 3, 99], [42] * 7, list(range(100, 130))]
    greedy = SamplingSpec(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    ids = itertools.count()

    async def generate_all(client):
        segments = await asyncio.gather(*(client.generate(f"w-{next(ids)}", p, greedy) for p in prompts))
        return [s.token_ids for s in segments]

    async def scenario():
        client = InstanceClient(instances[0].address, TOKEN)
        try:
            start = (await client.stats()).weight_version
            before_params, before_greedy = (await client.read_weights())[0], await generate_all(client)
            version = start + 1
            request = publisher.publish(version, [1], _megatron_params(perturbed, arch)).loads[1]
            rank = request.ranks[0]

            refused = []
            gone = dataclasses.replace(rank, handle={"kind": "shm", "path": "/dev/shm/libra-no-such-buffer"})
            bad_sum = BucketDigest(rank.manifest.buckets[1].start, rank.manifest.buckets[1].end, 12345)
            stale = RankLoad(
                dataclasses.replace(
                    rank.manifest, buckets=(rank.manifest.buckets[0], bad_sum, *rank.manifest.buckets[2:])
                ),
                rank.handle,
            )
            for broken in (gone, stale):
                result = await client.load_weights(dataclasses.replace(request, ranks=(broken,)))
                refused.append(result)
                assert (await client.stats()).weight_version == start
                assert await generate_all(client) == before_greedy
            unchanged = (await client.read_weights())[0]

            generated = (await client.stats()).num_generated_tokens
            in_flight = asyncio.create_task(
                client.generate("in-flight", prompts[2], _long_sampling(400), chunk_tokens=1)
            )
            while (await client.stats()).num_generated_tokens < generated + 4:
                await asyncio.sleep(0.005)
            loaded = await client.load_weights(request)
            preempted = await in_flight
            after_params, after_greedy = (await client.read_weights())[0], await generate_all(client)
            stats_version = (await client.stats()).weight_version

            restore = publisher.publish(version + 1, [1], _megatron_params(original, arch)).loads[1]
            restored = await client.load_weights(restore)
            return dict(
                start=start, before_params=before_params, before_greedy=before_greedy, refused=refused,
                unchanged=unchanged, loaded=loaded, preempted=preempted, after_params=after_params,
                after_greedy=after_greedy, stats_version=stats_version, restored=restored,
                restored_params=(await client.read_weights())[0], restored_greedy=await generate_all(client),
            )  # fmt: skip
        finally:
            await client.close()
            publisher.close()

    r = run(scenario())
    start, version = r["start"], r["start"] + 1
    gone, stale = r["refused"]
    assert not gone.ok and "is gone" in gone.error and gone.version == start, gone
    assert not stale.ok and "incomplete or stale" in stale.error and stale.version == start, stale
    assert all(torch_equal(r["unchanged"][n], t) for n, t in r["before_params"].items())

    loaded = r["loaded"]
    assert loaded.ok and loaded.version == version == r["stats_version"], loaded
    assert loaded.num_preempted == 1 and loaded.commit_seconds > 0 and loaded.seconds >= loaded.commit_seconds
    preempted = r["preempted"]
    assert preempted.finish_reason == FinishReason.PREEMPTED
    assert {c.weight_version for c in preempted.chunks} == {start}
    _assert_engine_holds(r["after_params"], perturbed, publisher.shape)
    assert r["after_greedy"] != r["before_greedy"], "the perturbation did not change greedy output"
    ties = assert_greedy_under_hf(hf_model(model_dirs.scripted, perturbed), prompts, r["after_greedy"])
    assert ties <= 2, f"{ties} near-ties: the comparison says little"

    assert r["restored"].ok and r["restored"].version == version + 1
    assert all(torch_equal(r["restored_params"][n], t) for n, t in r["before_params"].items())
    assert r["restored_greedy"] == r["before_greedy"]


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_malformed_load_requests_name_the_field():
    from libra.control.convert import InvalidArgument
    from libra.rollout import convert
    from libra.v1 import rollout_pb2, weights_pb2

    with pytest.raises(InvalidArgument, match="load must be set"):
        convert.load_request_from_proto(rollout_pb2.LoadWeightsRequest())
    manifest = weights_pb2.BufferManifest(
        version=3, key="tp1/rank0", dtype="float32", num_bytes=16,
        buckets=[weights_pb2.BucketDigest(start=0, end=8, checksum=1)],
    )  # fmt: skip
    rank = weights_pb2.RankLoad(manifest=manifest, handle=weights_pb2.TransportHandle(shm={"path": "/x"}))
    with pytest.raises(InvalidArgument, match=r"ranks\[0\]\.manifest: .*buckets cover 8 of 16"):
        convert.load_request_from_proto(
            rollout_pb2.LoadWeightsRequest(load=weights_pb2.VersionLoad(version=3, ranks=[rank]))
        )
    manifest.buckets[0].end = 16
    with pytest.raises(InvalidArgument, match=r"ranks\[0\]\.handle: no transport"):
        convert.load_request_from_proto(
            rollout_pb2.LoadWeightsRequest(
                load=weights_pb2.VersionLoad(version=3, ranks=[weights_pb2.RankLoad(manifest=manifest)])
            )
        )
    with pytest.raises(InvalidArgument, match="ranks must not be empty"):
        convert.load_request_from_proto(
            rollout_pb2.LoadWeightsRequest(load=weights_pb2.VersionLoad(version=3))
        )
