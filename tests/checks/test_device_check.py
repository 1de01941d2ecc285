"""The device check: the runner's failure handling (fast), and `scripts/check_cuda.sh --cpu` end
to end on the cpu backend, as CI runs it (~2 min on 2 cores: a vLLM instance, a Megatron rank,
then a 5-step job)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from libra.checks.result import Check, CheckResult
from libra.checks.runner import main

REPO = Path(__file__).resolve().parents[2]
CHECK_TIMEOUT_S = 900


def _passes(ctx) -> CheckResult:
    return CheckResult("first", True, "fine", {"x": 1})


def _raises(ctx) -> CheckResult:
    raise RuntimeError("no device here")


def test_a_check_that_raises_is_a_fail_line_and_the_others_still_run(tmp_path, capsys):
    ran = []

    def last(ctx) -> CheckResult:
        ran.append(ctx.backend_name)
        return CheckResult("last", True, "also fine")

    checks = [Check("first", _passes), Check("broken", _raises), Check("last", last)]
    out = tmp_path / "summary.json"
    code = main(["--backend", "cpu", "--workdir", str(tmp_path), "--out", str(out)], checks=checks)
    assert code == 1
    assert capsys.readouterr().out.splitlines() == [
        "[PASS] first: fine",
        "[FAIL] broken: RuntimeError: no device here",
        "[PASS] last: also fine",
    ]
    assert ran == ["cpu"]
    summary = json.loads(out.read_text())
    assert not summary["passed"]
    assert [(c["name"], c["passed"]) for c in summary["checks"]] == [
        ("first", True),
        ("broken", False),
        ("last", True),
    ]


def test_all_passing_checks_exit_0(tmp_path, capsys):
    assert main(["--backend", "cpu", "--workdir", str(tmp_path)], checks=[Check("first", _passes)]) == 0
    assert capsys.readouterr().out == "[PASS] first: fine\n"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(CHECK_TIMEOUT_S + 60)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_check_cuda_sh_cpu_passes_every_check_with_its_figure(tmp_path):
    out = tmp_path / "summary.json"
    run = subprocess.run(
        ["bash", "scripts/check_cuda.sh", "--cpu", "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_S,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    names = ["backend", "model logits", "bf16 step", "rollout engine", "publication", "job"]
    assert [line.split(":")[0] for line in lines] == [f"[PASS] {name}" for name in names]
    summary = json.loads(out.read_text())
    assert summary["backend"] == "cpu" and summary["passed"]
    checks = {c["name"]: c for c in summary["checks"]}
    assert list(checks) == names
    assert checks["backend"]["values"]["profile"].startswith("cpu-slot")
    logits = checks["model logits"]["values"]
    assert logits["spec"] == "local" and logits["dtype"] == "float32"
    assert logits["max_logit_diff"] <= logits["tolerance"]
    step = checks["bf16 step"]["values"]
    assert step["grad_norm_bf16"] > 0 and step["grad_norm_fp32"] > 0
    assert step["main_changed_bf16"] > 0.5
    rollout = checks["rollout engine"]["values"]
    assert rollout["greedy_exact"] == rollout["prompts"] > 0 and rollout["greedy_off"] == 0
    assert rollout["decode_tok_s_batch_32"] > 0 and rollout["decode_tok_s_batch_1"] > 0
    published = checks["publication"]["values"]
    assert published["tensors_compared"] > 0 and published["tensors_mismatched"] == 0
    assert published["logprob_gap_max"] < min(1e-4, published["logprob_step_shift"] / 10)
    job = checks["job"]["values"]
    assert job["steps"] == 5 and job["lost"] == 0 and job["trajectories"] > 0
