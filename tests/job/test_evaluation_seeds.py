"""The held-out evaluation's sampling seeds (`GroupRollout(seed=job.seed)`): each (task, sample)
has its own seed, the same in every rollout of those tasks (before and after training, and run
after run), so that the two evaluations draw the same random numbers; training rollouts stay
unseeded, so that a group's samples differ. The agent loop here is a stand-in that ends every
trajectory at once (a fake, stated: the engines' side of the seeds, the same tokens for the same
seed, is `tests/rollout/test_agent_loop.py`'s)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from libra.job.rollouts import Group, GroupRollout
from libra.tasks.datasets import TaskRecord, TaskType
from libra.trajectory import Outcome

SAMPLES = 4
TASK = TaskRecord("What is 2+2?", "4", TaskType.MATH)


class EndingLoop:
    async def run(self, trajectory, episode=None):
        trajectory.outcome = Outcome.MAX_TURNS
        return trajectory


def seeds(seed: int | None, task_index: int) -> list[int | None]:
    chat = SimpleNamespace(prompt_ids=lambda messages: [1, 2, 3], tokenizer=SimpleNamespace(decode=str))
    rollout = GroupRollout(EndingLoop(), chat, SAMPLES, seed=seed)
    group = asyncio.run(rollout.run(Group(task_index, task_index, 0), TASK))
    return [t.sampling_seed for t in group.trajectories]


def test_each_evaluation_sample_has_its_own_seed_the_same_in_every_rollout():
    before, after = seeds(0, -1), seeds(0, -1)
    assert before == after
    assert len(set(before)) == SAMPLES and all(0 <= s < 2**31 for s in before)
    assert set(seeds(0, -2)).isdisjoint(before)  # another task
    assert set(seeds(1, -1)).isdisjoint(before)  # another job.seed


def test_training_rollouts_are_unseeded():
    assert seeds(None, 5) == [None] * SAMPLES
