"""The multi-turn agent loop: one asyncio task per trajectory, thousands on one event loop.

A trajectory alternates model turns and tool calls:

    admit → generate on the routed instance until </tool_call> or EOS → parse and run the tool →
    append the result tokens (loss mask 0) → router.on_tool_return says where the next turn runs →
    ... → an answer, max turns, the token budget or the context window.

Token continuity: the context sent for a turn is exactly `trajectory.token_ids`, i.e. the
previous context, the tokens the model produced and the tool-result tokens; nothing is
re-tokenized, so a turn may run on any instance (it re-prefills there).

With an environment (`libra.rollout.environment`: an `Episode` given to `run`), the environment
answers every model turn instead of the tools: its first observation is the prompt, each turn's
text is its action, and its observation, unless the step is done, is appended as the next user
turn (loss mask 0) and routed like a tool return.

Interruptions keep what was produced: a generation call cut short by a Pause in ABORT mode (a
weight update) or by a dying instance leaves its tokens in the trajectory, each tagged with the
policy version that sampled it, and the turn continues from them — on the same instance after a
pause, on the one the router picks after a loss. Every ending is recorded as an `Outcome` with a
reason; nothing raises out of `run`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libra.rollout.chat import ChatFormat, ToolCallError
from libra.rollout.client import InstanceUnavailable
from libra.rollout.config import AgentLoopConfig
from libra.rollout.environment import EnvironmentFailed, Episode
from libra.rollout.pool import InstancePool
from libra.rollout.tools.base import Tool, ToolResult
from libra.rollout.types import FinishReason, SamplingSpec, Segment, derive_seed
from libra.scheduler.config import CmlfqConfig
from libra.scheduler.tool_state import ToolReturnState
from libra.trajectory import Outcome, ToolReturn, ToolStatus, Trajectory

logger = logging.getLogger(__name__)

MALFORMED_TOOL = "<malformed>"
"""Tool type of a tool call that could not be parsed (in the scheduler's tool-return state)."""
UNKNOWN_TOOL = "<unknown>"
"""Tool type of a call to a tool that does not exist."""
_MAX_CONSECUTIVE_FAILURES = 3
"""Failed calls to an instance that still answers health checks before it is treated as lost."""


@dataclass(frozen=True)
class CallRecord:
    """One generation call, for observers (tests check token continuity with these)."""

    trajectory_id: str
    instance_id: int
    context_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    """None: the instance failed during the call (output_ids are the tokens kept)."""


class TrajectoryEnded(Exception):
    """The trajectory reached an outcome (raised by `model_turn`; `run` records it)."""

    def __init__(self, outcome: Outcome, reason: str):
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason


class AgentLoop:
    def __init__(
        self,
        pool: InstancePool,
        chat: ChatFormat,
        tools: Sequence[Tool],
        config: AgentLoopConfig | None = None,
        cmlfq: CmlfqConfig | None = None,
        on_call: Callable[[CallRecord], None] | None = None,
    ):
        self.pool = pool
        self.router = pool.router
        self.chat = chat
        self.tools = {t.name: t for t in tools}
        self.config = config or AgentLoopConfig()
        self.cmlfq = cmlfq or CmlfqConfig()
        self._on_call = on_call
        self._request_seq = itertools.count()
        self.num_migrations = 0
        """Tool returns the router sent to another instance than the turn before (metrics)."""

    async def run_all(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        return list(await asyncio.gather(*(self.run(t) for t in trajectories)))

    async def run(self, trajectory: Trajectory, episode: Episode | None = None) -> Trajectory:
        """Runs `trajectory` (prompt set, response empty or kept from an earlier run) to an outcome.
        With `episode`, a fresh trajectory: the environment's first observation replaces its
        prompt, its step rewards add up in `trajectory.reward`, and it answers every turn."""
        admitted = False
        try:
            if episode is not None:
                trajectory.reward = 0.0
                messages = await episode.reset(self.config.tool_timeout_s)
                trajectory.prompt_token_ids = self.chat.prompt_ids(messages, list_tools=False)
            instance_id = self.router.admit(trajectory.trajectory_id, trajectory.prompt_id).instance_id
            admitted = True
            if episode is None:
                await self._turns(trajectory, instance_id)
            else:
                await self._episode_turns(trajectory, instance_id, episode)
        except TrajectoryEnded as end:
            trajectory.outcome, trajectory.outcome_reason = end.outcome, end.reason
        except EnvironmentFailed as e:  # the user's environment: its own failure, named
            logger.warning("trajectory %s: %s", trajectory.trajectory_id, e, exc_info=e.__cause__ is not None)
            trajectory.outcome, trajectory.outcome_reason = Outcome.ERROR, str(e)
        except Exception as e:  # noqa: BLE001 - every ending is recorded, never raised
            logger.exception("trajectory %s failed", trajectory.trajectory_id)
            trajectory.outcome, trajectory.outcome_reason = Outcome.ERROR, f"{type(e).__name__}: {e}"
        finally:
            if admitted:
                self.release(trajectory)
        return trajectory

    def release(self, trajectory: Trajectory) -> None:
        """Frees `trajectory`'s place in the router once it ended (a finish, or an abort when we
        cut it short: nothing to learn from its length)."""
        try:
            if trajectory.outcome in (Outcome.ABORTED, Outcome.ERROR, Outcome.NO_INSTANCE):
                self.router.on_abort(trajectory.trajectory_id)  # truncated by us: nothing to learn
            else:
                self.router.on_finish(trajectory.trajectory_id, trajectory.num_generated_tokens)
        except KeyError:
            return  # the router no longer knows it (e.g. it was reset); nothing to free
        self.pool.room_freed()

    async def _turns(self, trajectory: Trajectory, instance_id: int | None) -> None:
        while True:
            turn_start = len(trajectory.response_token_ids)
            instance_id, finish = await self.model_turn(trajectory, instance_id)
            if finish == FinishReason.LENGTH:
                raise self._turn_cap_reached(trajectory)
            if trajectory.response_token_ids[-1] != self.chat.tool_call_end_id:
                raise TrajectoryEnded(Outcome.ANSWERED, "")
            if trajectory.num_turns >= self.config.max_turns:
                raise TrajectoryEnded(
                    Outcome.MAX_TURNS, f"still calling tools after {trajectory.num_turns} turns"
                )
            state = await self._call_tool(trajectory, trajectory.response_token_ids[turn_start:])
            instance_id = self.on_tool_return(trajectory, state)

    async def _episode_turns(self, trajectory: Trajectory, instance_id: int | None, episode: Episode) -> None:
        """Model turns answered by the environment: each turn's text is an action; the observation
        of a step that is not done becomes the next user turn, placed by the router like a tool
        return (the environment's name is the tool type)."""
        while True:
            turn_start = len(trajectory.response_token_ids)
            instance_id, finish = await self.model_turn(trajectory, instance_id)
            if finish == FinishReason.LENGTH:
                raise self._turn_cap_reached(trajectory)
            turn = trajectory.response_token_ids[turn_start:]
            action = self.chat.tokenizer.decode(turn, skip_special_tokens=True)
            result = await episode.step(action, self.config.tool_timeout_s)
            trajectory.reward = episode.reward
            if result.done:
                raise TrajectoryEnded(Outcome.ANSWERED, "")
            if trajectory.num_turns >= self.config.max_turns:
                raise TrajectoryEnded(
                    Outcome.MAX_TURNS,
                    f"environment {episode.name} not done after {trajectory.num_turns} turns",
                )
            observation_ids = self.chat.user_turn_ids(self._clip(result.observation), after=turn[-1])
            state = self.append_tool_return(trajectory, episode.name, ToolStatus.SUCCESS, observation_ids)
            instance_id = self.on_tool_return(trajectory, state)

    def _turn_cap_reached(self, trajectory: Trajectory) -> TrajectoryEnded:
        cap = self.config.max_tokens_per_turn
        return TrajectoryEnded(
            Outcome.MAX_TOKENS, f"turn {trajectory.num_turns} reached max_tokens_per_turn={cap}"
        )

    async def model_turn(
        self, trajectory: Trajectory, instance_id: int | None, sampling: SamplingSpec | None = None
    ) -> tuple[int, FinishReason]:
        """Generates one model turn of `trajectory` on `instance_id` (or where the router sends a
        displaced trajectory) until a stop token (STOP) or the turn's cap (LENGTH): resubmitted
        after a weight-update pause, continued elsewhere after a lost instance. `sampling` gives
        the temperature, top-p/k and the turn's cap in `max_tokens` (default: the loop's config);
        the stop tokens are the chat format's. Returns the instance that finished the turn.
        Raises TrajectoryEnded when the context window or the response budget fills, or the
        instance aborts the request."""
        sampling = sampling or SamplingSpec(
            self.config.temperature, self.config.top_p, self.config.top_k, self.config.max_tokens_per_turn
        )
        sampling = dataclasses.replace(sampling, stop_token_ids=self.chat.stop_token_ids)
        turn_start = len(trajectory.response_token_ids)
        failures = 0
        while True:
            if len(trajectory.response_token_ids) - turn_start >= sampling.max_tokens:
                trajectory.num_turns += 1  # interrupted right at the cap: the turn is cut there
                return instance_id, FinishReason.LENGTH
            if instance_id is None or self.pool.get(instance_id).lost:
                instance_id = await self._reroute(trajectory.trajectory_id)
            segment, max_tokens = await self._generate(trajectory, instance_id, sampling, turn_start)
            if segment is None:  # the instance failed; the tokens it produced are kept
                failures += 1
                if failures >= _MAX_CONSECUTIVE_FAILURES:
                    self.pool.mark_lost(instance_id, f"{failures} consecutive failed calls")
                if await self.pool.confirm_lost(instance_id):
                    instance_id, failures = None, 0
            else:
                failures = 0
            # A call interrupted after the turn's stop token (a cut or a failure racing the last
            # token) left a finished turn: resubmitting would generate past the stop.
            if self._turn_finished(trajectory, turn_start):
                trajectory.num_turns += 1
                return instance_id, FinishReason.STOP
            if segment is None or segment.finish_reason == FinishReason.PREEMPTED:
                continue  # resubmit (a weight update: the paused engine holds it)
            if segment.finish_reason == FinishReason.ABORT:
                raise TrajectoryEnded(Outcome.ABORTED, f"instance {instance_id} aborted the request")
            if segment.finish_reason == FinishReason.LENGTH:
                self._end_for_length(trajectory, instance_id, max_tokens, len(segment.token_ids))
                trajectory.num_turns += 1
                return instance_id, FinishReason.LENGTH

    def on_tool_return(self, trajectory: Trajectory, state: ToolReturnState) -> int | None:
        """Tells the router that `trajectory`'s tool call returned (its return appended); the
        instance of its next turn. The context it is told is what its instance holds: the return
        is prefilled wherever the next turn runs, so a move re-prefills only the rest."""
        context = len(trajectory.prompt_token_ids) + trajectory.last_turn_end
        decision = self.router.on_tool_return(
            trajectory.trajectory_id, state, trajectory.num_generated_tokens, context
        )
        self.num_migrations += decision.migrated
        return decision.instance_id

    def _turn_finished(self, trajectory: Trajectory, turn_start: int) -> bool:
        turn = trajectory.response_token_ids[turn_start:]
        return bool(turn) and turn[-1] in self.chat.stop_token_ids

    async def _generate(
        self, trajectory: Trajectory, instance_id: int, sampling: SamplingSpec, turn_start: int
    ) -> tuple[Segment | None, int]:
        """One generation call continuing `trajectory`'s turn (begun at `turn_start`); appends
        what it produced. Returns the segment (None when the instance failed) and the max_tokens
        the call asked for: what is left of the turn's cap, the response budget and the window."""
        pooled = self.pool.get(instance_id)
        context = trajectory.token_ids
        budget = self.config.max_response_tokens - len(trajectory.response_token_ids)
        room = pooled.max_model_len - len(context)
        if budget <= 0:
            raise TrajectoryEnded(
                Outcome.MAX_TOKENS, f"response reached max_response_tokens={self.config.max_response_tokens}"
            )
        if room <= 0:
            raise TrajectoryEnded(
                Outcome.CONTEXT_OVERFLOW,
                f"context of {len(context)} tokens leaves no room in max_model_len={pooled.max_model_len}",
            )
        turn_left = sampling.max_tokens - (len(trajectory.response_token_ids) - turn_start)
        sampling = dataclasses.replace(sampling, max_tokens=min(budget, room, turn_left))
        if trajectory.sampling_seed is not None:
            # By position, not by call: a call resumed mid-turn must not replay the numbers
            # its first part drew.
            position = len(trajectory.response_token_ids)
            sampling = dataclasses.replace(sampling, seed=derive_seed(trajectory.sampling_seed, position))
        request_id = f"{trajectory.trajectory_id}.{next(self._request_seq)}"
        try:
            segment = await pooled.client.generate(
                request_id, context, sampling, self.config.stream_chunk_tokens, self.config.rpc_timeout_s
            )
        except InstanceUnavailable as e:
            logger.warning("trajectory %s: instance %d failed: %s", trajectory.trajectory_id, instance_id, e)
            self._keep(trajectory, e.partial)
            self._record(trajectory, instance_id, context, e.partial, None)
            return None, sampling.max_tokens
        self._keep(trajectory, segment)
        self._record(trajectory, instance_id, context, segment, segment.finish_reason)
        return segment, sampling.max_tokens

    @staticmethod
    def _keep(trajectory: Trajectory, segment: Segment) -> None:
        for chunk in segment.chunks:
            trajectory.append(chunk.token_ids, chunk.logprobs, chunk.weight_version)

    def _record(self, trajectory, instance_id, context, segment, finish) -> None:
        if self._on_call is not None:
            record = CallRecord(
                trajectory.trajectory_id, instance_id, tuple(context), tuple(segment.token_ids), finish
            )
            self._on_call(record)

    def _end_for_length(self, trajectory: Trajectory, instance_id: int, asked: int, produced: int) -> None:
        """A call stopped for length: the context window filled (the one the instance reported,
        or the engine's own, which stops a call short of the `asked` tokens) or the response
        budget ran out, which end the trajectory; else the turn reached its cap (returns)."""
        max_model_len = self.pool.get(instance_id).max_model_len
        context = len(trajectory.token_ids)
        if context >= max_model_len:
            raise TrajectoryEnded(
                Outcome.CONTEXT_OVERFLOW, f"the context filled max_model_len={max_model_len} mid-turn"
            )
        if produced < asked:
            raise TrajectoryEnded(
                Outcome.CONTEXT_OVERFLOW,
                f"instance {instance_id} stopped for length after {produced} of {asked} tokens, at a "
                f"context of {context} tokens: its engine's window is smaller than it reports",
            )
        if len(trajectory.response_token_ids) >= self.config.max_response_tokens:
            raise TrajectoryEnded(
                Outcome.MAX_TOKENS, f"response reached max_response_tokens={self.config.max_response_tokens}"
            )

    async def _reroute(self, trajectory_id: str) -> int:
        """A new instance for a displaced or unplaced trajectory; waits up to `no_instance_wait_s`
        for one with room (none ready, or all full while a plan's new ones load)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.no_instance_wait_s
        while True:
            changed = self.pool.changed
            decision = self.router.reroute(trajectory_id)
            if decision.instance_id is not None:
                return decision.instance_id
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TrajectoryEnded(
                    Outcome.NO_INSTANCE, f"no rollout instance within {self.config.no_instance_wait_s} s"
                )
            self.pool.waiting += 1
            try:
                await asyncio.wait_for(changed.wait(), timeout=remaining)
            except TimeoutError:
                pass
            finally:
                self.pool.waiting -= 1

    async def _call_tool(self, trajectory: Trajectory, turn: list[int]) -> ToolReturnState:
        """Parses and runs the turn's tool call, appends the result tokens; returns its state."""
        try:
            call = self.chat.parse_tool_call(turn)
        except ToolCallError as e:
            tool_type, result = MALFORMED_TOOL, ToolResult(f"error: {e}", ToolStatus.FAILURE)
        else:
            tool = self.tools.get(call.name)
            if tool is None:
                tool_type = UNKNOWN_TOOL
                result = ToolResult(
                    f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}", ToolStatus.FAILURE
                )
            else:
                tool_type, result = call.name, await self._run_tool(tool, call.arguments)
        result_ids = self.chat.tool_result_ids(self._clip(result.content))
        return self.append_tool_return(trajectory, tool_type, result.status, result_ids)

    def _clip(self, text: str) -> str:
        """A tool's output (or an observation) cut to `max_tool_result_chars`, with a note."""
        if len(text) > self.config.max_tool_result_chars:
            return text[: self.config.max_tool_result_chars] + "\n[output truncated]"
        return text

    def append_tool_return(
        self, trajectory: Trajectory, tool_type: str, status: ToolStatus, token_ids: list[int]
    ) -> ToolReturnState:
        """Appends what a tool (an environment, a client's new messages) returned after a turn,
        with loss mask 0, and records it; the state the router is to hear of."""
        trajectory.tool_returns.append(
            ToolReturn(tool_type, status, len(token_ids), trajectory.num_generated_tokens)
        )
        trajectory.append(token_ids, None, 0)
        return ToolReturnState.of(tool_type, status, len(token_ids), self.cmlfq)

    async def _run_tool(self, tool: Tool, arguments: dict) -> ToolResult:
        try:
            return await asyncio.wait_for(tool(arguments), timeout=self.config.tool_timeout_s)
        except TimeoutError:
            return ToolResult(
                f"error: the tool timed out after {self.config.tool_timeout_s} s", ToolStatus.TIMEOUT
            )
        except Exception as e:  # noqa: BLE001 - a buggy tool is the model's failure result, not a crash
            return ToolResult(f"error: the tool raised {type(e).__name__}: {e}", ToolStatus.FAILURE)
