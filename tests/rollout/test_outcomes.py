"""Every way a trajectory can go wrong ends as a recorded outcome with a reason, never an
exception out of the loop — driven by scripted fake instances (no engine), so each path is
deterministic: the context overflowing mid-turn (the engine's length stop at the window), an
engine whose window is smaller than it reports, a tool result that leaves no room, a malformed
tool call and an unknown tool. (A dead instance: test_instance_loss.py and test_pool_watch.py.)"""

from __future__ import annotations

from libra.scheduler import LeastLoadRouter
from libra.trajectory import Outcome, ToolStatus
from tests.rollout.conftest import run
from tests.rollout.fake_instance import ScriptedInstance, serve_fake
from tests.rollout.helpers import check_continuity, make_loop, make_pool, new_trajectory
from tests.rollout.scripted_model import scripted_chat

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def _run_scripted(tokenizer, fake: ScriptedInstance, question: str = "What is 6*7?", **overrides):
    calls = []

    async def scenario():
        server, address = await serve_fake(fake)
        pool = await make_pool(LeastLoadRouter(), [address])
        try:
            loop = make_loop(pool, tokenizer, calls, **overrides)
            return await loop.run(new_trajectory(tokenizer, question, "t"))
        finally:
            await pool.close()
            await server.stop(grace_s=0)

    return run(scenario()), calls


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _long_turn(tokenizer, num_tokens: int) -> list[int]:
    """A model turn of exactly `num_tokens` ordinary tokens and no end."""
    word = _encode(tokenizer, " seven")
    return (word * num_tokens)[:num_tokens]


def test_context_overflowing_mid_turn_ends_context_overflow(tokenizer):
    """Turn 1 calls the calculator; turn 2 would run past the window: the engine stops it with a
    length stop exactly at max_model_len, and the trajectory ends CONTEXT_OVERFLOW with the
    tokens it got, continuity intact."""
    chat = scripted_chat(tokenizer)
    prompt_len = len(new_trajectory(tokenizer, "What is 6*7?", "p").prompt_token_ids)
    call_ids = _encode(tokenizer, CALL)
    result_len = len(chat.tool_result_ids("42"))
    window = prompt_len + len(call_ids) + result_len + 20  # turn 2 gets 20 tokens of room
    fake = ScriptedInstance([call_ids, _long_turn(tokenizer, 200)], chat.tool_call_end_id, window)

    trajectory, calls = _run_scripted(tokenizer, fake, max_tokens_per_turn=128)

    assert trajectory.outcome == Outcome.CONTEXT_OVERFLOW
    assert f"max_model_len={window}" in trajectory.outcome_reason
    assert len(trajectory.token_ids) == window
    assert [len(c.output_ids) for c in calls] == [len(call_ids), 20]
    assert fake.requests[1].sampling.max_tokens == 20  # the loop asked for no more than the room
    assert trajectory.num_turns == 1  # completed turns; the cut one is kept but not counted
    assert trajectory.tool_returns[0].status == ToolStatus.SUCCESS
    check_continuity(trajectory, calls)


def test_engine_window_smaller_than_reported_ends_context_overflow(tokenizer):
    """The instance reports a 512-token window but its engine stops at 60: the length stop comes
    before the tokens asked for, and the loop says so instead of blaming the turn cap."""
    chat = scripted_chat(tokenizer)
    fake = ScriptedInstance(
        [_long_turn(tokenizer, 300)],
        chat.tool_call_end_id,
        engine_max_model_len=60,
        reported_max_model_len=512,
    )
    trajectory, calls = _run_scripted(tokenizer, fake, max_tokens_per_turn=128)

    prompt_len = len(trajectory.prompt_token_ids)
    assert trajectory.outcome == Outcome.CONTEXT_OVERFLOW
    assert f"after {60 - prompt_len} of 128 tokens" in trajectory.outcome_reason
    assert len(trajectory.token_ids) == 60
    check_continuity(trajectory, calls)


def test_tool_result_filling_the_window_ends_before_the_next_call(tokenizer):
    """The tool's result fills the rest of the window: the next turn is not sent at all."""
    chat = scripted_chat(tokenizer)
    prompt_len = len(new_trajectory(tokenizer, "What is 6*7?", "p").prompt_token_ids)
    call_ids = _encode(tokenizer, CALL)
    window = prompt_len + len(call_ids) + len(chat.tool_result_ids("42")) - 1  # the result overflows it
    fake = ScriptedInstance([call_ids, _encode(tokenizer, "Done.<|im_end|>")], chat.tool_call_end_id, window)

    trajectory, calls = _run_scripted(tokenizer, fake)

    assert trajectory.outcome == Outcome.CONTEXT_OVERFLOW
    assert "leaves no room" in trajectory.outcome_reason
    assert len(fake.requests) == 1
    check_continuity(trajectory, calls)


def test_malformed_tool_call_is_a_failed_tool_result(tokenizer):
    chat = scripted_chat(tokenizer)
    malformed = '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'
    fake = ScriptedInstance(
        [_encode(tokenizer, malformed), _encode(tokenizer, "Sorry.<|im_end|>")], chat.tool_call_end_id
    )
    trajectory, calls = _run_scripted(tokenizer, fake)

    assert trajectory.outcome == Outcome.ANSWERED, trajectory.outcome_reason
    [tool_return] = trajectory.tool_returns
    assert (tool_return.tool, tool_return.status) == ("<malformed>", ToolStatus.FAILURE)
    shown = tokenizer.decode(fake.requests[1].prompt_token_ids[-60:], skip_special_tokens=False)
    assert "error: the tool call is not valid JSON" in shown  # the model is told what is wrong
    check_continuity(trajectory, calls)


def test_unknown_tool_is_a_failed_tool_result(tokenizer):
    chat = scripted_chat(tokenizer)
    weather = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    fake = ScriptedInstance(
        [_encode(tokenizer, weather), _encode(tokenizer, "Sorry.<|im_end|>")], chat.tool_call_end_id
    )
    trajectory, calls = _run_scripted(tokenizer, fake)

    assert trajectory.outcome == Outcome.ANSWERED, trajectory.outcome_reason
    [tool_return] = trajectory.tool_returns
    assert (tool_return.tool, tool_return.status) == ("<unknown>", ToolStatus.FAILURE)
    shown = tokenizer.decode(fake.requests[1].prompt_token_ids, skip_special_tokens=False)
    assert "error: unknown tool 'weather'; available: ['calculator']" in shown
    check_continuity(trajectory, calls)
