"""An agent written against the `openai` package, trained by Libra through its endpoint.

Nothing here knows Libra's internals: the agent chats with `ctx.base_url` like with any
OpenAI-compatible server and runs the tools the model calls. Libra records the exact tokens and
logprobs sampled for each session and trains on them. Run the default job with it:

    libra run configs/tiny_cpu.py endpoint.agent=examples.openai_agent:agent

Every call carries the session header (`ctx.headers`), so the calls of one run of `agent` are one
trajectory. Tools come from the job (`ctx.tools`, the config's `tools.enabled`) so that the
tiny policy's own tools answer; an agent may as well run its own, or call a SWE harness. The
agent returns None, so the job's reward rule scores the final answer; an agent that grades
itself returns a number instead (or posts it to `/v1/libra/sessions/{id}/reward`).
"""

from __future__ import annotations

import json

import openai

from libra.job.agents import AgentContext

MAX_TURNS = 8


async def agent(ctx: AgentContext) -> float | None:
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, default_headers=ctx.headers)
    try:
        messages: list[dict] = ctx.task.chat_messages()
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(model=ctx.model, messages=messages)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return None  # answered (or cut by length): the job's reward rule scores it
            for call in message.tool_calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": await run_tool(ctx, call.function)}
                )
        return None
    finally:
        await client.close()


async def run_tool(ctx: AgentContext, function) -> str:
    """The tool's output, or an error message the model reads (as the built-in loop does)."""
    tool = ctx.tools.get(function.name)
    if tool is None:
        return f"error: unknown tool {function.name!r}; available: {sorted(ctx.tools)}"
    try:
        result = await tool(json.loads(function.arguments))
    except Exception as e:  # noqa: BLE001 - a failing tool is the model's problem to read about
        return f"error: the tool raised {type(e).__name__}: {e}"
    return result.content
