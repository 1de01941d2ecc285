"""Measured times of real training steps and decoding on this project's CPU machines, as cost-model
measurements for calibration (`libra plan --calibrate-cpu`, tests, the benchmark).

Sources (2 cores, AVX-512): Megatron-core steps from `reference/megatron-cpu.md` §6 (10.58M-param
GPT: hidden 256, 8 layers, 8 heads, vocab 8192, LayerNorm + GELU MLP, seq 256, global batch 8,
fp32, Megatron DDP + Adam, one thread per rank); vLLM decoding from `reference/vllm-cpu.md` §4
(32 prompts x 64 new tokens, eager, in-process, bf16). A CPU slot is one core (training) or both
cores (vLLM's OMP_NUM_THREADS=2 rows), with the cpu backend's figures per core.
"""

from __future__ import annotations

from libra.backends.base import HardwareProfile
from libra.planner.calibration import Measurement
from libra.planner.config import ClusterSpec, ModelArch, PlannerConfig, RequestRecord, TrainingBatch
from libra.planner.cost_model import EfficiencyFactors
from libra.planner.rollout_cost import RolloutCostModel
from libra.planner.training_cost import SequenceStats, TrainingConfig, TrainingCostModel

_FLOPS_PER_CORE = 40e9  # the cpu backend's per-core figures (libra/backends/cpu.py)
_BANDWIDTH_PER_CORE = 10e9
_GLOO_BANDWIDTH = 2e9


def cpu_profile(cores: int) -> HardwareProfile:
    return HardwareProfile(
        name=f"cpu-slot ({cores} cores)",
        peak_bf16_flops=_FLOPS_PER_CORE * cores,
        memory_bandwidth_bytes_per_s=_BANDWIDTH_PER_CORE * cores,
        memory_capacity_bytes=int(12e9),
        intra_node_bandwidth_bytes_per_s=_GLOO_BANDWIDTH,
        inter_node_bandwidth_bytes_per_s=_GLOO_BANDWIDTH,
        devices_per_node=2,
    )


# Non-gated GELU MLP of width 4h has 8h^2 weights, i.e. a gated one of width 8h/3.
MEGATRON_10M = ModelArch(
    num_layers=8,
    hidden_size=256,
    num_attention_heads=8,
    num_kv_heads=8,
    ffn_hidden_size=683,
    vocab_size=8192,
    num_params=10_580_000,
    bytes_per_param=4,
)

# (label, TP, PP, DP, micro-batch, measured step seconds) -- medians of two repetitions each.
MEGATRON_STEPS = (
    ("TP1", 1, 1, 1, 8, 1.91),
    ("TP1", 1, 1, 1, 8, 2.07),
    ("TP2", 2, 1, 1, 8, 1.19),
    ("TP2", 2, 1, 1, 8, 1.25),
    ("PP2", 1, 2, 1, 2, 1.29),
    ("DP2", 1, 1, 2, 4, 0.99),
    ("DP2", 1, 1, 2, 4, 1.03),
)

VLLM_MODELS = {
    "tiny": ModelArch(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=256,
        vocab_size=2048,
        num_params=820_000,
    ),
    "small": ModelArch(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=1408,
        vocab_size=2048,
        num_params=25_700_000,
    ),
    "mid": ModelArch(
        num_layers=16,
        hidden_size=1024,
        num_attention_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=2816,
        vocab_size=2048,
        num_params=193_000_000,
    ),
}
# (model, generated tokens/s at batch 32, in-process, 2 threads)
VLLM_DECODE = (("tiny", 9000.0), ("tiny", 11500.0), ("small", 2300.0), ("mid", 451.0), ("mid", 461.0))
_VLLM_BATCH, _VLLM_PROMPT, _VLLM_NEW_TOKENS = 32, 16, 64


def megatron_measurements() -> list[Measurement]:
    sequences = SequenceStats(mean=256.0, mean_square=256.0**2, max=256)
    batch = TrainingBatch(
        global_batch=8,
        group_size=1,
        micro_batch_sizes=(1, 2, 4, 8),
        distributed_optimizer=False,
        recompute_logprobs=False,
    )
    cluster = ClusterSpec(1, 2, cpu_profile(1))
    cost = TrainingCostModel(cluster, MEGATRON_10M, batch, PlannerConfig(), EfficiencyFactors())
    return [
        Measurement(cost.step(TrainingConfig(tp, pp, dp, mb), sequences), seconds, label, group=label)
        for label, tp, pp, dp, mb, seconds in MEGATRON_STEPS
    ]


def vllm_decode_measurements() -> list[Measurement]:
    """One decode step at batch 32 and the mean context of the run, per measurement."""
    cluster = ClusterSpec(1, 2, cpu_profile(2))
    mean_context = _VLLM_PROMPT + _VLLM_NEW_TOKENS / 2
    result = []
    for name, tokens_per_s in VLLM_DECODE:
        cost = RolloutCostModel(
            cluster, VLLM_MODELS[name], PlannerConfig(activation_workspace_bytes=0), EfficiencyFactors()
        )
        step = cost.decode_step(1, _VLLM_BATCH, mean_context)
        result.append(Measurement(step, _VLLM_BATCH / tokens_per_s, f"vllm-{name}", group=name))
    return result


def history_like_vllm_runs() -> tuple[RequestRecord, ...]:
    return tuple(RequestRecord(_VLLM_PROMPT, _VLLM_NEW_TOKENS) for _ in range(_VLLM_BATCH))
