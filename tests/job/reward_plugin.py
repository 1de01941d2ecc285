"""A reward function the dataset job test loads from config (`tasks.reward_function`): async, and
a function of what it is given that varies between trajectories, so the test can recompute it
from the run folder (the random model's answers would all score 0 under a correctness rule)."""

from __future__ import annotations

import asyncio

from libra.tasks.rewards import RewardInput


def score(generated_tokens: int, row_index: int) -> float:
    return generated_tokens / 100 + row_index / 1000


async def length_and_row(given: RewardInput) -> float:
    await asyncio.sleep(0)  # a coroutine, as a reward calling a grading service would be
    return score(given.trajectory.num_generated_tokens, given.task.metadata["index"])
