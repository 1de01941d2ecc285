"""Config validation names the field; `libra plan CONFIG` prints a plan without running anything."""

from __future__ import annotations

import pytest

from libra.backends.profiles import H200_SXM_141GB
from libra.cli import main
from libra.planner.config import ClusterSpec, ModelArch, SearchConfig, TrainingBatch, TriggerPolicy


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: ClusterSpec(2, 6, H200_SXM_141GB), "devices_per_node"),
        (lambda: ModelArch(4, 256, 8, 3, 512, 100), "num_kv_heads"),
        (lambda: TrainingBatch(global_batch=10, group_size=4), "group_size"),
        (lambda: SearchConfig(rollout_tp_sizes=(3,)), "rollout_tp_sizes"),
        (lambda: TriggerPolicy(hysteresis=1.5), "hysteresis"),
        (
            lambda: SearchConfig(split_granularity=3).granularity(ClusterSpec(1, 8, H200_SXM_141GB)),
            "split_granularity",
        ),
    ],
)
def test_bad_values_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_libra_plan_prints_the_plan(capsys):
    assert main(["plan", "configs/planner_qwen3_14b_48xa800.py"]) == 0
    out = capsys.readouterr().out
    assert "training:" in out and "rollout:" in out
    assert "predicted: T_train" in out and "TP-" in out


def test_libra_plan_rejects_a_file_without_the_function(tmp_path, capsys):
    config = tmp_path / "empty.py"
    config.write_text("x = 1\n")
    assert main(["plan", str(config)]) == 2
    assert "planning_problem" in capsys.readouterr().err
