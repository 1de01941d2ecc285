"""GRPO learns: a tiny Llama policy on a verifiable parity task (see learn_job.py) raises its mean
reward clearly within a fixed number of steps, in fp32 and in bf16 (fp32 main parameters in
Megatron's optimizer). Fixed seeds; the margin is on reward, not time."""

from __future__ import annotations

import importlib.util

import pytest

from tests.training.jobs import free_port, run_job
from tests.training.tiny_models import make_hf_model

NUM_CPUS = 1
STEPS = 12

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_raises_mean_reward(tmp_path, dtype):
    model = make_hf_model("llama", tmp_path / "policy", tie=False, seed=3, vocab=16)
    spec = {
        "model": str(model),
        "steps": STEPS,
        "lr": 3e-3,
        "num_prompts": 16,
        "group_size": 8,
        "seed": 0,
        "dtype": dtype,
        "port": free_port(),
    }
    rewards = run_job(spec, tmp_path / "job", script="learn_job.py")["rewards"]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert 0.3 < first < 0.7, rewards  # starts near chance
    assert last >= first + 0.25, rewards
