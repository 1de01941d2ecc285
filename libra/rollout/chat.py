"""The chat format of the agent loop, in token ids: prompts, tool-call parsing, tool results.

Hermes / Qwen style: the model calls a tool by emitting `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`, and generation stops on `</tool_call>` (a special token, so a stop token id).
The tool's result goes back as a user turn wrapped in `<tool_response>`:

    ...</tool_call> | <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>
                      <|im_end|>\\n<|im_start|>assistant\\n

An environment's observation (`libra.rollout.environment`) goes back as a plain user turn, after
either ending of the model's turn (`user_turn_ids`):

    ...</tool_call> | <|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n
    ...<|im_end|>   | \n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n

The model's own tokens are never re-tokenized: a tool call is parsed by decoding a copy, and the
result is appended as new tokens after the model's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from libra.rollout.tools.base import Tool, ToolCall

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
"""Ends every turn; the model's end-of-sequence token."""
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
PAD = "<|endoftext|>"


class ToolCallError(ValueError):
    """The model's tool call cannot be parsed; the message is shown to the model."""


class ChatFormat:
    """Token-level chat markup for one tokenizer (any HF tokenizer with these special tokens)."""

    def __init__(self, tokenizer, tools: Sequence[Tool] = ()):
        self.tokenizer = tokenizer
        self.tool_schemas = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in tools
        ]
        ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (IM_END, TOOL_CALL_START, TOOL_CALL_END)}
        unknown = [tok for tok, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if unknown:
            raise ValueError(f"the tokenizer lacks the special tokens {unknown}")
        for tok in ids:
            if len(tokenizer.encode(tok, add_special_tokens=False)) != 1:
                raise ValueError(f"{tok} must be a single special token of the tokenizer")
        self.eos_id = ids[IM_END]
        self.tool_call_start_id = ids[TOOL_CALL_START]
        self.tool_call_end_id = ids[TOOL_CALL_END]
        self._result_prefix = self._markup(f"{IM_END}\n{IM_START}user\n{TOOL_RESPONSE_START}\n")
        self._result_suffix = self._markup(f"\n{TOOL_RESPONSE_END}{IM_END}\n{IM_START}assistant\n")
        self._user_after_call = self._markup(f"{IM_END}\n{IM_START}user\n")
        self._user_after_end = self._markup(f"\n{IM_START}user\n")
        self._user_suffix = self._markup(f"{IM_END}\n{IM_START}assistant\n")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """A turn ends at a tool call's end or at the end of the message."""
        return (self.tool_call_end_id, self.eos_id)

    def _markup(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict[str, Any]], list_tools: bool = True) -> list[int]:
        """The chat template applied to `messages` with the tools (unless `list_tools` is False: an
        environment's prompt), ending with the assistant header."""
        tools = self.tool_schemas if list_tools else None
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        return self._markup(text)

    def tool_result_ids(self, content: str) -> list[int]:
        """Tokens appended after a `</tool_call>`. Special-token text inside `content` is split
        into plain tokens, so a tool's output cannot forge chat markup."""
        return self._result_prefix + self._plain_ids(content) + self._result_suffix

    def user_turn_ids(self, content: str, after: int) -> list[int]:
        """Tokens of a user message appended after a model turn whose last token is `after` (one
        of `stop_token_ids`), ending with the next assistant header; `content` is tokenized as
        plain text, as in `tool_result_ids`."""
        if after == self.tool_call_end_id:
            prefix = self._user_after_call
        elif after == self.eos_id:
            prefix = self._user_after_end
        else:
            raise ValueError(
                f"a user turn follows a turn ended by {self.stop_token_ids}, not by token {after}"
            )
        return prefix + self._plain_ids(content) + self._user_suffix

    def _plain_ids(self, text: str) -> list[int]:
        """`text` tokenized as plain text (special-token strings split into ordinary tokens).
        Runs once per tool call, so it goes straight to a fast tokenizer's Rust backend, which
        is what the HF call does too, minus ~90 µs of wrapper per call; the result is the same
        (tests/rollout/test_chat.py). Falls back to the HF call where the backend is absent or
        configured to truncate or pad."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        previous = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            return backend.encode(text, add_special_tokens=False).ids
        finally:
            backend.encode_special_tokens = previous

    def parse_tool_call(self, turn_ids: Sequence[int]) -> ToolCall:
        """The call in a turn ending with `</tool_call>`: the JSON between the last `<tool_call>`
        and the end. Raises ToolCallError saying what is wrong."""
        if not turn_ids or turn_ids[-1] != self.tool_call_end_id:
            raise ToolCallError(f"the turn does not end with {TOOL_CALL_END}")
        starts = [i for i, t in enumerate(turn_ids[:-1]) if t == self.tool_call_start_id]
        if not starts:
            raise ToolCallError(f"{TOOL_CALL_END} without a preceding {TOOL_CALL_START}")
        text = self.tokenizer.decode(list(turn_ids[starts[-1] + 1 : -1]), skip_special_tokens=False).strip()
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the tool call is not valid JSON ({e.msg} at char {e.pos})") from None
        if not isinstance(payload, dict):
            raise ToolCallError(f"the tool call must be a JSON object, got {type(payload).__name__}")
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            raise ToolCallError('the tool call needs a string "name"')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ToolCallError('"arguments" is a string that is not JSON') from None
        if not isinstance(arguments, dict):
            raise ToolCallError(f'"arguments" must be a JSON object, got {type(arguments).__name__}')
        return ToolCall(name=name, arguments=arguments)
