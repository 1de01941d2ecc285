"""The job trained on an agent written only against the `openai` package (`endpoint.agent`,
`examples/openai_agent.py`): the warm-started tiny policy calls its tools through the endpoint's
tool calls, every session is one trajectory of exactly the tokens sampled, and the job steps and
publishes weights on them. A driver thread plays an outside client meanwhile: without the run's
token it is refused; with it, it is served, and its session is never trained on."""

from __future__ import annotations

import asyncio

import openai
import pytest

from libra.job.recorder import read_jsonl
from tests.job.driven_job import ONE_INSTANCE, run_driven_job, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.warm_start, pytest.mark.timeout(600)]

NUM_STEPS = 2


def _outside_client(run_dir, driver: dict) -> None:
    if not wait_for(lambda: (run_dir / "endpoint.url").is_file() and (run_dir / "token").is_file(), driver):
        return
    url = (run_dir / "endpoint.url").read_text().strip()
    token = (run_dir / "token").read_text().strip()

    async def calls() -> None:
        messages = [{"role": "user", "content": "What is 2+2?"}]
        async with openai.AsyncOpenAI(base_url=url, api_key="not-the-token", max_retries=0) as stranger:
            try:
                await stranger.chat.completions.create(model="m", messages=messages)
            except openai.AuthenticationError as e:
                driver["refused"] = e.status_code
        async with openai.AsyncOpenAI(base_url=url, api_key=token, max_retries=0) as client:
            response = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, extra_headers={"x-libra-session": "outside"}
            )
            driver["served"] = response.model_extra["libra"]["choices"][0]["trajectory_id"]

    asyncio.run(calls())


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("agent_job") / "run"
    driver: dict = {}
    overrides = [
        *ONE_INSTANCE,
        "endpoint.agent=examples.openai_agent:agent",
        f"job.num_steps={NUM_STEPS}",
        "job.prompts_per_step=2",
        "job.group_size=4",
        "job.eval_tasks=0",
        "job.planner=false",
        "training.max_staleness=0",  # step 2 rolls out on the weights step 1 published
        # With max_staleness 0 every group in flight is due before each step: the loop's waiting
        # path runs every step (and, the bound being 0, nothing could be dropped anyway).
        "training.staleness_mode=wait",
    ]
    result = run_driven_job(run_dir, overrides, _outside_client, driver)
    return run_dir, result, driver


def test_the_job_steps_and_publishes_on_the_agents_sessions(agent_run):
    run_dir, result, _ = agent_run
    assert result.version == NUM_STEPS and [s.step for s in result.steps] == [1, 2]
    for step in result.steps:
        assert step.num_trajectories > 0 and step.publish_time_s > 0
    # The trainer scored step 1's tokens as the instance sampled them (the same version-0
    # weights, fp32): the endpoint's tokens and logprobs line up with what is trained.
    first = result.steps[0]
    assert first.num_current_tokens > 0 and first.logprob_max_abs_diff < 1e-4, first
    # Step 2 sampled with the weights published after step 1, and the trainer agrees with them.
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert {v for s in samples for v in s["policy_versions"]} == {0, 1}
    second = result.steps[1]
    assert second.num_current_tokens > 0 and second.logprob_abs_diff < 1e-3, second


def test_each_session_is_a_trajectory_of_the_agents_calls(agent_run):
    run_dir, _, _ = agent_run
    samples = read_jsonl(run_dir / "samples.jsonl")
    # Sessions are named by group and slot (`g{group}-{slot}`), segments by index.
    assert samples and all(s["trajectory_id"].split(".")[-1].isdigit() for s in samples)
    assert all(s["trajectory_id"].startswith("g") for s in samples)
    # The policy called its tools through the endpoint's tool calls: multi-turn sessions.
    assert max(s["num_turns"] for s in samples) >= 2
    assert all(s["outcome"] == "answered" for s in samples), {s["outcome_reason"] for s in samples}


def test_an_outside_client_needs_the_token_and_is_not_trained_on(agent_run):
    run_dir, _, driver = agent_run
    assert driver["refused"] == 401
    assert driver["served"] == "outside.0"
    assert all(not s["trajectory_id"].startswith("outside") for s in read_jsonl(run_dir / "samples.jsonl"))
