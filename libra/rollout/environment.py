"""Pluggable environments: a user's world that answers every model turn instead of the tools.

An environment is a class named in the config (`tasks.environment`, `package.module:Class`),
instantiated with no arguments once per trajectory, with two methods, each sync or async:

    reset(task) -> first observation        a string (the user message) or a list of chat
                                            messages: rendered with the chat template, the prompt
    step(action) -> StepResult              the action is the model turn's text (special tokens
                                            skipped); the result: observation, reward, done, info

The agent loop (`AgentLoop.run(trajectory, episode)`) alternates the two: a model turn (ended by
the chat format's stop tokens), `step` on its text, and, unless the step is done, the observation
appended as the next user turn (loss mask 0, like a tool result; the router places the next turn
as after a tool return). `done` ends the trajectory ANSWERED; `rollout.agent.max_turns`, the
token budgets and the context window end it as they end any trajectory. The trajectory's reward
is the sum of its step rewards, unless `tasks.reward_function` is set: then that function scores
it and gets the sum as `RewardInput.environment_reward`.

A `reset` or `step` that raises, times out (an async one, after `rollout.agent.tool_timeout_s`)
or returns something outside this contract ends the trajectory ERROR with a reason naming the
environment; the job goes on. A sync method runs on the event loop that drives every
trajectory: keep it quick, or make it `async`. `check_environment` is the contract test a
plug-in can run in its own tests. See `examples/custom_environment.py`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from libra.plugins import load_object

Messages = list[dict[str, Any]]
Observation = str | Messages
"""A first observation: a user message, or chat messages (`{"role": ..., "content": ...}`)."""


@dataclass(frozen=True)
class StepResult:
    """What `Environment.step` returns for one action."""

    observation: str | None = None
    """Shown to the model as the next user turn; may be None only when `done`."""
    reward: float = 0.0
    """This step's reward; a trajectory's reward is the sum over its steps."""
    done: bool = False
    """The episode is over: the trajectory ends ANSWERED (a final observation is not shown)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything for the environment's own use or logs; the loop does not read it."""

    def __post_init__(self) -> None:
        if self.observation is not None and not isinstance(self.observation, str):
            raise ValueError(
                f"StepResult.observation must be a string or None, got {type(self.observation).__name__}"
            )
        reward = self.reward
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"StepResult.reward must be a finite number, got {reward!r}")
        object.__setattr__(self, "reward", float(reward))
        if not isinstance(self.done, bool):
            raise ValueError(f"StepResult.done must be a bool, got {self.done!r}")
        if not isinstance(self.info, dict):
            raise ValueError(f"StepResult.info must be a dict, got {type(self.info).__name__}")


class Environment(Protocol):
    """The contract of a `tasks.environment` class (instantiated with no arguments, one instance
    per trajectory; either method may be `async def`)."""

    def reset(self, task: Any) -> Observation | Awaitable[Observation]:
        """Starts an episode of `task` (in a job, its `libra.tasks.datasets.TaskRecord`) and returns
        the first observation: a non-empty string (one user message) or a non-empty list of chat
        messages, each with a string `role` and `content`."""
        ...

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Acts on the model's turn (its decoded text) and returns a `StepResult`: with an
        observation (a string) unless `done`. Not called again once a step is done."""
        ...


class EnvironmentFailed(ValueError):
    """An environment raised, timed out or broke its contract; the message names it."""


def environment_name(environment_cls: type) -> str:
    """`module:Class`: the name in outcome reasons, and the tool type the router learns from."""
    return f"{environment_cls.__module__}:{environment_cls.__qualname__}"


def load_environment(spec: str, field: str = "tasks.environment") -> type[Environment]:
    """The class `package.module:Class` names; ValueError naming `field` when it cannot be loaded,
    is not a class, lacks `reset` or `step`, or needs constructor arguments."""
    return _checked_class(load_object(spec, field), f"{field} {spec!r}")


def _checked_class(environment_cls: Any, named: str) -> type[Environment]:
    if not inspect.isclass(environment_cls):
        raise ValueError(f"{named} must be a class (it is a {type(environment_cls).__name__})")
    missing = [name for name in ("reset", "step") if not callable(getattr(environment_cls, name, None))]
    if missing:
        raise ValueError(
            f"{named} lacks {' and '.join(missing)}: an environment has reset(task) and step(action)"
        )
    try:
        inspect.signature(environment_cls).bind()
    except TypeError as e:
        raise ValueError(f"{named} must be constructible with no arguments: {e}") from None
    except ValueError:
        pass  # no signature to read: creating the first instance will tell
    return environment_cls


class Episode:
    """One trajectory's environment: a fresh instance of `environment_cls` for `task`, its calls
    awaited (sync or async), timed and checked against the contract, its step rewards summed."""

    def __init__(self, environment_cls: type[Environment], task: Any):
        self.environment_cls, self.task = environment_cls, task
        self.name = environment_name(environment_cls)
        self.environment: Environment | None = None
        self.reward = 0.0
        """The sum of the step rewards so far."""
        self.done = False
        self.step_seconds: list[float] = []
        """Wall time of each step (the trajectory's trace records it like a tool call's)."""

    async def reset(self, timeout_s: float | None = None) -> Messages:
        """Creates the instance and resets it; the first observation as chat messages."""
        self.environment = self._call("creating it", self.environment_cls)
        observation = await self._wait(
            "reset", self._call("reset", self.environment.reset, self.task), timeout_s
        )
        return self._messages(observation)

    async def step(self, action: str, timeout_s: float | None = None) -> StepResult:
        if self.environment is None or self.done:
            raise EnvironmentFailed(
                f"environment {self.name}: step called {'after done' if self.done else 'before reset'}"
            )
        started = time.perf_counter()
        result = await self._wait("step", self._call("step", self.environment.step, action), timeout_s)
        self.step_seconds.append(time.perf_counter() - started)
        if not isinstance(result, StepResult):
            raise EnvironmentFailed(
                f"environment {self.name}: step returned {_show(result)}: a "
                "libra.rollout.environment.StepResult is needed"
            )
        if not result.done and result.observation is None:
            raise EnvironmentFailed(
                f"environment {self.name}: step returned no observation and is not done "
                "(return an observation, or done=True)"
            )
        self.reward += result.reward
        self.done = result.done
        return result

    def _call(self, what: str, method, *args):
        try:
            return method(*args)
        except Exception as e:  # noqa: BLE001 - the user's code: named, never a crash of the job
            raise EnvironmentFailed(f"environment {self.name}: {what} raised {type(e).__name__}: {e}") from e

    async def _wait(self, what: str, value, timeout_s: float | None):
        if not inspect.isawaitable(value):
            return value
        try:
            return await asyncio.wait_for(value, timeout_s)
        except TimeoutError:
            raise EnvironmentFailed(
                f"environment {self.name}: {what} timed out after {timeout_s} s"
            ) from None
        except Exception as e:  # noqa: BLE001 - as in `_call`
            raise EnvironmentFailed(f"environment {self.name}: {what} raised {type(e).__name__}: {e}") from e

    def _messages(self, observation: Any) -> Messages:
        if isinstance(observation, str) and observation.strip():
            return [{"role": "user", "content": observation}]
        if (
            isinstance(observation, list)
            and observation
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in observation
            )
        ):
            return [dict(m) for m in observation]
        raise EnvironmentFailed(
            f"environment {self.name}: reset returned {_show(observation)}: the first observation must be "
            "a non-empty string or a non-empty list of chat messages ({'role': str, 'content': str})"
        )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_environment(
    environment: type[Environment] | str, task: Any, actions: Sequence[str], must_finish: bool = False
) -> list[StepResult]:
    """The contract test of an environment (a class or its `module:Class` spec): what the agent
    loop does with it, minus the model. A fresh instance is reset with `task`, then stepped with
    `actions` in order until a step is done (later actions unused); `must_finish`: it must be done
    by the last one. Raises EnvironmentFailed (a ValueError) naming the environment and what broke
    the contract; returns the step results, for the plug-in's own checks. Runs its own event loop
    (call it from a plain test function)."""
    if isinstance(environment, str):
        environment_cls = load_environment(environment)
    else:
        environment_cls = _checked_class(environment, f"environment {_show(environment)}")

    async def play() -> list[StepResult]:
        episode = Episode(environment_cls, task)
        await episode.reset()
        results = []
        for action in actions:
            results.append(await episode.step(action))
            if episode.done:
                return results
        if must_finish:
            raise EnvironmentFailed(f"environment {episode.name}: not done after {len(actions)} actions")
        return results

    return asyncio.run(play())
