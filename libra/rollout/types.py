"""Typed messages of the rollout service. Protobuf stays at the edge (`convert.py`); the engine
wrapper, the client and the agent loop work on these. Enum values equal the proto's."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    NONE = 0
    """Not finished: an intermediate chunk."""
    STOP = 1
    """A stop token or EOS, which is the last token of the output."""
    LENGTH = 2
    """max_tokens or the context window."""
    ABORT = 3
    PREEMPTED = 4
    """A Pause in ABORT mode ended it: resubmit from the tokens kept."""


class PauseMode(enum.IntEnum):
    KEEP = 1
    """Requests in flight freeze and go on after Resume."""
    ABORT = 2
    """Requests in flight end PREEMPTED."""


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    """0: greedy."""
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    """Generate past the model's EOS (stop_token_ids still stop): fixed lengths for benchmarks."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def derive_seed(*parts: object) -> int:
    """A sampling seed (31 bits, what every engine accepts) that is a function of `parts` only:
    the same parts give the same random numbers on any machine and in any run."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


@dataclass
class Chunk:
    """New tokens of one generation call, all produced by one policy version."""

    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: FinishReason = FinishReason.NONE
    stop_token_id: int = -1


@dataclass
class Segment:
    """The tokens one generation call produced, in policy-version runs."""

    chunks: list[Chunk] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    stop_token_id: int = -1

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]


@dataclass(frozen=True)
class InstanceStats:
    num_active_requests: int
    kv_cache_usage: float
    generated_tokens_per_s: float
    num_generated_tokens: int
    weight_version: int
    paused: bool
    max_model_len: int
    tensor_parallel_size: int
    model: str
    num_engine_steps: int = 0
    """Engine steps that produced output since start."""
    num_prompt_tokens: int = 0
    """Prompt tokens those steps computed (prefill; prefix-cache hits excluded)."""
