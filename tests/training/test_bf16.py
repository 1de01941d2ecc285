"""bf16 training learns like fp32 (one rank, the tiny Qwen3 of the equivalence tests; see
precision_job.py).

At lr 1e-6 an Adam update (about lr per element) is far below half an ulp of a bf16 weight of
0.02 (about 6e-5): stepped on the bf16 weights themselves it rounds away. Megatron's optimizer
steps fp32 main parameters instead, so one step changes the same elements in bf16 as in fp32,
while the bf16 copy the model computes with has not moved yet. Over 20 GRPO steps at lr 3e-4 the
bf16 run's losses and per-token logprobs track the fp32 run's, and a bf16 checkpoint (bf16
weights, fp32 main parameters and Adam state) resumes on the same curve.

Measured on the development machine: 94.6 % of main-parameter elements change in both dtypes
(0.5 % of the bf16 model's elements); losses spread over 0.15 across the 20 steps, and the max
|loss gap| is 9.5e-4; the max |logprob gap| is 0.033 before training (bf16 forward rounding) and
0.037 after, while fp32 logprobs moved by up to 0.60.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.training.jobs import free_port, run_job
from tests.training.tiny_models import make_hf_model

NUM_CPUS = 1
STEPS = 20
LOSS_TOL = 5e-3
LOGPROB_TOL = 0.1
MEAN_LOGPROB_TOL = 0.02
RESUME_TOL = 1e-6

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    model = make_hf_model("qwen3", root / "qwen3", tie=True, seed=0)
    spec = {"model": str(model), "port": free_port(), "lr": 3e-4, "steps": STEPS}
    return run_job(spec, root / "job", script="precision_job.py")


def _gaps(a: list[list[float]], b: list[list[float]]) -> torch.Tensor:
    return torch.tensor(
        [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    )


def test_one_step_at_lr_1e6_changes_in_bf16_what_it_changes_in_fp32(result):
    fp32, bf16 = result["small_lr"]["float32"], result["small_lr"]["bfloat16"]
    assert bf16["model_dtypes"] == ["torch.bfloat16"] and bf16["main_dtypes"] == ["torch.float32"]
    changed32 = torch.cat([c.reshape(-1) for c in fp32["main_changed"]])
    changed16 = torch.cat([c.reshape(-1) for c in bf16["main_changed"]])
    assert changed32.float().mean() > 0.5  # the step does move most weights
    # Nearly every element the fp32 step changes, the bf16 run's fp32 main copy changes too.
    assert (changed16 & changed32).sum() >= 0.99 * changed32.sum()
    # ... while the rounded bf16 copy has barely moved: without main parameters, that is all
    # the update there would be.
    assert bf16["model_changed_fraction"] < 0.02


def test_20_bf16_steps_track_fp32(result):
    fp32, bf16 = result["run"]["float32"], result["run"]["bfloat16"]
    assert len(fp32["losses"]) == len(bf16["losses"]) == STEPS
    # The losses vary far more from step to step than the tolerance allows between dtypes.
    assert max(fp32["losses"]) - min(fp32["losses"]) > 10 * LOSS_TOL
    loss_gaps = [abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"], strict=True)]
    assert max(loss_gaps) <= LOSS_TOL, loss_gaps
    moved = _gaps(fp32["logprobs_start"], fp32["logprobs_end"])
    assert moved.max() > 3 * LOGPROB_TOL  # the policy really moved: tracking means something
    end = _gaps(fp32["logprobs_end"], bf16["logprobs_end"])
    assert end.max() <= LOGPROB_TOL and end.mean() <= MEAN_LOGPROB_TOL, (end.max(), end.mean())
    assert all(torch.isfinite(torch.tensor(bf16["grad_norms"])))


def test_a_bf16_checkpoint_resumes_on_the_same_curve(result):
    run = result["run"]["bfloat16"]
    second_half = run["losses"][STEPS // 2 :]
    gaps = [abs(a - b) for a, b in zip(run["resumed_losses"], second_half, strict=True)]
    assert max(gaps) <= RESUME_TOL, (run["resumed_losses"], second_half)


@pytest.mark.parametrize("dtype, bytes_per_param", [("float32", 4), ("bfloat16", 2)])
def test_planner_prices_the_optimizer_state_the_engine_holds(result, dtype, bytes_per_param):
    """`training_cost.optimizer_state_bytes` (what the planner's memory model charges) against the
    engine's measured main parameters and Adam moments: fp32 m, v, plus an fp32 main copy in bf16."""
    from libra.planner.training_cost import optimizer_state_bytes

    run = result["run"][dtype]
    predicted = optimizer_state_bytes(run["num_params"], bytes_per_param, dp=1, distributed=True)
    assert abs(run["optimizer_bytes"] - predicted) <= 0.02 * predicted, (run["optimizer_bytes"], predicted)
