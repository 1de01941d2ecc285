"""Bucket speeds from the rollout cost model (`libra.planner.routing_speeds`): the router's linear
step and move cost reproduce the cost model's decode step and prefill time."""

from __future__ import annotations

import numpy as np
import pytest

from libra.backends.profiles import A800_SXM4_80GB
from libra.planner.config import QWEN3_14B, ClusterSpec, PlannerConfig, RequestRecord
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_speeds import bucket_speed, with_speeds
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS
from libra.scheduler import BucketConfig

COST = RolloutCostModel(
    ClusterSpec(6, 8, A800_SXM4_80GB), QWEN3_14B, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS
)
HISTORY = (RequestRecord(6000, 2000), RequestRecord(10000, 6000))
"""Mean decoding context: (6,000 + 1,000 + 10,000 + 3,000) / 2 = 10,000 tokens."""


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_step_is_the_cost_models_at_the_histories_context(tp: int) -> None:
    speed = bucket_speed(COST, tp, HISTORY)
    for batch in (1, 8, 64):
        expected = COST.decode_step(tp, batch, 10_000.0).seconds(COST.factors)
        assert speed.step_s + speed.per_sequence_s * batch == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("tp", [1, 4])
def test_the_move_costs_the_re_prefill_of_the_context(tp: int) -> None:
    speed = bucket_speed(COST, tp, HISTORY)
    for context in (500.0, 8_000.0, 30_000.0):
        expected = float(
            COST.prefill_seconds(tp, np.float64(context)) - COST.prefill_seconds(tp, np.float64(0))
        )
        moved = speed.move_linear_s * context + speed.move_quadratic_s * context**2
        assert moved == pytest.approx(expected, rel=1e-6)
    # A larger TP size decodes a lone trajectory faster (the published engines' ordering).
    assert bucket_speed(COST, 4, HISTORY).step_s + bucket_speed(COST, 4, HISTORY).per_sequence_s < (
        bucket_speed(COST, 1, HISTORY).step_s + bucket_speed(COST, 1, HISTORY).per_sequence_s
    )


def test_a_kv_transfer_prices_the_move_as_free() -> None:
    speed = bucket_speed(COST, 2, HISTORY, kv_transfer=True)
    assert (speed.move_linear_s, speed.move_quadratic_s) == (0.0, 0.0)
    assert speed.step_s == bucket_speed(COST, 2, HISTORY).step_s


def test_with_speeds_prices_each_bucket_at_its_tp_size() -> None:
    buckets = (BucketConfig("tp1", 1, 4000), BucketConfig("tp4", 4, 2**31 - 1))
    priced = with_speeds(buckets, COST, HISTORY)
    assert [b.speed for b in priced] == [bucket_speed(COST, 1, HISTORY), bucket_speed(COST, 4, HISTORY)]
    assert [(b.name, b.tp_size, b.max_remaining_tokens) for b in priced] == [
        ("tp1", 1, 4000),
        ("tp4", 4, 2**31 - 1),
    ]


def test_an_empty_history_is_refused() -> None:
    with pytest.raises(ValueError, match="history"):
        bucket_speed(COST, 1, ())
