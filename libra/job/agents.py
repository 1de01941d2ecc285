"""A user's agent as the job's rollout: one endpoint session per trajectory (`endpoint.agent`).

The agent is an async function written against any OpenAI client:

    async def agent(ctx: AgentContext) -> float | None:
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                    default_headers=ctx.headers)
        ... chat with ctx.task's prompt, run tools (its own, or the job's: ctx.tools) ...
        return reward   # or None: posted to the reward route, else the job's reward rule

For each trajectory of a group the job opens a session, awaits the agent, and closes the
session: its segments (one, or more if the agent rewrote its history) are the trajectories
trained on, every one with the session's reward. An agent that raises or runs past
`endpoint.agent_timeout_s` ends its segments as ERROR with the reason named; the job goes on.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from libra.endpoint.requests import SESSION_HEADER
from libra.endpoint.service import EndpointService
from libra.endpoint.sessions import Segment
from libra.plugins import load_callable
from libra.rollout.tools.base import Tool
from libra.tasks.datasets import TaskRecord
from libra.trajectory import Outcome

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentContext:
    """What an agent gets for one trajectory."""

    base_url: str
    """The endpoint's `/v1` URL."""
    api_key: str
    """The run's bearer token."""
    session_id: str
    task: TaskRecord
    """The prompt (`task.prompt`, or `task.chat_messages()`) and what scores it."""
    model: str
    """`endpoint.served_model_name`."""
    tools: Mapping[str, Tool] = field(default_factory=dict)
    """The job's tools by name (`await ctx.tools["python"]({"code": ...})`), for agents that do
    not bring their own."""

    @property
    def headers(self) -> dict[str, str]:
        """Headers that put a client's calls into this trajectory's session."""
        return {SESSION_HEADER: self.session_id}


@dataclass
class AgentRun:
    segments: list[Segment]
    reward: float | None
    """The agent's return value, else the reward posted for the session, else None."""


def load_agent(spec: str):
    return load_callable(spec, "endpoint.agent")


class AgentRunner:
    def __init__(self, spec: str, service: EndpointService, url: str, token: str, tools: Mapping[str, Tool]):
        self.spec = spec
        self.agent = load_agent(spec)
        self.service, self.url, self.token, self.tools = service, url, token, dict(tools)

    async def run(self, task: TaskRecord, session_id: str, prompt_id: str, group_id: str) -> AgentRun:
        try:
            self.service.open_session(session_id, prompt_id, group_id)
        except ValueError as e:  # an outside client holds the id: this trajectory is lost, not the job
            logger.warning("agent session %s not opened: %s", session_id, e)
            return AgentRun([], None)
        context = AgentContext(
            self.url, self.token, session_id, task, self.service.config.served_model_name, self.tools
        )
        returned, failure = None, ""
        timeout_s = self.service.config.agent_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                returned = await self.agent(context)
            if returned is not None and (
                isinstance(returned, bool)
                or not isinstance(returned, (int, float))
                or not math.isfinite(returned)
            ):
                raise TypeError(
                    f"it returned {returned!r}; an agent returns its reward (a finite number) or None"
                )
        except TimeoutError:
            failure = f"the agent {self.spec} ran past endpoint.agent_timeout_s={timeout_s}"
            logger.warning("session %s: %s", session_id, failure)
        except Exception as e:  # noqa: BLE001 - a failing agent ends its trajectory, not the job
            logger.warning("agent %s raised in session %s: %s", self.spec, session_id, e, exc_info=True)
            failure = f"the agent {self.spec} raised {type(e).__name__}: {e}"
        session = self.service.sessions.lookup(session_id)
        posted = session.reward if session is not None else None
        segments = await self.service.close_session(session_id)
        if failure:
            for segment in segments:
                segment.trajectory.outcome, segment.trajectory.outcome_reason = Outcome.ERROR, failure
            return AgentRun(segments, None)
        return AgentRun(segments, float(returned) if returned is not None else posted)
