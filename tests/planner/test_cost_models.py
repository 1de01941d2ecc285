"""Cost models against hand computations and an event-by-event 1F1B schedule."""

from __future__ import annotations

import numpy as np
import pytest

from libra.backends.profiles import A800_SXM4_80GB
from libra.planner.config import (
    QWEN3_14B,
    ClusterSpec,
    ModelArch,
    PlannerConfig,
    RequestRecord,
    TrainingBatch,
)
from libra.planner.cost_model import EfficiencyFactors, TimeBreakdown, ring_allreduce_s
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel

CLUSTER = ClusterSpec(6, 8, A800_SXM4_80GB)
UNIT = EfficiencyFactors(compute=1.0, memory=1.0, communication=1.0)


def test_param_count_from_shapes():
    # Qwen3-14B: 40 layers of (q 5120x5120, k/v 5120x1024, o 5120x5120, gated MLP 3x5120x17408),
    # untied 151936x5120 embedding and output: 14.77B as published.
    derived = ModelArch(
        num_layers=40,
        hidden_size=5120,
        num_attention_heads=40,
        num_kv_heads=8,
        ffn_hidden_size=17408,
        vocab_size=151936,
        head_dim=128,
    )
    assert derived.num_params == pytest.approx(14.77e9, rel=0.01)


def test_kv_capacity_by_hand():
    cost = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), UNIT)
    per_token = 2 * 40 * 8 * 128 * 2  # K and V, 40 layers, 8 KV heads of 128, bf16: 160 KiB
    assert cost.kv_bytes_per_token(1) == per_token
    assert cost.kv_bytes_per_token(8) == per_token / 8
    assert cost.kv_bytes_per_token(16) == per_token / 8  # KV heads replicate beyond 8-way TP
    pool = 79.3 * 2**30 * 0.9 - 14.77e9 * 2 - 2 * 2**30  # the capacity torch reports, in GiB
    assert cost.token_capacity(1) == int(pool / per_token * 0.96)
    tiny_gpu = ClusterSpec(
        1, 8, A800_SXM4_80GB.__class__(**{**A800_SXM4_80GB.__dict__, "memory_capacity_bytes": int(30e9)})
    )
    assert (
        RolloutCostModel(tiny_gpu, QWEN3_14B, PlannerConfig(), UNIT).token_capacity(1) == 0
    )  # weights do not fit


def test_router_weights_are_kv_capacity_in_units_of_the_smallest_instance_that_fits():
    """Per device, 79.3 GiB x 0.9 - 2 GiB of workspace leaves 74.5 GB; the 29.5 GB of weights
    take 29.5 / tp of it. KV per token per device falls as 1 / tp, so TP-tp holds
    tp x (74.5 - 29.5 / tp) / 44.9 times TP-1's: 1, 2.66, 5.97, 12.6."""
    cost = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), UNIT)
    assert [cost.router_weight(tp) for tp in (1, 2, 4, 8)] == [1, 3, 6, 13]
    # Where TP-1 cannot hold the weights (at 35 % of the device, 29.8 GB less 2.1 GB of workspace
    # leaves 27.6 GB, below the 29.5 GB of weights), TP-2 is the unit: TP-4 holds
    # 4 x (27.6 - 7.4) / (2 x (27.6 - 14.8)) = 3.15 times what it does.
    small = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(rollout_memory_utilization=0.35), UNIT)
    assert small.token_capacity(1) == 0
    assert [small.router_weight(tp) for tp in (1, 2, 4)] == [1, 1, 3]


def test_kv_capacity_as_the_engines_are_sized():
    """An engine sized by a memory share of its own, or by KV bytes (vLLM on the CPU), holds what
    it is sized to; training's share stays `memory_utilization`."""
    per_token = 2 * 40 * 8 * 128 * 2
    half = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(rollout_memory_utilization=0.5), UNIT)
    pool = 79.3 * 2**30 * 0.5 - 14.77e9 * 2 - 2 * 2**30
    assert half.token_capacity(1) == int(pool / per_token * 0.96)
    by_bytes = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(rollout_kv_bytes_per_device=2**30), UNIT)
    assert by_bytes.token_capacity(1) == int(2**30 / per_token * 0.96)
    assert by_bytes.token_capacity(8) == int(2**30 / (per_token / 8) * 0.96)  # each device holds its heads
    with pytest.raises(ValueError, match="rollout_memory_utilization"):
        PlannerConfig(rollout_memory_utilization=1.5)
    with pytest.raises(ValueError, match="rollout_kv_bytes_per_device"):
        PlannerConfig(rollout_kv_bytes_per_device=0)


def test_decode_step_by_hand():
    cost = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), UNIT)
    step = cost.decode_step(4, batch=32, mean_context=3000)
    kv_read = 32 * 3000 * (2 * 40 * 2 * 128 * 2)
    assert step.memory_s == pytest.approx(kv_read / 2039e9)
    # The matmuls read the weight shard while they multiply: an overlapped pair.
    ((compute, weight_read),) = step.overlapped
    assert compute == pytest.approx(2 * 14.77e9 * 32 / 4 / 312e12)
    assert weight_read == pytest.approx(14.77e9 * 2 / 4 / 2039e9)
    assert step.compute_s == 0.0
    all_reduce = 2 * 3 / 4 * (32 * 5120 * 2) / 200e9  # NVLink's 400 GB/s is 200 a direction
    assert step.communication_s == pytest.approx(2 * 40 * all_reduce)
    assert ring_allreduce_s(1e9, 1, 1e9) == 0.0


def test_tail_latency_and_fit():
    cost = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), EfficiencyFactors())
    history = (RequestRecord(1000, 2000, tool_time_s=3.0), RequestRecord(100, 10**7))
    work, latency = cost.request_costs(2, history)
    inst = cost.instance_profile(2, history)
    prefill = cost.prefill(2, 1000).seconds(cost.factors)
    assert latency[0] == pytest.approx(prefill + 2000 * inst.tail_step_s + 3.0)
    # Its work is priced at its own context (1,000 + 2,000 / 2), not at the history's mean (which
    # the ten-million-token request would blow up): an instance full of sequences like it runs
    # B = min(max batch, capacity / context) of them, and each token costs step(B) / B.
    context = 1000 + 2000 / 2
    full = min(PlannerConfig().max_decode_batch, cost.token_capacity(2) / context)
    share = cost.decode_step(2, full, context).seconds(cost.factors) / full
    assert work[0] == pytest.approx(prefill + 2000 * share)
    assert latency[1] == float("inf")  # ten million tokens fit no instance


def test_in_flight_trajectories_bound_the_batch():
    """With few trajectories decoding per device, batches are small and a token costs more."""
    cost = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), EfficiencyFactors())
    history = tuple(RequestRecord(1000, 2000, tool_time_s=30.0) for _ in range(8))
    decoding = cost.decoding_per_device(4, history, in_flight=64, rollout_devices=16)
    # The fixed point: the decoding share of 64 trajectories, given the step at their batch.
    batch = 4 * decoding
    step = cost.decode_step(4, batch, 2000).seconds(cost.factors)
    decode_s = 2000 * step
    prefill_s = cost.prefill(4, 1000).seconds(cost.factors)
    assert decoding == pytest.approx(64 * decode_s / (decode_s + 30.0 + prefill_s) / 16, rel=1e-5)
    work_free, _ = cost.request_costs(4, history)
    work_bound, _ = cost.request_costs(4, history, decoding)
    share = step / batch
    assert work_bound[0] == pytest.approx(prefill_s + 2000 * share)
    assert work_bound[0] > work_free[0]


def simulate_1f1b(stages: int, micro_batches: int, forward_s: float, backward_s: float) -> float:
    """Event-by-event 1F1B: stage s runs (stages - s - 1) warm-up forwards, then alternates one
    forward and one backward, then drains backwards; each op waits for its dependency."""
    orders = []
    for s in range(stages):
        warmup = min(stages - s - 1, micro_batches)
        order = [("F", m) for m in range(warmup)]
        f, b = warmup, 0
        while b < micro_batches:
            if f < micro_batches:
                order.append(("F", f))
                f += 1
            order.append(("B", b))
            b += 1
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                dep = (
                    (("F", s - 1, m) if s > 0 else None)
                    if kind == "F"
                    else (("B", s + 1, m) if s < stages - 1 else ("F", s, m))
                )
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done.get(dep, 0.0) if dep else 0.0)
                clock[s] = start + (forward_s if kind == "F" else backward_s)
                done[(kind, s, m)] = clock[s]
                position[s] += 1
    return max(clock)


@pytest.mark.parametrize("stages,micro_batches", [(1, 4), (2, 4), (4, 4), (4, 8), (8, 16), (2, 1)])
def test_pipeline_term_matches_1f1b_schedule(stages, micro_batches):
    layers = 8
    model = ModelArch(
        num_layers=layers,
        hidden_size=256,
        num_attention_heads=8,
        num_kv_heads=8,
        ffn_hidden_size=683,
        vocab_size=1,
        num_params=10_000_000,
    )
    batch = TrainingBatch(
        global_batch=micro_batches, group_size=1, micro_batch_sizes=(1,), recompute_logprobs=False
    )
    cost = TrainingCostModel(CLUSTER, model, batch, PlannerConfig(), UNIT)
    seqs = SequenceStats(256.0, 256.0**2, 256)
    step = cost.step(TrainingConfig(1, stages, 1, 1), seqs)
    one_stage = cost.step(TrainingConfig(1, 1, 1, 1), seqs)
    forward = (
        one_stage.compute_s / micro_batches / 3 / stages
    )  # forward of one micro-batch on one stage (output layer ~ 0)
    expected = simulate_1f1b(stages, micro_batches, forward, 2 * forward)
    assert step.compute_s == pytest.approx(expected, rel=1e-3)


def test_training_memory_shrinks_with_parallelism_and_sharding():
    batch = TrainingBatch(global_batch=128, group_size=4, recompute="full")
    cost = TrainingCostModel(CLUSTER, QWEN3_14B, batch, PlannerConfig(), UNIT)
    seqs = SequenceStats(8000.0, 8000.0**2, 16000)
    small = cost.memory_bytes(TrainingConfig(8, 2, 8, 1), seqs)
    assert small < cost.memory_bytes(TrainingConfig(4, 2, 8, 1), seqs)
    assert small < cost.memory_bytes(TrainingConfig(8, 2, 1, 1), seqs)  # optimizer sharded over DP
    # States by hand at TP8 PP2 DP8: (2 + 4) B/param + 12 B/param / 8, over 16-way model parallelism.
    params = 14.77e9 / 16
    activations = small - (6 * params + 12 * params / 8)
    assert 0 < activations < 30e9
    assert not cost.fits(TrainingConfig(1, 1, 32, 1), seqs)  # 14.8B params x 6 B do not fit 80 GB


def test_time_breakdown_is_linear_in_inverse_efficiency():
    b = TimeBreakdown(2.0, 1.0, 0.5, 1.0)
    f = EfficiencyFactors(compute=0.5, memory=0.25, communication=0.5, overhead_s=0.1)
    assert b.seconds(f) == pytest.approx(4 + 4 + 1 + 0.1)
    assert (b + b).seconds(f) == pytest.approx(2 * b.seconds(f))


def _without_latency(cluster: ClusterSpec) -> ClusterSpec:
    profile = cluster.profile.__class__(**{**cluster.profile.__dict__, "allreduce_latency_s": 0.0})
    return ClusterSpec(cluster.num_nodes, cluster.devices_per_node, profile)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_decode_and_prefill_pay_two_all_reduce_latencies_per_layer(tp):
    factors = EfficiencyFactors(compute=0.5, memory=0.8, communication=0.6, overhead_s=1e-4)
    with_floor = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), factors)
    without = RolloutCostModel(_without_latency(CLUSTER), QWEN3_14B, PlannerConfig(), factors)
    # 40 layers x (attention + MLP output) x 20 us on A800; nothing at TP 1 (no collective);
    # not scaled by the communication efficiency (a measured floor, not a share of a peak).
    expected = 2 * 40 * 20e-6 if tp > 1 else 0.0
    for batch, context in ((1, 100), (64, 4000)):
        added = with_floor.decode_step(tp, batch, context).seconds(factors) - without.decode_step(
            tp, batch, context
        ).seconds(factors)
        assert added == pytest.approx(expected, abs=1e-12)
    base_with = with_floor.decode_terms(tp).fixed_s
    base_without = without.decode_terms(tp).fixed_s
    assert base_with - base_without == pytest.approx(expected, abs=1e-12)  # the floor is per step
    prefill = with_floor.prefill(tp, 10_000)
    assert prefill.latency_s == pytest.approx(expected + 2e-3)  # and the engine's 2 ms a pass
    # Bytes of the prefill's all-reduces: 10k tokens x 5120 x bf16, ring 2 (tp-1)/tp, twice a layer.
    ring = 2 * (tp - 1) / tp * 10_000 * 5120 * 2 / 200e9
    assert prefill.communication_s == pytest.approx(2 * 40 * ring)
    assert with_floor.prefill_seconds(tp, np.array([10_000.0]))[0] == pytest.approx(prefill.seconds(factors))


def test_latency_floor_favours_small_tp_on_light_batches_only():
    """Per device, a TP-k instance of B sequences makes B / (k step) tokens per second. At one
    sequence per device the floor narrows TP-8's lead over TP-2 (fewer weight bytes per device
    against 80 more latencies per step); at full batches it does not matter."""
    cost = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), EfficiencyFactors())
    flat = RolloutCostModel(_without_latency(CLUSTER), QWEN3_14B, PlannerConfig(), EfficiencyFactors())

    def per_device_rate(model: RolloutCostModel, tp: int, per_device: float) -> float:
        batch = tp * per_device
        return batch / (tp * model.decode_step(tp, batch, 4000).seconds(model.factors))

    light_ratio = per_device_rate(cost, 8, 1) / per_device_rate(cost, 2, 1)
    light_ratio_flat = per_device_rate(flat, 8, 1) / per_device_rate(flat, 2, 1)
    assert light_ratio < light_ratio_flat
    heavy = per_device_rate(cost, 8, 32) / per_device_rate(flat, 8, 32)
    assert heavy > 0.9  # the floor (1.6 ms at TP-8) is a few percent of a full batch's step


def test_training_step_pays_tp_latency_per_layer_pass():
    batch = TrainingBatch(global_batch=64, group_size=4, recompute="full")
    seqs = SequenceStats(4000.0, 4000.0**2, 8000)
    cfg = TrainingConfig(tp=4, pp=2, dp=2, micro_batch=1)
    with_floor = TrainingCostModel(CLUSTER, QWEN3_14B, batch, PlannerConfig(), EfficiencyFactors())
    without = TrainingCostModel(
        _without_latency(CLUSTER), QWEN3_14B, batch, PlannerConfig(), EfficiencyFactors()
    )
    slots = 64 // (2 * 1) + 2 - 1
    # Per slot: forward, log-prob recompute forward and backward, 2 all-reduces per layer of the
    # stage's 20 layers each.
    expected = slots * 3 * 2 * 20 * 20e-6
    assert with_floor.step_s(cfg, seqs) - without.step_s(cfg, seqs) == pytest.approx(expected)
    single = TrainingConfig(tp=1, pp=2, dp=8, micro_batch=1)
    assert with_floor.step_s(single, seqs) == without.step_s(single, seqs)


def test_time_breakdown_latency_adds_unscaled():
    b = TimeBreakdown(1.0, 1.0, 1.0, 1.0, latency_s=0.25)
    assert b.seconds(EfficiencyFactors(0.5, 0.5, 0.5, 0.1)) == pytest.approx(6.1 + 0.25)
    assert (b + b).latency_s == 0.5 and b.scaled(3).latency_s == 0.75
    # Calibration's columns exclude the floor.
    assert list(b.features(EfficiencyFactors())) == [1.0, 1.0, 1.0, 1.0]


def test_an_overlapped_pair_takes_the_longer_side_and_sums_per_operation():
    f = EfficiencyFactors(compute=0.5, memory=0.25, communication=1.0)
    memory_bound = TimeBreakdown(memory_s=1.0, overlapped=((1.0, 1.0),))  # 2 s of compute, 4 of reads
    compute_bound = TimeBreakdown(overlapped=((3.0, 1.0),))  # 6 s against 4
    assert memory_bound.seconds(f) == pytest.approx(4 + 4)
    assert compute_bound.seconds(f) == pytest.approx(6)
    both = memory_bound + compute_bound
    assert both.seconds(f) == pytest.approx(14)  # each operation's own maximum, not the sum's
    assert memory_bound.scaled(3).seconds(f) == pytest.approx(24)
    # A calibration row counts each pair on the side that binds under the factors given.
    assert list(both.features(f)) == [3.0, 2.0, 0.0, 0.0]
    assert list(both.features(EfficiencyFactors(compute=0.1, memory=1.0))) == [4.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_decode_terms_are_the_decode_step_on_both_sides_of_the_ridge(tp):
    factors = EfficiencyFactors(compute=0.45, memory=0.8, communication=0.6, overhead_s=1e-4)
    cost = RolloutCostModel(CLUSTER, QWEN3_14B, PlannerConfig(), factors)
    terms = cost.decode_terms(tp)
    # A800 at these efficiencies: 312 T x 0.45 / (2.04 T x 0.8) ~ 86 tokens a pass.
    assert 70 < terms.ridge_tokens < 100
    for batch in (1, 16, 64, 128, 256):
        for context in (100.0, 4000.0):
            expected = cost.decode_step(tp, batch, context).seconds(factors)
            assert terms.step_s(batch, batch * context) == pytest.approx(expected, rel=1e-9)
    # Below the ridge, more sequences cost only their KV and all-reduce bytes; above it, the
    # matmuls' compute too.
    light = terms.step_s(32, 0.0) - terms.step_s(31, 0.0)
    heavy = terms.step_s(200, 0.0) - terms.step_s(199, 0.0)
    assert light == pytest.approx(terms.per_sequence_s)
    assert heavy == pytest.approx(terms.per_sequence_s + terms.gemm_per_token_s)
    # Prefill tokens riding in a light step share its weight read.
    assert terms.step_s(8, 0.0, prefill_tokens=40) == pytest.approx(terms.step_s(8, 0.0))
