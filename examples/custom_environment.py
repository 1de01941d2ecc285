"""A custom environment: a math checker that gives feedback and lets the model try again.

Multi-turn self-correction on any dataset whose tasks have one answer (DAPO-Math, GSM8K, ...):

    libra run CONFIG tasks.environment=examples.custom_environment:MathWithFeedback

An environment is a class with `reset(task)` (the first observation: the prompt) and
`step(action)` (a `StepResult`: observation, reward, done, info), each sync or `async def`. The
job makes one instance per trajectory, resets it with the task record, and steps it with the
text of each model turn; an observation goes back to the model as the next user message. The
trajectory's reward is the sum of the step rewards: here 1 for a right answer, minus 0.1 for
each attempt before it, and -0.1 per attempt when the model never gets there. Test a plug-in of
your own with `libra.rollout.environment.check_environment` (see tests/rollout/test_environment.py).
"""

from __future__ import annotations

from libra.rollout.environment import StepResult
from libra.tasks.datasets import TaskRecord
from libra.tasks.rewards import extract_answer, math_equal

MAX_ATTEMPTS = 3
INSTRUCTION = "Give your final answer on the last line, as: Answer: <your answer>"


class MathWithFeedback:
    def reset(self, task: TaskRecord) -> str:
        self.ground_truth = task.answers[0]
        self.attempts = 0
        return f"{task.prompt}\n\n{INSTRUCTION}"

    def step(self, action: str) -> StepResult:
        self.attempts += 1
        answer = extract_answer(action)
        if answer is not None and math_equal(answer, self.ground_truth):
            return StepResult(None, reward=1.0, done=True, info={"attempts": self.attempts})
        if self.attempts >= MAX_ATTEMPTS:
            return StepResult(None, reward=-0.1, done=True, info={"attempts": self.attempts})
        feedback = "I found no final answer." if answer is None else f"{answer} is not right."
        return StepResult(f"{feedback} Try again. {INSTRUCTION}", reward=-0.1)
