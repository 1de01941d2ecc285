"""Rollout cost model: one TP-k vLLM instance serving trajectories of the recent history.

Per instance of TP size k (all figures per device unless said otherwise):
- KV pool = usable memory - weights / k - activation workspace; token capacity = pool / KV bytes
  per token and device (KV heads split over k, replicated when k exceeds them) x (1 - fragmentation).
- Steady batch = capacity / mean context (prompt + output / 2), capped at max_decode_batch.
- Decode step = the longer of reading the weight shard and the batch's matmul FLOPs, plus reading
  the batch's KV, plus two all-reduces per layer over the TP group -- each paying the link's
  latency floor (`HardwareProfile.allreduce_latency_s`) on top of its bytes at the bus bandwidth
  (one direction of the links) -- plus the engine's host time per step
  (`HardwareProfile.engine_step_overhead_s`). At small batches those floors, which do not shrink
  with the TP size, are what a large TP size pays for reading fewer weights per device: the
  anchor table (`tests/planner/test_rollout_anchors.py`) holds the single-stream speed-ups they
  leave to what published engines measure. The matmuls' compute and weight read overlap (the
  longer one counts, `DecodeTerms`): below the ridge (~100 tokens a pass on an A800 at the default
  efficiencies) a decode step is the weight and KV read, and the batch's matmul FLOPs are free.
- Prefill of p tokens: 2 * params * p + 2 * layers * p^2 * query_dim FLOPs (causal attention),
  plus the same two all-reduces per layer, of p tokens' activations each.

A trajectory occupies an instance for `work_s` = prefill + output_tokens x its share of a decode
step, and cannot finish before `latency_s` = prefill + output_tokens x the decode step of a nearly
empty instance + its tool time (the long tail).

Its share of a step is priced at its *own* context, not the history's mean: C-MLFQ's buckets hold
trajectories of similar length, so an instance of short ones runs a large batch and one of long
ones a small batch. The step (`DecodeTerms`: fixed + b B + c K + max(weight read, matmul compute
of B)) is split by what each sequence holds: c x its context for its KV read, b for its
per-sequence work, and the rest over the batch B it shares. B is the least of max_decode_batch, what
the KV capacity holds at that context, and -- when the rollout side's size is given -- what the
trajectories in flight can fill: an asynchronous loop keeps at most global_batch x
(max_staleness + 1) trajectories in flight, and only those decoding (not waiting on a tool) are
in a batch (`decoding_per_device`). That last bound is what decides between TP sizes on an
agentic workload: with few trajectories decoding per device, batches are small, the weight read
dominates, and the fewer weight copies of a large TP size win; with many, small TP sizes win
because a large instance is capped at max_decode_batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from libra.planner.config import ClusterSpec, ModelArch, PlannerConfig, RequestRecord
from libra.planner.cost_model import (
    EfficiencyFactors,
    TimeBreakdown,
    allreduce_latency_s,
    ring_allreduce_s,
)


def mean_decoding_context(history: Sequence[RequestRecord]) -> float:
    """The KV tokens a request of `history` holds while it decodes, on average: its prefill and
    half its output."""
    return float(np.mean([r.prompt_tokens + r.output_tokens / 2 for r in history]))


@dataclass(frozen=True)
class DecodeTerms:
    """One decode step of a TP-k instance, in seconds: B sequences holding K KV tokens, with n
    prefill tokens riding in the same forward pass, take

        fixed_s + per_sequence_s B + per_kv_token_s K + max(weight_read_s, gemm_per_token_s (B + n))

    -- the floors, each sequence's share of the all-reduces, the attention's KV read, and the
    matmuls, which read the weights while they multiply every token of the pass (the roofline:
    below `ridge_tokens` the weight read binds and the batch's matmul compute is free)."""

    fixed_s: float
    weight_read_s: float
    gemm_per_token_s: float
    per_sequence_s: float
    per_kv_token_s: float

    def step_s(self, batch: float, kv_tokens: float, prefill_tokens: float = 0.0) -> float:
        matmuls = max(self.weight_read_s, self.gemm_per_token_s * (batch + prefill_tokens))
        return self.fixed_s + self.per_sequence_s * batch + self.per_kv_token_s * kv_tokens + matmuls

    @property
    def ridge_tokens(self) -> float:
        """Tokens a pass holds before its matmuls are compute-bound."""
        return self.weight_read_s / self.gemm_per_token_s if self.gemm_per_token_s > 0 else float("inf")


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
        """KV tokens a TP-tp instance holds."""
        config = self.config
        if config.rollout_kv_bytes_per_device is not None:
            pool = float(config.rollout_kv_bytes_per_device)
        else:
            share = config.rollout_memory_utilization or config.memory_utilization
            usable = self.cluster.profile.memory_capacity_bytes * share
            pool = usable - self.model.weight_bytes / tp - config.activation_workspace_bytes
        if pool <= 0:
            return 0
        return int(pool / self.kv_bytes_per_token(tp) * (1.0 - self.config.kv_fragmentation))

    def router_weight(self, tp: int) -> int:
        """A TP-tp instance's weight for the router (`Router.add_instance`): its KV capacity in
        units of the smallest instance size that holds the model (a TP-8 instance holds several
        times what a TP-1 one does, and should get that share of the trajectories)."""
        sizes = [k for k in (1, 2, 4, 8, 16) if self.token_capacity(k) > 0]
        unit = self.token_capacity(sizes[0]) if sizes else 0
        return max(1, round(self.token_capacity(tp) / unit)) if unit > 0 else 1

    def decode_step(self, tp: int, batch: float, mean_context: float) -> TimeBreakdown:
        """Ideal components of one decode step of `batch` sequences of `mean_context` tokens. The
        matmuls read the weight shard while they multiply (an overlapped pair); attention reads the
        batch's KV in kernels of its own."""
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
            memory_s=kv_read / profile.memory_bandwidth_bytes_per_s,
            communication_s=comm,
            overhead_steps=1.0,
            latency_s=self._pass_floor_s(tp),
            overlapped=(
                (flops / profile.peak_bf16_flops, weight_read / profile.memory_bandwidth_bytes_per_s),
            ),
        )

    def decode_terms(self, tp: int) -> DecodeTerms:
        """`decode_step` as `DecodeTerms` under the model's factors: each term is linear in the
        batch or its KV tokens, so two evaluations recover it exactly."""
        f = self.factors
        empty = self.decode_step(tp, 0.0, 0.0)
        one = self.decode_step(tp, 1.0, 0.0)
        held = self.decode_step(tp, 1.0, 1000.0)
        (_, weight_read), (gemm, _) = empty.overlapped[0], one.overlapped[0]
        return DecodeTerms(
            fixed_s=empty.seconds(f) - weight_read / f.memory,
            weight_read_s=weight_read / f.memory,
            gemm_per_token_s=gemm / f.compute,
            per_sequence_s=(one.communication_s - empty.communication_s) / f.communication,
            per_kv_token_s=(held.memory_s - one.memory_s) / 1000.0 / f.memory,
        )

    def _pass_floor_s(self, tp: int) -> float:
        """Fixed floors of one forward pass: the engine's host time, and the latency of two
        all-reduces per layer (attention and MLP outputs) over the TP group."""
        profile = self.cluster.profile
        return profile.engine_step_overhead_s + 2 * self.model.num_layers * allreduce_latency_s(
            tp, profile.allreduce_latency_s
        )

    def prefill(self, tp: int, prompt_tokens: float) -> TimeBreakdown:
        return TimeBreakdown(
            compute_s=float(self._prefill_compute_s(tp, np.asarray(prompt_tokens, dtype=float))),
            communication_s=float(self._prefill_communication_s(tp, np.asarray(prompt_tokens, dtype=float))),
            latency_s=self._pass_floor_s(tp),
        )

    def prefill_coefficients(self, tp: int) -> tuple[float, float]:
        """(linear, quadratic) of `prefill_seconds` = floor + linear p + quadratic p^2 (p prompt
        tokens): the model's prefill is a quadratic in the tokens, so three evaluations recover it
        exactly (the floor, a step's own, is left out)."""
        f0, f1, f2 = (float(self.prefill_seconds(tp, float(p))) for p in (0.0, 1000.0, 2000.0))
        quadratic = (f2 - 2 * f1 + f0) / (2 * 1000.0**2)
        return (f1 - f0) / 1000.0 - quadratic * 1000.0, quadratic

    def prefill_seconds(self, tp: int, prompt_tokens: np.ndarray) -> np.ndarray:
        """`prefill(tp, p).seconds(factors)` for every p in `prompt_tokens` at once."""
        f = self.factors
        return (
            self._prefill_compute_s(tp, prompt_tokens) / f.compute
            + self._prefill_communication_s(tp, prompt_tokens) / f.communication
            + self._pass_floor_s(tp)
        )

    def _prefill_compute_s(self, tp: int, prompt_tokens: np.ndarray) -> np.ndarray:
        m = self.model
        flops = 2.0 * m.num_params * prompt_tokens + 2.0 * m.num_layers * prompt_tokens**2 * m.query_dim
        return flops / (tp * self.cluster.profile.peak_bf16_flops)

    def _prefill_communication_s(self, tp: int, prompt_tokens: np.ndarray) -> np.ndarray:
        """Two all-reduces per layer of the prompt's activations (ring: linear in the bytes)."""
        m = self.model
        per_token = ring_allreduce_s(
            m.hidden_size * m.bytes_per_param, tp, self.cluster.profile.intra_node_bandwidth_bytes_per_s
        )
        return 2 * m.num_layers * per_token * prompt_tokens

    def instance_profile(self, tp: int, history: tuple[RequestRecord, ...]) -> InstanceProfile:
        capacity = self.token_capacity(tp)
        mean_context = mean_decoding_context(history)
        if capacity <= 0:
            return InstanceProfile(tp, 0, 0.0, float("inf"), 0.0, float("inf"))
        batch = max(1.0, min(float(self.config.max_decode_batch), capacity / max(mean_context, 1.0)))
        step = self.decode_step(tp, batch, mean_context).seconds(self.factors)
        tail = self.decode_step(tp, 1.0, mean_context).seconds(self.factors)
        return InstanceProfile(tp, capacity, batch, step, batch / step, tail)

    def request_costs(
        self, tp: int, history: tuple[RequestRecord, ...], decoding_per_device: float | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(work_s, latency_s) of each request on a TP-tp instance; latency is inf where the
        request does not fit the instance's KV capacity. `decoding_per_device`: sequences decoding
        at once per rollout device (None: instances are as full as memory and max_decode_batch
        allow)."""
        inst = self.instance_profile(tp, history)
        prompts = np.array([r.prompt_tokens for r in history], dtype=float)
        outputs = np.array([r.output_tokens for r in history], dtype=float)
        tools = np.array([r.tool_time_s for r in history], dtype=float)
        totals = prompts + outputs
        prefill = self.prefill_seconds(tp, prompts)
        if inst.token_capacity <= 0:
            return np.full(len(history), np.inf), np.full(len(history), np.inf)
        work = prefill + outputs * self.token_share_s(tp, prompts + outputs / 2.0, decoding_per_device)
        latency = prefill + outputs * inst.tail_step_s + tools
        latency = np.where(totals <= inst.token_capacity, latency, np.inf)
        return work, latency

    def token_share_s(
        self, tp: int, context: np.ndarray, decoding_per_device: float | None = None
    ) -> np.ndarray:
        """Instance seconds one output token of a sequence holding `context` KV tokens costs in a
        TP-tp instance of sequences like it (see the module docstring)."""
        terms = self.decode_terms(tp)
        context = np.maximum(np.asarray(context, dtype=float), 1.0)
        batch = np.minimum(self.token_capacity(tp) / context, float(self.config.max_decode_batch))
        if decoding_per_device is not None:
            batch = np.minimum(batch, tp * decoding_per_device)
        batch = np.maximum(batch, 1.0)
        shared = terms.fixed_s + np.maximum(terms.weight_read_s, terms.gemm_per_token_s * batch)
        return shared / batch + terms.per_sequence_s + terms.per_kv_token_s * context

    def decoding_per_device(
        self, tp: int, history: tuple[RequestRecord, ...], in_flight: int, rollout_devices: int
    ) -> float:
        """Sequences decoding at once per device when `in_flight` trajectories share
        `rollout_devices` devices of TP-tp instances. A trajectory spends output_tokens x the
        step time decoding and the rest of its life prefilling or in its tools; the decoding
        share of the in-flight ones fills the batches. The step grows with the batch, so this is
        a fixed point, reached by iterating down from every in-flight trajectory decoding."""
        if rollout_devices < 1 or in_flight < 1 or self.token_capacity(tp) <= 0:
            return 0.0
        outputs = sum(r.output_tokens for r in history)
        prompts = np.array([r.prompt_tokens for r in history], dtype=float)
        waiting = sum(r.tool_time_s for r in history) + float(self.prefill_seconds(tp, prompts).sum())
        context = mean_decoding_context(history)
        capacity_batch = min(self.token_capacity(tp) / max(context, 1.0), float(self.config.max_decode_batch))
        per_device = in_flight / rollout_devices
        for _ in range(100):
            batch = max(1.0, min(capacity_batch, tp * per_device))
            decoding = outputs * self.decode_step(tp, batch, context).seconds(self.factors)
            updated = in_flight * decoding / (decoding + waiting) / rollout_devices
            if abs(updated - per_device) <= 1e-6 * per_device:
                return updated
            per_device = updated
        return per_device
