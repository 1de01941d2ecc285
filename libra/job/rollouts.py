"""Rollout of GRPO groups: prompts in, rewarded trajectories and their traces out.

A group is `group_size` trajectories of one prompt, each an asyncio task of the agent loop (which
routes every turn through the pool's router). The driver adds what the agent loop leaves to the
job: the reward of each finished trajectory, the wall time of each tool call (for the simulator's
trace format, measured by wrapping the tools), and the trajectory's trace.
"""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from libra.rollout.agent_loop import AgentLoop
from libra.rollout.chat import ChatFormat
from libra.rollout.tools.base import Tool, ToolResult
from libra.sim.trace import TrajectoryTrace, TurnTiming, trace_from_trajectory
from libra.tasks.procedural import ProceduralTask
from libra.tasks.rewards import compute_reward
from libra.trajectory import Outcome, Trajectory

_tool_latencies: contextvars.ContextVar[list[float]] = contextvars.ContextVar("libra_tool_latencies")


class TimedTool:
    """A tool that records each call's wall time into the calling trajectory's list (a context
    variable: every trajectory runs in its own task)."""

    def __init__(self, tool: Tool):
        self._tool = tool
        self.name, self.description, self.parameters = tool.name, tool.description, tool.parameters

    async def __call__(self, arguments: dict) -> ToolResult:
        started = time.perf_counter()
        try:
            return await self._tool(arguments)
        finally:
            latencies = _tool_latencies.get(None)
            if latencies is not None:
                latencies.append(time.perf_counter() - started)


@dataclass
class Group:
    """One prompt's trajectories."""

    index: int
    """Draw order (the data position)."""
    task_index: int
    started_version: int
    trajectories: list[Trajectory] = field(default_factory=list)
    traces: list[TrajectoryTrace] = field(default_factory=list)
    started_at: float = 0.0
    finished_at: float = 0.0


class TaskStream:
    """Prompts in a seeded random order, epoch after epoch; `position` is the number drawn (saved
    with checkpoints so a resumed run draws what it would have drawn)."""

    def __init__(self, tasks: Sequence[ProceduralTask], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("the task stream needs at least one task")
        self.tasks = list(tasks)
        self.seed = seed
        self.position = position

    def next(self) -> tuple[int, ProceduralTask]:
        epoch, offset = divmod(self.position, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        self.position += 1
        index = order[offset]
        return index, self.tasks[index]


class GroupRollout:
    def __init__(self, loop: AgentLoop, chat: ChatFormat, group_size: int, qa_metric: str = "em"):
        self.loop = loop
        self.chat = chat
        self.group_size = group_size
        self.qa_metric = qa_metric

    async def run(self, group: Group, task: ProceduralTask) -> Group:
        import asyncio

        group.started_at = time.monotonic()
        prompt = self.chat.prompt_ids([{"role": "user", "content": task.record.prompt}])
        runs = [
            asyncio.create_task(
                self._one(
                    task,
                    Trajectory(
                        f"g{group.index}-{i}", f"p{group.task_index}", f"g{group.index}", list(prompt)
                    ),
                )
            )
            for i in range(self.group_size)
        ]
        for trajectory, trace in await asyncio.gather(*runs):
            group.trajectories.append(trajectory)
            group.traces.append(trace)
        group.finished_at = time.monotonic()
        return group

    async def _one(self, task: ProceduralTask, trajectory: Trajectory) -> tuple[Trajectory, TrajectoryTrace]:
        latencies: list[float] = []
        _tool_latencies.set(latencies)
        trajectory = await self.loop.run(trajectory)
        trajectory.reward = await self.reward(task, trajectory)
        # A turn whose tool call was not run (none: the agent loop runs every parsed call) would
        # leave fewer latencies than tool returns; pad so the trace stays well-formed.
        latencies += [0.0] * (len(trajectory.tool_returns) - len(latencies))
        timings = [TurnTiming(s) for s in latencies[: len(trajectory.tool_returns)]]
        return trajectory, trace_from_trajectory(trajectory, timings)

    async def reward(self, task: ProceduralTask, trajectory: Trajectory) -> float:
        """1 when the trajectory ended with an answer turn whose `<answer>` is right, else 0."""
        if trajectory.outcome != Outcome.ANSWERED:
            return 0.0
        last_turn = _last_model_turn(trajectory)
        text = self.chat.tokenizer.decode(last_turn, skip_special_tokens=True)
        return await compute_reward(task.record, text, qa_metric=self.qa_metric)


def _last_model_turn(trajectory: Trajectory) -> list[int]:
    turn: list[int] = []
    for token, mask in zip(
        reversed(trajectory.response_token_ids), reversed(trajectory.loss_mask), strict=True
    ):
        if not mask:
            break
        turn.append(token)
    return turn[::-1]
