"""While a plan starts instances (`InstancePool.expect`), a trajectory that the instances serving
have no room for waits instead of queueing on a full one, and runs as soon as a trajectory ends
and frees room (or the expected instance joins). Scripted fake instances, no engine."""

from __future__ import annotations

import asyncio

from libra.rollout.pool import InstancePool
from libra.scheduler import BucketConfig, CmlfqConfig, CmlfqRouter
from libra.trajectory import Outcome
from tests.rollout.conftest import TOKEN, run
from tests.rollout.fake_instance import ScriptedInstance, serve_fake
from tests.rollout.helpers import make_loop, new_trajectory
from tests.rollout.scripted_model import scripted_chat

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def test_a_trajectory_without_room_waits_for_room_while_a_plan_starts_an_instance(tokenizer):
    chat = scripted_chat(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    fake = ScriptedInstance([encode(CALL), encode("42<|im_end|>")], chat.tool_call_end_id)
    config = CmlfqConfig(buckets=(BucketConfig("all", 1, 100_000),), max_queue_length=1)

    async def scenario():
        server, address = await serve_fake(fake)
        pool = InstancePool(CmlfqRouter(config), TOKEN, config)
        try:
            await pool.add(0, address, tp_size=1)
            pool.expect((1,))  # a plan is starting a second instance: one trajectory each
            loop = make_loop(pool, tokenizer)
            first = asyncio.create_task(loop.run(new_trajectory(tokenizer, "What is 6*7?", "first")))
            await asyncio.sleep(0)  # admitted: the only room there is
            second = asyncio.create_task(loop.run(new_trajectory(tokenizer, "And 7*6?", "second")))
            waited = False
            while not second.done():
                waited = waited or pool.waiting == 1
                await asyncio.sleep(0.001)
            return await first, await second, waited, pool.waiting
        finally:
            await pool.close()
            await server.stop(grace_s=0)

    first, second, waited, still_waiting = run(scenario())
    assert first.outcome == second.outcome == Outcome.ANSWERED, (first.outcome_reason, second.outcome_reason)
    assert waited and still_waiting == 0
    # The second ran on the one instance after the first had ended, not beside it over its cap.
    owners = [r.request_id.rsplit(".", 1)[0] for r in fake.requests]
    assert owners == ["first", "first", "second", "second"], owners
