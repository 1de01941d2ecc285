"""C-MLFQ's bucket thresholds fitted to the buckets' capacity.

The router sends a trajectory to the smallest bucket whose threshold is at least its predicted
remaining output tokens. Thresholds chosen without the buckets' sizes (the original's 4k / 12k /
30k for TP-1 / 2 / 4) can pour most of the decode work into a bucket that holds a small share of
the devices: its instances sit at their caps with full KV while the large ones idle. Here each
bucket takes the band of tokens whose decode work matches its share of the rollout pool's decode
throughput, from the finished trajectories the planner plans from:

- With demotion (`CmlfqConfig.demote`), a trajectory of T output tokens generates them at
  remaining counts T, T-1, ..., 1, each in the bucket of its current count: the work at counts up
  to x is W(x) = sum over trajectories of min(T, x).
- Without it, a trajectory stays in the largest bucket it was sent to, the one of its whole
  length (its first prediction after admission): W(x) = sum of T over trajectories with T <= x.
  A bucket then holds the trajectories of one band of lengths, and its throughput is priced at
  their contexts (a band of long trajectories fills a KV pool with fewer of them), which moves the
  thresholds: they are fitted again until they settle.

Bucket j of the ascending buckets gets the threshold x_j with W(x_j) / W(inf) = (capacity of
buckets 0..j) / (total capacity), the last bucket everything above. A bucket's capacity is its
instances' decode throughput at the steady batch (`RolloutCostModel.instance_profile`), so a TP-4
instance counts what it decodes, not four TP-1 instances' worth.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from libra.planner.config import RequestRecord
from libra.planner.rollout_cost import RolloutCostModel

MAX_THRESHOLD = 2**31 - 1
"""The last bucket's threshold (token counts are int32 in the router's core)."""


def capacity_thresholds(
    cost: RolloutCostModel,
    buckets: Sequence[tuple[int, int]],
    history: Sequence[RequestRecord],
    demote: bool,
) -> tuple[int, ...]:
    """Thresholds for `buckets`, (TP size, number of instances) in ascending TP order, strictly
    increasing, the last one `MAX_THRESHOLD`."""
    if not buckets:
        raise ValueError("capacity thresholds need at least one bucket")
    tps = [tp for tp, _ in buckets]
    if tps != sorted(set(tps)):
        raise ValueError(f"buckets must have distinct TP sizes in ascending order, got {tps}")
    if any(n < 0 for _, n in buckets) or not any(n for _, n in buckets):
        raise ValueError(f"buckets need instances (and no negative counts), got {list(buckets)}")
    outputs = np.sort(np.array([r.output_tokens for r in history], dtype=float))
    if outputs.size == 0:
        raise ValueError("capacity thresholds need a history of trajectories with generated tokens")
    history = tuple(history)
    bands = [history] * len(buckets)
    thresholds: tuple[int, ...] = ()
    for _ in range(_REFINEMENTS):
        capacity = np.array(
            [
                n * cost.instance_profile(tp, band).throughput_tokens_per_s if n and band else 0.0
                for (tp, n), band in zip(buckets, bands, strict=True)
            ]
        )
        if not np.isfinite(capacity).all() or capacity.sum() <= 0:
            raise ValueError(f"no bucket of {tps} holds the history's contexts")
        previous, thresholds = thresholds, _thresholds(outputs, capacity, demote)
        if demote or thresholds == previous:
            break
        # Without demotion a bucket holds the trajectories of its band of lengths: price it at them.
        lows = (0, *thresholds[:-1])
        bands = [
            tuple(r for r in history if lo < r.output_tokens <= hi)
            for lo, hi in zip(lows, thresholds, strict=True)
        ]
    return thresholds


_REFINEMENTS = 8
"""Fixed-point rounds of thresholds and the bands' throughput (it settles in two to four)."""


def _thresholds(sorted_outputs: np.ndarray, capacity: np.ndarray, demote: bool) -> tuple[int, ...]:
    shares = np.cumsum(capacity)[:-1] / capacity.sum()
    total = float(sorted_outputs.sum())
    thresholds: list[int] = []
    for share in shares:
        work = share * total
        x = _work_quantile(sorted_outputs, work) if demote else _length_quantile(sorted_outputs, work)
        thresholds.append(max(int(round(x)), thresholds[-1] + 1 if thresholds else 1))
    return (*thresholds, MAX_THRESHOLD)


def _work_quantile(sorted_outputs: np.ndarray, work: float) -> float:
    """The x with W(x) = sum(min(T, x)) = `work` (W is piecewise linear and increasing)."""
    n = sorted_outputs.size
    # Below the k-th smallest output, W(x) = (sum of the k smaller outputs) + (n - k) x.
    below = np.concatenate(([0.0], np.cumsum(sorted_outputs)))
    for k in range(n):
        upper = sorted_outputs[k]
        if below[k] + (n - k) * upper >= work:
            return (work - below[k]) / (n - k)
    return float(sorted_outputs[-1])


def _length_quantile(sorted_outputs: np.ndarray, work: float) -> float:
    """The smallest output length x with sum(T for T <= x) >= `work`: without demotion a
    trajectory spends its whole work in the bucket its total length maps to."""
    below = np.cumsum(sorted_outputs)
    return float(sorted_outputs[min(int(np.searchsorted(below, work)), sorted_outputs.size - 1)])
