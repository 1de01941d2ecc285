"""End to end on the CPU at vLLM TP=2: the Megatron TP=2 training step, published over shared
memory into a running TP=2 `vllm.LLM` (two worker processes, each loading its own rank's buffer),
checked bit for bit on every rank against vLLM's own sharding of the trainer's HF export, and by
greedy output against transformers. A corrupted transfer on one rank leaves BOTH ranks on the old
version (the load is two-phase: no rank commits unless every rank staged), and the retry succeeds.

Needs: 2 cores (vLLM on CPU binds one TP rank per core: `VLLM_CPU_OMP_THREADS_BIND`), ~5 GB free
memory for the multiprocess engine, and the session's 2-process gloo training job.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libra.sync.instance_update import apply_version
from libra.sync.publisher import WeightPublisher, buffer_key
from libra.sync.shm import ShmSender
from libra.sync.versions import VersionLedger
from tests.sync.engine_helpers import PROMPTS, rank_params, vllm_greedy
from tests.sync.hf_reference import assert_greedy_under_hf, hf_greedy, hf_model
from tests.sync.reference_reshard import hf_to_vllm, megatron_to_hf

# Engine start (15-60 s on 2 busy cores) falls into the first test's time.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

TP = 2
MIN_FREE_GIB = 6.0  # the TP=2 engine peaks at ~5 GB (front end + 2 workers), plus headroom


def _free_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    return 0.0


@contextlib.contextmanager
def _engine_env(cores: list[int]) -> Iterator[None]:
    """The environment a TP=2 CPU engine needs while it starts (its processes inherit it), restored
    afterwards so that engines started later in the session are not affected."""
    import vllm.envs

    values = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        # The only binding that starts TP=2 on a single NUMA node: one core per rank ("auto" asks
        # for one NUMA node per rank and refuses).
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cores[:TP]),
        # TP=2 is always the multiprocess engine: front end, engine core, one process per rank.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    # An in-process engine started earlier in this session (the TP=1 `llm` fixture) froze vLLM's
    # env reads (`enable_envs_cache`); without this the new values would not be seen.
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def llm_tp2(tiny_model):
    """A TP=2 vLLM engine (fp32, eager) with the Libra weight loader; shut down with the module."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < TP:
        pytest.skip(f"vLLM TP={TP} on CPU needs {TP} cores (one per rank), this process may use {len(cores)}")
    if _free_gib() < MIN_FREE_GIB:
        pytest.skip(
            f"vLLM TP={TP} on CPU needs ~{MIN_FREE_GIB:.0f} GiB free memory, {_free_gib():.1f} GiB available"
        )
    from vllm import LLM

    from libra.sync.vllm_loader import WORKER_EXTENSION

    with _engine_env(cores):
        engine = LLM(
            model=str(tiny_model),
            dtype="float32",
            enforce_eager=True,
            max_model_len=128,
            tensor_parallel_size=TP,
            skip_tokenizer_init=True,
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
        )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def assert_ranks_hold(llm, expected_ranks: list[dict[str, torch.Tensor]]) -> None:
    """Every rank's live params (as the engine computes with them) equal the expected per-rank
    tensors bit for bit."""
    got_ranks = rank_params(llm)
    assert len(got_ranks) == TP, f"{len(got_ranks)} param blobs from a TP={TP} engine"
    for rank, (got, expected) in enumerate(zip(got_ranks, expected_ranks, strict=True)):
        expected = dict(expected)
        packed = {name for name in got if name.endswith("@packed")}
        # Tied: the embedding and the LM head each compute with a packed copy of this rank's
        # vocab shard of the embedding.
        assert packed == {"model.embed_tokens.weight@packed", "lm_head.weight@packed"}, (rank, packed)
        for name in packed:
            expected[name] = expected["model.embed_tokens.weight"]
        assert set(got) == set(expected), (rank, set(got) ^ set(expected))
        for name, tensor in expected.items():
            assert got[name].shape == tensor.shape, (rank, name, got[name].shape, tensor.shape)
            assert torch.equal(got[name].view(torch.int32), tensor.contiguous().view(torch.int32)), (
                rank,
                name,
            )


def test_trained_step_published_to_tp2_engine_is_bit_identical_on_every_rank(
    llm_tp2, trained, plans, shape, tiny_model
):
    assert llm_tp2.collective_rpc("libra_weight_version") == [0] * TP
    start_greedy = vllm_greedy(llm_tp2, PROMPTS)
    assert start_greedy == hf_greedy(hf_model(tiny_model, None), PROMPTS)
    sender = ShmSender()
    try:
        publication = WeightPublisher({TP: plans[TP]}, sender, torch.float32).publish(1, trained["shards"])
        result = apply_version(llm_tp2, publication.load_request(TP))
        assert result.ok, result.error
        assert result.version == 1
        assert llm_tp2.collective_rpc("libra_weight_version") == [1] * TP

        assert_ranks_hold(llm_tp2, hf_to_vllm(trained["hf"], shape, TP))
        after = vllm_greedy(llm_tp2, PROMPTS)
        ties = assert_greedy_under_hf(hf_model(tiny_model, trained["hf"]), PROMPTS, after)
        assert ties <= 2, f"{ties} near-ties: the comparison says little"
        assert after != start_greedy, "the training step did not change greedy output: weak test"
    finally:
        sender.close()


def _corrupt_middle_bucket(path: Path, manifest) -> int:
    """Flips every bit of 8 bytes inside one bucket of the published file (a transfer that went
    bad in transit); returns the bucket index."""
    index = len(manifest.buckets) // 2
    bucket = manifest.buckets[index]
    with open(path, "r+b") as f:
        f.seek(bucket.start)
        good = f.read(8)
        f.seek(bucket.start)
        f.write(bytes(b ^ 0xFF for b in good))
    return index


def test_corrupted_bucket_on_one_rank_keeps_both_ranks_on_old_version_and_retry_succeeds(
    llm_tp2, trained, plans, shape
):
    version = llm_tp2.collective_rpc("libra_weight_version")[0]
    assert version >= 1, "runs after the first publication (module order)"
    before_ranks, before_greedy = rank_params(llm_tp2), vllm_greedy(llm_tp2, PROMPTS)
    # The next version: the trained shards scaled, so a rank left on either version would show.
    shards = {key: tensor * 0.9 for key, tensor in trained["shards"].items()}
    ledger = VersionLedger(initial_version=version, backoff_s=1.0)
    ledger.add_instance("tp2", version)
    sender = ShmSender()
    try:
        publication = WeightPublisher({TP: plans[TP]}, sender, torch.float32).publish(version + 1, shards)
        ledger.publish(version + 1)
        request = publication.load_request(TP)
        path = Path(publication.handles[buffer_key(TP, 1)]["path"])
        pristine = path.read_bytes()
        bad_bucket = _corrupt_middle_bucket(path, publication.manifests[buffer_key(TP, 1)])

        (task,) = ledger.due(now=0.0)
        failed = apply_version(llm_tp2, request)
        assert not failed.ok
        assert "rank 1" in failed.error and f"bucket {bad_bucket} " in failed.error, failed.error
        assert "rank 0" not in failed.error, "rank 0's buffer was intact: " + failed.error
        assert failed.version == version
        ledger.failed(task.instance, task.version, failed.error, now=0.0)
        # Rank 0 staged the new version but never committed it: both ranks still run the old one.
        assert llm_tp2.collective_rpc("libra_weight_version") == [version] * TP
        for rank, (after, before) in enumerate(zip(rank_params(llm_tp2), before_ranks, strict=True)):
            assert set(after) == set(before)
            for name, tensor in before.items():
                assert torch.equal(after[name].view(torch.int32), tensor.view(torch.int32)), (rank, name)
        assert vllm_greedy(llm_tp2, PROMPTS) == before_greedy

        # The transport delivers intact bytes the second time; the ledger retries after backoff.
        path.write_bytes(pristine)
        assert ledger.due(now=0.5) == [], "retried before its backoff"
        (retry_task,) = ledger.due(now=1.0)
        assert retry_task.version == version + 1
        retry = apply_version(llm_tp2, request)
        assert retry.ok, retry.error
        ledger.loaded(retry_task.instance, retry.version, now=1.0)
        assert ledger.version_of("tp2") == version + 1
        assert llm_tp2.collective_rpc("libra_weight_version") == [version + 1] * TP
        assert_ranks_hold(llm_tp2, hf_to_vllm(megatron_to_hf(shards, shape, 2, 1), shape, TP))
    finally:
        sender.close()
