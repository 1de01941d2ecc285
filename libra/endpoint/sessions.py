"""Sessions: the calls of one agent run, kept as trajectories with exactly the tokens sampled.

A session holds one or more *segments*, each a `Trajectory`. A call continues the segment whose
history (the messages its tokens hold, ending with the reply the endpoint gave) is a prefix of
the call's messages: the new messages are appended as tokens with loss mask 0, as tool results
are in the built-in loop. A call that continues no segment (the client dropped earlier reasoning,
edited a message, changed the tools, or the segment ended) starts a new segment from the whole
conversation, and says so (`SegmentStart.reason`): nothing is silently re-aligned. A request
with `n` > 1 forks the continued segment into `n` (a GRPO group from one call); a later call
continues the fork whose reply it carries.

A session the job opened (`open`) is trained on once the job closes it; one a client names
without the job (`get`) is served and dropped after `idle_s` without a call.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass, field

from libra.endpoint.messages import Message
from libra.scheduler.tool_state import ToolReturnState
from libra.trajectory import Outcome, Trajectory


class SessionLimit(Exception):
    """No room for another session (HTTP 429)."""


@dataclass
class Segment:
    trajectory: Trajectory
    history: list[Message] | None
    """Chat segments: the messages the tokens hold, ending with the last reply."""
    text: str | None
    """Completion segments given text: the prompt and completions so far."""
    tools_key: str
    reason: str
    """Why it started: "" for a session's first segment."""
    admitted: bool = False
    """The router knows its trajectory (after its first call)."""
    instance_id: int | None = None
    """Where its last turn ran (the router's choice for the next one)."""
    pending_state: ToolReturnState | None = None
    """Messages were appended since the last turn: the router hears of them as this tool return
    before the next turn."""
    last_reply_at: float = 0.0
    tool_latencies: list[float] = field(default_factory=list)
    """Seconds between a reply with a tool call and the call bringing its result (the traces)."""

    @property
    def ended(self) -> bool:
        return self.trajectory.outcome != Outcome.RUNNING


@dataclass
class Session:
    session_id: str
    prompt_id: str
    group_id: str
    trained: bool
    """Opened by the job: sampled at the job's settings, trained on when closed."""
    segments: list[Segment] = field(default_factory=list)
    reward: float | None = None
    """Set through the reward call (`/v1/libra/sessions/{id}/reward`)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One call at a time: concurrent calls of one session would race on its segments."""
    closed: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def new_segment(
        self,
        prompt_ids: list[int],
        history: list[Message] | None,
        text: str | None,
        tools_key: str,
        reason: str,
    ) -> Segment:
        index = len(self.segments)
        trajectory = Trajectory(f"{self.session_id}.{index}", self.prompt_id, self.group_id, list(prompt_ids))
        trajectory.metadata["session"] = self.session_id
        if reason:
            trajectory.metadata["segment_reason"] = reason
        segment = Segment(trajectory, history, text, tools_key, reason)
        self.segments.append(segment)
        return segment

    def fork(self, segment: Segment) -> Segment:
        """A copy of `segment` under a new trajectory id (one more choice of an `n` > 1 call)."""
        twin = copy.deepcopy(segment)
        twin.trajectory.trajectory_id = f"{self.session_id}.{len(self.segments)}"
        twin.admitted, twin.reason = (
            False,
            f"choice of a call with n > 1, forked from {segment.trajectory.trajectory_id}",
        )
        twin.trajectory.metadata["segment_reason"] = twin.reason
        self.segments.append(twin)
        return twin

    def continued_chat(self, messages: list[Message], tools_key: str) -> tuple[Segment | None, str]:
        """The live chat segment `messages` continue (the longest history that is their prefix),
        or None and why none is."""
        best: Segment | None = None
        for segment in self.segments:
            history = segment.history
            if history is None or segment.ended or segment.tools_key != tools_key:
                continue
            if len(history) <= len(messages) and messages[: len(history)] == history:
                if best is None or len(history) > len(best.history):
                    best = segment
        if best is not None:
            return best, ""
        return None, self._why_new_chat(messages, tools_key)

    def _why_new_chat(self, messages: list[Message], tools_key: str) -> str:
        chats = [s for s in self.segments if s.history is not None]
        if not chats:
            return "" if not self.segments else "the session's earlier segments were completions"
        last = chats[-1]
        if last.ended:
            return f"segment {last.trajectory.trajectory_id} ended ({last.trajectory.outcome.value})"
        if last.tools_key != tools_key:
            return "the tools changed"
        for index, (sent, held) in enumerate(zip(messages, last.history, strict=False)):
            if sent != held:
                return (
                    f"message {index} ({sent.role}) differs from what segment "
                    f"{last.trajectory.trajectory_id} holds: the history was rewritten"
                )
        return (
            f"the messages hold fewer than the {len(last.history)} of segment {last.trajectory.trajectory_id}"
        )

    def continued_completion(self, prompt: str | list[int]) -> tuple[Segment | None, str]:
        """The live completion segment `prompt` extends (its text, or its token ids), or None."""
        for segment in reversed(self.segments):
            if segment.history is not None or segment.ended:
                continue
            if isinstance(prompt, str) and segment.text is not None and prompt.startswith(segment.text):
                return segment, ""
            tokens = segment.trajectory.token_ids
            if isinstance(prompt, list) and segment.text is None and prompt[: len(tokens)] == tokens:
                return segment, ""
        if not self.segments:
            return None, ""
        return None, "the prompt does not extend the session's last prompt and completion"


class SessionStore:
    """Every session the endpoint holds, by id."""

    def __init__(self, max_sessions: int, idle_s: float):
        self.max_sessions = max_sessions
        """Sessions of outside clients held at once (the job's are bounded by its gate)."""
        self.idle_s = idle_s
        self._sessions: dict[str, Session] = {}
        self._outside = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str, prompt_id: str, group_id: str) -> Session:
        """A session the job runs an agent in (trained on when closed); ValueError when a
        session of that id is open (an outside client's, say)."""
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already open")
        return self._add(Session(session_id, prompt_id, group_id, trained=True))

    def get(self, session_id: str) -> Session:
        """The session named by a request; a new untrained one when the job did not open it."""
        session = self._sessions.get(session_id)
        if session is None:
            session = self._add(Session(session_id, session_id, session_id, trained=False))
        session.last_used = time.monotonic()
        return session

    def ephemeral(self) -> Session:
        """A session of one call (a request naming none), never stored."""
        return Session(f"call-{time.monotonic_ns()}", "", "", trained=False)

    def lookup(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def _add(self, session: Session) -> Session:
        if not session.trained:
            if self._outside >= self.max_sessions:
                held = self.max_sessions
                raise SessionLimit(
                    f"the endpoint holds {held} sessions of outside clients (endpoint.max_sessions)"
                )
            self._outside += 1
        session.prompt_id = session.prompt_id or session.session_id
        self._sessions[session.session_id] = session
        return session

    def remove(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None and not session.trained:
            self._outside -= 1
        return session

    def idle(self) -> list[Session]:
        """Untrained sessions without a call for `idle_s` (the job closes its own)."""
        cutoff = time.monotonic() - self.idle_s
        return [s for s in self._sessions.values() if not s.trained and s.last_used < cutoff]
