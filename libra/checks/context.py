"""What the checks share: the backend, its torch device, one torch.distributed world and Megatron
parallel state (a process can initialize them once), a tiny random Qwen3 checkpoint, a tiny
Qwen3 policy with a tokenizer and chat template as the job serves one, and the rollout instance
serving it."""

from __future__ import annotations

import socket
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from libra.backends import Backend
    from libra.checks.instance import CheckInstance
    from libra.training.parallel import RankInfo

TINY_VOCAB = 300
"""Not a multiple of 128: Megatron pads the vocabulary, as it does for real models."""


class CheckContext:
    def __init__(self, backend_name: str, workdir: Path):
        self.backend_name = backend_name
        self.workdir = workdir
        self._world: RankInfo | None = None
        self._tiny_model: Path | None = None
        self._policy: Path | None = None
        self._instance: CheckInstance | None = None

    @cached_property
    def backend(self) -> Backend:
        from libra.backends import get_backend

        return get_backend(self.backend_name)

    @cached_property
    def device(self) -> torch.device:
        return self.backend.torch_device(0)

    def world(self) -> RankInfo:
        """A one-rank world (TP = PP = DP = 1) over the backend's collective."""
        if self._world is None:
            from libra.training.parallel import initialize

            # The cpu backend patches Megatron here: before Megatron builds anything.
            self.backend.prepare_worker()
            self._world = initialize(
                1,
                1,
                rank=0,
                world_size=1,
                master_addr="127.0.0.1",
                master_port=_free_port(),
                backend=self.backend.distributed_backend,
            )
        return self._world

    def tiny_model(self) -> Path:
        """A random Qwen3 (QK-norm, GQA 4q/2kv, head_dim 16, tied embeddings) in fp32 safetensors."""
        if self._tiny_model is None:
            self._tiny_model = _write_tiny_qwen3(self.workdir / "tiny-qwen3")
        return self._tiny_model

    def policy(self) -> Path:
        """`libra make-tiny-model --random --arch qwen3`: a random Qwen3 with the factory's
        tokenizer and chat template, what a rollout instance and the job need to serve a model."""
        if self._policy is None:
            from libra.tasks.tiny_model import TinyModelSpec, make_tiny_model

            self._policy = make_tiny_model(self.workdir / "tiny-policy", TinyModelSpec(arch="qwen3"))
        return self._policy

    def instance(self) -> CheckInstance:
        """A rollout instance serving `policy()` in fp32 (exact comparisons) with the backend's
        engine defaults, started on first use and kept until `close`."""
        if self._instance is None:
            from libra.checks.instance import CheckInstance, check_instance_config

            instance = CheckInstance(
                check_instance_config(self.policy(), self.backend),
                self.backend_name,
                self.workdir,
                "instance",
            )
            self._instance = instance.__enter__()
        return self._instance

    def stop_instance(self) -> None:
        """Stops `instance()`'s process (a check that needs its device memory calls this)."""
        if self._instance is not None:
            self._instance.__exit__(None, None, None)
            self._instance = None

    def close(self) -> None:
        self.stop_instance()
        if self._world is not None:
            from libra.training.parallel import shutdown

            shutdown()
            self._world = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_tiny_qwen3(directory: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    # HF's init (std 0.02) leaves logits near zero, where a wrong mapping can hide: wider weights,
    # and norms away from 1 so that swapped norms show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
