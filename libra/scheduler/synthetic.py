"""A synthetic long-tailed multi-turn agentic workload, for benchmarks and the simulator.

Each prompt is a small debugging task with its own character: a tool it works with, a typical
turn length, how many bugs its solutions tend to have, how easily they get fixed and how often a
first attempt is too slow. A trajectory writes code and runs it; a too-slow attempt times out
until it is rewritten; then the tests fail, with output that grows with the number of bugs left,
until the bugs are fixed; then a validator succeeds and it answers. So tool-return outcomes
cause the remaining work, as C-MLFQ assumes: a large failure output means many fixes ahead, a
validated success means one turn. Bug counts are geometric with a per-prompt mean drawn from a
log-normal, which makes turn counts and output lengths long-tailed across prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from libra.scheduler.config import CmlfqConfig
from libra.scheduler.tool_state import ToolReturnState, size_class_of
from libra.trajectory import ToolStatus


@dataclass(frozen=True)
class SyntheticWorkloadConfig:
    num_prompts: int = 200
    seed: int = 0
    max_turns: int = 64
    median_tokens_per_turn: float = 350.0
    """Median over prompts of a prompt's typical turn length (log-normal across prompts)."""
    median_bugs: float = 1.5
    """Median over prompts of a prompt's mean number of bugs (log-normal across prompts)."""
    tokens_per_failing_test: tuple[int, int] = (2000, 4000)
    """Range of the test output per remaining bug, in payload tokens."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_turns < 2:
            raise ValueError(f"max_turns must be >= 2, got {self.max_turns}")


@dataclass(frozen=True)
class PromptProfile:
    prompt_id: str
    tool: str
    """The tool its solutions are run with."""
    searches_first: bool
    """Opens with a search before writing code."""
    tokens_per_turn: float
    mean_bugs: float
    fix_probability: float
    """Chance that a failing run leads to a fix of one bug."""
    slow_probability: float
    """Chance that a trajectory's first attempt is too slow and times out until rewritten."""


@dataclass(frozen=True)
class ToolReturnEvent:
    state: ToolReturnState
    generated_tokens: int
    """Output tokens generated before this tool return."""


@dataclass(frozen=True)
class SyntheticTrajectory:
    trajectory_id: str
    prompt_id: str
    tool_returns: tuple[ToolReturnEvent, ...]
    total_output_tokens: int


class SyntheticWorkload:
    """Deterministic for a given config: prompt profiles are drawn once, trajectories in order."""

    def __init__(
        self, config: SyntheticWorkloadConfig | None = None, cmlfq: CmlfqConfig | None = None
    ) -> None:
        self.config = config or SyntheticWorkloadConfig()
        self.cmlfq = cmlfq or CmlfqConfig()
        self._rng = random.Random(self.config.seed)
        self.prompts = [self._draw_prompt(i) for i in range(self.config.num_prompts)]
        self._next_id = 0

    def _draw_prompt(self, index: int) -> PromptProfile:
        rng = self._rng
        return PromptProfile(
            prompt_id=f"prompt-{index}",
            tool=rng.choice(("python", "bash", "sql")),
            searches_first=rng.random() < 0.4,
            tokens_per_turn=self.config.median_tokens_per_turn * math.exp(rng.gauss(0.0, 0.7)),
            mean_bugs=self.config.median_bugs * math.exp(rng.gauss(0.0, 1.0)),
            fix_probability=rng.uniform(0.3, 0.8),
            slow_probability=rng.uniform(0.0, 0.5),
        )

    def trajectories(self) -> Iterator[SyntheticTrajectory]:
        """An endless stream, prompts drawn uniformly."""
        while True:
            yield self.trajectory(self._rng.choice(self.prompts))

    def trajectory(self, prompt: PromptProfile) -> SyntheticTrajectory:
        rng = self._rng
        trajectory_id = f"traj-{self._next_id}"
        self._next_id += 1
        bugs = _geometric(rng, prompt.mean_bugs)
        slow = rng.random() < prompt.slow_probability
        events: list[ToolReturnEvent] = []
        generated = 0

        def turn(tool: str, status: ToolStatus, payload_tokens: int) -> None:
            nonlocal generated
            generated += max(1, round(prompt.tokens_per_turn * math.exp(rng.gauss(0.0, 0.35))))
            state = ToolReturnState(tool, size_class_of(payload_tokens, self.cmlfq), status)
            events.append(ToolReturnEvent(state, generated))

        if prompt.searches_first:
            turn("search", ToolStatus.SUCCESS, rng.randint(800, 4000))
        while len(events) < self.config.max_turns - 1:
            if slow:
                turn(prompt.tool, ToolStatus.TIMEOUT, rng.randint(10, 100))
                slow = rng.random() < 0.5  # rewritten, or not yet
            elif bugs > 0:
                turn(
                    prompt.tool, ToolStatus.FAILURE, bugs * rng.randint(*self.config.tokens_per_failing_test)
                )
                bugs -= rng.random() < prompt.fix_probability
            else:
                turn("validator", ToolStatus.SUCCESS, rng.randint(20, 400))
                break
        # The final answer turn.
        generated += max(1, round(prompt.tokens_per_turn * math.exp(rng.gauss(0.0, 0.35))))
        return SyntheticTrajectory(trajectory_id, prompt.prompt_id, tuple(events), generated)


def _geometric(rng: random.Random, mean: float) -> int:
    """Failures before the first success, with the given mean."""
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p)) if p < 1.0 else 0
