"""The agent loop against scripted fake instances (no engine): on instance loss the tokens a dying
instance streamed are kept and the trajectory finishes elsewhere, or, with no instance left, ends
NO_INSTANCE with a reason; and thousands of trajectories run on one event loop."""

from __future__ import annotations

import asyncio

from libra.control.aio_server import start_aio_server
from libra.control.config import ControlConfig
from libra.rollout.instance_server import MultiplexedGenerate
from libra.scheduler import LeastLoadRouter
from libra.trajectory import Outcome
from libra.v1 import rollout_pb2, rollout_pb2_grpc
from tests.rollout.conftest import TOKEN, run
from tests.rollout.helpers import PlannedRouter, check_continuity, make_loop, make_pool, new_trajectory

DYING_TOKENS = [300, 301, 302]


class FakeInstance(MultiplexedGenerate, rollout_pb2_grpc.RolloutInstanceServicer):
    """Streams `tokens` in one chunk each; with `finish_with` set, ends with that token (STOP),
    otherwise hangs after them, as an instance does that is about to die mid-generation."""

    def __init__(self, tokens: list[int], finish_with: int | None):
        self.tokens, self.finish_with = tokens, finish_with
        self.streamed = asyncio.Event()
        self.contexts: list[list[int]] = []

    async def Generate(self, request, context):
        self.contexts.append(list(request.prompt_token_ids))
        for token in self.tokens:
            yield rollout_pb2.GenerateChunk(token_ids=[token], logprobs=[-0.5], weight_version=3)
        self.streamed.set()
        if self.finish_with is None:
            await asyncio.Event().wait()  # until the server dies
        yield rollout_pb2.GenerateChunk(
            token_ids=[self.finish_with],
            logprobs=[-0.1],
            weight_version=3,
            finish_reason=rollout_pb2.FINISH_REASON_STOP,
            stop_token_id=self.finish_with,
        )

    async def Stats(self, request, context):
        return rollout_pb2.InstanceStats(max_model_len=512, tensor_parallel_size=1, model="fake")


async def _serve(servicer: FakeInstance):
    def add(server):
        rollout_pb2_grpc.add_RolloutInstanceServicer_to_server(servicer, server)
        return [rollout_pb2.DESCRIPTOR.services_by_name["RolloutInstance"].full_name]

    server = await start_aio_server(ControlConfig(port=0), TOKEN, add)
    return server, f"127.0.0.1:{server.port}"


def test_a_dying_instance_hands_its_trajectory_to_another_with_its_tokens_kept(tokenizer):
    dying = FakeInstance(DYING_TOKENS, finish_with=None)
    healthy = FakeInstance([303, 304], finish_with=tokenizer.eos_token_id)
    calls = []

    async def scenario():
        dying_server, dying_address = await _serve(dying)
        healthy_server, healthy_address = await _serve(healthy)
        # Admitted to the dying one; once it is lost, rerouting falls back to the healthy one.
        pool = await make_pool(PlannedRouter([0]), [dying_address, healthy_address])
        task = asyncio.create_task(
            make_loop(pool, tokenizer, calls).run(new_trajectory(tokenizer, "hi", "t"))
        )
        await dying.streamed.wait()
        await dying_server.stop(grace_s=0)
        trajectory = await task
        await healthy_server.stop(grace_s=0)
        await pool.close()
        return trajectory, pool

    trajectory, pool = run(scenario())
    assert trajectory.outcome == Outcome.ANSWERED, trajectory.outcome_reason
    assert trajectory.response_token_ids == DYING_TOKENS + [303, 304, tokenizer.eos_token_id]
    assert trajectory.policy_versions == [3] * 6
    assert [c.instance_id for c in calls] == [0, 1]
    assert calls[0].finish_reason is None and list(calls[0].output_ids) == DYING_TOKENS
    assert healthy.contexts == [
        trajectory.prompt_token_ids + DYING_TOKENS
    ]  # re-prefilled from the kept tokens
    assert pool.live_ids() == [1]
    check_continuity(trajectory, calls)


def test_an_instance_dying_right_after_the_stop_token_leaves_a_finished_turn(tokenizer):
    """The stop token arrived but the call's end did not: the turn is complete, and resubmitting
    it elsewhere would generate past the stop."""
    dying = FakeInstance([*DYING_TOKENS, tokenizer.eos_token_id], finish_with=None)
    healthy = FakeInstance([303, 304], finish_with=tokenizer.eos_token_id)

    async def scenario():
        dying_server, dying_address = await _serve(dying)
        healthy_server, healthy_address = await _serve(healthy)
        pool = await make_pool(PlannedRouter([0]), [dying_address, healthy_address])
        task = asyncio.create_task(make_loop(pool, tokenizer).run(new_trajectory(tokenizer, "hi", "t")))
        await dying.streamed.wait()
        await dying_server.stop(grace_s=0)
        trajectory = await task
        await healthy_server.stop(grace_s=0)
        await pool.close()
        return trajectory

    trajectory = run(scenario())
    assert trajectory.outcome == Outcome.ANSWERED, trajectory.outcome_reason
    assert trajectory.response_token_ids == [*DYING_TOKENS, tokenizer.eos_token_id]
    assert healthy.contexts == []


def test_with_no_instance_left_the_trajectory_ends_no_instance(tokenizer):
    dying = FakeInstance(DYING_TOKENS, finish_with=None)

    async def scenario():
        server, address = await _serve(dying)
        pool = await make_pool(LeastLoadRouter(), [address])
        loop = make_loop(pool, tokenizer, no_instance_wait_s=0.2)
        task = asyncio.create_task(loop.run(new_trajectory(tokenizer, "hi", "t")))
        await dying.streamed.wait()
        await server.stop(grace_s=0)
        trajectory = await task
        await pool.close()
        return trajectory

    trajectory = run(scenario())
    assert trajectory.outcome == Outcome.NO_INSTANCE
    assert "no rollout instance" in trajectory.outcome_reason
    assert trajectory.response_token_ids == DYING_TOKENS  # what it had is kept for a later resume


class ToolCallingFake(MultiplexedGenerate, rollout_pb2_grpc.RolloutInstanceServicer):
    """Answers a context without a tool result with a calculator call, otherwise with EOS."""

    def __init__(self, call_ids: list[int], tool_call_end_id: int, eos_id: int):
        self.call_ids, self.tool_call_end_id, self.eos_id = call_ids, tool_call_end_id, eos_id
        self.num_calls = 0

    async def Generate(self, request, context):
        self.num_calls += 1
        done = self.tool_call_end_id in request.prompt_token_ids
        tokens = [self.eos_id] if done else self.call_ids
        yield rollout_pb2.GenerateChunk(
            token_ids=tokens, logprobs=[-0.1] * len(tokens), finish_reason=rollout_pb2.FINISH_REASON_STOP
        )

    async def Stats(self, request, context):
        return rollout_pb2.InstanceStats(max_model_len=512, tensor_parallel_size=1, model="fake")


def test_thousands_of_trajectories_share_one_event_loop(tokenizer):
    from tests.rollout.scripted_model import scripted_chat

    chat = scripted_chat(tokenizer)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    fake = ToolCallingFake(
        tokenizer.encode(call, add_special_tokens=False), chat.tool_call_end_id, chat.eos_id
    )
    count = 2000

    async def scenario():
        server, address = await _serve(fake)
        pool = await make_pool(LeastLoadRouter(), [address])
        trajectories = await make_loop(pool, tokenizer).run_all(
            [new_trajectory(tokenizer, "What is 6*7?", f"t{i}") for i in range(count)]
        )
        await pool.close()
        await server.stop(grace_s=0)
        return trajectories

    trajectories = run(scenario())
    assert fake.num_calls == 2 * count
    assert all(t.outcome == Outcome.ANSWERED and t.num_turns == 2 for t in trajectories)
    assert all(t.tool_returns[0].status.name == "SUCCESS" for t in trajectories)
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(trajectories[-1].response_token_ids)
