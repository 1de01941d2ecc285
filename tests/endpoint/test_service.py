"""The endpoint's sessions under concurrency and failure, with a scripted agent loop (no engine):
the router hears of every segment's admission and release exactly once, a call that waited for a
closed session is refused, and a call whose one choice failed leaves nothing a retry could
continue by mistake."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from libra.endpoint.config import EndpointConfig
from libra.endpoint.requests import parse_chat
from libra.endpoint.service import EndpointService, SessionClosed
from libra.rollout.agent_loop import AgentLoop
from libra.rollout.chat import ChatFormat
from libra.rollout.types import FinishReason
from libra.trajectory import Outcome


class CountingRouter:
    """A fake router (the test says so): everything on instance 0, every call counted."""

    def __init__(self):
        self.admitted: list[str] = []
        self.released: list[str] = []

    def admit(self, trajectory_id, prompt_id):
        self.admitted.append(trajectory_id)
        return SimpleNamespace(instance_id=0, migrated=False)

    def on_tool_return(self, trajectory_id, state, generated_tokens, context_tokens=0):
        return SimpleNamespace(instance_id=0, migrated=False)

    def on_finish(self, trajectory_id, total_output_tokens):
        self.released.append(trajectory_id)

    def on_abort(self, trajectory_id):
        self.released.append(trajectory_id)


class ScriptedLoop(AgentLoop):
    """The real agent loop but for `model_turn`, which appends scripted turns (an exception in
    the script is raised instead) and can be held at `gate`."""

    def __init__(self, tokenizer, script: list):
        pool = SimpleNamespace(router=CountingRouter(), room_freed=lambda: None)
        super().__init__(pool, ChatFormat(tokenizer), [])
        self.script, self.gate = list(script), asyncio.Event()
        self.gate.set()
        self.started = asyncio.Event()

    async def model_turn(self, trajectory, instance_id, sampling=None):
        self.started.set()
        await self.gate.wait()
        turn = self.script.pop(0)
        if isinstance(turn, BaseException):
            raise turn
        tokens = self.chat.tokenizer.encode(turn, add_special_tokens=False)
        trajectory.append(tokens, [-0.5] * len(tokens), 0)
        trajectory.num_turns += 1
        return 0, FinishReason.STOP


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from libra.tasks.tiny_model import make_tiny_model

    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


def _call(content: str, n: int = 1):
    return parse_chat({"messages": [{"role": "user", "content": content}], "n": n}, max_n=4)


def test_a_call_that_waited_for_a_closed_session_is_refused_and_nothing_leaks(tokenizer):
    async def scenario():
        loop = ScriptedLoop(tokenizer, ["first<|im_end|>", "second<|im_end|>"])
        service = EndpointService(loop, EndpointConfig())
        loop.gate.clear()
        first = asyncio.create_task(service.chat("s", _call("hello")))
        await loop.started.wait()  # the first call holds the session
        closing = asyncio.create_task(service.close_session("s"))
        late = asyncio.create_task(service.chat("s", _call("again")))
        await asyncio.sleep(0)
        loop.gate.set()
        served, segments = await first, await closing
        with pytest.raises(SessionClosed):
            await late
        return loop.router, served, segments

    router, served, segments = asyncio.run(scenario())
    assert served.choices[0].reply.message.content == "first"
    assert [s.trajectory.trajectory_id for s in segments] == ["s.0"]
    assert router.admitted == router.released == ["s.0"]


def test_a_call_whose_choice_failed_leaves_nothing_to_continue(tokenizer):
    async def scenario():
        loop = ScriptedLoop(tokenizer, ["fine<|im_end|>", RuntimeError("engine broke"), "retried<|im_end|>"])
        service = EndpointService(loop, EndpointConfig())
        with pytest.raises(RuntimeError, match="engine broke"):
            await service.chat("s", _call("hello", n=2))
        retried = await service.chat("s", _call("hello"))
        segments = await service.close_session("s")
        return loop.router, retried, segments

    router, retried, segments = asyncio.run(scenario())
    first, second, third = segments
    assert first.trajectory.outcome == second.trajectory.outcome == Outcome.ERROR
    assert "another choice of its call failed" in first.trajectory.outcome_reason
    # The retry starts a segment of its own and says why.
    assert retried.new_segment == "segment s.1 ended (error)"
    assert third.trajectory.outcome == Outcome.ANSWERED
    assert sorted(router.admitted) == sorted(router.released) == ["s.0", "s.1", "s.2"]
