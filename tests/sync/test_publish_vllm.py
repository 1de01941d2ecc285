"""End to end on the CPU: a Megatron TP=2 training step, published through each transport into a
running vLLM engine, checked bit for bit against the trainer's own HF export, by greedy output
against transformers, and by the train/inference logprob gap; failed transfers and failed commits
leave the engine on its old version, and the retry succeeds.

Needs: vLLM (one in-process engine, ~2 GB) and a 2-process gloo training job; ~40 s on 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from libra.sync.grpc_stream import GrpcSender
from libra.sync.instance_update import apply_version
from libra.sync.publisher import WeightPublisher, buffer_key
from libra.sync.shm import ShmSender
from tests.sync.engine_helpers import PROMPTS, engine_params, vllm_greedy
from tests.sync.hf_reference import assert_greedy_under_hf, hf_greedy, hf_model
from tests.sync.reference_reshard import hf_to_vllm, megatron_to_hf

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_trained_step_published_over_shm_is_bit_identical_and_greedy_matches(
    llm, trained, plans, shape, tiny_model
):
    start_greedy = vllm_greedy(llm, PROMPTS)
    assert start_greedy == hf_greedy(hf_model(tiny_model, None), PROMPTS)
    sender = ShmSender()
    try:
        publication = WeightPublisher(plans, sender, torch.float32).publish(1, trained["shards"])
        result = apply_version(llm, publication.load_request(1))
        assert result.ok, result.error
        assert result.version == 1 == llm.collective_rpc("libra_weight_version")[0]

        hf = trained["hf"]
        # TP=1: what the running engine computes with equals the trainer's export, bit for bit.
        expected = hf_to_vllm(hf, shape, 1)[0]
        got = engine_params(llm)
        packed = {name for name in got if name.endswith("@packed")}
        # Tied: the embedding and the LM head each compute with a packed copy of the embedding.
        assert packed == {"model.embed_tokens.weight@packed", "lm_head.weight@packed"}
        for name in packed:
            expected[name] = expected["model.embed_tokens.weight"]
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name].view(torch.int32), tensor.contiguous().view(torch.int32)), name
        # TP=2: each rank's published buffer equals vLLM's own sharding of the export (engine not run).
        for rank, rank_expected in enumerate(hf_to_vllm(hf, shape, 2)):
            manifest = publication.manifests[buffer_key(2, rank)]
            flat = torch.frombuffer(
                Path(publication.handles[manifest.key]["path"]).read_bytes(), dtype=torch.float32
            )
            for entry in manifest.params:
                piece = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
                assert torch.equal(piece, rank_expected[entry.name]), (rank, entry.name)

        after = vllm_greedy(llm, PROMPTS)
        ties = assert_greedy_under_hf(hf_model(tiny_model, hf), PROMPTS, after)
        assert ties <= 2, f"{ties} near-ties: the comparison says little"
        assert after != start_greedy, "the training step did not change greedy output: weak test"
    finally:
        sender.close()


def test_train_inference_logprob_gap(llm, trained):
    """Per-token logprobs of the same tokens under the same weights (version 1, loaded by the
    previous test): vLLM's prompt logprobs against the Megatron trainer's (TP=2, fp32)."""
    from vllm import SamplingParams, TokensPrompt

    assert llm.collective_rpc("libra_weight_version")[0] == 1
    diffs = []
    for trajectory, trainer_lp in zip(trained["probe"], trained["trainer_logprobs"], strict=True):
        tokens = trajectory.prompt_token_ids + trajectory.response_token_ids
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        output = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        offset = len(trajectory.prompt_token_ids)
        for j, (token, mask) in enumerate(
            zip(trajectory.response_token_ids, trajectory.loss_mask, strict=True)
        ):
            if mask:
                engine_lp = output.prompt_logprobs[offset + j][token].logprob
                diffs.append(abs(engine_lp - trainer_lp[j]))
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(f"train/inference logprob gap over {len(diffs)} tokens: mean {mean:.3e}, max {worst:.3e}")
    assert worst < 1e-4, f"gap mean {mean:.3e} max {worst:.3e}"


class _DyingSender(GrpcSender):
    """A publisher that dies halfway through every stream (the connection drops mid-transfer)."""

    def iter_chunks(self, buffer, chunk_bytes):
        for i, chunk in enumerate(super().iter_chunks(buffer, chunk_bytes)):
            if i * chunk_bytes >= buffer.numel() // 2:
                raise RuntimeError("publisher killed")
            yield chunk


def test_transfer_killed_halfway_keeps_old_version_and_retry_succeeds(llm, trained, plans):
    os.environ.setdefault("LIBRA_TOKEN", "sync-test-token")
    token = os.environ["LIBRA_TOKEN"]
    version = llm.collective_rpc("libra_weight_version")[0]
    before_params, before_greedy = engine_params(llm), vllm_greedy(llm, PROMPTS)
    # Version 2: the trained shards scaled, so that a half-loaded engine would show.
    shards = {key: tensor * 0.9 for key, tensor in trained["shards"].items()}

    dying = _DyingSender(token, chunk_bytes=16 << 10)
    try:
        publication = WeightPublisher({1: plans[1]}, dying, torch.float32).publish(version + 1, shards)
        result = apply_version(llm, publication.load_request(1))
    finally:
        dying.close()
    assert not result.ok and "broke after" in result.error, result.error
    assert result.version == version == llm.collective_rpc("libra_weight_version")[0]
    after = engine_params(llm)
    assert all(torch.equal(after[n], before_params[n]) for n in before_params)
    assert vllm_greedy(llm, PROMPTS) == before_greedy

    healthy = GrpcSender(token, chunk_bytes=16 << 10)
    try:
        publication = WeightPublisher({1: plans[1]}, healthy, torch.float32).publish(version + 1, shards)
        retry = apply_version(llm, publication.load_request(1))
    finally:
        healthy.close()
    assert retry.ok, retry.error
    assert retry.version == version + 1 == llm.collective_rpc("libra_weight_version")[0]
    scaled = engine_params(llm)
    assert torch.equal(scaled["model.norm.weight"], before_params["model.norm.weight"] * 0.9)


def test_commit_failing_midway_restores_the_old_version(llm, trained, plans):
    version = llm.collective_rpc("libra_weight_version")[0]
    before_params, before_greedy = engine_params(llm), vllm_greedy(llm, PROMPTS)
    shards = {key: tensor * 1.1 for key, tensor in trained["shards"].items()}
    sender = ShmSender()
    try:
        publication = WeightPublisher({1: plans[1]}, sender, torch.float32).publish(version + 1, shards)
        request = publication.load_request(1)
        failed = apply_version(llm, request, fail_after=7)  # after 7 params are already overwritten
        assert not failed.ok and "injected failure" in failed.error
        assert failed.version == version == llm.collective_rpc("libra_weight_version")[0]
        after = engine_params(llm)
        assert all(torch.equal(after[n], before_params[n]) for n in before_params)
        assert vllm_greedy(llm, PROMPTS) == before_greedy

        # A stale bucket (the file rewritten under the manifest) is refused before any copy.
        path = Path(publication.handles[buffer_key(1, 0)]["path"])
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - 8)
            f.write(b"\0" * 8)
        stale = apply_version(llm, request)
        assert not stale.ok and "incomplete or stale" in stale.error, stale.error
        assert stale.version == version
    finally:
        sender.close()


def test_collective_group_transport(llm, trained, plans, shape):
    """gloo p2p between a publisher thread (group rank 0) and the engine's worker (rank 1)."""
    from libra.sync.collective import CollectiveSender
    from tests.training.jobs import free_port

    version = llm.collective_rpc("libra_weight_version")[0]
    port = free_port()
    sender = CollectiveSender("127.0.0.1", port, num_receivers=1, timeout_s=60)
    assert llm.collective_rpc("libra_join_collective", args=("127.0.0.1", port, 1, 2)) == [1]
    assert sender.wait_ready(60)
    shards = {key: tensor * 0.5 for key, tensor in trained["shards"].items()}
    publication = WeightPublisher({1: plans[1]}, sender, torch.float32).publish(version + 1, shards)
    result = apply_version(llm, publication.load_request(1))
    assert result.ok, result.error
    assert llm.collective_rpc("libra_weight_version")[0] == version + 1
    expected = hf_to_vllm(megatron_to_hf(shards, shape, 2, 1), shape, 1)[0]
    got = engine_params(llm)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    llm.collective_rpc("libra_leave_collective")
