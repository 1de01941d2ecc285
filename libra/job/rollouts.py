"""Rollout of GRPO groups: prompts in, rewarded trajectories and their traces out.

A group is `group_size` trajectories of one prompt, each an asyncio task of the agent loop (which
routes every turn through the pool's router). The driver adds what the agent loop leaves to the
job: the reward of each finished trajectory (by its task type's rule, `libra.tasks.rewards`), the
wall time of each tool call (for the simulator's trace format, measured by wrapping the tools),
and the trajectory's trace.

Prompts are `TaskRecord`s: the warm-started policy's procedural tasks by default, or a dataset's
records (`tasks.dataset_path`, `load_dataset_tasks`), offered the tools their task type needs.
With an environment (`tasks.environment`), each trajectory gets its own instance of it, reset with
the task record: it gives the prompt, answers every turn instead of the tools, and its step
rewards summed are the trajectory's reward (unless `tasks.reward_function` is set).
"""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from libra.job.agents import AgentRunner
from libra.rollout.agent_loop import AgentLoop
from libra.rollout.chat import ChatFormat
from libra.rollout.environment import Episode, load_environment
from libra.rollout.tools.base import Tool, ToolResult
from libra.rollout.tools.config import ToolsConfig
from libra.rollout.tools.sandbox import SandboxPool
from libra.rollout.types import derive_seed
from libra.tasks.config import TasksConfig
from libra.tasks.datasets import TaskRecord, TaskType, load_tasks
from libra.tasks.rewards import RewardInput, call_reward_function, compute_reward, load_reward_function
from libra.trace import TrajectoryTrace, TurnTiming, trace_from_trajectory
from libra.trajectory import Outcome, Trajectory

TOOLS_BY_TASK_TYPE: dict[TaskType, tuple[str, ...]] = {
    TaskType.MATH: ("python",),
    TaskType.RETRIEVAL_QA: ("retrieve",),
    # No issue-validator tool exists (the original's R2E workflow has one): R2E-style code tasks
    # get the sandboxed interpreter, and their reward runs the task's tests in the same sandbox.
    TaskType.CODE: ("python",),
    TaskType.PROCEDURAL: (),
}
"""Built-in tools (`tools.enabled` names) a dataset task of each type must be offered: the code
interpreter for tool-integrated math (DAPO-Math, ReTool-style), retrieval for Search-R1."""


def load_dataset_tasks(tasks: TasksConfig, tools: ToolsConfig) -> list[TaskRecord]:
    """The records of `tasks.dataset_path`, after checking that `tools` offers what their task
    types need (ValueError naming `tools.enabled` otherwise; with `tasks.environment` no tool
    is run, so none is needed). A custom tool of the same name
    stands in for a built-in one (e.g. `retrieve` served by a retrieval server)."""
    records = load_tasks(tasks.dataset_path, tasks.dataset_shape, tasks.max_records)
    if not records:
        raise ValueError(f"tasks.dataset_path {tasks.dataset_path!r} holds no records")
    if tasks.environment:
        return records  # the environment answers every turn: no tool is run
    offered = [*tools.enabled, *(custom.name for custom in tools.custom)]
    for task_type in sorted({r.task_type for r in records}, key=lambda t: t.value):
        missing = [name for name in TOOLS_BY_TASK_TYPE[task_type] if name not in offered]
        if missing:
            raise ValueError(
                f"tasks.dataset_path has {task_type.value} tasks, which need the tools {missing}: "
                f"add them to tools.enabled (now {tools.enabled}) or tools.custom"
            )
    return records


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

    def __init__(self, tasks: Sequence[TaskRecord], seed: int, position: int = 0):
        if not tasks:
            raise ValueError("the task stream needs at least one task")
        self.tasks = list(tasks)
        self.seed = seed
        self.position = position

    def next(self) -> tuple[int, TaskRecord]:
        epoch, offset = divmod(self.position, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        self.position += 1
        index = order[offset]
        return index, self.tasks[index]


class GroupRollout:
    def __init__(
        self,
        loop: AgentLoop,
        chat: ChatFormat,
        group_size: int,
        qa_metric: str = "em",
        sandbox: SandboxPool | None = None,
        reward_function: str = "",
        environment: str = "",
        agent: AgentRunner | None = None,
        seed: int | None = None,
    ):
        self.loop = loop
        self.chat = chat
        self.group_size = group_size
        self.qa_metric = qa_metric
        self.sandbox = sandbox
        """Runs the tests of code tasks' rewards."""
        self.reward_spec = reward_function
        self.reward_function = load_reward_function(reward_function) if reward_function else None
        """The user's reward function (`tasks.reward_function`) replacing the built-in rules."""
        self.environment = load_environment(environment) if environment else None
        """The user's environment class (`tasks.environment`) answering turns instead of the tools."""
        self.agent = agent
        """The user's agent (`endpoint.agent`), run in place of the built-in loop."""
        self.seed = seed
        """Set (the held-out evaluation's): the built-in loop's trajectory for (task, slot) samples
        with its own seed (`Trajectory.sampling_seed`), so that rolling the same tasks out twice
        (before and after training) draws the same random numbers: a paired comparison, and
        reproducible from run to run. A user agent's sessions sample as the agent asks. None
        (training): fresh numbers."""

    async def run(self, group: Group, task: TaskRecord) -> Group:
        import asyncio

        group.started_at = time.monotonic()
        # An agent renders its own prompt through the endpoint.
        prompt = self.chat.prompt_ids(task.chat_messages()) if self.agent is None else []
        slots = [asyncio.create_task(self._slot(group, i, task, prompt)) for i in range(self.group_size)]
        for results in await asyncio.gather(*slots):
            for trajectory, trace in results:
                group.trajectories.append(trajectory)
                group.traces.append(trace)
        group.finished_at = time.monotonic()
        return group

    async def _slot(
        self, group: Group, slot: int, task: TaskRecord, prompt: list[int]
    ) -> list[tuple[Trajectory, TrajectoryTrace]]:
        """One trajectory of the group: the built-in loop's, or the user's agent's session (one
        trajectory per segment of it)."""
        trajectory_id, prompt_id, group_id = (
            f"g{group.index}-{slot}",
            f"p{group.task_index}",
            f"g{group.index}",
        )
        if self.agent is not None:
            return await self._agent_session(task, trajectory_id, prompt_id, group_id)
        trajectory = Trajectory(trajectory_id, prompt_id, group_id, list(prompt))
        if self.seed is not None:
            trajectory.sampling_seed = derive_seed(self.seed, group.task_index, slot)
        return [await self._one(task, trajectory)]

    async def _agent_session(
        self, task: TaskRecord, session_id: str, prompt_id: str, group_id: str
    ) -> list[tuple[Trajectory, TrajectoryTrace]]:
        """The agent's session: its segments, each rewarded with the session's reward (the agent's,
        else the one posted, else the reward of the segment that replied last)."""
        run = await self.agent.run(task, session_id, prompt_id, group_id)
        if not run.segments:
            return []
        reward = run.reward
        if reward is None:
            reward = await self.reward(task, max(run.segments, key=lambda s: s.last_reply_at).trajectory)
        results = []
        for segment in run.segments:
            trajectory = segment.trajectory
            trajectory.reward = reward
            latencies = segment.tool_latencies + [0.0] * (
                len(trajectory.tool_returns) - len(segment.tool_latencies)
            )
            timings = [TurnTiming(s) for s in latencies[: len(trajectory.tool_returns)]]
            results.append((trajectory, trace_from_trajectory(trajectory, timings)))
        return results

    async def _one(self, task: TaskRecord, trajectory: Trajectory) -> tuple[Trajectory, TrajectoryTrace]:
        latencies: list[float] = []
        _tool_latencies.set(latencies)
        if self.environment is None:
            trajectory = await self.loop.run(trajectory)
        else:
            episode = Episode(self.environment, task)
            trajectory = await self.loop.run(trajectory, episode)
            latencies += episode.step_seconds  # its steps stand for the tool calls
        trajectory.reward = await self.reward(task, trajectory)
        # A turn whose tool call was not run (none: the agent loop runs every parsed call) would
        # leave fewer latencies than tool returns; pad so the trace stays well-formed.
        latencies += [0.0] * (len(trajectory.tool_returns) - len(latencies))
        timings = [TurnTiming(s) for s in latencies[: len(trajectory.tool_returns)]]
        return trajectory, trace_from_trajectory(trajectory, timings)

    async def reward(self, task: TaskRecord, trajectory: Trajectory) -> float:
        """The user's reward function's score, if there is one (given the environment's reward
        too); else, with an environment, the sum of its step rewards (which the agent loop keeps
        in `trajectory.reward`); else the task type's reward of the final answer turn
        (`compute_reward`), 0 when the trajectory did not end with an answer (cut by the turn,
        token or context limit)."""
        answered = trajectory.outcome == Outcome.ANSWERED
        decode = self.chat.tokenizer.decode
        answer = decode(_last_model_turn(trajectory), skip_special_tokens=True) if answered else None
        environment_reward = (trajectory.reward or 0.0) if self.environment is not None else None
        if self.reward_function is not None:
            response = decode(trajectory.response_token_ids, skip_special_tokens=True)
            given = RewardInput(task, trajectory, response, answer, environment_reward)
            return await call_reward_function(self.reward_function, self.reward_spec, given)
        if environment_reward is not None:
            return environment_reward
        if answer is None:
            return 0.0
        return await compute_reward(task, answer, pool=self.sandbox, qa_metric=self.qa_metric)


def _last_model_turn(trajectory: Trajectory) -> list[int]:
    turn: list[int] = []
    for token, mask in zip(
        reversed(trajectory.response_token_ids), reversed(trajectory.loss_mask), strict=True
    ):
        if not mask:
            break
        turn.append(token)
    return turn[::-1]
