"""The speed of each router bucket's instances, priced by the rollout cost model, so that C-MLFQ
promotes a trajectory only when the move pays (`libra.scheduler.BucketSpeed`).

A decode step of a TP-tp instance with n sequences holding K KV tokens takes
fixed + b n + c K + max(weight read, matmul compute of n) (`RolloutCostModel.decode_terms`). The
router's speed is linear in n, so it is priced below the ridge, where the weight read binds
(`DecodeTerms.ridge_tokens`, ~100 sequences decoding at once on an A800; an agentic instance
decodes fewer, its other trajectories waiting in tools): step_s = fixed + weight read. The router
knows each instance's live trajectories, not their contexts, so K is priced at the history's mean
decoding context, prompt plus half the output, as `RolloutCostModel.instance_profile` does:
per_sequence_s = b + c x context.
A move re-prefills the trajectory's context on the target, priced by the cost model's prefill
(`RolloutCostModel.prefill_coefficients`, without the floor a step pays anyway).
Where the KV is transferred instead (started when the tool returns, finished within the tool call
in all but the longest contexts), the move is priced as free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from libra.planner.config import RequestRecord
from libra.planner.rollout_cost import RolloutCostModel, mean_decoding_context
from libra.scheduler.config import BucketConfig, BucketSpeed


def bucket_speed(
    cost: RolloutCostModel, tp: int, history: Sequence[RequestRecord], kv_transfer: bool = False
) -> BucketSpeed:
    """The speed of one TP-tp instance on a workload like `history`."""
    if not history:
        raise ValueError("bucket speeds need a history of finished trajectories")
    terms = cost.decode_terms(tp)
    context = mean_decoding_context(history)
    # Rounding in the recovery can leave a coefficient a hair below zero.
    linear, quadratic = (0.0, 0.0) if kv_transfer else (max(0.0, c) for c in cost.prefill_coefficients(tp))
    return BucketSpeed(
        terms.fixed_s + terms.weight_read_s,
        terms.per_sequence_s + terms.per_kv_token_s * context,
        linear,
        quadratic,
    )


def with_speeds(
    buckets: Sequence[BucketConfig],
    cost: RolloutCostModel,
    history: Sequence[RequestRecord],
    kv_transfer: bool = False,
) -> tuple[BucketConfig, ...]:
    """`buckets` with each one's speed (`bucket_speed` at its TP size)."""
    return tuple(replace(b, speed=bucket_speed(cost, b.tp_size, history, kv_transfer)) for b in buckets)
