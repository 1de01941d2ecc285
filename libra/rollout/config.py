"""Rollout configuration: the engine of one rollout instance, and the agent loop.

Buckets (TP sizes and their remaining-token thresholds) are the scheduler's, in
`libra.scheduler.CmlfqConfig`; nothing here repeats them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libra.backends.base import Backend


@dataclass
class InstanceConfig:
    """One rollout instance: a vLLM `AsyncLLM` behind the RolloutInstance gRPC service. The
    engine settings left None take the backend's `engine_defaults` (`for_backend`)."""

    model: str = ""
    """Folder of an HF checkpoint (e.g. one made by `libra make-tiny-model`)."""
    dtype: str = "float32"
    """Engine dtype. fp32 on CPU makes greedy output equal transformers' token for token."""
    max_model_len: int = 2048
    """Context window (prompt + all turns). The agent loop ends a trajectory that would exceed it
    with CONTEXT_OVERFLOW."""
    tensor_parallel_size: int = 1
    """TP size k: the instance spans k devices and belongs to the bucket of TP k."""
    kv_cache_gib: int | None = None
    """KV-cache space on the CPU (VLLM_CPU_KVCACHE_SPACE). Default: the backend's (1 GiB)."""
    gpu_memory_utilization: float | None = None
    """Share of the device's memory the engine takes on an accelerator (below 1 when a train
    rank shares the device). Default: the backend's (0.9)."""
    max_num_seqs: int = 256
    """Requests the engine batches at once."""
    enforce_eager: bool | None = None
    """No graphs or torch.compile. Default: the backend's (eager on the CPU, graphs on accelerators)."""
    chunked_prefill: bool | None = None
    """Prefills split over engine steps. Default: the backend's (off on the CPU, where a seeded
    request's split prefill kills vLLM's engine; on on accelerators)."""
    seed: int = 0
    stats_window_s: float = 5.0
    """Window over which Stats reports generated tokens per second."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(
                f"rollout.instance.dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}"
            )
        for name in ("max_model_len", "tensor_parallel_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.instance.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_gib is not None and self.kv_cache_gib < 1:
            raise ValueError(f"rollout.instance.kv_cache_gib must be >= 1, got {self.kv_cache_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "rollout.instance.gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization}"
            )
        if self.stats_window_s <= 0:
            raise ValueError(f"rollout.instance.stats_window_s must be > 0, got {self.stats_window_s}")

    def for_backend(self, backend: Backend) -> InstanceConfig:
        """This config with every engine setting left None taken from `backend.engine_defaults`.
        A setting the backend has no use for (KV GiB on a GPU, a memory share on the CPU) is an
        error rather than silently ignored."""
        defaults = backend.engine_defaults
        for name, replacement in (
            ("kv_cache_gib", "gpu_memory_utilization"),
            ("gpu_memory_utilization", "kv_cache_gib"),
        ):
            if getattr(self, name) is not None and getattr(defaults, name) is None:
                raise ValueError(
                    f"rollout.instance.{name} does not apply to the {backend.name} backend, whose "
                    f"engine is sized by rollout.instance.{replacement}"
                )
        unset = {
            f.name: getattr(defaults, f.name)
            for f in dataclasses.fields(defaults)
            if getattr(self, f.name) is None
        }
        return dataclasses.replace(self, **unset)

    @property
    def engine_settings_decided(self) -> bool:
        """Whether every engine setting is decided (`for_backend`), as an engine needs."""
        return (
            self.enforce_eager is not None
            and self.chunked_prefill is not None
            and (self.kv_cache_gib is not None or self.gpu_memory_utilization is not None)
        )


@dataclass
class AgentLoopConfig:
    """The multi-turn agent loop in the controller."""

    max_turns: int = 8
    """Model turns per trajectory; a trajectory still calling tools after this many ends MAX_TURNS."""
    max_response_tokens: int = 4096
    """Budget of response tokens (model and tool tokens) per trajectory; reaching it ends MAX_TOKENS."""
    max_tokens_per_turn: int = 1024
    """Cap on the tokens one generation call may produce."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    stream_chunk_tokens: int = 0
    """Tokens per streamed chunk from an instance (0: one chunk per turn, the cheapest). Smaller
    chunks keep more tokens of a turn cut short by a dying instance."""
    max_tool_result_chars: int = 4096
    """Tool output beyond this is cut (with a note) before it is tokenized into the context."""
    tool_timeout_s: float = 60.0
    """A tool call running longer ends as a TIMEOUT result."""
    no_instance_wait_s: float = 600.0
    """How long a trajectory waits for a rollout instance when none is ready (or, while a plan's
    new instances load, none has room) before it ends NO_INSTANCE. Long enough for a restarted
    instance or a plan's new one to come up (20-60 s on a loaded 2-core CPU, minutes for a large
    model on GPUs): a trajectory is not lost to a gap in rollout capacity, and one kept waiting
    too long is dropped as stale, not as lost."""
    rpc_timeout_s: float = 600.0
    """Deadline of one generation call."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_response_tokens", "max_tokens_per_turn", "max_tool_result_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.agent.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(
                f"rollout.agent.temperature must be in [0, 2] (vLLM's range), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.agent.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.agent.top_k must be >= 0, got {self.top_k}")
        if self.stream_chunk_tokens < 0:
            raise ValueError(
                f"rollout.agent.stream_chunk_tokens must be >= 0, got {self.stream_chunk_tokens}"
            )
        for name in ("tool_timeout_s", "rpc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.agent.{name} must be > 0, got {getattr(self, name)}")
        if self.no_instance_wait_s < 0:
            raise ValueError(f"rollout.agent.no_instance_wait_s must be >= 0, got {self.no_instance_wait_s}")


@dataclass
class RolloutConfig:
    """Section `rollout` of `LibraConfig`."""

    instance: InstanceConfig = field(default_factory=InstanceConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
