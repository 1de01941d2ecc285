"""What the checks share: the backend, its torch device, one torch.distributed world and Megatron
parallel state (a process can initialize them once), a tiny random Qwen3 with a tokenizer and
chat template, and the rollout instance serving it."""

from __future__ import annotations

import socket
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from libra.tasks.tiny_model import TinyModelSpec, make_tiny_model

if TYPE_CHECKING:
    import torch

    from libra.backends import Backend
    from libra.checks.instance import CheckInstance
    from libra.training.parallel import RankInfo

TINY_QWEN3 = TinyModelSpec(arch="qwen3", vocab_size=300, norm_std=0.2, tie_word_embeddings=True)
"""The checks' model, with the factory's tokenizer and chat template (an instance and the job
serve it): a vocabulary that is no multiple of 128, which Megatron pads as it does real models';
norms away from 1, so that swapped norms show; tied embeddings, as the smaller Qwen3s have."""
TINY_VOCAB = TINY_QWEN3.vocab_size


class CheckContext:
    def __init__(self, backend_name: str, workdir: Path):
        self.backend_name = backend_name
        self.workdir = workdir
        self._world: RankInfo | None = None
        self._tiny_model: Path | None = None
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
        """`TINY_QWEN3`, built on first use (`libra.tasks.tiny_model`, a few seconds)."""
        if self._tiny_model is None:
            self._tiny_model = make_tiny_model(self.workdir / "tiny-qwen3", TINY_QWEN3)
        return self._tiny_model

    def instance(self) -> CheckInstance:
        """A rollout instance serving `tiny_model()` in fp32 (exact comparisons) with the backend's
        engine defaults, started on first use and kept until `close`."""
        if self._instance is None:
            from libra.checks.instance import CheckInstance, check_instance_config

            config = check_instance_config(self.tiny_model(), self.backend)
            self._instance = CheckInstance(config, self.backend_name, self.workdir, "instance").start()
        return self._instance

    def stop_instance(self) -> None:
        """Stops `instance()`'s process (a check that needs its device memory calls this)."""
        if self._instance is not None:
            self._instance.stop()
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
