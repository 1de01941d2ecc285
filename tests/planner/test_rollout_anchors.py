"""The rollout cost model held against what real engines publish (`reference/rollout-anchors.md`).

Each anchor is a measured decode step (or KV capacity) of a public model on a datasheet GPU; the
model, with the hardware profiles and the default rollout factors the planner and the simulator
use, must land within the stated tolerance. What it gets wrong on purpose is asserted as such
(the direction and the size of the error), so that a change that makes it worse fails here.
"""

from __future__ import annotations

import dataclasses

import pytest

from libra.backends.profiles import A800_SXM4_80GB, ASCEND_910B, H100_SXM_80GB, H200_SXM_141GB
from libra.planner.config import ClusterSpec, ModelArch, PlannerConfig
from libra.planner.cost_model import ring_allreduce_s
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.search import DEFAULT_ROLLOUT_FACTORS

LLAMA2_13B = ModelArch(40, 5120, 40, 40, 13824, 32000)
INTERNLM_20B = ModelArch(60, 5120, 40, 40, 13824, 103168)
LLAMA2_70B = ModelArch(80, 8192, 64, 8, 28672, 32000)
CODELLAMA_34B = ModelArch(48, 8192, 64, 8, 22016, 32000)
LLAMA31_8B = ModelArch(32, 4096, 32, 8, 14336, 128256)
QWEN3_14B = ModelArch(40, 5120, 40, 8, 17408, 151936, head_dim=128)

# The A100 80GB SXM4 is the A800's silicon with NVLink at 600 GB/s (300 a direction).
A100_SXM4_80GB = dataclasses.replace(
    A800_SXM4_80GB, name="NVIDIA A100-SXM4-80GB", intra_node_bandwidth_bytes_per_s=300e9
)


def decode_ms(model: ModelArch, profile, tp: int, batch: int, context: float) -> float:
    cost = RolloutCostModel(ClusterSpec(1, 8, profile), model, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS)
    return cost.decode_step(tp, batch, context).seconds(DEFAULT_ROLLOUT_FACTORS) * 1e3


# (case, model, profile, TP, batch, measured ms a step, source). Contexts are short (256 tokens).
ANCHORS = [
    ("Llama-2-13B TP-1 b1", LLAMA2_13B, A100_SXM4_80GB, 1, 1, 17.4, "lmdeploy a100_fp16 benchmark"),
    ("Llama-2-13B TP-1 b16", LLAMA2_13B, A100_SXM4_80GB, 1, 16, 18.4, "lmdeploy a100_fp16 benchmark"),
    ("Llama-2-13B TP-1 b64", LLAMA2_13B, A100_SXM4_80GB, 1, 64, 21.0, "lmdeploy a100_fp16 benchmark"),
    ("InternLM-20B TP-2 b1", INTERNLM_20B, A100_SXM4_80GB, 2, 1, 16.4, "lmdeploy a100_fp16 benchmark"),
    ("Llama-2-70B TP-4 b1", LLAMA2_70B, A100_SXM4_80GB, 4, 1, 29.5, "lmdeploy a100_fp16 benchmark"),
    ("CodeLlama-34B TP-1 b1", CODELLAMA_34B, A100_SXM4_80GB, 1, 1, 46.8, "TGI 1.2, TGI issue 1315"),
    ("CodeLlama-34B TP-2 b1", CODELLAMA_34B, A100_SXM4_80GB, 2, 1, 29.4, "TGI 1.2, TGI issue 1315"),
    ("Llama-3.1-8B TP-8 b1", LLAMA31_8B, H100_SXM_80GB, 8, 1, 2.25, "SGLang, sglang PR 3124"),
]


@pytest.mark.parametrize("case", ANCHORS, ids=[a[0] for a in ANCHORS])
def test_decode_step_within_30_percent_of_published_engines(case):
    """Each published step within 0.75-1.3x of the model's. (Before the engine's step overhead,
    the all-reduce floor at decode sizes and one-direction link bandwidth were modelled, TP-2 /
    TP-4 / TP-8 ran at 1.29-1.44x / 1.38x / 2.2x of the model.)"""
    _, model, profile, tp, batch, measured, _ = case
    ratio = measured / decode_ms(model, profile, tp, batch, 256)
    assert 0.75 <= ratio <= 1.3, f"measured / model = {ratio:.2f}"


def test_matmul_compute_hides_under_the_weight_read_below_the_ridge():
    """Llama-2-13B on an A100 goes from 17.4 ms a step at batch 1 to 21.0 ms at batch 64
    (lmdeploy): its matmuls' 2 x 13 G x 64 FLOPs (9.7 ms at the rollout compute efficiency) run
    while the weights stream in. A model that added them to the weight read said 26.7 ms at batch
    64 (1.27x); one that overlaps them must stay under 1.2x of the measured growth plus its KV."""
    growth = decode_ms(LLAMA2_13B, A100_SXM4_80GB, 1, 64, 256) - decode_ms(
        LLAMA2_13B, A100_SXM4_80GB, 1, 1, 256
    )
    cost = RolloutCostModel(
        ClusterSpec(1, 8, A100_SXM4_80GB), LLAMA2_13B, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS
    )
    kv_ms = cost.decode_terms(1).per_kv_token_s * 63 * 256 * 1e3
    assert growth == pytest.approx(kv_ms, rel=1e-6)  # the batch's KV read, no matmul time
    assert growth <= 1.2 * (21.0 - 17.4) + kv_ms


@pytest.mark.parametrize("profile", [A800_SXM4_80GB, H100_SXM_80GB, H200_SXM_141GB, ASCEND_910B])
def test_single_stream_tp_speedups_stay_inside_the_published_range(profile):
    """One sequence of Qwen3-14B at 4k context: the step at TP-1 over the step at TP-k. Published
    engines give about 1.5-1.7x / 2.2-2.6x / 2.5-3.3x at TP-2 / 4 / 8 (CodeLlama-34B on TGI,
    Llama-2-13B / -70B on lmdeploy, Llama-3.1-8B on SGLang); the model, without the engine's
    step overhead, said 1.86x / 3.5x / 6.2x. Bounds: the published range widened by 0.1 for TP-2
    and TP-4, and to 3.6x at TP-8 (the H100 rows sit at its top: their weight read is the
    smallest share of a step)."""
    tp1 = decode_ms(QWEN3_14B, profile, 1, 1, 4096)
    speedups = {tp: tp1 / decode_ms(QWEN3_14B, profile, tp, 1, 4096) for tp in (2, 4, 8)}
    assert 1.4 <= speedups[2] <= 1.8, speedups
    assert 2.1 <= speedups[4] <= 2.7, speedups
    assert 2.4 <= speedups[8] <= 3.6, speedups
    assert speedups[2] < speedups[4] < speedups[8]


def test_kv_capacity_counts_the_memory_torch_reports():
    """Qwen3-14B at TP-1 on an 80 GB part: 0.9 x 79.3 GiB - 29.5 GB of weights - 2 GiB of
    workspace, at 160 KiB a token, less 4 % fragmentation: about 263k tokens (vLLM reports
    about 270k; the decimal-GB profile said 236k)."""
    cost = RolloutCostModel(
        ClusterSpec(1, 8, A800_SXM4_80GB), QWEN3_14B, PlannerConfig(), DEFAULT_ROLLOUT_FACTORS
    )
    assert 255_000 <= cost.token_capacity(1) <= 280_000


def test_all_reduce_bus_bandwidth_matches_nccl_tests():
    """A large all-reduce over 8 A100s: nccl-tests measures a bus bandwidth of 200-230 GB/s. The
    model's ring over one direction of the links (300 GB/s) at its communication efficiency must
    land there (it said 420 GB/s when it used both directions)."""
    size, group = 1e9, 8
    seconds = ring_allreduce_s(size, group, A100_SXM4_80GB.intra_node_bandwidth_bytes_per_s)
    seconds /= DEFAULT_ROLLOUT_FACTORS.communication
    bus_bandwidth = 2 * (group - 1) / group * size / seconds
    assert 190e9 <= bus_bandwidth <= 240e9, bus_bandwidth / 1e9
