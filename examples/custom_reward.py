"""A custom reward function: DAPO's rule-based reward with its soft overlong punishment.

DAPO (Yu et al., 2025) scores a math answer +1 when it matches the ground truth and -1 otherwise,
and punishes length softly: a response within `OVERLONG_BUFFER` tokens of `MAX_RESPONSE_TOKENS`
loses up to 1 more, linearly, so that truncated rambling is discouraged without cutting the
reward of long correct work to zero. Use it for any config whose tasks have one answer:

    libra run configs/qwen25_7b_dapo.py tasks.reward_function=examples.custom_reward:dapo_reward

A reward function gets a `libra.tasks.rewards.RewardInput` (the task record with its dataset
metadata, the trajectory, the decoded response and final answer) and returns a finite number; it
may be `async def` (e.g. to call a judge model or a grading service).
"""

from __future__ import annotations

from libra.tasks.rewards import RewardInput, extract_answer, math_equal

MAX_RESPONSE_TOKENS = 20480
"""DAPO's maximum generation length (keep it equal to `rollout.agent.max_response_tokens`)."""
OVERLONG_BUFFER = 4096
"""The last tokens before the maximum, over which the punishment grows from 0 to 1."""


def overlong_penalty(
    num_tokens: int, max_tokens: int = MAX_RESPONSE_TOKENS, buffer: int = OVERLONG_BUFFER
) -> float:
    """0 up to `max_tokens - buffer`, then falling linearly to -1 at `max_tokens`."""
    start = max_tokens - buffer
    if num_tokens <= start:
        return 0.0
    return -min(1.0, (num_tokens - start) / buffer)


def dapo_reward(given: RewardInput) -> float:
    answer = extract_answer(given.answer) if given.answer is not None else None
    correct = answer is not None and math_equal(answer, given.task.answers[0])
    return (1.0 if correct else -1.0) + overlong_penalty(given.trajectory.num_generated_tokens)
