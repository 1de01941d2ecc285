"""Rollout cost model: one TP-k vLLM instance serving trajectories of the recent history.

Per instance of TP size k (all figures per device unless said otherwise):
- KV pool = usable memory - weights / k - activation workspace; token capacity = pool / KV bytes
  per token and device (KV heads split over k, replicated when k exceeds them) x (1 - fragmentation).
- Steady batch = capacity / mean context (prompt + output / 2), capped at max_decode_batch.
- Decode step (bandwidth bound) = read the weight shard and the batch's KV, plus the batch's
  matmul FLOPs, plus two all-reduces per layer over the TP group.
- Prefill of p tokens: 2 * params * p + 2 * layers * p^2 * query_dim FLOPs (causal attention).

A trajectory occupies an instance for `work_s` = prefill + output_tokens / throughput (it shares
decode steps with the steady batch), and cannot finish before `latency_s` = prefill +
output_tokens x the decode step of a nearly empty instance + its tool time (the long tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.planner.config import ClusterSpec, ModelArch, PlannerConfig, RequestRecord
from libra.planner.cost_model import EfficiencyFactors, TimeBreakdown, ring_allreduce_s


@dataclass(frozen=True)
class InstanceProfile:
    """Derived figures of one TP-k instance for a given workload."""

    tp: int
    token_capacity: int
    """KV tokens one instance holds; 0: the model does not fit at this TP."""
    steady_batch: float
    decode_step_s: float
    """Step time at the steady batch."""
    throughput_tokens_per_s: float
    tail_step_s: float
    """Step time with a single sequence in flight."""


class RolloutCostModel:
    def __init__(
        self, cluster: ClusterSpec, model: ModelArch, config: PlannerConfig, factors: EfficiencyFactors
    ):
        self.cluster = cluster
        self.model = model
        self.config = config
        self.factors = factors

    def kv_bytes_per_token(self, tp: int) -> float:
        """KV-cache bytes one token costs on each device of a TP-tp instance."""
        kv_heads_per_device = max(1.0, self.model.num_kv_heads / tp)
        return (
            2.0
            * self.model.num_layers
            * kv_heads_per_device
            * self.model.head_dim
            * self.model.bytes_per_param
        )

    def token_capacity(self, tp: int) -> int:
        profile = self.cluster.profile
        usable = profile.memory_capacity_bytes * self.config.memory_utilization
        pool = usable - self.model.weight_bytes / tp - self.config.activation_workspace_bytes
        if pool <= 0:
            return 0
        return int(pool / self.kv_bytes_per_token(tp) * (1.0 - self.config.kv_fragmentation))

    def decode_step(self, tp: int, batch: float, mean_context: float) -> TimeBreakdown:
        """Ideal components of one decode step of `batch` sequences of `mean_context` tokens."""
        profile = self.cluster.profile
        weight_read = self.model.weight_bytes / tp
        kv_read = batch * mean_context * self.kv_bytes_per_token(tp)
        flops = 2.0 * self.model.num_params * batch / tp
        activation_bytes = batch * self.model.hidden_size * self.model.bytes_per_param
        comm = (
            2
            * self.model.num_layers
            * ring_allreduce_s(activation_bytes, tp, profile.intra_node_bandwidth_bytes_per_s)
        )
        return TimeBreakdown(
            compute_s=flops / profile.peak_bf16_flops,
            memory_s=(weight_read + kv_read) / profile.memory_bandwidth_bytes_per_s,
            communication_s=comm,
            overhead_steps=1.0,
        )

    def prefill(self, tp: int, prompt_tokens: float) -> TimeBreakdown:
        m = self.model
        flops = 2.0 * m.num_params * prompt_tokens + 2.0 * m.num_layers * prompt_tokens**2 * m.query_dim
        return TimeBreakdown(compute_s=flops / (tp * self.cluster.profile.peak_bf16_flops))

    def instance_profile(self, tp: int, history: tuple[RequestRecord, ...]) -> InstanceProfile:
        capacity = self.token_capacity(tp)
        mean_context = float(np.mean([r.prompt_tokens + r.output_tokens / 2 for r in history]))
        if capacity <= 0:
            return InstanceProfile(tp, 0, 0.0, float("inf"), 0.0, float("inf"))
        batch = max(1.0, min(float(self.config.max_decode_batch), capacity / max(mean_context, 1.0)))
        step = self.decode_step(tp, batch, mean_context).seconds(self.factors)
        tail = self.decode_step(tp, 1.0, mean_context).seconds(self.factors)
        return InstanceProfile(tp, capacity, batch, step, batch / step, tail)

    def request_costs(self, tp: int, history: tuple[RequestRecord, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(work_s, latency_s) of each request on a TP-tp instance; latency is inf where the
        request does not fit the instance's KV capacity."""
        inst = self.instance_profile(tp, history)
        prompts = np.array([r.prompt_tokens for r in history], dtype=float)
        outputs = np.array([r.output_tokens for r in history], dtype=float)
        tools = np.array([r.tool_time_s for r in history], dtype=float)
        totals = prompts + outputs
        m, profile, eff = self.model, self.cluster.profile, self.factors
        prefill_flops = 2.0 * m.num_params * prompts + 2.0 * m.num_layers * prompts**2 * m.query_dim
        prefill = (
            prefill_flops / (tp * profile.peak_bf16_flops) / eff.compute
        )  # == self.prefill(), vectorised
        if inst.token_capacity <= 0:
            return np.full(len(history), np.inf), np.full(len(history), np.inf)
        work = prefill + outputs / inst.throughput_tokens_per_s
        latency = prefill + outputs * inst.tail_step_s + tools
        latency = np.where(totals <= inst.token_capacity, latency, np.inf)
        return work, latency
