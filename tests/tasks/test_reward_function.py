"""A user's reward function (`tasks.reward_function`): loaded from `module:function` with errors
naming the field, called sync or async, its value checked; and the worked example
(`examples/custom_reward.py`, DAPO's reward with the overlong punishment) against hand-computed
scores."""

from __future__ import annotations

import asyncio

import pytest

from libra.tasks.config import TasksConfig
from libra.tasks.datasets import TaskRecord, TaskType
from libra.tasks.rewards import RewardInput, call_reward_function, load_reward_function
from libra.trajectory import Outcome, Trajectory

TASK = TaskRecord("What is 6 * 7?", "42", TaskType.MATH, {"data_source": "math_dapo", "index": 3})


def _given(answer: str | None, num_tokens: int) -> RewardInput:
    trajectory = Trajectory("g0-1", "p0", "g0", [1, 2, 3])
    trajectory.append(list(range(num_tokens)), [-0.1] * num_tokens, 0)
    trajectory.outcome = Outcome.ANSWERED if answer is not None else Outcome.MAX_TOKENS
    return RewardInput(TASK, trajectory, answer or "", answer)


def _score(function, spec, given) -> float:
    return asyncio.run(call_reward_function(function, spec, given))


def test_the_dapo_example_scores_correctness_and_punishes_overlong_responses():
    spec = "examples.custom_reward:dapo_reward"
    dapo = load_reward_function(spec)
    assert _score(dapo, spec, _given("6 * 7 = 42\nAnswer: 42", 1000)) == 1.0
    assert _score(dapo, spec, _given("Answer: 41", 1000)) == -1.0
    assert _score(dapo, spec, _given(None, 1000)) == -1.0  # cut before answering
    # Inside the last 4,096 of 20,480 tokens the punishment grows linearly to -1.
    assert _score(dapo, spec, _given("Answer: 42", 16384 + 1024)) == pytest.approx(1.0 - 0.25)
    assert _score(dapo, spec, _given("Answer: 42", 20480)) == 0.0


def test_sync_and_async_functions_are_called_and_their_value_checked(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "async def by_length(given):\n    return given.trajectory.num_generated_tokens / 10\n"
        "def flag(given):\n    return given.answer is not None\n"
        "def nan(given):\n    return float('nan')\n"
        "def two(a, b):\n    return 0.0\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _score(load_reward_function("my_rewards:by_length"), "my_rewards:by_length", _given("x", 5)) == 0.5
    for spec, what in [("my_rewards:flag", "True"), ("my_rewards:nan", "nan")]:
        with pytest.raises(
            ValueError, match=rf"{spec}' returned {what} for trajectory g0-1: a reward must be"
        ):
            _score(load_reward_function(spec), spec, _given("x", 5))
    with pytest.raises(ValueError, match=r"tasks.reward_function 'my_rewards:two' must take one argument"):
        load_reward_function("my_rewards:two")
    with pytest.raises(ValueError, match=r"tasks.reward_function 'my_rewards:NOT_CALLABLE' is not callable"):
        load_reward_function("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"tasks.reward_function 'my_rewards:gone' cannot be loaded"):
        load_reward_function("my_rewards:gone")
    with pytest.raises(ValueError, match=r"tasks.reward_function 'no_such_module:f' cannot be loaded"):
        load_reward_function("no_such_module:f")
    with pytest.raises(ValueError, match=r"tasks.reward_function must be 'package.module:function'"):
        TasksConfig(reward_function="my_rewards.by_length")
