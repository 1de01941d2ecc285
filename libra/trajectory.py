"""The trajectory: the one type that rollout, scheduling, training and the simulator all share.

A trajectory is one multi-turn episode. Everything after the prompt is the *response*: the
model's tokens and the tool-result tokens appended between turns, in order, exactly as they were
fed to the engine (nothing is re-tokenized). Per response token we keep whether it is trained on
(`loss_mask`), the sampling logprob, and the policy version that produced it, so a trajectory
interrupted by a weight update and resumed under a newer policy stays exact.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

TOOL_TOKEN_VERSION = -1
"""`policy_versions` entry of tokens the model did not produce (tool results, templates)."""


class ToolStatus(enum.IntEnum):
    SUCCESS = 0
    FAILURE = 1
    TIMEOUT = 2


class Outcome(enum.Enum):
    """How a trajectory ended. Every ending is recorded; none escapes as an exception."""

    RUNNING = "running"
    ANSWERED = "answered"
    """The model gave a final answer (no tool call in its last turn)."""
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    """The response reached its token budget."""
    CONTEXT_OVERFLOW = "context_overflow"
    """Prompt plus response no longer fit the engine's context window."""
    NO_INSTANCE = "no_instance"
    """No rollout instance could take the next turn (all lost)."""
    ABORTED = "aborted"
    ERROR = "error"
    """An unexpected failure; `Trajectory.outcome_reason` says what."""


@dataclass
class ToolReturn:
    """One tool call's result, as the scheduler's causal state needs it."""

    tool: str
    status: ToolStatus
    payload_tokens: int
    """Tokens of the result as appended to the context."""
    response_tokens_before: int
    """Model-generated response tokens before this tool return (to compute remaining lengths)."""


@dataclass
class Trajectory:
    trajectory_id: str
    prompt_id: str
    group_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 for tokens the model sampled (trained on), 0 for tool results and template tokens."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Sampling logprob of each response token (0.0 where `loss_mask` is 0)."""
    policy_versions: list[int] = field(default_factory=list)
    """Policy version that produced each response token (TOOL_TOKEN_VERSION for tool tokens)."""
    tool_returns: list[ToolReturn] = field(default_factory=list)
    num_turns: int = 0
    reward: float | None = None
    outcome: Outcome = Outcome.RUNNING
    outcome_reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    """Task fields needed to score it (e.g. ground truth id); never used for training."""
    sampling_seed: int | None = None
    """None: fresh random numbers (a group's samples must differ to be compared). Set (the
    held-out evaluation): each generation call is seeded by it and the position the call starts
    at, so that a trajectory rolled out again with the same seed draws the same numbers turn by
    turn, on any instance and in any batch (up to the engine's rounding); a call cut and resumed
    mid-turn draws other numbers from there."""

    def append(self, token_ids: list[int], logprobs: list[float] | None, policy_version: int) -> None:
        """Appends model tokens (with `logprobs`) or, with `logprobs=None`, tool/template tokens."""
        self.response_token_ids.extend(token_ids)
        if logprobs is None:
            self.loss_mask.extend([0] * len(token_ids))
            self.rollout_logprobs.extend([0.0] * len(token_ids))
            self.policy_versions.extend([TOOL_TOKEN_VERSION] * len(token_ids))
        else:
            if len(logprobs) != len(token_ids):
                raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
            self.loss_mask.extend([1] * len(token_ids))
            self.rollout_logprobs.extend(logprobs)
            self.policy_versions.extend([policy_version] * len(token_ids))

    def truncate(self, num_response_tokens: int) -> None:
        """Keeps only the first `num_response_tokens` response tokens (a stop string of the
        OpenAI endpoint ends a turn inside what the engine sampled: the rest is not shown to the
        client, so it must not be trained on either)."""
        for per_token in (
            self.response_token_ids,
            self.loss_mask,
            self.rollout_logprobs,
            self.policy_versions,
        ):
            del per_token[num_response_tokens:]

    @property
    def token_ids(self) -> list[int]:
        """The full context: prompt then response."""
        return self.prompt_token_ids + self.response_token_ids

    def model_turns(self) -> list[list[int]]:
        """The model's turns: maximal runs of loss-mask-1 tokens of the response."""
        turns, current = [], []
        for token, mask in zip(self.response_token_ids, self.loss_mask, strict=True):
            if mask:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        if current:
            turns.append(current)
        return turns

    @property
    def last_turn_end(self) -> int:
        """Response tokens up to the model's last sampled one (0 before its first turn): what
        follows (tool returns, template tokens) is not yet in any instance's KV."""
        return next((i + 1 for i in range(len(self.loss_mask) - 1, -1, -1) if self.loss_mask[i]), 0)

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_policy_version(self) -> int | None:
        versions = [v for v in self.policy_versions if v != TOOL_TOKEN_VERSION]
        return min(versions) if versions else None
