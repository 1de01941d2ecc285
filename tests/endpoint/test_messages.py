"""The endpoint's edge without an engine: chat messages to tokens and model turns back, request
parsing, and which segment a call continues.

The reference for rendering is the chat template itself: a conversation rendered whole must be
token for token the first call's prompt, the tokens the model sampled (as the template would
write them) and each continuation. And for tool results, the built-in agent loop's tokens.
"""

from __future__ import annotations

import json

import pytest

from libra.endpoint.messages import ChatRenderer, Message, RequestError, ToolCall, parse_messages, tools_key
from libra.endpoint.requests import parse_chat, parse_completion
from libra.endpoint.sessions import Session, SessionLimit, SessionStore
from libra.rollout.chat import ChatFormat
from libra.rollout.types import FinishReason
from libra.trajectory import Outcome


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from libra.tasks.tiny_model import make_tiny_model

    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(ChatFormat(tokenizer))


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>'
TOOL = {"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {}}}


def test_a_continued_conversation_is_the_conversation_rendered_whole(renderer, tokenizer):
    """prompt + sampled turn + continuation == the template over all the messages, with and
    without tools in the system prompt, after a tool call and after an answer."""
    for tools in ((), (TOOL,)):
        user = Message("user", "What is 12+7?")
        call = ToolCall("c1", "calculator", json.dumps({"expression": "12+7"}))
        assistant = Message("assistant", "", (call,))
        result = Message("tool", "19", tool_call_id="c1")
        answer = Message("assistant", "The answer is 19.")
        follow_up = Message("user", "And 3*45?")

        tokens = renderer.prompt_ids([user], tools)
        tokens += _encode(tokenizer, CALL_TEXT)  # the model's turn ends at </tool_call>
        tokens += renderer.continuation_ids(tokens[-1], [result], tools)
        tokens += _encode(tokenizer, "The answer is 19.<|im_end|>")  # ends at EOS
        tokens += renderer.continuation_ids(tokens[-1], [follow_up], tools)
        whole = renderer.prompt_ids([user, assistant, result, answer, follow_up], tools)
        assert tokens == whole


# Qwen3's way: the last assistant message gets an empty think block, an earlier one does not.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_the_last_assistant_turn_apart_still_continues(tokenizer):
    import copy

    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = THINKING_TEMPLATE
    renderer = ChatRenderer(ChatFormat(thinking))
    user = Message("user", "What is 12+7?")
    call = ToolCall("c1", "calculator", json.dumps({"expression": "12+7"}))
    result = Message("tool", "19", tool_call_id="c1")
    tokens = renderer.prompt_ids([user], ()) + _encode(thinking, CALL_TEXT)
    tokens += renderer.continuation_ids(tokens[-1], [result], ())
    assert tokens == renderer.prompt_ids([user, Message("assistant", "", (call,)), result], ())


def test_a_tool_result_is_what_the_built_in_loop_appends(renderer, tokenizer):
    chat = renderer.chat
    after_call = _encode(tokenizer, CALL_TEXT)[-1]
    appended = renderer.continuation_ids(after_call, [Message("tool", "19", tool_call_id="c1")], ())
    assert appended == chat.tool_result_ids("19")


def test_a_turn_cut_by_length_is_closed_with_the_whole_markup(renderer, tokenizer):
    """A plain token whose text begins the closing markup (`<`) is no end of turn: the closing
    `<|im_end|>` is still written, as the special token."""
    [less_than] = _encode(tokenizer, "<")
    appended = renderer.continuation_ids(less_than, [Message("user", "go on")], ())
    assert appended[0] == renderer.chat.eos_id
    after_eos = renderer.continuation_ids(renderer.chat.eos_id, [Message("user", "go on")], ())
    assert after_eos == appended[1:]


def test_a_turn_read_back(renderer, tokenizer):
    call = renderer.reply(_encode(tokenizer, "Let me see." + CALL_TEXT), FinishReason.STOP, (), True)
    assert call.finish_reason == "tool_calls"
    assert call.message.content == "Let me see."
    [tool_call] = call.message.tool_calls
    assert (tool_call.name, json.loads(tool_call.arguments)) == ("calculator", {"expression": "12+7"})
    as_text = renderer.reply(_encode(tokenizer, CALL_TEXT), FinishReason.STOP, (), False)
    assert (as_text.finish_reason, as_text.message.tool_calls) == ("stop", ())
    malformed = renderer.reply(
        _encode(tokenizer, "<tool_call>\n{oops\n</tool_call>"), FinishReason.STOP, (), True
    )
    assert malformed.finish_reason == "stop" and "{oops" in malformed.message.content
    cut = renderer.reply(_encode(tokenizer, "abc def"), FinishReason.LENGTH, (), True)
    assert cut.finish_reason == "length"


def test_a_stop_string_cuts_the_turn_after_the_token_completing_it(renderer, tokenizer):
    turn = _encode(tokenizer, "one two three four<|im_end|>")
    reply = renderer.reply(turn, FinishReason.STOP, ("three",), True)
    assert reply.finish_reason == "stop" and reply.message.content == "one two "
    kept = tokenizer.decode(turn[: reply.kept_tokens])
    assert "three" in kept and "three" not in tokenizer.decode(turn[: reply.kept_tokens - 1])
    assert renderer.reply(turn, FinishReason.STOP, ("absent",), True).kept_tokens == len(turn)


def test_bad_messages_and_requests_are_named():
    cases = [
        (lambda: parse_messages([]), "'messages' must be a non-empty list"),
        (lambda: parse_messages([{"role": "robot", "content": "x"}]), "messages[0].role"),
        (
            lambda: parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0] must be a text part",
        ),
        (
            lambda: parse_messages([{"role": "user", "content": "x", "tool_calls": [{}]}]),
            "on an assistant message",
        ),
        (lambda: parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 0}, 4), "n must be"),
        (lambda: parse_chat({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 4), "top_p"),
        (lambda: parse_chat({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 4), "'stop'"),
        (
            lambda: parse_chat({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}, 4),
            "presence_penalty",
        ),
        (
            lambda: parse_chat(
                {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 4
            ),
            "guided decoding",
        ),
        (lambda: parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 4), "tools[0]"),
        (lambda: parse_completion({"prompt": ""}, 4), "'prompt'"),
        (lambda: parse_completion({"prompt": "x", "echo": True}, 4), "echo"),
        (lambda: parse_completion({"prompt": "x", "logprobs": 5}, 4), "logprobs"),
    ]
    for call, expected in cases:
        with pytest.raises(RequestError, match=_escaped(expected)):
            call()


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_a_well_formed_chat_request():
    request = parse_chat(
        {
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_completion_tokens": 7,
            "stop": "END",
            "n": 2,
            "logprobs": True,
            "tool_choice": "none",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        4,
    )
    assert request.messages[0] == Message("system", "be brief")
    assert (request.sampling.max_tokens, request.sampling.stop, request.sampling.n) == (7, ("END",), 2)
    assert request.parse_tools is False and request.stream and request.include_usage
    assert parse_completion({"prompt": [[1, 2, 3]]}, 4).prompt == [1, 2, 3]


def _session_with_reply() -> tuple[Session, list[Message]]:
    session = Session("s", "p", "g", trained=True)
    history = [Message("user", "q"), Message("assistant", "", (ToolCall("c1", "calculator", "{}"),))]
    session.new_segment([1, 2], history, None, tools_key(()), "")
    return session, history


def test_a_call_continues_the_segment_whose_history_it_extends():
    session, history = _session_with_reply()
    [segment] = session.segments
    tool = Message("tool", "19", tool_call_id="c1")
    assert session.continued_chat([*history, tool], tools_key(())) == (segment, "")
    # The client's echo of the reply is compared in canonical form (arguments re-serialised).
    echoed = parse_messages(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": " {} "}}
                ],
            },
        ]
    )
    assert session.continued_chat([*echoed, tool], tools_key(()))[0] is segment


def test_why_a_call_starts_a_new_segment():
    session, history = _session_with_reply()
    edited = [history[0], Message("assistant", "thinking...", history[1].tool_calls)]
    assert session.continued_chat(edited, tools_key(())) == (
        None,
        "message 1 (assistant) differs from what segment s.0 holds: the history was rewritten",
    )
    assert session.continued_chat(history, tools_key((TOOL,)))[1] == "the tools changed"
    session.segments[0].trajectory.outcome = Outcome.CONTEXT_OVERFLOW
    assert session.continued_chat(history, tools_key(()))[1] == "segment s.0 ended (context_overflow)"


def test_forks_and_the_session_limit():
    session, _ = _session_with_reply()
    twin = session.fork(session.segments[0])
    assert twin.trajectory.trajectory_id == "s.1" and twin.trajectory.prompt_token_ids == [1, 2]
    assert twin.trajectory is not session.segments[0].trajectory and not twin.admitted
    # The limit holds outside clients' sessions; the job's own are bounded by its gate.
    store = SessionStore(max_sessions=1, idle_s=60)
    store.open("job", "p", "g")
    store.get("outside")
    with pytest.raises(SessionLimit, match="endpoint.max_sessions"):
        store.get("another")
    with pytest.raises(ValueError, match="already open"):
        store.open("outside", "p", "g")  # an outside client named it first: the job's open fails
    store.remove("outside")
    assert store.get("another").trained is False
