"""Session fixtures for the weight-publication tests: one tiny Qwen2 model (tied embeddings, QKV
bias, head size 32 for vLLM's CPU attention), its resharding shape and the transfer plans from
Megatron TP=2 to vLLM TP=1 and TP=2, one Megatron TP=2 training job that takes a step on it, and
one in-process vLLM engine (TP=1) with the Libra worker extension. (The TP=2 engine, ~5 GB, lives
only as long as its own module: `test_publish_vllm_tp2.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.model_spec import ModelSpec
from libra.sync import ModelShape, build_transfer_plan, logical_tensors, megatron_layout, vllm_layout

PROBE_SEED = 21


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tests.training.tiny_models import make_hf_model

    return make_hf_model("qwen2", tmp_path_factory.mktemp("sync-model"), tie=True, seed=5, hidden=128)


@pytest.fixture(scope="session")
def shape(tiny_model) -> ModelShape:
    return ModelShape.from_spec(ModelSpec.from_hf_dir(tiny_model))


@pytest.fixture(scope="session")
def plans(shape) -> dict:
    """Transfer plans from the trainer's Megatron TP=2 to vLLM TP=1 and TP=2 (fp32, 4 KiB buckets)."""
    return {
        tp: build_transfer_plan(
            megatron_layout(shape, 2, 1), vllm_layout(shape, tp), logical_tensors(shape), 4, 4096
        )
        for tp in (1, 2)
    }


@pytest.fixture(scope="session")
def trained(tiny_model, tmp_path_factory) -> dict:
    """One GRPO step at Megatron TP=2: shards, the trainer's HF export and probe logprobs."""
    from tests.training.jobs import run_job

    spec = {"tp": 2, "models": [str(tiny_model)], "probe_seed": PROBE_SEED}
    script = str(Path(__file__).parent / "train_job.py")
    return run_job(spec, tmp_path_factory.mktemp("sync-train"), script=script)


@pytest.fixture(scope="session")
def llm(tiny_model):
    """In-process vLLM (TP=1, fp32) on the checkpoint, with the Libra weight loader."""
    from libra.backends import get_backend
    from libra.rollout.config import InstanceConfig
    from libra.rollout.engine import configure_vllm_env

    configure_vllm_env(InstanceConfig().for_backend(get_backend("cpu")))  # before vLLM is imported
    from vllm import LLM

    from libra.sync.vllm_loader import WORKER_EXTENSION

    engine = LLM(
        model=str(tiny_model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        skip_tokenizer_init=True,
        worker_extension_cls=WORKER_EXTENSION,
        seed=0,
    )
    return engine
