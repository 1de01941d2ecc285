"""Evaluating a policy on procedural tasks through the real multi-turn protocol.

Each task runs as a trajectory in `AgentLoop` (greedy) over a pool — a `LocalPool` of the
in-process transformers engine here, or an `InstancePool` of vLLM instances — with the real
tools. The summary says how often the policy solves the task, how many of its turns are
well-formed, and how its turns are distributed.

A trajectory *succeeds* when it ends with an answer (no tool call in its last turn) whose
`<answer>` matches the ground truth (`compute_reward` of that last turn). A turn is *well-formed*
when it is a tool call that parses and names an offered tool, or a final turn holding an
`<answer>…</answer>`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from libra.rollout.agent_loop import MALFORMED_TOOL, UNKNOWN_TOOL, AgentLoop
from libra.rollout.chat import ChatFormat
from libra.rollout.config import AgentLoopConfig
from libra.rollout.tools.base import Tool
from libra.tasks.procedural import ProceduralTask
from libra.tasks.rewards import compute_reward, extract_answer
from libra.trajectory import Outcome, Trajectory


@dataclass(frozen=True)
class TaskResult:
    num_calls: int
    """Tool calls of the reference solution (the task's difficulty)."""
    family: str
    success: bool
    num_turns: int
    """Model turns, a turn cut short by a token limit included."""
    num_tool_calls: int
    num_wellformed_calls: int
    wellformed_final: bool
    """It ended with an answer turn holding `<answer>…</answer>`."""
    outcome: str

    @property
    def num_wellformed_turns(self) -> int:
        return self.num_wellformed_calls + int(self.wellformed_final)


@dataclass(frozen=True)
class EvalSummary:
    num_tasks: int
    success_rate: float
    wellformed_turn_rate: float
    """Well-formed turns / all turns."""
    wellformed_call_rate: float
    """Tool calls that parse and name an offered tool / all tool-call turns."""
    turn_histogram: dict[int, int]
    """Number of model turns -> trajectories."""
    mean_turns: float
    median_turns: float
    max_turns: int
    success_by_num_calls: dict[int, list[int]]
    """Reference calls k -> [successes, tasks]."""
    outcomes: dict[str, int]

    def to_json(self) -> dict:
        out = asdict(self)
        out["turn_histogram"] = {str(k): v for k, v in sorted(self.turn_histogram.items())}
        out["success_by_num_calls"] = {str(k): v for k, v in sorted(self.success_by_num_calls.items())}
        return out


def agent_config(max_turns: int, max_tokens_per_turn: int = 128) -> AgentLoopConfig:
    """The greedy agent-loop settings of evaluation."""
    return AgentLoopConfig(
        temperature=0.0,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        max_response_tokens=8192,
    )


async def run_tasks(
    pool, chat: ChatFormat, tools: Sequence[Tool], tasks: Sequence[ProceduralTask], config: AgentLoopConfig
) -> list[Trajectory]:
    loop = AgentLoop(pool, chat, tools, config)
    trajectories = []
    for index, task in enumerate(tasks):
        prompt = chat.prompt_ids([{"role": "user", "content": task.record.prompt}])
        trajectory_id = f"eval-{index}"
        trajectories.append(Trajectory(trajectory_id, trajectory_id, trajectory_id, prompt))
    return await loop.run_all(trajectories)


async def score(chat: ChatFormat, task: ProceduralTask, trajectory: Trajectory) -> TaskResult:
    turns = trajectory.model_turns()
    calls = trajectory.tool_returns
    final_text = None
    if trajectory.outcome == Outcome.ANSWERED and turns:
        final_text = chat.tokenizer.decode(turns[-1], skip_special_tokens=True)
    wellformed_final = final_text is not None and extract_answer(final_text) is not None
    success = final_text is not None and await compute_reward(task.record, final_text) == 1.0
    return TaskResult(
        num_calls=task.num_calls,
        family=str(task.record.metadata.get("family", "")),
        success=success,
        num_turns=len(turns),
        num_tool_calls=len(calls),
        num_wellformed_calls=sum(r.tool not in (MALFORMED_TOOL, UNKNOWN_TOOL) for r in calls),
        wellformed_final=wellformed_final,
        outcome=trajectory.outcome.value,
    )


def summarize(results: Sequence[TaskResult]) -> EvalSummary:
    if not results:
        raise ValueError("no task results to summarize")
    turns = [r.num_turns for r in results]
    total_turns = sum(turns)
    total_calls = sum(r.num_tool_calls for r in results)
    wellformed_calls = sum(r.num_wellformed_calls for r in results)
    by_calls: dict[int, list[int]] = {}
    for r in results:
        entry = by_calls.setdefault(r.num_calls, [0, 0])
        entry[0] += int(r.success)
        entry[1] += 1
    return EvalSummary(
        num_tasks=len(results),
        success_rate=sum(r.success for r in results) / len(results),
        wellformed_turn_rate=sum(r.num_wellformed_turns for r in results) / max(total_turns, 1),
        wellformed_call_rate=wellformed_calls / max(total_calls, 1),
        turn_histogram=dict(sorted(Counter(turns).items())),
        mean_turns=statistics.mean(turns),
        median_turns=statistics.median(turns),
        max_turns=max(turns),
        success_by_num_calls=dict(sorted(by_calls.items())),
        outcomes=dict(Counter(r.outcome for r in results)),
    )


async def evaluate(
    pool, chat: ChatFormat, tools: Sequence[Tool], tasks: Sequence[ProceduralTask], config: AgentLoopConfig
) -> tuple[EvalSummary, list[TaskResult]]:
    """Runs `tasks` through the agent loop over `pool` and summarizes them."""
    trajectories = await run_tasks(pool, chat, tools, tasks, config)
    results = [await score(chat, task, t) for task, t in zip(tasks, trajectories, strict=True)]
    return summarize(results), results
