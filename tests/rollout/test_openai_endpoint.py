"""The OpenAI-compatible endpoint against real instances, driven by the real `openai` package.

The scripted model has memorised calculator dialogs, so greedy decoding drives an agent written
only against `openai.AsyncOpenAI` through a known multi-turn tool-calling session. The session's
trajectory must hold exactly the tokens the engines sampled (the agent loop's call records), be
token for token the trajectory Libra's built-in loop produces for the same question, and carry
logprobs that fp32 transformers recomputes on the same weights. A client that rewrites its
history gets a new segment, said in the response.
"""

from __future__ import annotations

import json

import openai
import pytest

from libra.endpoint.config import EndpointConfig
from libra.endpoint.server import OpenAIEndpoint
from libra.endpoint.service import EndpointService
from libra.rollout.tools.calculator import evaluate
from libra.scheduler import LeastLoadRouter
from libra.trajectory import Outcome
from tests.rollout.conftest import TOKEN, run
from tests.rollout.helpers import check_continuity, make_loop, make_pool, new_trajectory

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

QUESTION = "What is 12+7?"
ANSWER = "The answer is 19."


class Served:
    """A pool over the instances, the agent loop (its calls recorded) and the endpoint."""

    def __init__(self, instances, tokenizer, **endpoint):
        self.instances, self.tokenizer, self.endpoint_config = (
            instances,
            tokenizer,
            EndpointConfig(**endpoint),
        )
        self.calls = []

    async def __aenter__(self):
        self.pool = await make_pool(LeastLoadRouter(), [i.address for i in self.instances])
        self.loop = make_loop(self.pool, self.tokenizer, self.calls)
        self.service = EndpointService(self.loop, self.endpoint_config)
        self.endpoint = await OpenAIEndpoint(self.service, TOKEN, "127.0.0.1").start()
        self.client = openai.AsyncOpenAI(base_url=self.endpoint.url, api_key=TOKEN, max_retries=0)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.endpoint.close()
        await self.pool.close()


async def calculator_agent(client: openai.AsyncOpenAI, session: str, question: str = QUESTION) -> list:
    """A plain OpenAI-client agent: call the model, run its tool calls, until it answers."""
    messages = [{"role": "user", "content": question}]
    responses = []
    for _ in range(4):
        response = await client.chat.completions.create(
            model="any", messages=messages, temperature=0, extra_headers={"x-libra-session": session}
        )
        responses.append(response)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return responses
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = evaluate(arguments["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(result))})
    raise AssertionError("the agent never answered")


def test_an_openai_agent_session_is_the_trajectory_the_engines_sampled(instances, tokenizer, model_dirs):
    async def scenario():
        async with Served(instances, tokenizer) as served:
            responses = await calculator_agent(served.client, "s1")
            [segment] = await served.service.close_session("s1")
            builtin = await served.loop.run(new_trajectory(tokenizer, QUESTION, "builtin"))
            return responses, segment.trajectory, builtin, served.calls

    responses, trajectory, builtin, calls = run(scenario())
    first, second = responses
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "12+7"})
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].finish_reason == "stop"
    # One session, one trajectory: every call continued the tokens sampled before.
    check_continuity(trajectory, calls)
    assert trajectory.outcome == Outcome.ANSWERED and trajectory.num_turns == 2
    assert [r.tool for r in trajectory.tool_returns] == ["calculator"]
    # Token for token what the built-in loop (calculator tool, Hermes format) produces.
    assert trajectory.token_ids == builtin.token_ids
    assert trajectory.loss_mask == builtin.loss_mask
    # Token-out: each response names the tokens sampled for it.
    sampled = [t for t, m in zip(trajectory.response_token_ids, trajectory.loss_mask, strict=True) if m]
    told = [t for r in responses for t in r.model_extra["libra"]["choices"][0]["token_ids"]]
    assert told == sampled
    assert responses[0].model_extra["libra"]["new_segment"] is True
    assert responses[1].model_extra["libra"]["new_segment"] is False
    _check_logprobs_against_transformers(trajectory, model_dirs.scripted)


def _check_logprobs_against_transformers(trajectory, model_dir) -> None:
    """The sampled tokens' logprobs equal fp32 transformers' on the same weights (within the
    1e-3 the CPU engine's kernels round to, see `scripted_model.MIN_MARGIN`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = torch.tensor([trajectory.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    prompt = len(trajectory.prompt_token_ids)
    for i, (token, mask, sampled) in enumerate(
        zip(trajectory.response_token_ids, trajectory.loss_mask, trajectory.rollout_logprobs, strict=True)
    ):
        if mask:
            assert abs(logp[prompt + i - 1, token].item() - sampled) < 1e-3, (i, token)


def test_a_rewritten_history_starts_a_new_segment_and_says_so(instances, tokenizer):
    async def scenario():
        async with Served(instances, tokenizer) as served:
            headers = {"x-libra-session": "s2"}
            messages = [{"role": "user", "content": QUESTION}]
            first = await served.client.chat.completions.create(
                model="any", messages=messages, temperature=0, extra_headers=headers
            )
            [call] = first.choices[0].message.tool_calls
            # The client keeps the call but rewrites its arguments' JSON with other content.
            edited = {
                "role": "assistant",
                "content": "Let me compute.",
                "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
            }
            second = await served.client.chat.completions.create(
                model="any",
                messages=[*messages, edited, {"role": "tool", "tool_call_id": call.id, "content": "19"}],
                temperature=0,
                extra_headers=headers,
            )
            segments = await served.service.close_session("s2")
            return second, segments

    second, segments = run(scenario())
    libra = second.model_extra["libra"]
    assert libra["new_segment"] is True
    assert "message 1 (assistant) differs" in libra["segment_reason"]
    assert [s.trajectory.trajectory_id for s in segments] == ["s2.0", "s2.1"]
    rewritten = segments[1].trajectory
    assert rewritten.metadata["segment_reason"] == libra["segment_reason"]
    # The new segment's prompt is the whole rewritten conversation, rendered by the template.
    prompt = tokenizer.decode(rewritten.prompt_token_ids, skip_special_tokens=False)
    assert "Let me compute." in prompt and "<tool_response>\n19\n</tool_response>" in prompt
    assert segments[0].trajectory.num_turns == 1


def test_streaming_n_and_completions(instances, tokenizer):
    async def scenario():
        async with Served(instances, tokenizer) as served:
            models = await served.client.models.list()
            messages = [{"role": "user", "content": QUESTION}]
            stream = await served.client.chat.completions.create(
                model="any",
                messages=messages,
                temperature=0,
                stream=True,
                extra_headers={"x-libra-session": "st"},
            )
            parts = [chunk async for chunk in stream]
            several = await served.client.chat.completions.create(
                model="any", messages=messages, n=3, logprobs=True, extra_headers={"x-libra-session": "n3"}
            )
            prompt = new_trajectory(tokenizer, QUESTION, "x").prompt_token_ids
            completion = await served.client.completions.create(
                model="any",
                prompt=prompt,
                max_tokens=5,
                temperature=0,
                extra_headers={"x-libra-session": "c"},
            )
            continued = await served.client.completions.create(
                model="any",
                prompt=prompt + completion.model_extra["libra"]["choices"][0]["token_ids"],
                max_tokens=5,
                temperature=0,
                extra_headers={"x-libra-session": "c"},
            )
            n3 = await served.service.close_session("n3")
            c = await served.service.close_session("c")
            return models, parts, several, completion, continued, n3, c

    models, parts, several, completion, continued, n3, c = run(scenario())
    assert [m.id for m in models.data] == ["libra-policy"]
    deltas = [p.choices[0].delta for p in parts if p.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls and calls[0].function.name == "calculator"
    assert parts[-2].choices[0].finish_reason == "tool_calls"
    assert len(several.choices) == 3 and len(n3) == 3
    assert len({s.trajectory.trajectory_id for s in n3}) == 3
    for choice, segment in zip(several.choices, n3, strict=True):
        sampled = [
            lp
            for lp, m in zip(segment.trajectory.rollout_logprobs, segment.trajectory.loss_mask, strict=True)
            if m
        ]
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(sampled)
    # A completion prompt that extends the session's tokens continues its one segment.
    assert continued.model_extra["libra"]["new_segment"] is False
    [segment] = c
    assert segment.trajectory.num_turns == 2
    assert segment.trajectory.loss_mask.count(0) == 0  # nothing appended between the two calls


def test_errors_auth_and_trained_sessions(instances, tokenizer):
    async def scenario():
        async with Served(instances, tokenizer) as served:
            outcomes = {}
            anonymous = openai.AsyncOpenAI(base_url=served.endpoint.url, api_key="wrong", max_retries=0)
            messages = [{"role": "user", "content": QUESTION}]
            for name, client, kwargs in [
                ("auth", anonymous, {}),
                ("tool_choice", served.client, {"tool_choice": "required", "tools": [_TOOL]}),
                ("top_logprobs", served.client, {"logprobs": True, "top_logprobs": 2}),
                ("n", served.client, {"n": 99}),
                (
                    "trained_temperature",
                    served.client,
                    {"temperature": 0.5, "extra_headers": {"x-libra-session": "job"}},
                ),
            ]:
                if name == "trained_temperature":
                    served.service.open_session("job", "p0", "g0")
                try:
                    await client.chat.completions.create(model="any", messages=messages, **kwargs)
                except openai.APIStatusError as e:
                    outcomes[name] = (e.status_code, e.message)
            await anonymous.close()
            reward = await served.client.post(
                "/libra/sessions/job/reward", body={"reward": 0.5}, cast_to=object
            )
            try:  # the job's own session is the job's to close
                await served.client.delete("/libra/sessions/job", cast_to=object)
            except openai.APIStatusError as e:
                outcomes["delete_trained"] = (e.status_code, e.message)
            await served.client.chat.completions.create(
                model="any", messages=messages, max_tokens=2, extra_headers={"x-libra-session": "outside"}
            )
            closed = await served.client.delete("/libra/sessions/outside", cast_to=object)
            outcomes["delete_outside"] = (closed, served.service.sessions.lookup("outside"))
            return outcomes, reward, served.service.sessions.lookup("job").reward

    outcomes, reward, stored = run(scenario())
    assert outcomes["auth"][0] == 401
    assert outcomes["tool_choice"][0] == 400 and "guided decoding" in outcomes["tool_choice"][1]
    assert outcomes["top_logprobs"][0] == 400
    assert outcomes["n"][0] == 400 and "endpoint.max_n" in outcomes["n"][1]
    assert (
        outcomes["trained_temperature"][0] == 400
        and "rollout.agent.temperature" in outcomes["trained_temperature"][1]
    )
    assert reward == {"session_id": "job", "reward": 0.5} and stored == 0.5
    assert outcomes["delete_trained"][0] == 409
    assert outcomes["delete_outside"] == ({"session_id": "outside", "closed": True, "segments": 1}, None)


_TOOL = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}},
}
