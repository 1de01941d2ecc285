"""The job with an environment (`tasks.environment`): the worked example
(`examples/custom_environment.py`, a math checker that gives feedback) loaded from the config on a
small dataset with the factory's random tiny model, two job steps end to end; plus how a
trajectory's reward comes from the environment or from a reward function given the environment's
reward, and an environment that cannot be loaded refused before any worker starts.

A random model rarely ends a turn (1 token in ~500 is one of its two stop tokens), and a turn cut
by its cap is no action; so the test model is the random one nudged to end its turns after a few
tokens (`_end_turns_often`), and the environment is stepped on every trajectory. The test then
checks that the trajectories carry the environment's prompt and observations, replays each one's
turns through a fresh environment to recompute its reward, and checks that the trainer stepped.
Needs ~3 GB: one vLLM instance, one Megatron rank, the controller and a node agent, all real
processes on loopback; a few minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from examples.custom_environment import INSTRUCTION, MathWithFeedback
from libra.config import load_config
from libra.job.loop import GrpoJob
from libra.job.recorder import read_jsonl
from libra.job.rollouts import GroupRollout
from libra.rollout.chat import ChatFormat
from libra.tasks.datasets import TaskRecord, TaskType
from libra.trajectory import Outcome, Trajectory
from tests.job.driven_job import ONE_INSTANCE, run_with_reward_spy

NUM_STEPS = 2
ENVIRONMENT = "examples.custom_environment:MathWithFeedback"
PROBLEMS = [("What is 17 + 25?", "42"), ("Compute 6 * 7 - 12.", "30"), ("What is 2 to the power 10?", "1024")]


@pytest.fixture(scope="module")
def tokenizer():
    from libra.tasks.tiny_model import TinyModelSpec, build_tokenizer

    return build_tokenizer(TinyModelSpec().vocab_size)


# -- where a trajectory's reward comes from -----------------------------------------------------


def doubled_environment_reward(given) -> float:
    """A reward function that uses the environment's reward (`RewardInput.environment_reward`)."""
    if given.environment_reward is None:
        return -1.0
    return 2 * given.environment_reward + (given.answer == "Answer: 42")


def _played(chat: ChatFormat, environment_reward: float) -> Trajectory:
    """A trajectory as the agent loop leaves one it ran with an environment (reward: the sum)."""
    trajectory = Trajectory("t", "p", "g", chat.prompt_ids([{"role": "user", "content": "What is 6 * 7?"}]))
    ids = chat.tokenizer.encode("Answer: 42", add_special_tokens=False) + [chat.eos_id]
    trajectory.append(ids, [-0.5] * len(ids), 0)
    trajectory.outcome, trajectory.reward = Outcome.ANSWERED, environment_reward
    return trajectory


def test_the_environments_reward_is_the_trajectorys_unless_a_reward_function_is_set(tokenizer):
    chat = ChatFormat(tokenizer)
    task = TaskRecord("What is 6 * 7?", "41", TaskType.MATH)  # the built-in rule would say 0
    alone = GroupRollout(loop=None, chat=chat, group_size=1, environment=ENVIRONMENT)
    assert asyncio.run(alone.reward(task, _played(chat, 0.7))) == 0.7
    function = "tests.job.test_environment_job:doubled_environment_reward"
    both = GroupRollout(loop=None, chat=chat, group_size=1, reward_function=function, environment=ENVIRONMENT)
    assert asyncio.run(both.reward(task, _played(chat, 0.7))) == pytest.approx(2.4)
    # Without an environment a reward function is given none.
    plain = GroupRollout(loop=None, chat=chat, group_size=1, reward_function=function)
    assert asyncio.run(plain.reward(task, _played(chat, 0.7))) == -1.0


def test_an_environment_that_cannot_be_loaded_stops_the_job_before_it_starts(tmp_path):
    config = load_config(
        "configs/tiny_cpu.py", [f"run_dir={tmp_path}", "tasks.environment=examples.nowhere:Env"]
    )
    with pytest.raises(ValueError, match=r"tasks.environment 'examples.nowhere:Env' cannot be loaded"):
        GrpoJob(config)
    assert not any(tmp_path.iterdir())  # no worker, no record


# -- two job steps with the environment ---------------------------------------------------------


def _end_turns_often(model_dir: Path) -> None:
    """Nudges the random model to end its turns after ~5 tokens: residual dimension 0 becomes a
    constant (set in every embedding, written by no layer), which the output layer reads only
    for `<|im_end|>`, lifting its logit by about 7 at every position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    end = AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[end, 0] = 4.5
    model.save_pretrained(model_dir, safe_serialization=True)


@pytest.fixture(scope="module")
def environment_run(tmp_path_factory):
    """Runs the job; returns (run folder, tokenizer, [(task, trajectory, reward)] seen by the reward)."""
    from transformers import AutoTokenizer

    from libra.cli import main

    root = tmp_path_factory.mktemp("environment-job")
    model = root / "tiny"
    assert main(["make-tiny-model", str(model), "--random"]) == 0
    _end_turns_often(model)
    dataset = root / "math.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"prompt": q, "ground_truth": a, "task_type": "math", "metadata": {"index": i}}) + "\n"
            for i, (q, a) in enumerate(PROBLEMS)
        )
    )
    overrides = [
        *ONE_INSTANCE,
        f"run_dir={root / 'run'}",
        f"tasks.dataset_path={dataset}",
        f"tasks.environment={ENVIRONMENT}",
        f"job.model={model}",
        f"job.num_steps={NUM_STEPS}",
        "job.prompts_per_step=2",
        "job.group_size=2",
        "job.metrics_port=-1",
        "rollout.agent.max_turns=3",
        "rollout.agent.max_tokens_per_turn=32",
        "rollout.agent.max_response_tokens=320",
        "training.grpo.entropy_coef=0.01",
    ]
    config = load_config("configs/tiny_cpu.py", overrides)
    result, seen = run_with_reward_spy(config)
    assert result.version == NUM_STEPS
    return Path(config.run_dir), AutoTokenizer.from_pretrained(model), seen


def _actions(trajectory: Trajectory, chat: ChatFormat) -> list[str]:
    """The text of each model turn the environment was stepped with: every turn that ended at a
    stop token (a turn cut by a budget is no action)."""
    decode = chat.tokenizer.decode
    turns = trajectory.model_turns()
    return [decode(t, skip_special_tokens=True) for t in turns if t[-1] in chat.stop_token_ids]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_trajectories_play_the_environment_and_are_rewarded_by_it(environment_run):
    run_dir, tokenizer, seen = environment_run
    chat = ChatFormat(tokenizer)
    assert len(seen) >= NUM_STEPS * 4
    num_observations = 0
    for task, trajectory, reward in seen:
        prompt = tokenizer.decode(trajectory.prompt_token_ids)
        # The environment's first observation, without the tools' list (the environment answers).
        assert prompt.endswith(
            f"<|im_start|>user\n{task.prompt}\n\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert '"name": "python"' not in prompt
        # Each observation is a user turn after a model turn, and a tool return of the environment.
        response = tokenizer.decode(trajectory.response_token_ids)
        assert response.count("Try again.") == len(trajectory.tool_returns)
        assert {r.tool for r in trajectory.tool_returns} <= {ENVIRONMENT}
        num_observations += len(trajectory.tool_returns)
        # The reward is the sum of the environment's step rewards: replayed here.
        environment = MathWithFeedback()
        environment.reset(task)
        steps = [environment.step(action) for action in _actions(trajectory, chat)]
        assert reward == pytest.approx(sum(s.reward for s in steps))
        assert (trajectory.outcome == Outcome.ANSWERED) == (bool(steps) and steps[-1].done)
    assert num_observations > 0
    rewards = {trajectory.trajectory_id: reward for _, trajectory, reward in seen}
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert samples and all(s["reward"] == pytest.approx(rewards[s["trajectory_id"]]) for s in samples)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_trainer_steps_on_the_environments_trajectories(environment_run):
    run_dir, _, _ = environment_run
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    # `job.rollout_tp_sizes` empty: the planner chose the launch's instances (on two slots, one).
    planned = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "launch_planned"]
    assert [e["tp_sizes"] for e in planned] == [[1]], planned
    for step in steps:
        assert step["num_trajectories"] > 0 and step["generated_tokens"] > 0
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
