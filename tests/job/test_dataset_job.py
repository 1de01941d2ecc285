"""The job on a dataset (`tasks.dataset_path` + `job.model`): a DAPO-Math-shaped JSONL of a few
rows and the factory's random tiny model, two job steps end to end, rewarded by a reward function
loaded from the config (`tasks.reward_function`); plus the built-in reward of each dataset task
type and a user's function on hand-built trajectories, and the errors of a job that cannot run a
dataset.

The random model's reward under a correctness rule is ~0 (it rarely even ends a turn), so the
job's reward function scores length and row (`reward_plugin`), and the end-to-end test checks
where the trajectories came from, that each was rewarded by that function of its own row, and
that the trainer stepped on them. Needs ~3 GB: one vLLM instance, one Megatron rank, the
controller and a node agent, all real processes on loopback; about a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from libra.config import load_config
from libra.job.recorder import read_jsonl
from libra.job.rollouts import GroupRollout, load_dataset_tasks
from libra.rollout.chat import ChatFormat
from libra.rollout.tools.config import CustomToolConfig, SandboxConfig, ToolsConfig
from libra.tasks.config import TasksConfig
from libra.tasks.datasets import TaskRecord, TaskType
from libra.trajectory import Outcome, Trajectory
from tests.job import reward_plugin
from tests.job.driven_job import ONE_INSTANCE, run_with_reward_spy

NUM_STEPS = 2
REWARD_FUNCTION = "tests.job.reward_plugin:length_and_row"
# DAPO-Math-17k's record shape: a chat-format prompt and `reward_model.ground_truth`.
PROBLEMS = [
    ("What is 17 + 25?", "42"),
    ("Compute 6 * 7 - 12.", "30"),
    ("What is 1/2 + 1/4? Give a fraction.", "3/4"),
    ("How many primes are below 20?", "8"),
    ("What is 2 to the power 10?", "1024"),
]
INSTRUCTION = "Solve the problem. The last line of your response should be of the form Answer: $Answer"


def _write_dataset(path: Path) -> Path:
    with open(path, "w") as f:
        for index, (question, answer) in enumerate(PROBLEMS):
            row = {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}],
                "reward_model": {"ground_truth": answer, "style": "rule"},
                "extra_info": {"index": index},
            }
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """`libra make-tiny-model DIR --random`."""
    from libra.cli import main

    out = tmp_path_factory.mktemp("model") / "tiny"
    assert main(["make-tiny-model", str(out), "--random"]) == 0
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# -- the rewards of dataset tasks, on hand-built trajectories ---------------------------------


def _answered(chat: ChatFormat, prompt: str, final_turn: str, outcome=Outcome.ANSWERED) -> Trajectory:
    """A trajectory whose one model turn is `final_turn`, ended by the end-of-message token."""
    trajectory = Trajectory("t", "p", "g", chat.prompt_ids([{"role": "user", "content": prompt}]))
    ids = chat.tokenizer.encode(final_turn, add_special_tokens=False) + [chat.eos_id]
    trajectory.append(ids, [-0.5] * len(ids), 0)
    trajectory.outcome = outcome
    return trajectory


def test_each_dataset_task_type_is_rewarded_by_its_rule(tokenizer):
    from libra.rollout.tools.sandbox import SandboxPool

    chat = ChatFormat(tokenizer)
    math_task = TaskRecord("What is 17 + 25?", "42", TaskType.MATH)
    qa_task = TaskRecord("Who wrote Hamlet?", ("William Shakespeare", "Shakespeare"), TaskType.RETRIEVAL_QA)
    code_task = TaskRecord("Write add(a, b).", "assert add(2, 3) == 5", TaskType.CODE)

    async def rewards() -> list[float]:
        sandbox = await SandboxPool(SandboxConfig(num_workers=1)).start()
        try:
            rollout = GroupRollout(loop=None, chat=chat, group_size=2, qa_metric="em", sandbox=sandbox)
            cases = [
                (math_task, _answered(chat, math_task.prompt, "17 + 25 = 42.\nAnswer: 42")),
                (math_task, _answered(chat, math_task.prompt, "Answer: 41")),
                # The right answer in a trajectory cut by its token budget earns nothing.
                (math_task, _answered(chat, math_task.prompt, "Answer: 42", Outcome.MAX_TOKENS)),
                (qa_task, _answered(chat, qa_task.prompt, "<answer>the Shakespeare</answer>")),
                (qa_task, _answered(chat, qa_task.prompt, "<answer>Marlowe</answer>")),
                (
                    code_task,
                    _answered(chat, code_task.prompt, "```python\ndef add(a, b):\n    return a + b\n```"),
                ),
                (
                    code_task,
                    _answered(chat, code_task.prompt, "```python\ndef add(a, b):\n    return a - b\n```"),
                ),
            ]
            return [await rollout.reward(task, trajectory) for task, trajectory in cases]
        finally:
            await sandbox.close()

    assert asyncio.run(rewards()) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_a_reward_function_gets_the_decoded_response_and_answer(tokenizer):
    """`GroupRollout.reward` with `tasks.reward_function`: the function scores every trajectory,
    answered or cut (then `answer` is None), from the task record and the decoded text."""
    chat = ChatFormat(tokenizer)
    task = TaskRecord("What is 17 + 25?", "42", TaskType.MATH, {"index": 4})
    rollout = GroupRollout(loop=None, chat=chat, group_size=2, reward_function=REWARD_FUNCTION)
    answered = _answered(chat, task.prompt, "17 + 25 = 42.\nAnswer: 42")
    cut = _answered(chat, task.prompt, "17 + 25 is", Outcome.MAX_TOKENS)
    given: list = []
    real = rollout.reward_function

    async def spy(value):
        given.append(value)
        return await real(value)

    rollout.reward_function = spy
    scores = [asyncio.run(rollout.reward(task, t)) for t in (answered, cut)]
    assert scores == [reward_plugin.score(t.num_generated_tokens, 4) for t in (answered, cut)]
    assert [g.answer for g in given] == ["17 + 25 = 42.\nAnswer: 42", None]
    assert [g.response for g in given] == ["17 + 25 = 42.\nAnswer: 42", "17 + 25 is"]
    assert all(g.task is task for g in given)


def test_dataset_tasks_need_their_task_types_tools(tmp_path):
    dataset = tmp_path / "nq.jsonl"
    dataset.write_text(json.dumps({"question": "capital of France?", "golden_answers": ["Paris"]}) + "\n")
    with pytest.raises(
        ValueError, match=r"retrieval_qa tasks, which need the tools \['retrieve'\].*tools\.enabled"
    ):
        load_dataset_tasks(TasksConfig(dataset_path=str(dataset)), ToolsConfig(enabled=["python"]))
    corpus = tmp_path / "corpus.jsonl"
    records = load_dataset_tasks(
        TasksConfig(dataset_path=str(dataset)),
        ToolsConfig(enabled=["retrieve"], retrieval_corpus=str(corpus)),
    )
    assert [(r.prompt, r.answers, r.task_type) for r in records] == [
        ("capital of France?", ("Paris",), TaskType.RETRIEVAL_QA)
    ]
    # A retrieval server registered under the built-in's name serves as well.
    server = CustomToolConfig(name="retrieve", endpoint="http://127.0.0.1:8000/retrieve")
    served = ToolsConfig(enabled=[], custom=[server])
    assert load_dataset_tasks(TasksConfig(dataset_path=str(dataset)), served) == records
    # An environment answers every turn: no tool is run, so none is needed.
    answered = TasksConfig(
        dataset_path=str(dataset), environment="examples.custom_environment:MathWithFeedback"
    )
    assert load_dataset_tasks(answered, ToolsConfig(enabled=[])) == records


def test_a_dataset_job_needs_a_model(tmp_path):
    with pytest.raises(ValueError, match="tasks.dataset_path needs job.model"):
        load_config("configs/tiny_cpu.py", [f"tasks.dataset_path={_write_dataset(tmp_path / 'd.jsonl')}"])


# -- two job steps on the dataset ------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset_run(tmp_path_factory, tiny_model):
    """Runs the job; returns (run folder, [(task, trajectory, reward)] seen by the reward)."""
    root = tmp_path_factory.mktemp("dataset-job")
    dataset = _write_dataset(root / "dapo_math.jsonl")
    overrides = [
        *ONE_INSTANCE,
        f"run_dir={root / 'run'}",
        f"tasks.dataset_path={dataset}",
        f"job.model={tiny_model}",
        f"job.num_steps={NUM_STEPS}",
        "job.prompts_per_step=2",
        "job.group_size=2",
        "job.metrics_port=-1",
        # Short turns: the random model rarely ends one, so trajectories end at the turn cap.
        "rollout.agent.max_turns=2",
        "rollout.agent.max_tokens_per_turn=24",
        "rollout.agent.max_response_tokens=96",
        "training.grpo.entropy_coef=0.01",
        f"tasks.reward_function={REWARD_FUNCTION}",
    ]
    config = load_config("configs/tiny_cpu.py", overrides)
    result, seen = run_with_reward_spy(config)
    assert result.version == NUM_STEPS
    return Path(config.run_dir), seen


@pytest.mark.multiprocess
@pytest.mark.slow
def test_trajectories_come_from_the_datasets_prompts_in_the_models_template(dataset_run, tokenizer):
    run_dir, seen = dataset_run
    prompts = {f"{q}\n\n{INSTRUCTION}": answer for q, answer in PROBLEMS}
    assert len(seen) >= NUM_STEPS * 4
    for task, trajectory, _ in seen:
        assert task.task_type == TaskType.MATH and prompts[task.prompt] == task.ground_truth
        text = tokenizer.decode(trajectory.prompt_token_ids)
        # The model's own chat template, with the configured tools listed (tools.enabled default).
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert task.prompt in text and '"name": "python"' in text and '"name": "calculator"' in text
        assert trajectory.num_generated_tokens > 0
    samples = read_jsonl(run_dir / "samples.jsonl")
    by_id = {trajectory.trajectory_id: task for task, trajectory, _ in seen}
    # `task_index` is the dataset row the group was drawn from.
    assert all(by_id[s["trajectory_id"]].prompt == list(prompts)[s["task_index"]] for s in samples)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_each_trajectory_is_rewarded_by_the_configured_function_of_its_row(dataset_run):
    run_dir, seen = dataset_run
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert samples
    for sample in samples:  # recomputed from what the run folder recorded
        expected = reward_plugin.score(sample["generated_tokens"], sample["task_index"])
        assert sample["reward"] == pytest.approx(expected)
    for task, trajectory, reward in seen:
        assert reward == pytest.approx(
            reward_plugin.score(trajectory.num_generated_tokens, task.metadata["index"])
        )
    assert len({s["reward"] for s in samples}) > 1  # rewards that differ: a real advantage signal


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_trainer_steps_on_the_dataset_trajectories(dataset_run):
    run_dir, seen = dataset_run
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    for step in steps:
        assert step["num_trajectories"] > 0 and step["generated_tokens"] > 0
        assert math.isfinite(step["loss"]) and step["grad_norm"] > 0 and step["entropy"] > 0
    # The trainer scored the first batch's sampled tokens as the instance did (same weights, fp32).
    assert steps[0]["num_current_tokens"] > 0 and steps[0]["logprob_max_abs_diff"] < 1e-4
    state = json.loads((run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}" / "job_state.json").read_text())
    assert state["version"] == NUM_STEPS and state["data_position"] >= NUM_STEPS * 2
