"""Training cost model: one GRPO step of Megatron-core with TP x PP x DP and 1F1B.

For a micro-batch of mb sequences (lengths drawn from the recent history, so the attention term
uses E[s^2], not E[s]^2) on one pipeline stage of L/pp layers:
- forward FLOPs = mb * (L/pp) * (2 s P_layer + 2 s^2 query_dim), plus the output layer on the
  last stage (2 s d V); backward = 2x forward; full activation recompute adds one forward;
- TP: two all-reduces of the activations per layer forward and two backward (ring, intra-node),
  each also paying the link's latency floor (`HardwareProfile.allreduce_latency_s`);
- PP: one activation send forward and one gradient send backward per micro-batch and stage;
- 1F1B: (n_micro + pp - 1) slots of (forward + backward) of the slowest stage, n_micro being the
  micro-batches of the largest DP share (`largest_share`: with uneven shares, ceil(G/DP) groups);
- the old-policy log-prob recompute is one more forward-only pipeline pass;
- DP: gradient reduce-scatter + parameter all-gather (distributed optimizer) or an all-reduce,
  of which `DATA_PARALLEL_OVERLAP` hides behind the backward pass;
- Adam step: memory bound, ~30 bytes touched per parameter of the rank's shard.

Memory per device, as `libra.training.engine` trains (Megatron DDP with fp32 gradient buffers,
Megatron's optimizer): weights in the model dtype (2 B/param in bf16), fp32 main grads (4), the
optimizer state (`optimizer_state_bytes`: an fp32 main copy for a bf16 model and Adam's m and v,
divided by DP with the distributed optimizer), activations of min(pp, n_micro) in-flight
micro-batches at the longest sequence (flash attention: no s^2 term; full recompute keeps only
each layer's input), and fp32 logits + their gradient on the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.planner.config import ClusterSpec, ModelArch, PlannerConfig, RequestRecord, TrainingBatch
from libra.planner.cost_model import (
    EfficiencyFactors,
    TimeBreakdown,
    allreduce_latency_s,
    ring_allreduce_s,
)

DATA_PARALLEL_OVERLAP = 0.4
"""Share of the gradient synchronisation hidden behind the backward pass (the original assumes 30-50%)."""
ADAM_BYTES_PER_PARAM = 30


def optimizer_state_bytes(num_params: float, bytes_per_param: int, dp: int, distributed: bool) -> float:
    """Megatron's optimizer state on one rank holding `num_params` of the model: Adam's m and v in
    fp32, plus an fp32 main copy when the model is in a 16-bit dtype (an fp32 model is its own main
    copy); the distributed optimizer divides it over the DP ranks."""
    per_param = 8 + (4 if bytes_per_param < 4 else 0)
    return per_param * num_params / (dp if distributed else 1)


@dataclass(frozen=True, order=True)
class TrainingConfig:
    tp: int
    pp: int
    dp: int
    micro_batch: int

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def replica_size(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class SequenceStats:
    mean: float
    mean_square: float
    max: int

    @staticmethod
    def of(history: tuple[RequestRecord, ...]) -> SequenceStats:
        lengths = np.array([r.total_tokens for r in history], dtype=float)
        return SequenceStats(float(lengths.mean()), float((lengths**2).mean()), int(lengths.max()))


def largest_share(batch: TrainingBatch, dp: int) -> int:
    """Sequences of the largest DP share: G groups over `dp` replicas, whole groups each, is
    ceil(G/dp) groups (G/dp when dp divides G); the step waits for that replica."""
    groups = batch.global_batch // batch.group_size
    return -(-groups // dp) * batch.group_size


def batch_split_error(batch: TrainingBatch, cfg: TrainingConfig, uneven_data_parallel: bool) -> str | None:
    """Why `cfg` cannot split the batch (None if it can): every DP replica trains whole groups
    (at least one), equally many unless `uneven_data_parallel`, and the largest share splits into
    whole micro-batches (smaller shares may end on a shorter one: they finish first anyway)."""
    groups = batch.global_batch // batch.group_size
    if cfg.dp > groups:
        return f"DP {cfg.dp} exceeds the {groups} groups of {batch.group_size} (a replica would train none)"
    if groups % cfg.dp and not uneven_data_parallel:
        return (
            f"DP {cfg.dp} does not divide the {groups} groups of {batch.group_size} "
            "(uneven shares need planner.search.uneven_data_parallel)"
        )
    share = largest_share(batch, cfg.dp)
    if share % cfg.micro_batch:
        return (
            f"the largest DP share, {share} sequences, does not split into micro-batches of {cfg.micro_batch}"
        )
    return None


class TrainingCostModel:
    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelArch,
        batch: TrainingBatch,
        config: PlannerConfig,
        factors: EfficiencyFactors,
    ):
        self.cluster = cluster
        self.model = model
        self.batch = batch
        self.config = config
        self.factors = factors

    def num_micro_batches(self, cfg: TrainingConfig) -> int:
        """Micro-batches of the largest DP share (the replica the step waits for)."""
        return -(-largest_share(self.batch, cfg.dp) // cfg.micro_batch)

    def _links(self, cfg: TrainingConfig) -> tuple[float, float]:
        """(pipeline link, data-parallel link) bandwidths: inter-node once the group leaves a node."""
        profile = self.cluster.profile
        dpn = self.cluster.devices_per_node
        intra, inter = profile.intra_node_bandwidth_bytes_per_s, profile.inter_node_bandwidth_bytes_per_s
        return (inter if cfg.replica_size > dpn else intra), (inter if cfg.num_devices > dpn else intra)

    def step(self, cfg: TrainingConfig, seqs: SequenceStats) -> TimeBreakdown:
        m, profile = self.model, self.cluster.profile
        layers = m.num_layers / cfg.pp
        mb = cfg.micro_batch
        layer_flops = 2 * seqs.mean * m.params_per_layer + 2 * seqs.mean_square * m.query_dim
        logits_flops = 2 * seqs.mean * m.hidden_size * m.vocab_size
        forward_compute = mb * (layers * layer_flops + logits_flops) / (cfg.tp * profile.peak_bf16_flops)
        backward_compute = forward_compute * (3 if self.batch.recompute == "full" else 2)

        pp_link, dp_link = self._links(cfg)
        activation_bytes = mb * seqs.mean * m.hidden_size * m.bytes_per_param
        tp_comm = (
            2 * layers * ring_allreduce_s(activation_bytes, cfg.tp, profile.intra_node_bandwidth_bytes_per_s)
        )
        p2p = activation_bytes / pp_link if cfg.pp > 1 else 0.0
        tp_latency = 2 * layers * allreduce_latency_s(cfg.tp, profile.allreduce_latency_s)

        slots = self.num_micro_batches(cfg) + cfg.pp - 1
        passes = 2 if self.batch.recompute_logprobs else 1  # forward passes: training + log-prob recompute
        compute = slots * (forward_compute * passes + backward_compute)
        comm = slots * ((tp_comm + p2p) * passes + tp_comm + p2p)
        latency = slots * tp_latency * (passes + 1)

        shard_params = m.num_params / cfg.replica_size
        if self.batch.distributed_optimizer:
            dp_bytes = (
                4 * shard_params + 2 * shard_params
            )  # reduce-scatter fp32 grads, all-gather bf16 params
            dp_comm = (cfg.dp - 1) / cfg.dp * dp_bytes / dp_link
            optimizer_params = shard_params / cfg.dp
        else:
            dp_comm = ring_allreduce_s(4 * shard_params, cfg.dp, dp_link)
            optimizer_params = shard_params
        comm += (1 - DATA_PARALLEL_OVERLAP) * dp_comm
        memory = ADAM_BYTES_PER_PARAM * optimizer_params / profile.memory_bandwidth_bytes_per_s
        return TimeBreakdown(
            compute_s=compute, memory_s=memory, communication_s=comm, overhead_steps=1.0, latency_s=latency
        )

    def step_s(self, cfg: TrainingConfig, seqs: SequenceStats) -> float:
        return self.step(cfg, seqs).seconds(self.factors)

    def memory_bytes(self, cfg: TrainingConfig, seqs: SequenceStats) -> float:
        """Peak bytes on the most loaded device (the first stage holds the most activations;
        the last stage's logits are added too, a safe upper bound)."""
        m = self.model
        shard_params = m.num_params / cfg.replica_size
        optimizer = optimizer_state_bytes(
            shard_params, m.bytes_per_param, cfg.dp, self.batch.distributed_optimizer
        )
        states = (m.bytes_per_param + 4) * shard_params + optimizer

        s, mb, d = seqs.max, cfg.micro_batch, m.hidden_size
        layers = m.num_layers / cfg.pp
        per_layer = s * mb * d * (10 + 24 / cfg.tp)
        if self.batch.recompute == "full":
            per_micro_batch = layers * s * mb * d * m.bytes_per_param + per_layer
        else:
            per_micro_batch = layers * per_layer
        in_flight = min(cfg.pp, max(1, self.num_micro_batches(cfg)))
        logits = 2 * 4 * mb * s * m.vocab_size / cfg.tp
        return states + in_flight * per_micro_batch + logits

    def fits(self, cfg: TrainingConfig, seqs: SequenceStats) -> bool:
        budget = self.cluster.profile.memory_capacity_bytes * self.config.memory_utilization
        return self.memory_bytes(cfg, seqs) <= budget
