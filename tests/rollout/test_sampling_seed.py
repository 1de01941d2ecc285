"""What a seeded trajectory asks the engine for (`Trajectory.sampling_seed`), against a scripted
fake instance (no engine): each generation call carries the seed of the trajectory's seed and the
position the call starts at, so that every call draws numbers of its own (a call resumed mid-turn
does not replay its first part's) and a second rollout of the same seed asks for the same ones;
an unseeded trajectory's calls carry none. (That an engine then samples the same tokens for the
same seed is `test_agent_loop.py`'s.)"""

from __future__ import annotations

from libra.rollout.types import derive_seed
from libra.scheduler import LeastLoadRouter
from libra.trajectory import Outcome
from tests.rollout.conftest import run
from tests.rollout.fake_instance import ScriptedInstance, serve_fake
from tests.rollout.helpers import make_loop, make_pool, new_trajectory
from tests.rollout.scripted_model import scripted_chat

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def _call_seeds(tokenizer, sampling_seed: int | None) -> tuple[list[int | None], list[int]]:
    """(the seed of each call, the position each call started at) of one rollout: a tool call,
    then an answer that the turn's cap cuts."""
    chat = scripted_chat(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    fake = ScriptedInstance([encode(CALL), encode(" seven" * 40 + "<|im_end|>")], chat.tool_call_end_id)
    trajectory = new_trajectory(tokenizer, "What is 6*7?", "t")
    trajectory.sampling_seed = sampling_seed

    async def scenario():
        server, address = await serve_fake(fake)
        pool = await make_pool(LeastLoadRouter(), [address])
        try:
            return await make_loop(pool, tokenizer, max_tokens_per_turn=64).run(trajectory)
        finally:
            await pool.close()
            await server.stop(grace_s=0)

    run(scenario())
    assert trajectory.outcome == Outcome.MAX_TOKENS, trajectory.outcome_reason  # the answer's cap
    prompt = len(trajectory.prompt_token_ids)
    starts = [len(r.prompt_token_ids) - prompt for r in fake.requests]
    seeds = [r.sampling.seed if r.sampling.HasField("seed") else None for r in fake.requests]
    return seeds, starts


def test_each_call_of_a_seeded_trajectory_has_the_seed_of_where_it_starts(tokenizer):
    seeds, starts = _call_seeds(tokenizer, 7)
    assert len(seeds) == 2 and starts[0] == 0 < starts[1]
    assert seeds == [derive_seed(7, start) for start in starts]
    assert len(set(seeds)) == len(seeds)
    assert _call_seeds(tokenizer, 7) == (seeds, starts)  # the same again
    assert not set(_call_seeds(tokenizer, 8)[0]) & set(seeds)


def test_an_unseeded_trajectory_asks_for_no_seed(tokenizer):
    assert _call_seeds(tokenizer, None)[0] == [None, None]
