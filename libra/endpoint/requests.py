"""The endpoint's requests, parsed from their JSON into typed values (RequestError names the field).

Sampling that would make the tokens differ from what the policy itself samples is refused, not
silently applied: forced tool choice (it needs guided decoding), logit bias, penalties, top
logprobs beyond the sampled token's (the engine reports only that one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libra.endpoint.messages import Message, RequestError, parse_messages, parse_tools

SESSION_HEADER = "x-libra-session"
"""Names the session (one trajectory per session); the body's `user` field is the fallback."""


@dataclass(frozen=True)
class Sampling:
    """What a request asks of sampling; None: the job's (`rollout.agent`)."""

    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: tuple[str, ...]
    seed: int | None
    n: int
    logprobs: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: list[Message]
    tools: tuple[dict[str, Any], ...]
    parse_tools: bool
    """False with `tool_choice: "none"`: tool-call markup the model writes reaches the client as text."""
    sampling: Sampling
    stream: bool
    include_usage: bool
    """`stream_options.include_usage`: a last chunk with the token counts."""


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool


def session_of(headers, body: dict[str, Any]) -> str:
    """The session a request belongs to: the header, else the `user` field, else "" (none)."""
    session = headers.get(SESSION_HEADER) or body.get("user") or ""
    if not isinstance(session, str):
        raise RequestError("'user' must be a string")
    return session


def parse_chat(body: Any, max_n: int) -> ChatRequest:
    body = _object(body)
    _refuse_unsupported(body)
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none", None):
        raise RequestError(
            f"tool_choice {tool_choice!r} is not supported: forcing a call needs guided decoding, which "
            "changes the sampled distribution away from the policy's; use 'auto' or 'none'"
        )
    top_logprobs = body.get("top_logprobs") or 0
    if top_logprobs:
        raise RequestError(
            "top_logprobs is not supported: the engine reports the sampled token's logprob only"
        )
    stream, include_usage = _stream(body)
    return ChatRequest(
        messages=parse_messages(body.get("messages")),
        tools=parse_tools(body.get("tools")),
        parse_tools=tool_choice != "none",
        sampling=_sampling(body, body.get("max_completion_tokens", body.get("max_tokens")), max_n),
        stream=stream,
        include_usage=include_usage,
    )


def parse_completion(body: Any, max_n: int) -> CompletionRequest:
    body = _object(body)
    _refuse_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    tokens = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    if not tokens and not (isinstance(prompt, str) and prompt):
        raise RequestError("'prompt' must be a non-empty string or a list of token ids (one prompt)")
    if body.get("echo"):
        raise RequestError("echo is not supported")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1):
        raise RequestError("logprobs above 1 are not supported: the engine reports the sampled token's only")
    stream, include_usage = _stream(body)
    sampling = _sampling({**body, "logprobs": logprobs is not None}, body.get("max_tokens"), max_n)
    return CompletionRequest(prompt, sampling, stream, include_usage)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(name) not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0):
            raise RequestError(f"{name} is not supported: it would train on tokens the policy did not sample")
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported: it would train on tokens the policy did not sample")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise RequestError("response_format other than text is not supported (it needs guided decoding)")


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object")
    return stream, bool(options.get("include_usage"))


def _sampling(body: dict[str, Any], max_tokens: Any, max_n: int) -> Sampling:
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be in (0, 1]")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= max_n:
        raise RequestError(f"n must be an integer in 1..{max_n} (endpoint.max_n), got {n!r}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError("'seed' must be an integer")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise RequestError("'logprobs' must be a boolean")
    return Sampling(temperature, top_p, max_tokens, _stop(body.get("stop")), seed, n, logprobs)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = (value,) if isinstance(value, str) else value
    if (
        not isinstance(stops, (list, tuple))
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError("'stop' must be a non-empty string or a list of up to 4 of them")
    return tuple(stops)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
