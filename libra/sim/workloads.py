"""Trace generators shaped like the three agentic workloads of the original evaluation, with long
tails and drift.

All three share one causal story, so that tool returns carry information about the work left (as
C-MLFQ assumes, and as real agents behave): a trajectory has some number of problems to fix; each
turn ends in a tool call whose outcome reflects what is left -- a failing run prints output that
grows with the problems left, a timeout means a rewrite, a success leads to the final answer.
Problem counts are geometric with a per-prompt mean drawn log-normally, so a few prompts produce
most of the long trajectories (the long tail), and a prompt's difficulty is stable across the
epochs it is drawn in (what C-MLFQ's per-prompt trees learn).

- `r2e`: R2E-Gym-style issue work. Long turns, a validator tool with large failure output and
  test-suite latencies, up to 12 turns and 30K new tokens in a 32K context.
- `search_r1`: retrieval. Many short turns, a search tool returning ~1K-token documents in under
  a second; hard questions search many times.
- `dapo_math`: DAPO-Math with a code tool. Few, long reasoning turns; a Python tool whose
  failures are short tracebacks.

Drift: as training goes on (`progress` from 0 to 1) turns get longer by `length_drift` and prompts
harder by `difficulty_drift` (relative), so a split that was right at step 0 is not at step 100.
Generation is deterministic per (seed, group index), whatever order groups are asked for in.

A real run's own groups replay through the same interface (`ReplayedGroups`, a `GroupSource`):
the simulator then runs on what the job measured instead of a synthetic workload.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from libra.trace import TrajectoryTrace, TurnTrace
from libra.trajectory import ToolStatus


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of one workload; see the module docstring for the story."""

    name: str
    tool: str
    """The main tool (its returns carry the causal signal)."""
    median_prompt_tokens: int
    median_turn_tokens: float
    """Median over prompts of a prompt's typical turn length."""
    turn_tokens_sigma: float
    """Log-normal spread of turn lengths across prompts."""
    median_problems: float
    """Median over prompts of the mean number of problems a trajectory must fix."""
    problems_sigma: float
    fix_probability: float
    """Chance that one failing turn fixes one problem."""
    timeout_probability: float
    max_turns: int
    max_new_tokens: int
    context_limit: int
    failure_payload_per_problem: tuple[int, int]
    success_payload: tuple[int, int]
    median_tool_latency_s: float
    timeout_latency_s: float
    opening_tool: str = ""
    """A tool some trajectories call first (exploration), with a small fixed-shape return."""
    opening_probability: float = 0.0

    def __post_init__(self) -> None:
        if self.max_turns < 2:
            raise ValueError(f"workload {self.name}: max_turns must be >= 2, got {self.max_turns}")
        if self.max_new_tokens < 1 or self.context_limit <= self.median_prompt_tokens:
            raise ValueError(f"workload {self.name}: max_new_tokens and context_limit are too small")
        if not 0 < self.fix_probability <= 1:
            raise ValueError(f"workload {self.name}: fix_probability must be in (0, 1]")


R2E = WorkloadSpec(
    name="r2e",
    tool="r2e_issue_validator",
    median_prompt_tokens=1800,
    median_turn_tokens=700.0,
    turn_tokens_sigma=0.6,
    median_problems=1.2,
    problems_sigma=1.0,
    fix_probability=0.55,
    timeout_probability=0.08,
    max_turns=12,
    max_new_tokens=30_000,
    context_limit=32_768,
    failure_payload_per_problem=(800, 2500),
    success_payload=(50, 400),
    median_tool_latency_s=8.0,
    timeout_latency_s=60.0,
    opening_tool="bash",
    opening_probability=0.5,
)

SEARCH_R1 = WorkloadSpec(
    name="search_r1",
    tool="search",
    median_prompt_tokens=400,
    median_turn_tokens=220.0,
    turn_tokens_sigma=0.5,
    median_problems=2.0,
    problems_sigma=0.8,
    fix_probability=0.5,
    timeout_probability=0.02,
    max_turns=16,
    max_new_tokens=8_000,
    context_limit=40_960,
    failure_payload_per_problem=(300, 900),
    success_payload=(600, 1500),
    median_tool_latency_s=0.8,
    timeout_latency_s=10.0,
)

DAPO_MATH = WorkloadSpec(
    name="dapo_math",
    tool="python",
    median_prompt_tokens=300,
    median_turn_tokens=1800.0,
    turn_tokens_sigma=0.8,
    median_problems=0.7,
    problems_sigma=1.0,
    fix_probability=0.6,
    timeout_probability=0.03,
    max_turns=6,
    max_new_tokens=16_000,
    context_limit=20_480,
    failure_payload_per_problem=(150, 500),
    success_payload=(20, 200),
    median_tool_latency_s=1.5,
    timeout_latency_s=10.0,
)

WORKLOADS: dict[str, WorkloadSpec] = {w.name: w for w in (R2E, SEARCH_R1, DAPO_MATH)}


@dataclass(frozen=True)
class WorkloadConfig:
    """Which workload, how groups are drawn, and how it drifts (a section of `SimConfig`)."""

    name: str = "r2e"
    """One of `WORKLOADS`."""
    num_prompts: int = 1000
    """Size of the prompt pool; prompts recur across epochs with the same difficulty."""
    group_size: int = 4
    length_drift: float = 0.5
    """Relative growth of turn lengths from the first to the last step."""
    difficulty_drift: float = 0.3
    """Relative growth of the mean number of problems from the first to the last step."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload.name must be one of {sorted(WORKLOADS)}, got {self.name!r}")
        if self.num_prompts < 1 or self.group_size < 1:
            raise ValueError("workload.num_prompts and workload.group_size must be >= 1")
        if self.length_drift <= -1 or self.difficulty_drift <= -1:
            raise ValueError("workload.length_drift and difficulty_drift must be > -1")

    @property
    def spec(self) -> WorkloadSpec:
        return WORKLOADS[self.name]


@dataclass(frozen=True)
class _Prompt:
    prompt_id: str
    prompt_tokens: int
    turn_tokens: float
    mean_problems: float
    opens: bool


class GroupSource(Protocol):
    """Where a simulated run draws its groups: `group(i, progress)` is the i-th group of the run."""

    def group(self, index: int, progress: float = 0.0) -> list[TrajectoryTrace]: ...


class WorkloadGenerator:
    """Groups of trajectory traces, indexed: `group(i, progress)` is the i-th group of the run."""

    def __init__(self, config: WorkloadConfig):
        self.config = config
        self.spec = config.spec

    def _prompt(self, index: int) -> _Prompt:
        spec = self.spec
        rng = random.Random(_mix(self.config.seed, 1, index))
        return _Prompt(
            prompt_id=f"{spec.name}-p{index}",
            prompt_tokens=max(16, round(spec.median_prompt_tokens * math.exp(rng.gauss(0.0, 0.4)))),
            turn_tokens=spec.median_turn_tokens * math.exp(rng.gauss(0.0, spec.turn_tokens_sigma)),
            mean_problems=spec.median_problems * math.exp(rng.gauss(0.0, spec.problems_sigma)),
            opens=rng.random() < spec.opening_probability,
        )

    def group(self, index: int, progress: float = 0.0) -> list[TrajectoryTrace]:
        """The `index`-th group: `group_size` trajectories of one prompt, at training `progress` in [0, 1]."""
        if index < 0:
            raise ValueError(f"group index must be >= 0, got {index}")
        rng = random.Random(_mix(self.config.seed, 2, index))
        prompt = self._prompt(rng.randrange(self.config.num_prompts))
        progress = min(max(progress, 0.0), 1.0)
        length_scale = 1.0 + self.config.length_drift * progress
        difficulty_scale = 1.0 + self.config.difficulty_drift * progress
        group_id = f"g{index}"
        return [
            self._trajectory(rng, prompt, f"{group_id}-{j}", group_id, length_scale, difficulty_scale)
            for j in range(self.config.group_size)
        ]

    def _trajectory(
        self,
        rng: random.Random,
        prompt: _Prompt,
        trajectory_id: str,
        group_id: str,
        length_scale: float,
        difficulty_scale: float,
    ) -> TrajectoryTrace:
        spec = self.spec
        problems = _geometric(rng, prompt.mean_problems * difficulty_scale)
        timing_out = rng.random() < spec.timeout_probability
        turns: list[TurnTrace] = []
        generated, context = 0, prompt.prompt_tokens

        def turn_length() -> int:
            return max(1, round(prompt.turn_tokens * length_scale * math.exp(rng.gauss(0.0, 0.35))))

        def latency() -> float:
            return spec.median_tool_latency_s * math.exp(rng.gauss(0.0, 0.5))

        while len(turns) < spec.max_turns - 1:
            output = turn_length()
            if prompt.opens and not turns:
                call = (spec.opening_tool, rng.randint(200, 800), ToolStatus.SUCCESS, 0.3 * latency())
            elif timing_out:
                call = (spec.tool, rng.randint(10, 100), ToolStatus.TIMEOUT, spec.timeout_latency_s)
                timing_out = rng.random() < 0.4
            elif problems > 0:
                per_problem = rng.randint(*spec.failure_payload_per_problem)
                call = (spec.tool, problems * per_problem, ToolStatus.FAILURE, latency())
                problems -= rng.random() < spec.fix_probability
            else:
                call = (spec.tool, rng.randint(*spec.success_payload), ToolStatus.SUCCESS, latency())
            tool, payload, status, tool_latency = call
            # The context and new-token budgets end a trajectory early (the long tail is clipped
            # exactly where a real engine would stop it).
            if (
                generated + output >= spec.max_new_tokens
                or context + output + payload + 1 >= spec.context_limit
            ):
                break
            turns.append(TurnTrace(output, tool, payload, status, tool_latency))
            generated += output
            context += output + payload
            if status is ToolStatus.SUCCESS and tool == spec.tool:
                break
        final = min(turn_length(), spec.max_new_tokens - generated, spec.context_limit - context - 1)
        turns.append(TurnTrace(max(1, final)))
        return TrajectoryTrace(trajectory_id, prompt.prompt_id, group_id, prompt.prompt_tokens, tuple(turns))


class ReplayedGroups:
    """A real run's groups, replayed in their order (a `GroupSource`; no drift: `progress` is what
    the run measured). A simulated run that asks for more groups than there are goes round them
    again, each lap's trajectories renamed so that no two live ones share an id."""

    def __init__(self, groups: Sequence[Sequence[TrajectoryTrace]]):
        self.groups = [list(g) for g in groups if g]
        if not self.groups:
            raise ValueError("no finished group to replay: the simulator needs at least one")

    @classmethod
    def of_traces(cls, traces: Iterable[TrajectoryTrace]) -> ReplayedGroups:
        """The traces grouped by `group_id`, in the order of the number the id carries (g2 < g10)."""
        groups: dict[str, list[TrajectoryTrace]] = defaultdict(list)
        for trace in traces:
            groups[trace.group_id].append(trace)
        return cls([groups[g] for g in sorted(groups, key=_group_number)])

    def group(self, index: int, progress: float = 0.0) -> list[TrajectoryTrace]:
        traces = self.groups[index % len(self.groups)]
        lap = index // len(self.groups)
        if lap == 0:
            return traces
        return [
            TrajectoryTrace(
                f"{t.trajectory_id}~{lap}", t.prompt_id, f"{t.group_id}~{lap}", t.prompt_tokens, t.turns
            )
            for t in traces
        ]


def _group_number(group_id: str) -> tuple[float, str]:
    digits = "".join(c for c in group_id if c.isdigit())
    return (int(digits) if digits else math.inf, group_id)


def _mix(*values: int) -> int:
    """A stable integer seed from several (Python's own hash of str is salted per process)."""
    acc = 0x9E3779B97F4A7C15
    for v in values:
        acc = (acc ^ (v + 0x632BE59BD9B4E019 + (acc << 6) + (acc >> 2))) & 0xFFFFFFFFFFFFFFFF
    return acc


def _geometric(rng: random.Random, mean: float) -> int:
    """Failures before the first success, with the given mean."""
    if mean <= 0:
        return 0
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
