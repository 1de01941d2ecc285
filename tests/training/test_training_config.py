"""The training section's options for Megatron's path: defaults and errors that name the field."""

from __future__ import annotations

import pytest

from libra.config import load_config
from libra.planner.config import TrainingBatch
from libra.training.config import TrainingConfig


def test_defaults_are_megatrons_production_path():
    cfg = TrainingConfig()
    assert cfg.use_distributed_optimizer and cfg.recompute == "none" and not cfg.overlap_grad_reduce


def test_bad_recompute_names_the_field_and_the_choices():
    with pytest.raises(
        ValueError, match=r"training.recompute must be one of \('none', 'selective', 'full'\)"
    ):
        TrainingConfig(recompute="partial")
    with pytest.raises(ValueError, match="batch.recompute"):
        TrainingBatch(recompute="layers")


def test_overrides_reach_the_training_section():
    config = load_config(
        None,
        [
            "training.use_distributed_optimizer=false",
            "training.overlap_grad_reduce=true",
            "training.recompute=full",
        ],
    )
    assert not config.training.use_distributed_optimizer
    assert config.training.overlap_grad_reduce and config.training.recompute == "full"
    with pytest.raises(ValueError, match="training.recompute"):
        load_config(None, ["training.recompute=sometimes"])
