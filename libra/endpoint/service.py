"""Serving a call: continue (or start) a session's segment, run one model turn, read it back.

A turn goes through the same agent loop as Libra's built-in trajectories (`AgentLoop.model_turn`):
the router admits a segment's first turn and hears every later call's new messages as a tool
return (tool messages by their tool's name, other messages as `<user>`), so C-MLFQ routes endpoint
sessions the way it routes built-in ones; a weight update pauses and resumes the turn, a lost
instance hands it to another, and every token keeps the policy version that sampled it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from libra.endpoint.config import EndpointConfig
from libra.endpoint.messages import ChatRenderer, Message, Reply, RequestError, tools_key
from libra.endpoint.requests import ChatRequest, CompletionRequest, Sampling
from libra.endpoint.sessions import Segment, Session, SessionStore
from libra.rollout.agent_loop import AgentLoop, TrajectoryEnded
from libra.rollout.types import FinishReason, SamplingSpec
from libra.trajectory import Outcome, ToolStatus

logger = logging.getLogger(__name__)

USER_TURN = "<user>"
"""Tool type of new messages without a tool result (a user's next message)."""
CONTINUATION = "<continuation>"
"""Tool type of a completion prompt extended by the client."""


class Unavailable(Exception):
    """No rollout instance could take the turn (HTTP 503)."""


class SessionClosed(Exception):
    """The call's session was closed while the call waited for it (HTTP 404)."""


@dataclass(frozen=True)
class Choice:
    reply: Reply
    token_ids: list[int]
    """The turn's tokens as kept: exactly what the engine sampled, cut at a stop string."""
    logprobs: list[float]
    trajectory_id: str


@dataclass(frozen=True)
class Served:
    session_id: str
    choices: list[Choice]
    prompt_tokens: int
    new_segment: str | None
    """None: the call continued a segment; else why it started one ("" for a first call)."""


class EndpointService:
    def __init__(self, loop: AgentLoop, config: EndpointConfig):
        self.loop = loop
        self.renderer = ChatRenderer(loop.chat)
        self.config = config
        self.sessions = SessionStore(config.max_sessions, config.session_idle_s)

    # -- the job's sessions ------------------------------------------------------------------------

    def open_session(self, session_id: str, prompt_id: str, group_id: str) -> Session:
        return self.sessions.open(session_id, prompt_id, group_id)

    async def close_session(self, session_id: str) -> list[Segment]:
        """Ends a session once its last call returned; its segments, their router places freed."""
        session = self.sessions.lookup(session_id)
        if session is None:
            return []
        async with session.lock:
            session.closed = True  # a call that was waiting for the lock finds it closed
            self.sessions.remove(session_id)
            for segment in session.segments:
                self._end(segment)
        return list(session.segments)

    def set_reward(self, session_id: str, reward: float) -> None:
        session = self.sessions.lookup(session_id)
        if session is None:
            raise KeyError(session_id)
        session.reward = reward

    async def close_idle(self) -> int:
        """Closes sessions nobody called for `endpoint.session_idle_s` (not the job's)."""
        idle = self.sessions.idle()
        for session in idle:
            await self.close_session(session.session_id)
        return len(idle)

    def _end(self, segment: Segment) -> None:
        trajectory = segment.trajectory
        if trajectory.outcome == Outcome.RUNNING:
            trajectory.outcome, trajectory.outcome_reason = Outcome.ANSWERED, "the session ended"
        if segment.admitted:
            self.loop.release(trajectory)
            segment.admitted = False

    # -- calls -------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _held(self, session_id: str):
        """The call's session, locked (one call of a session at a time); a one-call session,
        closed after, when the call names none."""
        session = self.sessions.get(session_id) if session_id else self.sessions.ephemeral()
        try:
            async with session.lock:
                if session.closed:
                    raise SessionClosed(f"session {session_id!r} was closed")
                yield session
        finally:
            if not session_id:
                for segment in session.segments:
                    self._end(segment)

    async def chat(self, session_id: str, request: ChatRequest) -> Served:
        async with self._held(session_id) as session:
            spec = self._sampling(session, request.sampling)
            key = tools_key(request.tools)
            segment, reason = session.continued_chat(request.messages, key)
            new_segment: str | None = reason
            if segment is None:
                prompt = self.renderer.prompt_ids(request.messages, request.tools)
                segment = session.new_segment(prompt, list(request.messages), None, key, reason)
            else:
                new = request.messages[len(segment.history) :]
                if not new:
                    raise RequestError(
                        "the messages add nothing after the session's last reply: send the next "
                        "user or tool message"
                    )
                last_token = segment.trajectory.token_ids[-1]
                appended = self.renderer.continuation_ids(last_token, new, request.tools)
                self._append(segment, appended, _tool_type(segment.history, new))
                new_segment = None
            served, segments = await self._turns(
                session, segment, spec, request.sampling, request.parse_tools, new_segment
            )
            for segment_, choice in zip(segments, served.choices, strict=True):
                segment_.history = [*request.messages, choice.reply.message]
            return served

    async def complete(self, session_id: str, request: CompletionRequest) -> Served:
        tokenizer = self.renderer.tokenizer
        async with self._held(session_id) as session:
            spec = self._sampling(session, request.sampling)
            prompt = request.prompt
            segment, reason = session.continued_completion(prompt)
            new_segment: str | None = reason
            if segment is None:
                ids = (
                    list(prompt)
                    if isinstance(prompt, list)
                    else tokenizer.encode(prompt, add_special_tokens=False)
                )
                text = prompt if isinstance(prompt, str) else None
                segment = session.new_segment(ids, None, text, "", reason)
            else:
                held = segment.trajectory.token_ids
                appended = (
                    list(prompt[len(held) :])
                    if isinstance(prompt, list)
                    else tokenizer.encode(prompt[len(segment.text) :], add_special_tokens=False)
                )
                if appended:
                    self._append(segment, appended, CONTINUATION)
                new_segment = None
            served, segments = await self._turns(session, segment, spec, request.sampling, False, new_segment)
            if isinstance(prompt, str):  # forks hold the same prompt, each its own completion
                for segment_, choice in zip(segments, served.choices, strict=True):
                    segment_.text = prompt + choice.reply.message.content
            return served

    def _sampling(self, session: Session, asked: Sampling) -> SamplingSpec:
        """The call's sampling. A trained session samples at the job's temperature and top-p (the
        distribution the trainer scores); asking for others is an error, not ignored."""
        agent = self.loop.config
        if session.trained:
            for name, value, job in (
                ("temperature", asked.temperature, agent.temperature),
                ("top_p", asked.top_p, agent.top_p),
            ):
                if value is not None and value != job:
                    raise RequestError(
                        f"{name}={value}: session {session.session_id} is trained on, so it samples at "
                        f"rollout.agent.{name}={job}, the distribution the trainer scores; leave it unset"
                    )
        max_tokens = asked.max_tokens or agent.max_tokens_per_turn
        if session.trained:
            max_tokens = min(max_tokens, agent.max_tokens_per_turn)
        return SamplingSpec(
            temperature=agent.temperature if asked.temperature is None else asked.temperature,
            top_p=agent.top_p if asked.top_p is None else asked.top_p,
            top_k=agent.top_k,
            max_tokens=max_tokens,
            seed=asked.seed,
        )

    def _append(self, segment: Segment, token_ids: list[int], tool_type: str) -> None:
        """New messages' tokens after the last turn (loss mask 0): a tool return the router
        hears of before the next turn."""
        waited = tool_type not in (USER_TURN, CONTINUATION) and segment.last_reply_at
        segment.tool_latencies.append(time.monotonic() - segment.last_reply_at if waited else 0.0)
        segment.pending_state = self.loop.append_tool_return(
            segment.trajectory, tool_type, ToolStatus.SUCCESS, token_ids
        )

    async def _turns(
        self,
        session: Session,
        segment: Segment,
        spec: SamplingSpec,
        asked: Sampling,
        parse_tools: bool,
        new_segment: str | None,
    ) -> tuple[Served, list[Segment]]:
        """One turn on `segment` and on `n - 1` forks of it, concurrently; the segments in the
        order of the choices."""
        segments = [segment] + [session.fork(segment) for _ in range(asked.n - 1)]
        prompt_tokens = len(segment.trajectory.token_ids)
        specs = [
            spec if spec.seed is None else dataclasses.replace(spec, seed=spec.seed + i)
            for i in range(len(segments))
        ]
        choices = await asyncio.gather(
            *(
                self._turn(s, spec_, asked.stop, parse_tools)
                for s, spec_ in zip(segments, specs, strict=True)
            ),
            return_exceptions=True,
        )
        failed = [c for c in choices if isinstance(c, BaseException)]
        if failed:
            # The call's other choices hold its messages and a reply the client never gets: a
            # retry must not continue them.
            for other in segments:
                if other.trajectory.outcome == Outcome.RUNNING:
                    other.trajectory.outcome = Outcome.ERROR
                    other.trajectory.outcome_reason = f"another choice of its call failed: {failed[0]}"
            raise failed[0]
        return Served(session.session_id, list(choices), prompt_tokens, new_segment), segments

    async def _turn(
        self, segment: Segment, spec: SamplingSpec, stop: Sequence[str], parse_tools: bool
    ) -> Choice:
        trajectory = segment.trajectory
        start = len(trajectory.response_token_ids)
        try:
            if not segment.admitted:
                decision = self.loop.router.admit(trajectory.trajectory_id, trajectory.prompt_id)
                segment.instance_id, segment.admitted = decision.instance_id, True
            elif segment.pending_state is not None:
                segment.instance_id = self.loop.on_tool_return(trajectory, segment.pending_state)
            segment.pending_state = None
            segment.instance_id, finish = await self.loop.model_turn(trajectory, segment.instance_id, spec)
        except TrajectoryEnded as end:  # the window or the budget filled: the reply is cut
            trajectory.outcome, trajectory.outcome_reason = end.outcome, end.reason
            if end.outcome in (Outcome.ABORTED, Outcome.NO_INSTANCE):
                raise Unavailable(end.reason) from None
            finish = FinishReason.LENGTH
        except BaseException as e:
            # The segment holds this call's new messages but no reply: a retry must start a new
            # segment, not append them twice.
            trajectory.outcome, trajectory.outcome_reason = Outcome.ERROR, f"{type(e).__name__}: {e}"
            raise
        turn = trajectory.response_token_ids[start:]
        reply = self.renderer.reply(turn, finish, stop, parse_tools)
        trajectory.truncate(start + reply.kept_tokens)
        segment.last_reply_at = time.monotonic()
        return Choice(
            reply,
            trajectory.response_token_ids[start:],
            trajectory.rollout_logprobs[start:],
            trajectory.trajectory_id,
        )


def _tool_type(history: list[Message], new: list[Message]) -> str:
    """The tool whose result the new messages bring (by the call's id in the last reply), or
    `<user>` when they bring none."""
    calls = {call.id: call.name for call in history[-1].tool_calls} if history else {}
    for message in new:
        if message.role == "tool":
            return calls.get(message.tool_call_id) or message.name or "tool"
    return USER_TURN
