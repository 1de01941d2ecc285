"""Bucket thresholds fitted to capacity: each bucket's band of remaining tokens carries its share
of the pool's decode throughput, checked against a brute-force count of the work."""

from __future__ import annotations

import numpy as np
import pytest

from libra.backends.profiles import A800_SXM4_80GB
from libra.planner.config import QWEN3_14B, ClusterSpec, PlannerConfig, RequestRecord
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.routing_thresholds import MAX_THRESHOLD, capacity_thresholds
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS

COST = RolloutCostModel(
    ClusterSpec(6, 8, A800_SXM4_80GB), QWEN3_14B, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS
)


def _history(seed: int = 0, n: int = 300) -> tuple[RequestRecord, ...]:
    rng = np.random.default_rng(seed)
    outputs = np.clip(rng.lognormal(np.log(3000), 1.0, n), 50, 30000).astype(int)
    return tuple(RequestRecord(2000, int(t), tool_time_s=5.0) for t in outputs)


def _work_at_or_below(history, x: int) -> int:
    """Tokens generated while at most x remained, counted token by token."""
    return sum(sum(1 for remaining in range(1, r.output_tokens + 1) if remaining <= x) for r in history)


def test_with_demotion_each_band_of_remaining_tokens_carries_its_buckets_share():
    history = _history()
    buckets = [(1, 8), (2, 4), (4, 2)]
    thresholds = capacity_thresholds(COST, buckets, history, demote=True)
    assert thresholds[-1] == MAX_THRESHOLD and list(thresholds) == sorted(set(thresholds))
    capacity = [n * COST.instance_profile(tp, history).throughput_tokens_per_s for tp, n in buckets]
    total_work = sum(r.output_tokens for r in history)
    for j, x in enumerate(thresholds[:-1]):
        share = sum(capacity[: j + 1]) / sum(capacity)
        assert _work_at_or_below(history, x) / total_work == pytest.approx(share, abs=2e-3)


def test_more_small_instances_raise_the_small_buckets_threshold():
    history = _history(1)
    few = capacity_thresholds(COST, [(1, 2), (4, 4)], history, demote=True)[0]
    many = capacity_thresholds(COST, [(1, 16), (4, 4)], history, demote=True)[0]
    assert many > few
    # A bucket without instances takes no band: its threshold sits just above the one below.
    empty = capacity_thresholds(COST, [(1, 4), (2, 0), (4, 2)], history, demote=True)
    assert empty[1] == empty[0] + 1


def test_the_originals_thresholds_are_far_from_capacity_on_the_fixed_pattern():
    """The fixed pattern (TP 1, 1, 2, 4 per node): the TP-1 bucket holds about a sixth of the
    throughput, so its band must be well below the original's 4,000 tokens, under which most of
    the work of a long-tailed workload falls."""
    history = _history(2)
    thresholds = capacity_thresholds(COST, [(1, 4), (2, 2), (4, 2)], history, demote=True)
    total = sum(r.output_tokens for r in history)
    assert _work_at_or_below(history, 4000) / total > 0.5
    assert thresholds[0] < 4000


def test_without_demotion_each_band_of_lengths_carries_its_share_priced_at_its_own_contexts():
    """A bucket holds the trajectories of its band of total lengths; its capacity is its
    instances' throughput at those trajectories' contexts (fewer long ones fit a KV pool)."""
    history = _history(3)
    buckets = [(1, 8), (2, 4), (4, 2)]
    thresholds = capacity_thresholds(COST, buckets, history, demote=False)
    lows = (0, *thresholds[:-1])
    bands = [
        [r for r in history if lo < r.output_tokens <= hi] for lo, hi in zip(lows, thresholds, strict=True)
    ]
    capacity = [
        n * COST.instance_profile(tp, tuple(b)).throughput_tokens_per_s
        for (tp, n), b in zip(buckets, bands, strict=True)
    ]
    total = sum(r.output_tokens for r in history)
    largest = max(r.output_tokens for r in history)
    for j in range(len(buckets) - 1):
        share = sum(capacity[: j + 1]) / sum(capacity)
        work = sum(r.output_tokens for r in bands[j]) + sum(
            sum(r.output_tokens for r in b) for b in bands[:j]
        )
        # Lengths are discrete: the band may overshoot its share by at most one trajectory.
        assert share <= work / total <= share + largest / total
    # Priced at the whole history instead, the long band would look as fast as the short one.
    whole = [n * COST.instance_profile(tp, history).throughput_tokens_per_s for tp, n in buckets]
    assert capacity[-1] / capacity[0] < whole[-1] / whole[0]


@pytest.mark.parametrize(
    ("buckets", "history", "message"),
    [
        ([], (RequestRecord(10, 10),), "at least one bucket"),
        ([(2, 1), (1, 1)], (RequestRecord(10, 10),), "ascending"),
        ([(1, 0)], (RequestRecord(10, 10),), "need instances"),
        ([(1, 1)], (), "generated tokens"),
    ],
)
def test_bad_input_is_named(buckets, history, message):
    with pytest.raises(ValueError, match=message):
        capacity_thresholds(COST, buckets, history, demote=True)
