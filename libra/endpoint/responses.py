"""OpenAI response bodies (and stream chunks) of served calls.

Each body carries, besides OpenAI's fields, a `libra` object: the session, whether this call
started a new segment and why, and per choice the trajectory and the exact token ids sampled
(token-out: a client may check or store them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from libra.endpoint.service import Choice, Served


def _libra(served: Served) -> dict[str, Any]:
    return {
        "session_id": served.session_id,
        "new_segment": served.new_segment is not None,
        "segment_reason": served.new_segment or "",
        "choices": [{"trajectory_id": c.trajectory_id, "token_ids": c.token_ids} for c in served.choices],
    }


def _usage(served: Served) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in served.choices)
    return {
        "prompt_tokens": served.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": served.prompt_tokens + completion,
    }


def _token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def _chat_logprobs(tokenizer, choice: Choice) -> dict[str, Any]:
    texts = _token_texts(tokenizer, choice.token_ids)
    return {
        "content": [
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
            for text, logprob in zip(texts, choice.logprobs, strict=True)
        ]
    }


def chat_completion(served: Served, model: str, tokenizer, logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "message": choice.reply.message.to_openai(),
                "finish_reason": choice.reply.finish_reason,
                "logprobs": _chat_logprobs(tokenizer, choice) if logprobs else None,
            }
            for index, choice in enumerate(served.choices)
        ],
        "usage": _usage(served),
        "libra": _libra(served),
    }


def chat_chunks(
    served: Served, model: str, tokenizer, logprobs: bool, include_usage: bool
) -> Iterator[dict[str, Any]]:
    """The stream of a served call: per choice its role, content and tool calls, then its finish."""
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
    }
    base["model"] = model

    def chunk(index: int, delta: dict, finish: str | None = None, **extra) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return {**base, "choices": [choice]}

    for index, choice in enumerate(served.choices):
        message = choice.reply.message
        yield chunk(index, {"role": "assistant", "content": ""})
        if message.content:
            extra = {"logprobs": _chat_logprobs(tokenizer, choice)} if logprobs else {}
            yield chunk(index, {"content": message.content}, **extra)
        if message.tool_calls:
            calls = message.to_openai()["tool_calls"]
            yield chunk(index, {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
        yield chunk(index, {}, choice.reply.finish_reason)
    yield {
        **base,
        "choices": [],
        "libra": _libra(served),
        **({"usage": _usage(served)} if include_usage else {}),
    }


def _completion_logprobs(tokenizer, choice: Choice) -> dict[str, Any]:
    texts = _token_texts(tokenizer, choice.token_ids)
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": choice.logprobs, "top_logprobs": None, "text_offset": offsets}


def completion(served: Served, model: str, tokenizer, logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "text": choice.reply.message.content,
                "finish_reason": choice.reply.finish_reason,
                "logprobs": _completion_logprobs(tokenizer, choice) if logprobs else None,
            }
            for index, choice in enumerate(served.choices)
        ],
        "usage": _usage(served),
        "libra": _libra(served),
    }


def completion_chunks(
    served: Served, model: str, tokenizer, logprobs: bool, include_usage: bool
) -> Iterator[dict[str, Any]]:
    body = completion(served, model, tokenizer, logprobs)
    for choice in body["choices"]:
        yield {**body, "choices": [choice], "usage": None}
    yield {**body, "choices": [], "usage": body["usage"] if include_usage else None}


def models(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "libra"}],
    }


def error(message: str, kind: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
