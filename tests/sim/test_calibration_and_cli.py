import dataclasses
import json

import pytest

from libra.cli import main
from libra.planner.config import PlannerConfig, TrainingBatch
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel
from libra.sim.calibration import (
    DecodeSample,
    LatencyRun,
    TrainSample,
    calibrate,
    calibrate_rollout_by_vllm,
    latency_measurements,
)
from tests.sim.helpers import tiny_config


def test_calibration_recovers_known_factors():
    """Measurements made by a cost model with known factors are fitted back to those factors.
    Decode steps up to batch 64 are bound by the weight read; those of 256 and 512 by their
    matmuls' compute, which makes the compute efficiency visible (the fit finds each step's side)."""
    config = tiny_config()
    truth = EfficiencyFactors(compute=0.3, memory=0.6, communication=0.7, overhead_s=0.002)
    rollout = RolloutCostModel(config.cluster, config.model, PlannerConfig(), truth)
    batch = TrainingBatch(global_batch=16, group_size=4)
    train = TrainingCostModel(config.cluster, config.model, batch, PlannerConfig(), truth)
    decode = [
        DecodeSample(1, b, b * ctx, rollout.decode_step(1, b, ctx).seconds(truth))
        for b in (1, 4, 16, 64, 256, 512)
        for ctx in (100.0, 3000.0)
    ]
    samples = []
    for lengths in ((500, 700), (2000, 3000, 4000), (8000,)):
        cfg = TrainingConfig(1, 1, 1, 1)
        n = len(lengths)
        seqs = SequenceStats(sum(lengths) / n, sum(x * x for x in lengths) / n, max(lengths))
        samples.append(TrainSample(cfg, lengths, train.step_s(cfg, seqs)))
    fitted = calibrate(config.cluster, config.model, batch, PlannerConfig(), decode, samples)
    assert fitted.rollout.memory == pytest.approx(0.6, rel=1e-6)
    assert fitted.rollout.compute == pytest.approx(0.3, rel=1e-6)
    assert fitted.train.compute == pytest.approx(0.3, rel=1e-6)
    assert all(abs(e.relative_error) < 1e-6 for e in fitted.rollout_errors + fitted.train_errors)


def test_libra_simulate_writes_a_report(tmp_path):
    cfg = tmp_path / "sim_tiny.py"
    cfg.write_text(
        "from tests.sim.helpers import tiny_config\n"
        "def sim_config():\n    return tiny_config(num_steps=2, policies=('colocated_sync', 'libra'))\n"
    )
    out = tmp_path / "out"
    assert main(["simulate", str(cfg), "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "| libra |" in report and "libra / colocated_sync" in report
    assert (out / "throughput.png").stat().st_size > 1000


def test_libra_simulate_rejects_a_missing_config(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "none.py")]) == 2
    assert "config file not found" in capsys.readouterr().err


def _bench_latency_s(cost: RolloutCostModel, factors, tp, batch, input_len, output_len) -> float:
    """What a vLLM latency run takes on hardware with `factors`, summed step by step (the
    calibration prices it at the mean context instead): the batch's prefill in one pass (its
    FLOPs and all-reduces times the batch, one pass's floors and overhead), then each decode step
    at its own context."""
    one = cost.prefill(tp, input_len)
    prefill = (
        batch * (one.compute_s / factors.compute + one.communication_s / factors.communication)
        + one.latency_s
        + factors.overhead_s
    )
    decode = sum(cost.decode_step(tp, batch, input_len + i).seconds(factors) for i in range(1, output_len))
    return prefill + decode


def _write_runs(tmp_path, truth, settings) -> list[str]:
    config = tiny_config()
    cost = RolloutCostModel(config.cluster, config.model, PlannerConfig(), EfficiencyFactors())
    specs = []
    for tp, batch, input_len, output_len in settings:
        seconds = _bench_latency_s(cost, truth, tp, batch, input_len, output_len)
        path = tmp_path / f"tp{tp}-b{batch}-in{input_len}.json"
        path.write_text(json.dumps({"avg_latency": seconds, "latencies": [seconds] * 3, "percentiles": {}}))
        specs.append(f"{path}:tp={tp},batch={batch},input={input_len},output={output_len}")
    return specs


SWEEP = [(tp, b, i, 128) for tp in (1, 2, 4) for b in (1, 16, 64) for i in (512, 4096)]


def test_vllm_latency_files_calibrate_the_rollout_factors(tmp_path):
    """A sweep of TP x batch x context in `vllm bench latency` files, made by hardware with known
    factors, is fitted back to those factors, every run held out predicted within 1 %."""
    config = tiny_config()
    truth = EfficiencyFactors(compute=0.4, memory=0.7, communication=0.5, overhead_s=0.003)
    runs = [LatencyRun.parse(spec) for spec in _write_runs(tmp_path, truth, SWEEP)]
    factors, errors = calibrate_rollout_by_vllm(config.cluster, config.model, PlannerConfig(), runs)
    assert factors.compute == pytest.approx(0.4, rel=1e-3)
    assert factors.memory == pytest.approx(0.7, rel=1e-3)
    assert factors.communication == pytest.approx(0.5, rel=1e-3)
    assert factors.overhead_s == pytest.approx(0.003, rel=1e-3)
    assert len(errors) == len(SWEEP) and all(abs(e.relative_error) < 0.01 for e in errors)


def test_libra_simulate_runs_calibrated_by_vllm_files(tmp_path, capsys):
    truth = EfficiencyFactors(compute=0.4, memory=0.7, communication=0.5, overhead_s=0.003)
    specs = _write_runs(tmp_path, truth, SWEEP[:6])
    cfg = tmp_path / "sim_tiny.py"
    cfg.write_text(
        "from tests.sim.helpers import tiny_config\n"
        "def sim_config():\n    return tiny_config(num_steps=2, policies=('libra',))\n"
    )
    args = ["simulate", str(cfg), "--no-plots", "--out", str(tmp_path / "out")]
    assert main([*args, *(x for spec in specs for x in ("--calibrate-vllm", spec))]) == 0
    out = capsys.readouterr().out
    assert "rollout factors fitted to 6 vLLM runs: compute 0.4, memory 0.7" in out
    assert "overhead 3 ms a step" in out and "held out" in out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("runs.json", "expected FILE:tp=K"),
        ("{good}:tp=2,batch=8,input=64", "missing output"),
        ("{good}:tp=2,batch=8,input=64,output=0", "'output=0' is not one of"),
        ("{good}:tp=2,bs=8,input=64,output=8", "'bs=8' is not one of"),
        ("{good}:tp=2,batch=8,input=64,output=8,tp=1", "tp is given twice"),
        ("{missing}:tp=1,batch=1,input=1,output=2", "cannot read"),
        ("{other}:tp=1,batch=1,input=1,output=2", "no positive avg_latency"),
    ],
)
def test_vllm_latency_spec_errors_name_what_is_wrong(tmp_path, spec, message):
    good, other = tmp_path / "good.json", tmp_path / "other.json"
    good.write_text(json.dumps({"avg_latency": 1.5}))
    other.write_text(json.dumps({"requests_per_second": 3.0}))
    spec = spec.format(good=good, other=other, missing=tmp_path / "none.json")
    with pytest.raises(ValueError, match=message):
        LatencyRun.parse(spec)


def test_vllm_calibration_refuses_what_it_cannot_fit(tmp_path):
    """Too few settings for the factors, a run faster than the profile's floors, and runs that
    cannot tell compute from memory are refused, naming why, instead of fitting nonsense."""
    config = tiny_config()
    truth = EfficiencyFactors(compute=0.4, memory=0.7, communication=0.5, overhead_s=0.003)
    runs = [LatencyRun.parse(spec) for spec in _write_runs(tmp_path, truth, SWEEP)]

    def fit(selected):
        return calibrate_rollout_by_vllm(config.cluster, config.model, PlannerConfig(), selected)

    with pytest.raises(ValueError, match=r"needs runs of at least 3 different settings .*, got 1"):
        fit(runs[:1])
    with pytest.raises(ValueError, match="needs runs of at least 4 different settings"):
        fit([r for r in runs if r.batch == 1][:2] + [r for r in runs if r.tp == 2][:1])
    too_fast = dataclasses.replace(runs[0], measured_s=1e-4)
    with pytest.raises(ValueError, match="below the .* profile's fixed floors"):
        fit([too_fast, *runs[1:]])
    # Runs that the fixed floors and a per-step overhead explain alone: no compute or memory time
    # is left to fit (their efficiencies would come out infinite).
    rows = latency_measurements(config.cluster, config.model, PlannerConfig(), runs)
    overhead_only = [
        dataclasses.replace(r, measured_s=m.breakdown.latency_s + 0.003 * m.breakdown.overhead_steps)
        for r, m in zip(runs, rows, strict=True)
    ]
    with pytest.raises(ValueError, match="do not separate"):
        fit(overhead_only)
