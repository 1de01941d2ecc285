"""The agent loop against real instances: multi-turn tool calls with token continuity, moving
between instances, partial rollout across a weight update, and failures as recorded outcomes."""

from __future__ import annotations

import asyncio

import pytest

from libra.rollout import FinishReason, InstanceClient, PauseMode, SamplingSpec, Segment
from libra.scheduler import LeastLoadRouter
from libra.trajectory import TOOL_TOKEN_VERSION, Outcome, ToolStatus
from tests.rollout.conftest import MAX_MODEL_LEN, run
from tests.rollout.helpers import PlannedRouter, check_continuity, make_loop, make_pool, new_trajectory
from tests.rollout.scripted_model import (
    CALCULATOR_QUESTIONS,
    LONG_ANSWER_QUESTION,
    LOOPING_QUESTION,
    MALFORMED_QUESTION,
    UNKNOWN_TOOL_QUESTION,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_multi_turn_tool_calls_keep_token_continuity(instances, tokenizer):
    calls = []

    async def scenario():
        pool = await make_pool(LeastLoadRouter(), [i.address for i in instances])
        try:
            loop = make_loop(pool, tokenizer, calls)
            return await loop.run_all(
                [
                    new_trajectory(tokenizer, f"What is {q}?", f"calc-{i}")
                    for i, q in enumerate(CALCULATOR_QUESTIONS)
                ]
            )
        finally:
            await pool.close()

    trajectories = run(scenario())
    for trajectory, question in zip(trajectories, CALCULATOR_QUESTIONS, strict=True):
        assert trajectory.outcome == Outcome.ANSWERED, trajectory.outcome_reason
        assert trajectory.num_turns == 2
        [tool_return] = trajectory.tool_returns
        assert (tool_return.tool, tool_return.status) == ("calculator", ToolStatus.SUCCESS)
        expected = eval(question)  # the test's own reference for the calculator's answer
        text = tokenizer.decode(trajectory.response_token_ids, skip_special_tokens=False)
        assert f"<tool_response>\n{int(expected)}\n</tool_response>" in text
        assert text.endswith(f"The answer is {int(expected)}.<|im_end|>")
        assert {
            v for v, m in zip(trajectory.policy_versions, trajectory.loss_mask, strict=True) if m == 0
        } == {TOOL_TOKEN_VERSION}
        check_continuity(trajectory, calls)
    assert {c.instance_id for c in calls} == {0, 1}  # least-load spread them


def test_moving_to_another_instance_between_turns_gives_the_same_tokens(instances, tokenizer):
    def trajectory_on(plan):
        calls = []

        async def scenario():
            pool = await make_pool(PlannedRouter(plan), [i.address for i in instances])
            try:
                return await make_loop(pool, tokenizer, calls).run(
                    new_trajectory(tokenizer, "What is 3*45?", "t")
                )
            finally:
                await pool.close()

        return run(scenario()), calls

    stayed, stay_calls = trajectory_on([0])
    moved, move_calls = trajectory_on([0, 1])
    assert [c.instance_id for c in stay_calls] == [0, 0]
    assert [c.instance_id for c in move_calls] == [0, 1]
    assert moved.outcome == stayed.outcome == Outcome.ANSWERED
    assert moved.response_token_ids == stayed.response_token_ids
    assert moved.rollout_logprobs == pytest.approx(stayed.rollout_logprobs, abs=1e-4)
    check_continuity(moved, move_calls)


class PausingClient:
    """Wraps an instance's client: in the first call, right after the first token arrives, it
    pauses the instance in ABORT mode (as a weight update does) and resumes it under
    `new_version` 0.1 s later. Deterministic: the pause always lands mid-turn."""

    def __init__(self, inner: InstanceClient, new_version: int):
        self.inner, self.new_version = inner, new_version
        self.paused = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request_id, prompt_token_ids, sampling, chunk_tokens=0, timeout_s=None):
        if self.paused:
            return await self.inner.generate(request_id, prompt_token_ids, sampling, chunk_tokens, timeout_s)
        segment = Segment()
        async for chunk in self.inner.stream(request_id, prompt_token_ids, sampling, 1, timeout_s):
            if chunk.token_ids:
                segment.chunks.append(chunk)
            if not self.paused:
                self.paused = True
                await self.inner.pause(PauseMode.ABORT)
                asyncio.get_running_loop().call_later(
                    0.1, lambda: asyncio.ensure_future(self.inner.resume(weight_version=self.new_version))
                )
            if chunk.finish_reason != FinishReason.NONE:
                segment.finish_reason = chunk.finish_reason
        return segment


def test_partial_rollout_resumes_across_a_weight_update(instances, tokenizer):
    """A Pause in ABORT mode cuts a turn; the loop resubmits from the kept tokens and the
    trajectory records which policy version sampled each token."""
    calls = []
    overrides = dict(max_tokens_per_turn=300, max_turns=1)

    async def scenario():
        pool = await make_pool(PlannedRouter([1]), [instances[0].address, instances[1].address])
        try:
            loop = make_loop(pool, tokenizer, **overrides)
            reference = await loop.run(new_trajectory(tokenizer, LONG_ANSWER_QUESTION, "ref"))
            version = (await pool.get(1).client.stats()).weight_version
            pool.get(1).client = PausingClient(pool.get(1).client, version + 1)
            loop = make_loop(pool, tokenizer, calls, **overrides)
            return reference, await loop.run(new_trajectory(tokenizer, LONG_ANSWER_QUESTION, "cut")), version
        finally:
            await pool.close()

    reference, interrupted, version = run(scenario())
    assert reference.outcome == Outcome.ANSWERED and len(reference.response_token_ids) > 100
    assert interrupted.response_token_ids == reference.response_token_ids
    assert interrupted.outcome == reference.outcome
    first, second = calls
    assert first.finish_reason == FinishReason.PREEMPTED
    assert 0 < len(first.output_ids) < len(reference.response_token_ids)
    assert interrupted.policy_versions == sorted(interrupted.policy_versions)
    assert set(interrupted.policy_versions) == {version, version + 1}
    assert interrupted.policy_versions.count(version) == len(first.output_ids)
    check_continuity(interrupted, calls)


@pytest.mark.parametrize(
    ("question", "overrides", "outcome", "tool_type"),
    [
        (MALFORMED_QUESTION, {}, Outcome.ANSWERED, "<malformed>"),
        (UNKNOWN_TOOL_QUESTION, {}, Outcome.ANSWERED, "<unknown>"),
        (LOOPING_QUESTION, {"max_turns": 3}, Outcome.MAX_TURNS, "calculator"),
        ("What is 12+7?", {"max_response_tokens": 10}, Outcome.MAX_TOKENS, None),
        ("What is 12+7? " * 80, {}, Outcome.CONTEXT_OVERFLOW, None),
    ],
    ids=["malformed-call", "unknown-tool", "max-turns", "max-tokens", "prompt-too-long"],
)
def test_failures_end_as_recorded_outcomes(instances, tokenizer, question, overrides, outcome, tool_type):
    calls = []

    async def scenario():
        pool = await make_pool(LeastLoadRouter(), [instances[0].address])
        try:
            return await make_loop(pool, tokenizer, calls, **overrides).run(
                new_trajectory(tokenizer, question, "f")
            )
        finally:
            await pool.close()

    trajectory = run(scenario())
    assert trajectory.outcome == outcome, trajectory.outcome_reason
    if outcome != Outcome.ANSWERED:
        assert trajectory.outcome_reason
    if tool_type is not None:
        assert trajectory.tool_returns[0].tool == tool_type
        expected_status = ToolStatus.SUCCESS if tool_type == "calculator" else ToolStatus.FAILURE
        assert trajectory.tool_returns[0].status == expected_status
    if len(trajectory.prompt_token_ids) >= MAX_MODEL_LEN:
        assert not calls  # refused before anything was sent
    else:
        check_continuity(trajectory, calls)
    if tool_type in ("<malformed>", "<unknown>"):
        text = tokenizer.decode(trajectory.response_token_ids, skip_special_tokens=False)
        assert "<tool_response>\nerror: " in text


def test_a_seeded_trajectory_draws_the_same_tokens_on_any_instance_in_any_batch(instances, tokenizer):
    """`Trajectory.sampling_seed` (the held-out evaluation's): the same seed samples the same
    tokens alone on one instance and in a batch of others on another. A high temperature off the
    scripted dialogs, so that the tokens are a matter of the draw (that a training group's
    trajectories are unseeded is `tests/job/test_evaluation_seeds.py`'s). The batch of 65 arrives
    faster than the engine steps, and its prompts together exceed a step's token budget (2,048):
    some prefill does not fit in one step. A split prefill of a seeded request killed the CPU
    engine (its torch generator cannot rewind: measured, this test failed so), which now
    prefills whole (`EngineDefaults.chunked_prefill`)."""
    question = "Describe the sea. " * 6
    overrides = dict(temperature=2.0, max_turns=1, max_tokens_per_turn=24)

    def roll(seeds, instance):
        async def scenario():
            pool = await make_pool(PlannedRouter([instance]), [i.address for i in instances])
            try:
                trajectories = [new_trajectory(tokenizer, question, f"s{i}") for i in range(len(seeds))]
                for trajectory, seed in zip(trajectories, seeds, strict=True):
                    trajectory.sampling_seed = seed
                return await make_loop(pool, tokenizer, **overrides).run_all(trajectories)
            finally:
                await pool.close()

        trajectories = run(scenario())
        lost = {Outcome.ERROR, Outcome.NO_INSTANCE, Outcome.ABORTED}  # what a dead engine leaves
        assert not [t.outcome_reason for t in trajectories if t.outcome in lost]
        return trajectories

    seeds = range(1, 64)
    batch = roll([None, None, *seeds], instance=1)  # two unseeded among them
    assert sum(len(t.prompt_token_ids) for t in batch) > 2048
    drawn = {seed: tuple(t.response_token_ids) for seed, t in zip(seeds, batch[2:], strict=True)}
    longest = sorted(seeds, key=lambda seed: -len(drawn[seed]))[:3]
    assert len(drawn[longest[-1]]) > 4
    for seed in longest:
        [alone] = roll([seed], instance=0)
        assert tuple(alone.response_token_ids) == drawn[seed], seed


def test_sampling_vllm_refuses_is_the_callers_error_not_the_instances(instances, tokenizer):
    """vLLM's refusal of a call's sampling reaches the caller as a ValueError naming it, not as a
    failure of the instance: three in a row no longer take a healthy instance out of the pool."""

    async def scenario():
        pool = await make_pool(LeastLoadRouter(), [instances[0].address])
        try:
            loop = make_loop(pool, tokenizer)
            trajectory = new_trajectory(tokenizer, "What is 12+7?", "too-hot")
            for _ in range(3):
                with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
                    await loop.model_turn(trajectory, 0, SamplingSpec(temperature=3.0))
            return pool.get(0).lost
        finally:
            await pool.close()

    assert run(scenario()) is False
