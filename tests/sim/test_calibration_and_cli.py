import pytest

from libra.cli import main
from libra.planner.config import PlannerConfig, TrainingBatch
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel
from libra.sim.calibration import DecodeSample, TrainSample, calibrate
from tests.sim.helpers import tiny_config


def test_calibration_recovers_known_factors():
    """Measurements made by a cost model with known factors are fitted back to those factors."""
    config = tiny_config()
    truth = EfficiencyFactors(compute=0.3, memory=0.6, communication=0.7, overhead_s=0.002)
    rollout = RolloutCostModel(config.cluster, config.model, PlannerConfig(), truth)
    batch = TrainingBatch(global_batch=16, group_size=4)
    train = TrainingCostModel(config.cluster, config.model, batch, PlannerConfig(), truth)
    decode = [
        DecodeSample(1, b, b * ctx, rollout.decode_step(1, b, ctx).seconds(truth))
        for b in (1, 4, 16, 64)
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
