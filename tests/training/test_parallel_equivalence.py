"""Multi-process Megatron jobs on the CPU (gloo, one thread per rank), all through Megatron's DDP,
optimizer and schedules: TP=2, PP=2 (1F1B over >= 4 micro-batches, full recompute, the
non-distributed optimizer), DP=2 (distributed optimizer, reduction overlapped with backward) and
TP=2 x DP=2 (distributed optimizer, selective recompute) give the TP=1 logprobs and losses;
HF -> Megatron import and Megatron -> HF export match transformers for Llama, Qwen2 and Qwen3;
checkpoints with the distributed optimizer's sharded state resume at another layout on the same
loss curve (TP=2 -> TP=1, TP=2 x DP=2 -> TP=1 and TP=1 -> TP=2 x DP=2), staleness counters
restored, and PP=2's non-distributed optimizer resumes from a checkpoint taken before its first
step; the distributed optimizer halves the optimizer state per rank at DP=2. The last step's
batch is thin (3 trajectories): DP shares of its mini-batches are empty on some ranks.

The main model is a Qwen3 with tied embeddings (QK-norm, GQA 4q/2kv, head_dim 16, vocab 300
padded to 384 at TP=1 and 512 at TP=2). Every job trains 5 GRPO steps (2 mini-batches each,
KL and entropy terms on, clip-higher, one stale trajectory at step 3) on fixed batches, scoring
tokens at a sampling temperature of 0.7 (the reference divides transformers' logits by it).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.training.jobs import start_job, wait_job
from tests.training.tiny_models import make_batch, make_hf_model

NUM_CPUS = 2
STEPS = 5
SAVE_AT = 2
TOL = 1e-5
TRAINED_RTOL = 2e-4
"""After the steps: the layouts' logprobs agree to this share of what training moved them."""
TEMPERATURE = 0.7
SAVES = {"tp1": SAVE_AT, "tp2": SAVE_AT, "tp2dp2": SAVE_AT, "pp2": 0}
"""The step before which each job saves a checkpoint."""
LAYOUTS = ("tp2", "pp2", "dp2", "tp2dp2")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "qwen3": str(make_hf_model("qwen3", root / "qwen3", tie=True, seed=0)),
        "llama": str(make_hf_model("llama", root / "llama", tie=False, seed=1)),
        "qwen2": str(make_hf_model("qwen2", root / "qwen2", tie=False, seed=2)),
    }


PP2_MAX_TOKENS = 40
"""The PP=2 job's micro-batch budget: small enough for at least 4 micro-batches per mini-batch."""
PP2_LAYOUT = {
    "tp": 1,
    "pp": 2,
    "dp": 1,
    "max_tokens_per_microbatch": PP2_MAX_TOKENS,
    "recompute": "full",
    "use_distributed_optimizer": False,
}


@pytest.fixture(scope="module")
def jobs(models, tmp_path_factory):
    """tp1, tp2 (all three families), pp2, dp2 and tp2dp2 run at once, tp1, tp2 and tp2dp2 saving
    a checkpoint; then the checkpoints resume at another layout."""
    root = tmp_path_factory.mktemp("jobs")
    ckpt = {name: str(root / f"ckpt_{name}") for name in SAVES}
    common = {"steps": STEPS, "export": True, "temperature": TEMPERATURE}
    specs = {
        "tp1": {
            **common,
            "tp": 1,
            "pp": 1,
            "dp": 1,
            "save_at": SAVES["tp1"],
            "save_dir": ckpt["tp1"],
            "models": [models["qwen3"]],
        },
        "tp2": {
            **common,
            "tp": 2,
            "pp": 1,
            "dp": 1,
            "save_at": SAVES["tp2"],
            "save_dir": ckpt["tp2"],
            "models": [models["qwen3"], models["llama"], models["qwen2"]],
        },
        "pp2": {
            **common,
            **PP2_LAYOUT,
            "save_at": SAVES["pp2"],
            "save_dir": ckpt["pp2"],
            "models": [models["qwen3"]],
        },
        "dp2": {
            **common,
            "tp": 1,
            "pp": 1,
            "dp": 2,
            "overlap_grad_reduce": True,
            "models": [models["qwen3"]],
        },
        "tp2dp2": {
            **common,
            "tp": 2,
            "pp": 1,
            "dp": 2,
            "recompute": "selective",
            "save_at": SAVES["tp2dp2"],
            "save_dir": ckpt["tp2dp2"],
            "models": [models["qwen3"]],
        },
    }
    results = _run_all(specs, root)
    resume = {**common, "models": [models["qwen3"]], "export": False}
    resumes = {
        "resume_tp1": {**resume, "tp": 1, "pp": 1, "dp": 1, "resume": ckpt["tp2"]},
        "resume_tp1_from_tp2dp2": {**resume, "tp": 1, "pp": 1, "dp": 1, "resume": ckpt["tp2dp2"]},
        "resume_tp2dp2_from_tp1": {**resume, "tp": 2, "pp": 1, "dp": 2, "resume": ckpt["tp1"]},
        "resume_pp2": {**resume, **PP2_LAYOUT, "resume": ckpt["pp2"]},
    }
    return {**results, **_run_all(resumes, root)}


def _run_all(specs: dict, root) -> dict:
    started = {name: (start_job(spec, root / name), root / name) for name, spec in specs.items()}
    return {name: wait_job(procs, out) for name, (procs, out) in started.items()}


def hf_logprobs(
    model_dir: str, state_dict: dict | None = None, temperature: float = TEMPERATURE
) -> list[list[float]]:
    """Reference: transformers' per-token logprobs of the fixed batch's response tokens at the
    sampling temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        allowed_missing = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        assert set(missing) <= allowed_missing and not unexpected, (missing, unexpected)
        model.tie_weights()
    out = []
    with torch.no_grad():
        for t in make_batch(seed=7):
            ids = torch.tensor([t.token_ids])
            logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
            p = len(t.prompt_token_ids)
            targets = ids[0, p:]
            lp = logp[p - 1 : -1].gather(-1, targets[:, None])[:, 0]
            out.append((lp * torch.tensor(t.loss_mask, dtype=torch.float32)).tolist())
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for ra, rb in zip(a, b, strict=False) for x, y in zip(ra, rb, strict=False))


def test_tp2_pp2_dp2_logprobs_equal_tp1(jobs, models):
    ref = jobs["tp1"][models["qwen3"]]
    # After training, fp32 rounding that differs between layouts (reduction orders) has gone
    # through every step's update: the bound grows with how far training moved the logprobs,
    # while a wrong gradient or update in one layout would be off by a share of that movement.
    moved = max_diff(ref["logprobs_end"], ref["logprobs_start"])
    assert moved > 100 * TOL  # training moved them: the bound below is not vacuous
    trained_tol = TOL + TRAINED_RTOL * moved
    for name in LAYOUTS:
        got = jobs[name][models["qwen3"]]
        assert max_diff(got["logprobs_start"], ref["logprobs_start"]) <= TOL, name
        diff = max_diff(got["logprobs_end"], ref["logprobs_end"])
        assert diff <= trained_tol, (name, diff, moved)


def test_tp2_pp2_dp2_losses_equal_tp1(jobs, models):
    ref = jobs["tp1"][models["qwen3"]]
    assert len(ref["losses"]) == STEPS
    # The run really trains: the policy moves (logprobs change) and the losses are not all equal.
    assert max_diff(ref["logprobs_start"], ref["logprobs_end"]) > 1e-2
    assert len({round(x, 6) for x in ref["losses"]}) == STEPS
    for name in LAYOUTS:
        got = jobs[name][models["qwen3"]]
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert abs(a - b) <= TOL, (name, got["losses"], ref["losses"])
        for sa, sb in zip(got["steps"], ref["steps"], strict=True):
            assert math.isclose(sa["grad_norm"], sb["grad_norm"], rel_tol=1e-4), name
            assert sa["num_tokens"] == sb["num_tokens"] and sa["version"] == sb["version"]


def test_stale_trajectory_dropped_by_gate(jobs, models):
    steps = jobs["tp1"][models["qwen3"]]["steps"]
    assert [s["num_dropped_stale"] for s in steps] == [0, 0, 0, 1, 0]
    assert [s["num_trajectories"] for s in steps] == [12, 12, 12, 11, 3]  # step 4 is thin


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_hf_import_logits_equal_transformers(jobs, models, family):
    got = jobs["tp2"][models[family]]["logprobs_start"]
    assert max_diff(got, hf_logprobs(models[family])) <= TOL


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_export_after_training_equals_transformers(jobs, models, family):
    out = jobs["tp2"][models[family]]
    exported = hf_logprobs(models[family], out["export"])
    assert max_diff(exported, out["logprobs_end"]) <= TOL
    assert max_diff(exported, hf_logprobs(models[family])) > 1e-2  # trained weights, not the originals


def test_exports_agree_across_parallelism(jobs, models):
    ref = jobs["tp1"][models["qwen3"]]["export"]
    for name in LAYOUTS:
        got = jobs[name][models["qwen3"]]["export"]
        assert set(got) == set(ref)
        for key in ref:
            assert torch.allclose(got[key], ref[key], atol=TOL, rtol=0), (name, key)


@pytest.mark.parametrize(
    "saved_at, resumed_at",
    [
        ("tp2", "resume_tp1"),
        ("tp2dp2", "resume_tp1_from_tp2dp2"),
        ("tp1", "resume_tp2dp2_from_tp1"),
        ("pp2", "resume_pp2"),  # the non-distributed optimizer, saved before its first step
    ],
)
def test_checkpoint_resumes_on_the_same_curve(jobs, models, saved_at, resumed_at):
    saved = jobs[saved_at][models["qwen3"]]
    resumed = jobs[resumed_at][models["qwen3"]]
    for a, b in zip(resumed["losses"], saved["losses"][SAVES[saved_at] :], strict=True):
        assert abs(a - b) <= TOL, (resumed["losses"], saved["losses"])
    assert max_diff(resumed["logprobs_end"], saved["logprobs_end"]) <= TOL


def test_pp2_runs_at_least_four_micro_batches_per_mini_batch():
    from libra.training.batching import make_micro_batches
    from tests.training.rank_job import batch_for_step

    batch = batch_for_step(0)
    first_minibatch = range(len(batch) // 2)  # train steps split the batch into 2 mini-batches
    lengths = {i: len(batch[i].token_ids) for i in first_minibatch}
    assert len(make_micro_batches(list(first_minibatch), lengths, PP2_MAX_TOKENS)) >= 4


def test_distributed_optimizer_halves_optimizer_state_at_dp2(jobs, models):
    """Measured per rank (fp32: Adam's m and v; the model is its own main copy), and as the
    planner's memory model prices it."""
    from libra.planner.training_cost import optimizer_state_bytes

    one = jobs["tp1"][models["qwen3"]]["optimizer_bytes"]
    half = jobs["dp2"][models["qwen3"]]["optimizer_bytes"]
    print(f"optimizer state per rank: DP=1 {one} B, DP=2 (distributed) {half} B, ratio {half / one:.3f}")
    assert 0.45 <= half / one <= 0.56
    predicted = optimizer_state_bytes(jobs["dp2"][models["qwen3"]]["num_params"], 4, dp=2, distributed=True)
    assert abs(half - predicted) <= 0.05 * predicted, (half, predicted)


def test_checkpoint_restores_staleness_state(jobs, models):
    saved = jobs["tp2"][models["qwen3"]]["saved_staleness"]
    restored = jobs["resume_tp1"][models["qwen3"]]["restored_staleness"]
    assert saved["version"] == restored["version"] == SAVE_AT
    assert saved["num_started"] == restored["num_started"] > saved["num_consumed"] + saved["num_dropped"]
    assert restored["num_consumed"] == saved["num_consumed"]
    # The rollouts in flight at the checkpoint died with it: their slots are free again.
    assert restored["num_dropped"] == saved["num_started"] - saved["num_consumed"]
