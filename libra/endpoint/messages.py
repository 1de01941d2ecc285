"""OpenAI chat messages and the policy's tokens, both ways.

A session's first call renders its messages with the model's chat template, as vLLM's server
does. A later call never re-renders what the model sampled (templates drop earlier reasoning,
re-serialise tool-call JSON, trim whitespace: the tokens would differ from those trained on):
its new messages are rendered as a *continuation* and appended after the sampled tokens. The
continuation is what the template writes after an assistant turn: the rest of the turn's closing
markup (`<|im_end|>\\n` after `</tool_call>`, `\\n` after an `<|im_end|>` the model sampled),
then the new messages, then the generation prompt. It is derived from the template itself, with a
probe conversation, so any template that renders the messages after an assistant turn
independently of what came before works (Qwen's drop of earlier reasoning included); one that
does not is refused at the first continuation with a message saying so.

Messages are compared (to tell a continuation from a rewritten history) in a canonical form:
role, text, tool calls with parsed arguments, tool-call id and name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libra.rollout.chat import ChatFormat, ToolCallError
from libra.rollout.types import FinishReason

ROLES = ("system", "developer", "user", "assistant", "tool")
_PROBE_USER, _PROBE_ASSISTANT = "LIBRA-PROBE-USER", "LIBRA-PROBE-ASSISTANT"


class RequestError(ValueError):
    """A request the endpoint cannot serve; the message names the field (HTTP 400)."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """Canonical JSON (sorted keys) of the arguments object."""


@dataclass(frozen=True)
class Message:
    """One chat message in canonical form (hashable: histories compare with ==)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template renders (arguments as objects, as vLLM's server passes them)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message

    def to_openai(self) -> dict[str, Any]:
        """The assistant message of a response."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return message


def parse_messages(raw: Any) -> list[Message]:
    """A request's `messages` in canonical form; RequestError naming the message and field."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list")
    return [_parse_message(m, i) for i, m in enumerate(raw)]


def _parse_message(raw: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise RequestError(f"{where} must be an object")
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {ROLES}, got {role!r}")
    calls = raw.get("tool_calls") or []
    if not isinstance(calls, list) or (calls and role != "assistant"):
        raise RequestError(f"{where}.tool_calls must be a list, on an assistant message")
    tool_call_id = raw.get("tool_call_id") or ""
    if role == "tool" and not isinstance(tool_call_id, str):
        raise RequestError(f"{where}.tool_call_id must be a string")
    name = raw.get("name") or ""
    if not isinstance(name, str):
        raise RequestError(f"{where}.name must be a string")
    return Message(
        role="system" if role == "developer" else role,
        content=_text(raw.get("content"), where),
        tool_calls=tuple(_parse_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)),
        tool_call_id=tool_call_id,
        name=name,
    )


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(f"{where}.content[{j}] must be a text part: the policy reads text only")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, a list of text parts or null")


def _parse_tool_call(raw: Any, where: str) -> ToolCall:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(
            f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}"
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise RequestError(f"{where}.function.arguments is not JSON") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    return ToolCall(str(raw.get("id") or ""), function["name"], _canonical(arguments))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def parse_tools(raw: Any) -> tuple[dict[str, Any], ...]:
    """A request's `tools` (function tools only), as the template renders them."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError("'tools' must be a list")
    for i, tool in enumerate(raw):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(tool["function"].get("name"), str):
            raise RequestError(f"tools[{i}].function.name must be a string")
    return tuple(raw)


def tools_key(tools: Sequence[dict[str, Any]]) -> str:
    """Canonical form of a tool list: a session whose tools change has a new system prompt."""
    return _canonical(list(tools))


@dataclass(frozen=True)
class Reply:
    """A model turn as the client sees it."""

    message: Message
    finish_reason: str
    """OpenAI's: `stop`, `length` or `tool_calls`."""
    kept_tokens: int
    """Tokens of the turn kept (fewer than sampled when a stop string cut it)."""


class ChatRenderer:
    """Renders one tokenizer's chat template for the endpoint, and reads model turns back."""

    def __init__(self, chat: ChatFormat):
        self.chat = chat
        self.tokenizer = chat.tokenizer
        probe = [Message("user", _PROBE_USER), Message("assistant", _PROBE_ASSISTANT)]
        self._probe = probe
        closed_probe = self._render(probe, (), generation_prompt=False)
        at = closed_probe.rfind(_PROBE_ASSISTANT)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content")
        closing = closed_probe[at + len(_PROBE_ASSISTANT) :]
        self._closing = {
            stop: closing.removeprefix(self.tokenizer.decode([stop], skip_special_tokens=False))
            for stop in chat.stop_token_ids
        }
        """What the template writes after an assistant turn's content (`<|im_end|>\\n`), less
        the stop token the turn ended with when the template writes that token too."""
        self._full_closing = closing

    def _render(self, messages: Sequence[Message], tools: Sequence[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_template() for m in messages],
            tools=list(tools) or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict]) -> list[int]:
        """A new segment's prompt: the whole conversation rendered, with the generation prompt."""
        if messages[-1].role == "assistant":
            raise RequestError("the last message is the assistant's: there is no turn to answer")
        return self._encode(self._render(messages, tools, generation_prompt=True))

    def continuation_ids(self, last_token: int, new: Sequence[Message], tools: Sequence[dict]) -> list[int]:
        """Tokens to append after a model turn ending with `last_token`: the rest of the turn's
        closing markup, the `new` messages and the generation prompt."""
        # A stop token the model sampled may be the start of the closing markup (`<|im_end|>`);
        # any other last token (a turn cut by length) leaves the whole closing to write.
        closing = self._closing.get(last_token, self._full_closing)
        # What follows the probe assistant's content and its closing in the conversation
        # rendered with the new messages. (Located in that render itself: a template may render
        # an assistant turn differently once it is no longer the last, as Qwen3's drops the
        # empty think block.)
        extended = self._render([*self._probe, *new], tools, generation_prompt=True)
        after = extended.find(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT)
        if after < len(_PROBE_ASSISTANT) or not extended.startswith(self._full_closing, after):
            raise RequestError(
                "this model's chat template closes an assistant turn differently once more "
                "messages follow, so new messages cannot be appended to the sampled tokens exactly"
            )
        return self._encode(closing + extended[after + len(self._full_closing) :])

    def reply(
        self, turn: Sequence[int], finish: FinishReason, stop: Sequence[str], parse_tools: bool
    ) -> Reply:
        """The assistant message of a turn; a stop string cuts the turn after the token that
        completes it (the tokens past it are dropped from the trajectory by the caller)."""
        decode = self.tokenizer.decode
        if stop:
            kept = self._cut_at_stop(turn, stop)
            text = decode(list(turn[:kept]), skip_special_tokens=True)
            if self._contains_stop(text, stop):
                return Reply(Message("assistant", _before_stop(text, stop)), "stop", kept)
        turn = list(turn)
        if parse_tools and turn and turn[-1] == self.chat.tool_call_end_id:
            try:
                call = self.chat.parse_tool_call(turn)
            except ToolCallError:
                pass  # the model's malformed markup reaches the client as text
            else:
                start = max(i for i, t in enumerate(turn) if t == self.chat.tool_call_start_id)
                tool_call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", call.name, _canonical(call.arguments))
                content = decode(turn[:start], skip_special_tokens=True)
                return Reply(Message("assistant", content, (tool_call,)), "tool_calls", len(turn))
        reason = "length" if finish == FinishReason.LENGTH else "stop"
        return Reply(Message("assistant", decode(turn, skip_special_tokens=True)), reason, len(turn))

    def _contains_stop(self, text: str, stop: Sequence[str]) -> bool:
        return any(s in text for s in stop)

    def _cut_at_stop(self, turn: Sequence[int], stop: Sequence[str]) -> int:
        """The shortest prefix of `turn` whose text contains a stop string (all of it if none
        does): containment only grows with the prefix, so a binary search finds it."""
        decode = self.tokenizer.decode
        if not self._contains_stop(decode(list(turn), skip_special_tokens=True), stop):
            return len(turn)
        low, high = 1, len(turn)
        while low < high:
            middle = (low + high) // 2
            if self._contains_stop(decode(list(turn[:middle]), skip_special_tokens=True), stop):
                high = middle
            else:
                low = middle + 1
        return low


def _before_stop(text: str, stop: Sequence[str]) -> str:
    """OpenAI's content ends before the first stop string."""
    return text[: min(text.find(s) for s in stop if s in text)]
